"""Runs under the deepspeed launcher (2 ranks, pp = 2): a run resumed with every honoured setting
changed (trainer/run_dir.py RESUME_RULES), and what the resumed run then uses.

1. `--config` (fp32, 1F1B, no clipping) trains to step 4 with the real loop (`Trainer.run`).
2. The same run directory is resumed with the keys of CHANGED (train, data, model) set to other
   values; the resumed trainer's live objects are read (optimizer, scheduler, stream, guard,
   modules, process groups, signal handling), and its run to step 8 is recorded (the clipped norm
   each optimizer step sees, the micro-batches drawn, train.log's lines, the checkpoints kept).
3. Resumed again with LAYOUT_CHANGED (precision, schedule, activation checkpointing): the module's
   dtype and the master weights against the step-8 weights, the engine's schedule; two steps.
Rank 0 writes every rank's readings to `--out` (JSON: a list by rank).
"""
from __future__ import annotations

import copy
import json
import os

import torch

from checkpoint import manifest
from parallel.engine_config import inverse_sqrt
from runtime.distributed import exit_rank
from tests.dist.common import worker_args
from trainer import signals
from trainer.config import load_config
from trainer.trainer import Trainer

CHANGED = {
    "train.max_steps": 8, "train.micro_batches": 3, "train.keep_global_batch": False, "train.lr": 1e-3, "train.warmup_steps": 6,
    "train.adam_betas": (0.8, 0.95), "train.adam_eps": 1e-6, "train.weight_decay": 0.01, "train.clip_norm": 1e-3,
    "train.log_interval": 2, "train.valid_interval": 3, "train.save_interval": 5, "train.keep_checkpoints": 1,
    "train.instrument_interval": 2, "train.collective_timeout_seconds": 321.0, "train.stop_grace_seconds": 7.0,
    "train.divergence_policy": "skip", "train.divergence_spike_factor": 9.0, "train.divergence_window": 5,
    "train.divergence_max_events": 4,
    "data.max_tokens": 160, "data.sampling_temperature": 2.0, "data.directions": ["en-de"],
    "model.dropout": 0.2, "model.attention_dropout": 0.1, "model.activation_dropout": 0.3,
    "model.label_smoothing": 0.2,
}
LAYOUT_CHANGED = {"parallel.precision": "bf16", "parallel.schedule": "zb-h1", "parallel.zb_max_pending_w": -1,
                  "parallel.activation_checkpoint_interval": 1, "train.instrument_interval": 0, "train.max_steps": 10}


def changed(cfg, values: dict):
    out = copy.deepcopy(cfg)
    for key, value in values.items():
        section, name = key.split(".")
        setattr(getattr(out, section), name, value)
    return out


def dropouts(module: torch.nn.Module) -> dict[str, list[float]]:
    """Dropout probabilities in the stage's modules, by the class holding them."""
    found: dict[str, set] = {}
    for m in module.modules():
        value = getattr(m, "dropout", None)
        p = value.p if isinstance(value, torch.nn.Dropout) else value
        if isinstance(p, float):
            found.setdefault(type(m).__name__, set()).add(p)
    return {name: sorted(values) for name, values in found.items()}


def clipped_norms(trainer: Trainer) -> list[float]:
    """The global norm of the gradients each optimizer step hands to AdamW (after clipping), as
    FlatOptimizer selects and reduces them for its own norm; filled as the trainer steps."""
    opt = trainer.engine.optimizer
    seen: list[float] = []
    inner = opt.optimizer.step

    def step(*args, **kwargs):
        seen.append(float(opt._global_norm(opt._norm_tensors)))
        return inner(*args, **kwargs)

    opt.optimizer.step = step
    return seen


def drawn(trainer: Trainer) -> list[dict]:
    """Per step: how many micro-batches the stream gave and their largest padded size."""
    seen: list[dict] = []
    original = trainer.stream.next_step

    def next_step(n):
        batches = original(n)
        seen.append({"n": n, "largest": max(max(b["src"].numel(), b["tgt_in"].numel()) for b in batches),
                     "directions": sorted({trainer.train_data.directions[d] for b in batches for d in b["dirs"].tolist()})})
        return batches

    trainer.stream.next_step = next_step
    return seen


def main() -> None:
    args = worker_args()
    cfg = load_config(args.config)
    first = Trainer(cfg)
    first.run()
    out: dict = {"first": {"clip_grad": first.engine.optimizer.clip_grad, "step": first.step}}

    cfg2 = changed(cfg, CHANGED)
    t = Trainer(cfg2)
    opt, group = t.engine.optimizer, t.engine.optimizer.param_groups[0]
    from torch.distributed import distributed_c10d

    out["resumed"] = {
        "step": t.step, "max_steps": t.max_steps, "micro_batches": t.engine.gradient_accumulation_steps(),
        "base_lr": t.engine.lr_scheduler.base_lrs[0], "lr": group["lr"],
        "lr_expected": CHANGED["train.lr"] * inverse_sqrt(CHANGED["train.warmup_steps"])(t.step),
        "betas": list(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"],
        "clip_grad": opt.clip_grad, "stream_max_tokens": t.stream.max_tokens, "stream_temperature": t.stream.temperature,
        "guard": [t.guard.policy, t.guard.factor, t.guard.window, t.guard.max_events],
        "instrument_due": [s for s in range(t.step + 1, CHANGED["train.max_steps"] + 1)
                           if t.stability is not None and t.stability.due(s)],
        "collective_timeout": distributed_c10d.default_pg_timeout.total_seconds(),
        "stop_grace_seconds": signals.stop.grace_seconds,
        "dropouts": dropouts(t.module), "label_smoothing": t.module._cfg.label_smoothing,
        "directions": [[d for d, n in zip(data.directions, data.direction_sizes) if n]
                       for data in (t.train_data, t.valid_data)],
    }
    norms, draws = clipped_norms(t), drawn(t)
    t.run()
    torch.distributed.barrier()  # rank 0 removed the checkpoints past keep_checkpoints
    run_dir = cfg.run_dir
    with open(os.path.join(run_dir, "train.log"), encoding="utf-8") as f:
        log = f.read().splitlines()
    out["ran"] = {"step": t.step, "clipped_norms": norms, "draws": draws,
                  "committed": manifest.committed_tags(os.path.join(run_dir, "checkpoints")), "log": log}
    weights = torch.cat([p.detach().reshape(-1) for p in t.module.parameters()]).clone()

    cfg3 = changed(cfg2, LAYOUT_CHANGED)
    u = Trainer(cfg3)
    master = torch.cat([m.detach().reshape(-1) for m in u.engine.optimizer.fp32_groups_flat_partition])[:weights.numel()]
    rounded = torch.cat([p.detach().reshape(-1) for p in u.module.parameters()])
    out["layout"] = {
        "step": u.step, "dtypes": sorted({str(p.dtype) for p in u.module.parameters()}),
        "master_equals_step8_weights": bool(torch.equal(master, weights)),
        "weights_are_the_rounded_master": bool(torch.equal(rounded, master.to(rounded.dtype))),
        "engine": type(u.engine).__name__, "max_pending_w": u.engine.max_pending_w,
        "activation_checkpoint_interval": u.module.activation_checkpoint_interval,
    }
    u.run()
    out["layout"]["ran_to"] = u.step
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, out)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(gathered, f)
    exit_rank(0)


if __name__ == "__main__":
    main()

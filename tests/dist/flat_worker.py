"""Runs under the deepspeed launcher (2 ranks): parallel/optimizer.py's FlatOptimizer against
DeepSpeed's own BF16_Optimizer, and its checkpoints, in one launch (tests/test_flat_optimizer.py).

exact:   for pp = 2 × dp = 1 and pp = 1 × dp = 2 (ZeRO-1: the master partitions split over the
         replicas), `--steps` bf16 steps twice from the same weights and batches, once with
         `FlatOptimizer.enabled = False` (DeepSpeed's BF16_Optimizer) and once with it: losses,
         clipped norms, every parameter and every fp32 master partition, bit for bit (each rank
         compares its own; rank 0 gathers the verdicts). The FlatOptimizer run at pp = 2 saves a
         checkpoint after `--save-at` steps and at the end.
resume:  a fresh Trainer resumed from that checkpoint trains the remaining steps.
consolidate: checkpoint/checkpoints.py consolidate of the last checkpoint against the trained weights.
reshard: that checkpoint (pp = 2 × dp = 1) resharded to pp = 1 × dp = 2 (a DeepSpeed universal
         checkpoint) and trained on from there.
fp16:    (with --fp16) pp = 2 in fp16: a loss scale of 2^40 forced before step 2 overflows; the
         step must be skipped and counted, the weights and the learning rate left as they were,
         the scale halved and no divergence event recorded; step 3 at 2^8 applies.
"""
from __future__ import annotations

import argparse
import copy
import os

import torch

from parallel.optimizer import FlatOptimizer
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import fresh_run_dir, record_steps, write_result
from trainer.config import load_config
from trainer.trainer import Trainer


def layout_cfg(cfg, name: str, pp: int, dp: int, precision: str = "bf16"):
    out = copy.deepcopy(cfg)
    out.parallel.pipeline_stages, out.parallel.data_parallel, out.parallel.precision = pp, dp, precision
    out.train.micro_batches = cfg.train.micro_batches * cfg.parallel.data_parallel // dp  # same global batch
    out.run_dir = f"{cfg.run_dir}-{name}"
    fresh_run_dir(out.run_dir, os.path.join(cfg.run_dir, "data"))
    return out


def state(trainer) -> dict:
    """This rank's weights and fp32 master partitions, copied."""
    opt = trainer.engine.optimizer
    return {"params": {k: v.detach().clone() for k, v in trainer.module.state_dict().items() if torch.is_tensor(v)},
            "master": [m.detach().clone() for m in opt.fp32_groups_flat_partition]}


def differences(a: dict, b: dict) -> list[str]:
    """Names of this rank's tensors that differ between two `state`s; gathered from every rank."""
    diff = [k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
    diff += [f"master{i}" for i, (x, y) in enumerate(zip(a["master"], b["master"])) if not torch.equal(x, y)]
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, [f"rank{torch.distributed.get_rank()}:{d}" for d in diff])
    return [d for rank in gathered for d in rank]


def count_all(s: dict) -> int:
    """How many tensors `differences` compares, over every rank."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, len(s["params"]) + len(s["master"]))
    return sum(gathered)


def trainer(cfg, steps: int, flat: bool) -> Trainer:
    FlatOptimizer.enabled = flat
    try:
        return Trainer(cfg, max_steps=steps)
    finally:
        FlatOptimizer.enabled = True


def exact(cfg, name: str, pp: int, dp: int, steps: int, save_at: int | None = None) -> dict:
    runs = {}
    for flat in (False, True):
        t = trainer(layout_cfg(cfg, f"{name}-{'flat' if flat else 'deepspeed'}", pp, dp), steps, flat)
        r = record_steps(t, steps, save_at if flat else None)
        if flat and save_at is not None:
            t.save()  # the last step's checkpoint, for consolidate
        runs[flat] = {**r, "optimizer": type(t.engine.optimizer).__name__, "state": state(t),
                      "run_dir": t.cfg.run_dir}
        if flat:
            runs[flat]["plain"] = plain_weights(t)
    ds, fl = runs[False], runs[True]
    return {"deepspeed": {k: ds[k] for k in ("loss", "grad_norm", "lr", "optimizer")},
            "flat": {k: fl[k] for k in ("loss", "grad_norm", "lr", "optimizer")},
            "different_tensors": differences(ds["state"], fl["state"]),
            "tensors": len(fl["state"]["params"]), "run_dir": fl["run_dir"], "plain": fl.get("plain")}


def plain_weights(t) -> str:
    """Every stage's weights under the plain model's names, in one file written by rank 0."""
    from parallel.pipeline import plain_state_dict

    mine = plain_state_dict(t.cfg.model, {k: v.detach().float() for k, v in t.module.state_dict().items()
                                          if torch.is_tensor(v)}) if t.layout.replica == 0 else {}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    path = os.path.join(t.cfg.run_dir, "plain-weights.pt")
    if torch.distributed.get_rank() == 0:
        torch.save({k: v for part in gathered for k, v in part.items()}, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    setup_distributed()
    cfg = load_config(args.config)
    out = {"pp2": exact(cfg, "pp2", 2, 1, args.steps, args.save_at), "dp2": exact(cfg, "dp2", 1, 2, args.steps)}
    source = out["pp2"]["run_dir"]

    # resume the pp = 2 run from its checkpoint after --save-at steps
    resumed = layout_cfg(cfg, "pp2-resumed", 2, 1)
    fresh_run_dir(resumed.run_dir, os.path.join(cfg.run_dir, "data"), source, f"step{args.save_at}")
    t = Trainer(resumed, max_steps=args.steps)
    out["resume"] = {"from": t.step, **record_steps(t, args.steps), "optimizer": type(t.engine.optimizer).__name__}

    if torch.distributed.get_rank() == 0:
        from checkpoint.checkpoints import consolidate, reshard

        consolidated = consolidate(source, os.path.join(cfg.run_dir, "consolidated.pt"), f"step{args.steps}")
        package = torch.load(os.path.join(cfg.run_dir, "consolidated.pt"), weights_only=True)
        trained = torch.load(out["pp2"]["plain"], weights_only=True)
        out["consolidate"] = {"step": consolidated["step"], "names": sorted(package["state_dict"]) == sorted(trained),
                              "different": [k for k in trained if not torch.equal(package["state_dict"][k], trained[k])]}
        reshard(source, cfg.run_dir + "-resharded", 1, 2, f"step{args.save_at}", args.steps,
                check_config=lambda values: None)
    torch.distributed.barrier()
    resharded = load_config(os.path.join(cfg.run_dir + "-resharded", "config.yaml"))
    t = Trainer(resharded, max_steps=args.steps)
    out["reshard"] = {"from": t.step, **record_steps(t, args.steps), "optimizer": type(t.engine.optimizer).__name__}

    if args.fp16:
        out["fp16"] = fp16_overflow(cfg)
    write_result(args.out, out)


def fp16_overflow(cfg) -> dict:
    t = Trainer(layout_cfg(cfg, "fp16", 2, 1, "fp16"), max_steps=3)
    opt, scaler = t.engine.optimizer, t.engine.optimizer.loss_scaler
    first = t.train_step()
    scaler.cur_scale, scaler.cur_hysteresis = 2.0**40, 1  # the next backward overflows in fp16
    before, lr = state(t), t.engine.get_lr()[0]
    second = t.train_step()
    after = state(t)
    record = {"first": first["loss"], "second": second, "skipped_steps": t.engine.skipped_steps,
              "changed_by_overflow": differences(before, after), "scale_after": scaler.cur_scale,
              "lr_kept": t.engine.get_lr()[0] == lr, "events": len(t.guard.events),
              "overflow": bool(opt.overflow), "loss_scale_overflow": bool(opt.loss_scale_overflow)}
    scaler.cur_scale = 2.0**8
    third = t.train_step()
    record.update(third=third["loss"], third_norm=third["grad_norm"], skipped_after=t.engine.skipped_steps,
                  changed_by_third=len(differences(after, state(t))), tensors=count_all(after))
    record["second"] = {k: second[k] for k in ("loss", "grad_norm")}
    return record


if __name__ == "__main__":
    main()
    exit_rank()

"""What the workers under tests/dist/ share: the training loop that records each step, fresh run
directories, variants of a config, parameter dumps under the plain model's names, the result file.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil


import torch

from parallel.pipeline import plain_state_dict


def record_steps(trainer, until: int, save_at: int | None = None) -> dict:
    """Train until `trainer.step == until`, recording each step's loss, clipped global gradient norm,
    learning rate and the [src, tgt_in] shapes of its micro-batches; save a checkpoint after step
    `save_at`."""
    out = {"loss": [], "grad_norm": [], "lr": [], "shapes": []}
    original = trainer.stream.next_step

    def spy(n):
        batches = original(n)
        out["shapes"].append([[list(b["src"].shape), list(b["tgt_in"].shape)] for b in batches])
        return batches

    trainer.stream.next_step = spy
    while trainer.step < until:
        r = trainer.train_step()
        for key in ("loss", "grad_norm", "lr"):
            out[key].append(r[key])
        if save_at is not None and trainer.step == save_at:
            trainer.save()
    trainer.stream.next_step = original
    return out


def fresh_run_dir(run_dir: str, data_dir: str, checkpoint_from: str | None = None, tag: str = "") -> None:
    """Rank 0 makes `run_dir` with a link to the prepared data and, optionally, one checkpoint."""
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(os.path.join(run_dir, "checkpoints"))
        os.symlink(os.path.abspath(data_dir), os.path.join(run_dir, "data"))
        if checkpoint_from:
            shutil.copytree(os.path.join(checkpoint_from, "checkpoints", tag),
                            os.path.join(run_dir, "checkpoints", tag))
            with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
                f.write(tag)
    torch.distributed.barrier()


def variant(cfg, name: str):
    """A copy of `cfg` in its own fresh run directory `<run_dir>-<name>` (same prepared data)."""
    out = copy.deepcopy(cfg)
    out.run_dir = f"{cfg.run_dir}-{name}"
    fresh_run_dir(out.run_dir, os.path.join(cfg.run_dir, "data"))
    return out


def with_dropout(cfg, name: str, p: float = 0.1, checkpoint_interval: int = 1):
    """`variant` with dropout p on the residual stream, attention probabilities and FFN activations."""
    out = variant(cfg, name)
    out.model.dropout = out.model.attention_dropout = out.model.activation_dropout = p
    out.parallel.activation_checkpoint_interval = checkpoint_interval
    return out


def dump_params(trainer, prefix: str) -> None:
    """Replica 0 of each stage and tensor-parallel rank writes its parameters under the plain
    model's names to `<prefix>.stage<s>.tp<t>.pt`."""
    if trainer.layout.replica != 0:
        return
    state = {k: v.detach().cpu() for k, v in trainer.module.state_dict().items() if torch.is_tensor(v)}
    torch.save(plain_state_dict(trainer.cfg.model, state),
               f"{prefix}.stage{trainer.layout.stage}.tp{trainer.layout.tp_rank}.pt")


def train_and_resume(cfg, steps: int, save_at: int, dump: str | None = None) -> dict:
    """Uninterrupted run with a checkpoint at `save_at`, then a fresh run resumed from it."""
    from trainer.trainer import Trainer

    first = Trainer(cfg, max_steps=steps)
    result = {"uninterrupted": record_steps(first, steps, save_at),
              "partition": [int(x) for x in first.module.parts],
              "optimizer": type(first.engine.optimizer).__name__}
    if dump:
        dump_params(first, dump)
    resumed = copy.deepcopy(cfg)
    resumed.run_dir = cfg.run_dir + "-resumed"
    fresh_run_dir(resumed.run_dir, os.path.join(cfg.run_dir, "data"), cfg.run_dir, f"step{save_at}")
    second = Trainer(resumed, max_steps=steps)
    result["resumed_from"] = second.step
    result["resumed"] = record_steps(second, steps)
    return result


def worker_args(steps: int | None = None) -> argparse.Namespace:
    """A worker's command line: --config, --out, (--steps, default `steps`, where given) and the
    --local_rank the deepspeed launcher appends."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    if steps is not None:
        parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--local_rank", type=int)
    return parser.parse_args()


def write_result(path: str, result: dict) -> None:
    """Rank 0 writes the worker's result as JSON."""
    if torch.distributed.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f)

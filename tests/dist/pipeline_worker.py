"""Runs under the deepspeed launcher: several pipeline checks in one launch (start-up is costly).

1. Train `--steps` steps with the real Trainer, recording per step the loss, the global gradient
   norm and the micro-batch shapes; save a checkpoint after `--save-at` steps.
2. Write each stage's parameters under the plain model's names.
3. Copy the checkpoint into a second run directory, resume a fresh Trainer from it and record the
   losses of the remaining steps.
Rank 0 writes everything to `--out` (JSON) for the test to compare with a single-process run.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from launcher.config import load_config  # noqa: E402
from launcher.train import Trainer  # noqa: E402
from parallel.pipeline import plain_state_dict  # noqa: E402


def record_steps(trainer: Trainer, steps: int, save_at: int | None) -> dict:
    out = {"loss": [], "grad_norm": [], "lr": [], "shapes": []}
    shapes_seen = []
    original = trainer.stream.next_step

    def spy(n):
        batches = original(n)
        shapes_seen.append([[list(b["src"].shape), list(b["tgt_in"].shape)] for b in batches])
        return batches

    trainer.stream.next_step = spy
    while trainer.step < steps:
        r = trainer.train_step()
        out["loss"].append(r["loss"])
        out["grad_norm"].append(r["grad_norm"])
        out["lr"].append(r["lr"])
        if save_at is not None and trainer.step == save_at:
            trainer.save()
    out["shapes"] = shapes_seen
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    cfg = load_config(args.config)
    first = Trainer(cfg, max_steps=args.steps)
    result = {"uninterrupted": record_steps(first, args.steps, args.save_at)}
    rank = torch.distributed.get_rank()
    if first.dp_rank == 0:
        state = {k: v.detach().cpu() for k, v in first.module.state_dict().items()}
        torch.save(plain_state_dict(cfg.model, state), f"{args.out}.params.rank{rank}.pt")
    result["partition"] = [int(x) for x in first.module.parts]

    # Resume: a second run directory that holds only the checkpoint taken at --save-at.
    resumed_dir = cfg.run_dir + "-resumed"
    if rank == 0:
        shutil.rmtree(resumed_dir, ignore_errors=True)
        os.makedirs(os.path.join(resumed_dir, "checkpoints"))
        os.symlink(os.path.abspath(os.path.join(cfg.run_dir, "data")), os.path.join(resumed_dir, "data"))
        tag = f"step{args.save_at}"
        shutil.copytree(os.path.join(cfg.run_dir, "checkpoints", tag),
                        os.path.join(resumed_dir, "checkpoints", tag))
        with open(os.path.join(resumed_dir, "checkpoints", "latest"), "w") as f:
            f.write(tag)
    torch.distributed.barrier()
    cfg.run_dir = resumed_dir
    second = Trainer(cfg, max_steps=args.steps)
    result["resumed_from"] = second.step
    result["resumed"] = record_steps(second, args.steps, None)

    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()

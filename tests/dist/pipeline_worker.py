"""Runs under the deepspeed launcher: several pipeline checks in one launch (start-up is costly).

plain:  train `--steps` steps with the real Trainer, recording per step the loss, the global
        gradient norm and the micro-batch shapes; checkpoint after `--save-at` steps; write each
        stage's parameters under the plain model's names; resume a fresh Trainer from the
        checkpoint in a second run directory and record the remaining steps.
activation_checkpointing: the plain run again with checkpointing every 2 layers.
dropout: dropout 0.1 everywhere and checkpointing every layer, trained and resumed as 'plain'.
Rank 0 writes everything to `--out` (JSON) for the test to compare with a single-process run.
"""
from __future__ import annotations

import argparse
import copy
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


def train_and_resume(cfg, steps: int, save_at: int, dump_params: str | None = None) -> dict:
    """Uninterrupted run with a checkpoint at `save_at`, then a fresh run resumed from it."""
    data_dir = os.path.join(cfg.run_dir, "data")
    first = Trainer(cfg, max_steps=steps)
    result = {"uninterrupted": record_steps(first, steps, save_at),
              "partition": [int(x) for x in first.module.parts]}
    if dump_params and first.layout.replica == 0:
        state = {k: v.detach().cpu() for k, v in first.module.state_dict().items() if torch.is_tensor(v)}
        torch.save(plain_state_dict(cfg.model, state), f"{dump_params}.stage{first.layout.stage}.tp{first.layout.tp_rank}.pt")
    resumed = copy.deepcopy(cfg)
    resumed.run_dir = cfg.run_dir + "-resumed"
    fresh_run_dir(resumed.run_dir, data_dir, cfg.run_dir, f"step{save_at}")
    second = Trainer(resumed, max_steps=steps)
    result["resumed_from"] = second.step
    result["resumed"] = record_steps(second, steps, None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--only-plain", action="store_true", help="skip the other scenarios")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    cfg = load_config(args.config)
    data_dir = os.path.join(cfg.run_dir, "data")
    results = {"plain": train_and_resume(cfg, args.steps, args.save_at, dump_params=f"{args.out}.params")}
    if args.only_plain:
        if torch.distributed.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(results, f)
        return

    # Activation checkpointing (every 2 layers) must not change the numbers.
    ckpt = copy.deepcopy(cfg)
    ckpt.run_dir = cfg.run_dir + "-ac2"
    ckpt.parallel.activation_checkpoint_interval = 2
    fresh_run_dir(ckpt.run_dir, data_dir)
    results["activation_checkpointing"] = record_steps(Trainer(ckpt, max_steps=args.steps), args.steps, None)

    # Dropout with checkpointing every layer: the resumed run must replay the same dropout masks.
    drop = copy.deepcopy(cfg)
    drop.run_dir = cfg.run_dir + "-dropout"
    drop.model.dropout = drop.model.attention_dropout = drop.model.activation_dropout = 0.1
    drop.parallel.activation_checkpoint_interval = 1
    fresh_run_dir(drop.run_dir, data_dir)
    results["dropout"] = train_and_resume(drop, args.steps, args.save_at)

    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()

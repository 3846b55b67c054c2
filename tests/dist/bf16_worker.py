"""Runs under the deepspeed launcher: the bf16 checks of tests/test_bf16.py in one launch.

short:  `--steps` bf16 steps of the real Trainer (loss, clipped global gradient norm, shapes).
curves: `--curve-steps` steps in bf16 and in fp32 from the same initial weights and batches.
Rank 0 writes everything to `--out` (JSON).
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch

from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import fresh_run_dir, record_steps
from trainer.config import load_config
from trainer.trainer import Trainer


def run(cfg, precision: str, steps: int, name: str) -> dict:
    run_cfg = copy.deepcopy(cfg)
    run_cfg.parallel.precision = precision
    run_cfg.run_dir = f"{cfg.run_dir}-{name}"
    fresh_run_dir(run_cfg.run_dir, os.path.join(cfg.run_dir, "data"))
    trainer = Trainer(run_cfg, max_steps=steps)
    out = record_steps(trainer, steps, None)
    out["optimizer"] = type(trainer.engine.optimizer).__name__
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--curve-steps", type=int, default=50)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    setup_distributed()
    cfg = load_config(args.config)
    results = {"short": run(cfg, "bf16", args.steps, "bf16-short")}
    if args.curve_steps:
        curves = copy.deepcopy(cfg)
        curves.train.clip_norm = 1.0
        results["curves"] = {p: run(curves, p, args.curve_steps, f"{p}-curve") for p in ("bf16", "fp32")}
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
    exit_rank()

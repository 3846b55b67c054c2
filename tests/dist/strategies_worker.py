"""Runs under the deepspeed launcher: every normalisation strategy as a 2-stage pipeline, in one launch.

For each strategy in `--strategies`: a fresh run directory `<run_dir>-<strategy>`, the real
Trainer (with the stability instruments on every step, `train.instrument_interval=1`, for the
strategies in `--instrumented`), `--steps` steps, per-step losses and global gradient norms
recorded. BranchNorm (T = 3, so λ_t crosses 1
during the run) also saves a checkpoint after `--save-at` steps; a second Trainer then resumes from
it in the same run directory and records the remaining steps. Rank 0 writes the numbers to `--out`;
the instruments are in each run directory's metrics/stability.csv.
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil

import torch

from model.norms import BranchNormResidual
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import record_steps, write_result
from trainer.config import load_config
from trainer.trainer import Trainer

BRANCHNORM_T = 3


def branch_steps(trainer: Trainer) -> list[int]:
    """The step held by every BranchNorm block of this stage (all must agree)."""
    return sorted({int(m.step) for m in trainer.module.modules() if isinstance(m, BranchNormResidual)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--strategies", required=True, help="comma-separated model.norm values")
    parser.add_argument("--instrumented", default="", help="strategies run with train.instrument_interval=1")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    setup_distributed()
    base = load_config(args.config)
    data_dir = os.path.join(base.run_dir, "data")
    results = {}
    for norm in args.strategies.split(","):
        cfg = copy.deepcopy(base)
        cfg.model.norm = norm
        cfg.model.branchnorm_max_norm_step = BRANCHNORM_T
        cfg.train.instrument_interval = 1 if norm in args.instrumented.split(",") else 0
        cfg.run_dir = f"{base.run_dir}-{norm}"
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(cfg.run_dir, ignore_errors=True)
            os.makedirs(cfg.run_dir)
            os.symlink(os.path.abspath(data_dir), os.path.join(cfg.run_dir, "data"))
        torch.distributed.barrier()
        save_at = args.save_at if norm == "branchnorm" else None
        first = Trainer(cfg, max_steps=args.steps)
        result = {"uninterrupted": record_steps(first, args.steps, save_at), "branch_steps": branch_steps(first)}
        if save_at:
            second = Trainer(cfg, max_steps=args.steps)  # 'latest' is the step-`save_at` checkpoint
            result["resumed_from"] = second.step
            result["resumed_branch_steps"] = branch_steps(second)
            result["resumed"] = record_steps(second, args.steps)
        results[norm] = result

    write_result(args.out, results)


if __name__ == "__main__":
    main()
    exit_rank()

"""Runs under the deepspeed launcher: the first steps of a run with the stability instruments, no
validation (a 500L-500L pass over the dev split costs minutes and says nothing about ‖ΔF‖).

    deepspeed --num_gpus 2 --module experiments.fig4_worker --config RUN.yaml

The real Trainer (trainer/trainer.py) with `train.instrument_interval` as configured; the training
loss, lr and gradient norm of every step go to the same monitor CSVs as `Trainer.run` writes, and
summary.json marks the run finished. Short by design: an interrupted run starts again from step 0.
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from runtime.distributed import exit_rank
from trainer.config import load_config
from trainer.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()
    cfg = load_config(args.config)
    trainer = Trainer(cfg)
    monitor = trainer.engine.monitor
    while trainer.step < cfg.train.max_steps:
        out = trainer.train_step()
        monitor.write_events([("train/loss", out["loss"], trainer.step), ("train/lr", out["lr"], trainer.step),
                              ("train/grad_norm", out["grad_norm"], trainer.step)])
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(f"step {trainer.step}: loss is {out['loss']}")
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump({"steps": trainer.step}, f)


if __name__ == "__main__":
    main()
    exit_rank()

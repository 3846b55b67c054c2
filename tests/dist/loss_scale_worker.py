"""Runs under the deepspeed launcher (2 ranks): fp16's dynamic loss scale survives a resume and a
reshard.

An fp16 run (pp = 2) trains 2 steps; its scaler is set to a state a long run reaches (a low scale,
an overflow some iterations back), one more step is taken and the checkpoint of step 3 saved.
The scaler state is then read from (a) the same run resumed in its own layout and (b) the run
resharded to pp = 1 × dp = 2 by `./run.sh convert reshard` and resumed there. Rank 0 writes the
three states to `--out` (JSON).
"""
from __future__ import annotations

import os

import torch

from launcher.cli import main as cli
from runtime.distributed import exit_rank
from tests.dist.common import record_steps, worker_args, write_result
from trainer.config import load_config
from trainer.trainer import Trainer

KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def scaler_state(trainer: Trainer) -> dict:
    scaler = trainer.engine.optimizer.loss_scaler
    return {key: getattr(scaler, key) for key in KEYS}


def main() -> None:
    args = worker_args()
    cfg = load_config(args.config)
    first = Trainer(cfg, max_steps=5)
    record_steps(first, 2)
    scaler = first.engine.optimizer.loss_scaler
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 2.0**9, 40, 37, 1
    record_steps(first, 3)
    first.save()
    out = {"saved": scaler_state(first), "initial": 2.0**16}

    resumed = Trainer(cfg, max_steps=5)
    out["resumed"] = {"step": resumed.step, **scaler_state(resumed)}

    resharded = cfg.run_dir + "-pp1dp2"
    if torch.distributed.get_rank() == 0:
        code = cli(["convert", "reshard", os.path.join(cfg.run_dir, "checkpoints", "step3"), resharded,
                    "--pipeline-stages", "1", "--data-parallel", "2"])
        assert code == 0, "convert reshard failed"
    torch.distributed.barrier()
    other = Trainer(load_config(os.path.join(resharded, "config.yaml")), max_steps=5)
    out["resharded"] = {"step": other.step, "layout": [other.layout.pp, other.layout.dp], **scaler_state(other)}
    out["resharded_trains"] = record_steps(other, 4)["loss"]
    write_result(args.out, out)
    exit_rank(0)


if __name__ == "__main__":
    main()

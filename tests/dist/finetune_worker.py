"""Runs under the deepspeed launcher (2 ranks): train.init_from into other layouts, in one launch.

1. Source A: pp = 1 × dp = 2 trains 3 steps, checkpointing after steps 2 and 3.
2. B: init_from A's run directory (its newest checkpoint, step 3) at pp = 2: its weights right
   after start-up (dumped under the plain model's names), its optimizer, schedule, step and data
   position; then 4 steps with a checkpoint after step 2, and a relaunch that resumes step 2 and
   trains to 4 (its losses, and whether it read the source again).
3. C: init_from A's step-2 checkpoint folder at pp = 1 × tp = 2: its weights after start-up.
4. D: init_from a model file, the average of A's steps 2 and 3 (`./run.sh convert average`), at
   pp = 2: its weights after start-up.
Rank 0 writes the readings to `--out` (JSON); the weights go to `--out`.<run>.stage<s>.tp<t>.pt.
"""
from __future__ import annotations

import copy
import os

import torch

from launcher.cli import main as cli
from runtime.distributed import exit_rank
from tests.dist.common import dump_params, record_steps, variant, worker_args, write_result
from trainer.config import load_config
from trainer.trainer import Trainer


def started(trainer: Trainer) -> dict:
    """What a run that just started holds besides its weights."""
    engine = trainer.engine
    return {"step": trainer.step, "stream": trainer.stream.state_dict(),
            "adam_states": len(engine.optimizer.optimizer.state),
            "scheduler_epoch": engine.lr_scheduler.last_epoch, "lr": engine.get_lr()[0],
            "record": trainer.init_record, "history": trainer.history}


def from_source(cfg, name: str, source: str, pp: int, tp: int, out: str) -> Trainer:
    run = variant(cfg, name)
    run.train.init_from = source
    run.parallel.pipeline_stages, run.parallel.tensor_parallel = pp, tp
    trainer = Trainer(run)
    dump_params(trainer, f"{out}.{name}")
    return trainer


def main() -> None:
    args = worker_args()
    cfg = load_config(args.config)
    result = {}

    source = copy.deepcopy(cfg)
    source.parallel.pipeline_stages, source.parallel.data_parallel = 1, 2
    a = Trainer(source, max_steps=3)
    record_steps(a, 3, save_at=2)
    a.save()
    result["a"] = {"adam_states": len(a.engine.optimizer.optimizer.state), "step": a.step}

    b = from_source(cfg, "b", source.run_dir, 2, 1, args.out)
    result["b"] = started(b)
    result["b"]["loss"] = record_steps(b, 4, save_at=2)["loss"]
    again = Trainer(b.cfg, max_steps=4)  # the same run directory: resumes its own step 2
    result["b_resumed"] = {"step": again.step, "read_source": again.init_source is not None,
                           "record": again.init_record, "loss": record_steps(again, 4)["loss"]}

    c = from_source(cfg, "c", os.path.join(source.run_dir, "checkpoints", "step2"), 1, 2, args.out)
    result["c"] = started(c)

    average = os.path.join(os.path.dirname(source.run_dir), "average.pt")
    if torch.distributed.get_rank() == 0:
        steps = [os.path.join(source.run_dir, "checkpoints", f"step{s}") for s in (2, 3)]
        code = cli(["convert", "average", *steps, "--out", average])  # named: no collective verification
        assert code == 0, "convert average failed"
    torch.distributed.barrier()
    d = from_source(cfg, "d", average, 2, 1, args.out)
    result["d"] = started(d)
    write_result(args.out, result)


if __name__ == "__main__":
    main()
    exit_rank()

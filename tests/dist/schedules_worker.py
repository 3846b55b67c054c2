"""Runs under the deepspeed launcher (2 ranks, pp = 2): every schedule of parallel/schedules.py
trains the same run with the real Trainer, one after the other in fresh run directories; rank 0
writes each one's per-step losses and clipped norms to `--out` (JSON by schedule name) and every
stage its parameters to `--out`.<name>.stage<s>.tp0.pt."""
from __future__ import annotations

from parallel.schedules import SCHEDULES
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import dump_params, record_steps, variant, worker_args, write_result
from trainer.config import load_config
from trainer.trainer import Trainer


def main() -> None:
    args = worker_args(steps=3)
    cfg = load_config(args.config)
    setup_distributed()  # variant() makes the run directories on rank 0
    result = {}
    for name, schedule in SCHEDULES.items():
        run = variant(cfg, name)
        run.parallel.schedule = name
        trainer = Trainer(run, max_steps=args.steps)
        result[name] = {**record_steps(trainer, args.steps), "engine": type(trainer.engine).__name__,
                        "engine_of_registry": schedule.engine.rpartition(":")[2]}
        dump_params(trainer, f"{args.out}.{name}")
    write_result(args.out, result)
    exit_rank(0)


if __name__ == "__main__":
    main()

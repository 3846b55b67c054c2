"""Runs under the deepspeed launcher (tests/test_schedules.py: pp = 2 × tp = 2 and pp = 4, 4 ranks):
every schedule of parallel/schedules.py, and the one `--schedule-module` registers (a module file
defining SCHEDULE, as a user adding a schedule would write it), trains the same run with the real
Trainer, one after the other in fresh run directories, in each of `--precisions`; and so does
DeepSpeed's own 1F1B, `PipelineEngine` running its TrainSchedule (parallel/engine.py's
TrainerEngine built in place of the schedule engine: name `deepspeed`). Rank 0 writes each run's
per-step losses and clipped norms to `--out` (JSON by `<schedule>/<precision>`) and every stage its
parameters to `--out`.<schedule>.<precision>.stage<s>.tp<t>.pt."""
from __future__ import annotations

import argparse
import importlib.util
from unittest import mock

from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import dump_params, record_steps, variant, write_result
from trainer.config import load_config
from trainer.trainer import Trainer

DEEPSPEED = "deepspeed"


def register(path: str) -> str:
    """Import the module file at `path` and add its SCHEDULE to the registry; its name."""
    spec = importlib.util.spec_from_file_location("added_schedule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    SCHEDULES[module.SCHEDULE.name] = module.SCHEDULE
    return module.SCHEDULE.name


def train(cfg, name: str, precision: str, steps: int, out: str) -> dict:
    run = variant(cfg, f"{name}-{precision}")
    run.parallel.schedule = DEFAULT_SCHEDULE if name == DEEPSPEED else name
    run.parallel.precision = precision
    if name == DEEPSPEED:
        from parallel.engine import TrainerEngine

        with mock.patch("parallel.parallelize.engine_class", return_value=TrainerEngine):
            trainer = Trainer(run, max_steps=steps)
    else:
        trainer = Trainer(run, max_steps=steps)
    engine = trainer.engine
    result = {**record_steps(trainer, steps), "engine": type(engine).__name__,
              "schedule": run.parallel.schedule, "orders": getattr(engine, "orders", None),
              "buffers": engine.num_pipe_buffers, "skipped_steps": int(getattr(engine, "skipped_steps", 0))}
    dump_params(trainer, f"{out}.{name}.{precision}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule-module", help="a module file defining SCHEDULE, added to the registry")
    parser.add_argument("--precisions", default="fp32", help="comma-separated")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()
    added = register(args.schedule_module) if args.schedule_module else None
    cfg = load_config(args.config)
    setup_distributed()  # variant() makes the run directories on rank 0
    result = {}
    for precision in args.precisions.split(","):
        # the added schedule (its backwards in reverse order) only in fp32: its sums differ in rounding
        names = [n for n in SCHEDULES if precision == "fp32" or n != added] + [DEEPSPEED]
        for name in names:
            result[f"{name}/{precision}"] = train(cfg, name, precision, args.steps, args.out)
    write_result(args.out, result)
    exit_rank(0)


if __name__ == "__main__":
    main()

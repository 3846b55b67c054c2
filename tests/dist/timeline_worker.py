"""Runs under the deepspeed launcher (`--layouts` say pp × dp; each must use every rank): every
schedule of parallel/schedules.py trains the real Trainer with train.trace_steps = [3, 4] to
step 5, in fresh run directories. Per run and rank: the tracer's hook calls and the engine's
observers after each step; on rank 0 the bubble report and the files written. Then the first
layout's run is resumed to step 7 with trace_steps [3, 6] (step 3 ran before the launch), and the
clock offsets are measured once more with every rank's clock skewed by a known amount. Rank 0
writes everything to `--out` (JSON)."""
from __future__ import annotations

import argparse
import copy
import time

import torch

from parallel.schedules import SCHEDULES
from parallel.trace import clock_offsets
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import variant, write_result
from trainer.config import load_config
from trainer.trainer import Trainer

SKEW_NS = 7_123_456_789
"""Rank r's clock runs r × this ahead in the skewed measurement (as on nodes whose clocks differ)."""


def traced_run(cfg, name: str, pp: int, dp: int) -> dict:
    run = variant(cfg, f"{name}-pp{pp}-dp{dp}")
    run.parallel.schedule, run.parallel.pipeline_stages, run.parallel.data_parallel = name, pp, dp
    run.train.trace_steps, run.train.max_steps = [3, 4], 5
    trainer = Trainer(run)
    calls, observers = [], []
    while trainer.step < run.train.max_steps:
        trainer.train_step()
        calls.append(trainer.timeline.tracer.calls)
        observers.append(len(trainer.engine._observers) + ("_INSTRUCTION_MAP" in vars(trainer.engine)))
    out = {"calls": calls, "observers": observers, "run_dir": run.run_dir,
           "offsets": trainer.timeline.tracer.offsets, "report": trainer.timeline.report,
           "paths": trainer.timeline.paths}
    trainer.save()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--layouts", required=True, help="comma-separated PPxDP, e.g. 4x1,2x2")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()
    cfg = load_config(args.config)
    setup_distributed()
    rank = torch.distributed.get_rank()
    result: dict = {"runs": {}}
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    for pp, dp in layouts:
        for name in SCHEDULES:
            start = time.perf_counter()
            mine = traced_run(cfg, name, pp, dp)
            mine["seconds"] = time.perf_counter() - start
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, mine)
            result["runs"][f"{name}-pp{pp}-dp{dp}"] = gathered
    # The first run resumed (honoured on resume: the new steps are traced, the old one noted).
    first = result["runs"][next(iter(result["runs"]))][rank]
    resumed = copy.deepcopy(cfg)
    resumed.run_dir = first["run_dir"]
    resumed.parallel.schedule = next(iter(SCHEDULES))
    resumed.parallel.pipeline_stages, resumed.parallel.data_parallel = layouts[0]
    resumed.train.trace_steps, resumed.train.max_steps = [3, 6], 7
    trainer = Trainer(resumed)
    result["resumed"] = {"from": trainer.step, "steps": trainer.timeline.tracer.steps}
    while trainer.step < resumed.train.max_steps:
        trainer.train_step()
    result["resumed"]["paths"] = trainer.timeline.paths
    result["skewed"] = [None] * torch.distributed.get_world_size()
    skewed = clock_offsets(now=lambda: time.perf_counter_ns() + rank * SKEW_NS)
    torch.distributed.all_gather_object(result["skewed"], skewed)
    write_result(args.out, result)
    exit_rank(0)


if __name__ == "__main__":
    main()

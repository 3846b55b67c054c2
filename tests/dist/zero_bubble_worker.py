"""Runs under the deepspeed launcher: 1F1B and ZB-H1 trained from the same weights on the same
batches, several scenarios in one launch (start-up is costly).

zb, 1f1b:        the plain config (no dropout) under each schedule.
zb_ac:           ZB-H1 with activation checkpointing every layer.
zb_drop, 1f1b_drop: dropout 0.1 everywhere and checkpointing every layer, under each schedule
                 (dropout draws from each rank's stream in forward order, which both schedules
                 share, so the two must agree; the single process draws other masks).
zb_subln:        ZB-H1 with Sub-LN (LayerNorms inside attention and FFN: sharded under TP).
zb_auto:         ZB-H1 without a bound on pending W (parallel.zb_max_pending_w: -1): the paper's order
                 in step 1, the order tuned to the F, B, W times of step 2 from step 3 on;
                 the others use the default bound 0 (W right after its own B).
zb_filled:       as zb_auto, with costs given from the start (FILLED_COSTS), so every step runs
                 a filled order: the first stage defers (part of) its W too.
zb_filled_drop:  zb_filled with zb_drop's dropout and checkpointing (against 1f1b_drop).
zb_bf16, 1f1b_bf16, zb_fp16, 1f1b_fp16: each schedule in bf16 / fp16 with checkpointing every
                 layer and, at tp = 1, zb_drop's dropout; zb_filled_bf16: zb_filled in bf16 (the
                 first stage folds a share of its W after its own pass).
Per scenario rank 0 writes losses and global gradient norms to `--out` (JSON), and every stage
writes its parameters under the plain model's names to `--out`.<scenario>.stage<k>.tp<t>.pt.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch

from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import dump_params, fresh_run_dir, record_steps
from trainer.config import load_config
from trainer.trainer import Trainer

# Costs given to the zb_filled scenarios: at pp = 2 those measured on 6L-6L d=512 (the lean
# filled order, the first stage deferring 1/8 of its W), at pp = 3 W-cheap ones (the filled order).
FILLED_COSTS = {2: [{"F": 0.722, "B": 0.709, "W": 0.592}, {"F": 0.699, "B": 0.687, "W": 0.574}],
                3: [{"F": 1.0, "B": 1.0, "W": 0.4}] * 3}


def run(cfg, name: str, steps: int, out: str) -> dict:
    cfg = copy.deepcopy(cfg)
    data_dir = os.path.join(cfg.run_dir, "data")
    cfg.run_dir = f"{cfg.run_dir}-{name}"
    fresh_run_dir(cfg.run_dir, data_dir)
    trainer = Trainer(cfg, max_steps=steps)
    if name.startswith("zb_filled"):
        trainer.engine.measured_costs = FILLED_COSTS[trainer.engine.num_stages]
        trainer.engine.tune_step = 0
    result = record_steps(trainer, steps, None)
    result["engine"] = type(trainer.engine).__name__
    result["precision"] = cfg.parallel.precision
    result["skipped_steps"] = int(getattr(trainer.engine, "skipped_steps", 0))  # fp16 overflows
    result["max_pending_w"] = trainer.engine.max_pending_w  # from parallel.zb_max_pending_w
    result["schedule"] = trainer.engine.schedule.name
    result["orders"] = trainer.engine.orders
    result["measured_costs"] = trainer.engine.measured_costs
    result["share"] = trainer.engine.deferred_share
    dump_params(trainer, f"{out}.{name}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--scenarios", default="zb,1f1b,zb_ac,zb_drop,1f1b_drop", help="comma-separated")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    setup_distributed()
    cfg = load_config(args.config)
    drop = copy.deepcopy(cfg)
    drop.model.dropout = drop.model.attention_dropout = drop.model.activation_dropout = 0.1
    drop.parallel.activation_checkpoint_interval = 1
    subln = copy.deepcopy(cfg)
    subln.model.norm = "subln"
    mixed = drop if cfg.parallel.tensor_parallel == 1 else cfg
    scenarios = {"zb": (cfg, "zb-h1", 0), "1f1b": (cfg, "1f1b", 0), "zb_ac": (cfg, "zb-h1", 1),
                 "zb_drop": (drop, "zb-h1", 1), "1f1b_drop": (drop, "1f1b", 1), "zb_subln": (subln, "zb-h1", 0),
                 "zb_auto": (cfg, "zb-h1", 0), "zb_filled": (cfg, "zb-h1", 0), "zb_filled_drop": (drop, "zb-h1", 1),
                 **{f"{schedule}_{precision}": (mixed, schedule.replace("zb", "zb-h1"), 1)
                    for schedule in ("zb", "1f1b") for precision in ("bf16", "fp16")},
                 "zb_filled_bf16": (mixed, "zb-h1", 1)}
    results = {}
    for name in args.scenarios.split(","):
        base, schedule, interval = scenarios[name]
        scenario = copy.deepcopy(base)
        scenario.parallel.schedule = schedule
        if name.startswith(("zb_auto", "zb_filled")):
            scenario.parallel.zb_max_pending_w = -1  # the config key the engine reads
        scenario.parallel.activation_checkpoint_interval = interval
        for precision in ("bf16", "fp16"):
            if name.endswith(precision):
                scenario.parallel.precision = precision
        results[name] = run(scenario, name, args.steps, args.out)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
    exit_rank()

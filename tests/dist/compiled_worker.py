"""Compiled layers under the real deepspeed launcher (tests/test_compiled.py): one launch, pp = 2.

    deepspeed --num_gpus 2 --module tests.dist.compiled_worker --config RUN.yaml --out R.json --steps 4

compiled      train.compile=true, dropout 0: every step recorded, a checkpoint after step 2, the
              parameters dumped, then the host syncs of two more steps and the compile counts
eager_resume  train.compile=false, resumed from that checkpoint: the compiled run's checkpoint in an
              eager run
dropout_ac    compiled, dropout 0.1 everywhere, activation checkpointing every layer
dropout       the same without activation checkpointing (recomputation must draw the same masks)
"""
from __future__ import annotations

import argparse
import copy
import os

from bench.ops_syncs import sync_counts
from parallel import compiled
from runtime.distributed import exit_rank
from tests.dist.common import dump_params, fresh_run_dir, record_steps, with_dropout, write_result
from trainer.config import load_config
from trainer.trainer import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()
    cfg = load_config(args.config)
    cfg.train.compile = True
    steps, save_at = args.steps, args.steps // 2
    out = {}

    first = Trainer(cfg, max_steps=steps + 2)
    out["compiled"] = record_steps(first, steps, save_at)
    dump_params(first, args.out + ".compiled")
    out["syncs"] = sync_counts(first)
    out["graphs"] = {kind: int(s["graphs"]) for kind, s in compiled.stats.items()}

    eager = copy.deepcopy(cfg)
    eager.train.compile = False
    eager.run_dir = cfg.run_dir + "-eager"
    fresh_run_dir(eager.run_dir, os.path.join(cfg.run_dir, "data"), cfg.run_dir, f"step{save_at}")
    resumed = Trainer(eager, max_steps=steps)
    out["eager_resume"] = {"from": resumed.step, **record_steps(resumed, steps)}
    out["eager_compiled_layers"] = sum(getattr(m, "_compiled_call_impl", None) is not None
                                       for m in resumed.module.modules())

    for name, interval in (("dropout_ac", 1), ("dropout", 0)):
        run = with_dropout(cfg, name, checkpoint_interval=interval)
        out[name] = record_steps(Trainer(run, max_steps=steps), steps)
    out["graphs_after"] = {kind: int(s["graphs"]) for kind, s in compiled.stats.items()}
    write_result(args.out, out)
    exit_rank(0)


if __name__ == "__main__":
    main()

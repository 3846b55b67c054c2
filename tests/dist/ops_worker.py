"""One process (no launcher): kernel operations per training step beyond the model
(bench/ops.py `engine_ops_per_step`) for `--precisions` with the trainer's FlatOptimizer, and for bf16 with
DeepSpeed's BF16_Optimizer (`--deepspeed-bf16`), step 3 of each run; with `--syncs PRECISIONS` instead,
the host syncs of two steps after two warm-up steps in each precision (bench/ops_syncs.py
`sync_counts`: reads and blocking host-to-device copies). Writes JSON to `--out`."""
from __future__ import annotations

import argparse
import json
import os

from bench.ops_syncs import engine_ops_per_step, new_trainer, sync_counts
from runtime.distributed import exit_rank, setup_distributed
from trainer.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--deepspeed-bf16", action="store_true")
    parser.add_argument("--syncs", help="comma-separated precisions: count host syncs instead")
    args = parser.parse_args()

    setup_distributed()
    cfg = load_config(args.config)
    data = os.path.join(cfg.run_dir, "data")
    out = {}
    if args.syncs:
        for precision in args.syncs.split(","):
            cfg.parallel.precision = precision
            trainer = new_trainer(cfg, data, f"{cfg.run_dir}-syncs-{precision}")
            for _ in range(2):
                trainer.train_step()
            out[precision] = sync_counts(trainer)
    else:
        for precision in args.precisions.split(","):
            out[precision] = engine_ops_per_step(cfg, precision, data, f"{cfg.run_dir}-{precision}")
        if args.deepspeed_bf16:
            out["deepspeed_bf16"] = engine_ops_per_step(cfg, "bf16", data, f"{cfg.run_dir}-deepspeed",
                                                        flat_optimizer=False)
    with open(args.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
    exit_rank()

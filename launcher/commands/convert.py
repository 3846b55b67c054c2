"""./run.sh convert consolidate|reshard: one model file from a checkpoint, or a checkpoint for
another pipeline/data-parallel layout (see parallel/checkpoints.py for both formats)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from launcher.options import user_path

HELP = "checkpoints: 'consolidate' into one model file, 'reshard' to another pp × dp layout"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    one = sub.add_parser("consolidate", help="write one file: model config, weights, SentencePiece model")
    one.add_argument("source", type=user_path, help="run directory, its checkpoints/ folder, or one checkpoint folder")
    one.add_argument("--tag", help="checkpoint tag (default: latest)")
    one.add_argument("--out", type=user_path, help="output file (default RUN_DIR/model-<tag>.pt); an existing one is replaced only "
                                   "with --force")
    one.add_argument("--force", action="store_true", help="replace an existing --out file")
    re = sub.add_parser("reshard", help="a new run directory whose checkpoint resumes at another layout")
    re.add_argument("source", type=user_path, help="run directory, its checkpoints/ folder, or one checkpoint folder")
    re.add_argument("out_run_dir", type=user_path, help="new run directory (must not hold checkpoints yet)")
    re.add_argument("--pipeline-stages", type=int, required=True)
    re.add_argument("--data-parallel", type=int, required=True)
    re.add_argument("--tag", help="checkpoint tag (default: latest)")
    re.add_argument("--max-steps", type=int, help="new train.max_steps (a finished run needs more to continue)")


def run(args: argparse.Namespace) -> int:
    from trainer.config import check_run_config
    from parallel.checkpoints import CheckpointError, consolidate, locate, reshard

    start = time.perf_counter()
    try:
        if args.action == "consolidate":
            if args.out and os.path.isdir(args.out):
                raise CheckpointError(f"--out {args.out} is a folder; give a file name, e.g. "
                                      f"{os.path.join(args.out, 'model.pt')}")
            if args.out and os.path.exists(args.out) and not args.force:
                raise CheckpointError(f"--out {args.out} exists; choose another file, or pass --force to replace it")
            run_dir, _, tag = locate(args.source, args.tag)
            out = args.out or os.path.join(run_dir, f"model-{tag}.pt")
            source = consolidate(args.source, out, args.tag)
            size = os.path.getsize(out) / 2**20
            print(f"wrote {out} ({size:.1f} MiB, step {source['step']}, from {source['checkpoint']}) in "
                  f"{time.perf_counter() - start:.1f} s; use it with ./run.sh translate {out} --to LANG")
        else:
            config = reshard(args.source, args.out_run_dir, args.pipeline_stages, args.data_parallel,
                             args.tag, args.max_steps,
                             check_config=lambda run_cfg: check_run_config(run_cfg, "the resharded config"))
            print(f"wrote a universal checkpoint for {args.pipeline_stages} stages × {args.data_parallel} "
                  f"replicas in {time.perf_counter() - start:.1f} s; resume with:\n  ./run.sh train {config}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

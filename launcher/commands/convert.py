"""./run.sh convert consolidate|average|reshard: one model file from a checkpoint, one model file
averaging several checkpoints (checkpoint/average.py), or a new run directory whose checkpoint
resumes at another pp × tp × dp layout (see checkpoint/checkpoints.py for the formats; a run
resumed at another layout in its own run directory needs none: checkpoint/elastic.py)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from launcher.options import shown_path, user_path
from schema.text import count

HELP = ("checkpoints: 'consolidate' into one model file, 'average' several into one, 'reshard' to another "
        "pp × tp × dp layout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    one = sub.add_parser("consolidate", help="write one file: model config, weights, SentencePiece model")
    one.add_argument("source", type=user_path, help="run directory, its checkpoints/ folder, or one checkpoint folder")
    one.add_argument("--tag", help="checkpoint tag (default: latest)")
    one.add_argument("--out", type=user_path, help="output file (default RUN_DIR/model-<tag>.pt); an existing one is replaced only "
                                   "with --force")
    one.add_argument("--force", action="store_true", help="replace an existing --out file")
    avg = sub.add_parser("average", help="one model file: the element-wise mean of several checkpoints' weights")
    avg.add_argument("sources", nargs="+", type=user_path, metavar="SOURCE",
                     help="a run directory (with --last or --steps), or checkpoint folders / model files")
    which = avg.add_mutually_exclusive_group()
    which.add_argument("--last", type=int, metavar="N", help="the run's N newest checkpoints")
    which.add_argument("--steps", type=int, nargs="+", metavar="S", help="the run's checkpoints of these steps")
    avg.add_argument("--out", type=user_path, help="output file (default RUN_DIR/model-average-<steps>.pt); an "
                                                   "existing one is replaced only with --force")
    avg.add_argument("--force", action="store_true", help="replace an existing --out file")
    re = sub.add_parser("reshard", help="a new run directory whose checkpoint resumes at another layout")
    re.add_argument("source", type=user_path, help="run directory, its checkpoints/ folder, or one checkpoint folder")
    re.add_argument("out_run_dir", type=user_path, help="new run directory (must not hold checkpoints yet)")
    re.add_argument("--pipeline-stages", type=int, required=True)
    re.add_argument("--data-parallel", type=int, required=True)
    re.add_argument("--tensor-parallel", type=int, help="tensor-parallel ranks per stage (default: the checkpoint's)")
    re.add_argument("--tag", help="checkpoint tag (default: latest)")
    re.add_argument("--max-steps", type=int, help="new train.max_steps (a finished run needs more to continue)")


def run(args: argparse.Namespace) -> int:
    from checkpoint.checkpoints import CheckpointError, consolidate, locate, reshard
    from trainer.config import check_run_config

    start = time.perf_counter()
    try:
        if args.action in ("consolidate", "average"):
            if args.out and os.path.isdir(args.out):
                raise CheckpointError(f"--out {args.out} is a folder; give a file name, e.g. "
                                      f"{os.path.join(args.out, 'model.pt')}")
            if args.out and os.path.exists(args.out) and not args.force:
                raise CheckpointError(f"--out {args.out} exists; choose another file, or pass --force to replace it")
        if args.action == "average":
            return _average(args, start)
        if args.action == "consolidate":
            run_dir, _, tag = locate(args.source, args.tag)
            out = args.out or os.path.join(run_dir, f"model-{tag}.pt")
            source = consolidate(args.source, out, args.tag)
            size = os.path.getsize(out) / 2**20
            print(f"wrote {shown_path(out)} ({size:.1f} MiB, step {source['step']}, from {source['checkpoint']}) in "
                  f"{time.perf_counter() - start:.1f} s; use it with ./run.sh translate {shown_path(out)} --to LANG")
        else:
            for flag in ("pipeline_stages", "data_parallel", "tensor_parallel"):
                if getattr(args, flag) is not None and getattr(args, flag) < 1:
                    raise CheckpointError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
            config = reshard(args.source, args.out_run_dir, args.pipeline_stages, args.data_parallel,
                             args.tag, args.max_steps, tensor_parallel=args.tensor_parallel,
                             check_config=lambda run_cfg: check_run_config(run_cfg, "the resharded config"))
            tp = f" × tensor-parallel {args.tensor_parallel}" if args.tensor_parallel else ""
            print(f"wrote a universal checkpoint for {count(args.pipeline_stages, 'stage')}{tp} × "
                  f"{count(args.data_parallel, 'replica')} in {time.perf_counter() - start:.1f} s; resume with:\n  ./run.sh train {shown_path(config)}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _average(args: argparse.Namespace, start: float) -> int:
    from checkpoint.average import average, select
    from checkpoint.checkpoints import CheckpointError

    chosen = args.last is not None or args.steps
    if chosen and len(args.sources) != 1:
        raise CheckpointError("--last and --steps choose among one run directory's checkpoints; give one SOURCE")
    if not chosen and len(args.sources) < 2:
        one = args.sources[0]
        if os.path.isdir(os.path.join(one, "checkpoints")):
            raise CheckpointError(f"{one}: give --last N or --steps S [S ...] to choose its checkpoints")
        raise CheckpointError(f"{one}: an average needs two or more checkpoints / model files; name the others "
                              "too, or give a run directory with --last N or --steps S [S ...]")
    named = [os.path.realpath(s) for s in args.sources]
    twice = next((s for s, real in zip(args.sources, named) if named.count(real) > 1), None)
    if twice is not None or (args.steps and len(set(args.steps)) < len(args.steps)):
        what = twice or f"step {next(s for s in args.steps if args.steps.count(s) > 1)}"
        raise CheckpointError(f"{what} is named twice; an average counts each checkpoint once")
    if not chosen and not args.out:
        raise CheckpointError("--out FILE is needed when the sources are named one by one")
    sources = select(args.sources[0], args.last, args.steps) if chosen else args.sources
    out = args.out or os.path.join(args.sources[0], "model-average-" + "-".join(
        os.path.basename(s) for s in sources) + ".pt")
    if os.path.exists(out) and not args.force:
        raise CheckpointError(f"{out} exists; pass --force to replace it, or --out another file")
    source = average(sources, out)
    steps = ", ".join(str(a["step"]) for a in source["averaged"])
    print(f"wrote {shown_path(out)} ({os.path.getsize(out) / 2**20:.1f} MiB): the mean of {count(len(sources), 'checkpoint')} "
          f"(steps {steps}) in {time.perf_counter() - start:.1f} s; use it with ./run.sh eval RUN_DIR --model "
          f"{shown_path(out)}")
    return 0

"""./run.sh bench TARGET [ARGS]: `data` (data pipeline throughput) or `train` (layouts grid)."""
from __future__ import annotations

import argparse
import importlib

HELP = "benchmarks: 'bench data' (preparation and loader throughput), 'bench train' (layout grid on CPU; the paper's shapes in bf16 on a GPU), 'bench schedules' (1F1B vs ZB-H1, steps interleaved in one launch), 'bench startup' (launch to first step of one pipeline stage), 'bench model' (the plain model with torch's operators and with the CPU kernels, hashed dropout and short-sequence attention, steps interleaved)"

TARGETS = {"data": "bench.data", "train": "bench.layouts", "schedules": "bench.schedules", "startup": "bench.startup",
           "model": "bench.model"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark (--help)")


def run(args: argparse.Namespace) -> int:
    from parallel import accelerator

    module = TARGETS[args.target]
    if args.target == "train" and accelerator.gpu_available():
        module = "bench.gpu"  # the paper's shapes on one GPU, in bf16
    return importlib.import_module(module).main(args.args)

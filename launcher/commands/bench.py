"""./run.sh bench TARGET [ARGS]: `data` (data pipeline throughput) or `train` (layouts grid)."""
from __future__ import annotations

import argparse
import importlib

HELP = "benchmarks: 'bench data' (preparation and loader throughput), 'bench train' (layout grid)"

TARGETS = {"data": "data.bench", "train": "launcher.bench_layouts"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark (--help)")


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(TARGETS[args.target]).main(args.args)

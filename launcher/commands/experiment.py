"""./run.sh experiment NAME [ARGS]: reproductions of the paper's findings (experiments/)."""
from __future__ import annotations

import argparse
import importlib

HELP = ("run an experiment: 'experiment update-norms' (DeepNet Fig. 4 and Tables I/XI on tiny models), "
        "'experiment depth-1000' (200L-200L and 500L-500L trained as a 2-stage pipeline)")

EXPERIMENTS = {"update-norms": "experiments.update_norms", "depth-1000": "experiments.depth_1000"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(EXPERIMENTS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the experiment (--help)")


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(EXPERIMENTS[args.name]).main(args.args)

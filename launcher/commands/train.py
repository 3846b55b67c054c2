"""./run.sh train [CONFIG]: prepare the data, then launch the pipeline ranks."""
from __future__ import annotations

import argparse
import os
import subprocess

from launcher.cli import DEFAULT_CONFIG, ROOT, deepspeed_command, launch_env
from launcher.config import load_config

HELP = "prepare data and train a model (an existing run directory is resumed)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="YAML run config")
    parser.add_argument("--run-dir", help="override run_dir of the config")


def run(args: argparse.Namespace) -> int:
    from data.prepare import prepare_data

    cfg = load_config(args.config, {"run_dir": args.run_dir} if args.run_dir else None)
    print(f"config {args.config} → run directory {cfg.run_dir}", flush=True)
    prepare_data(cfg.data, os.path.join(cfg.run_dir, "data"))
    cmd = deepspeed_command(cfg.world_size, "launcher/train.py",
                            ["--config", os.path.abspath(args.config), "--run-dir", os.path.abspath(cfg.run_dir)])
    print(f"launching {cfg.world_size} ranks (pipeline_stages={cfg.parallel.pipeline_stages} × "
          f"data_parallel={cfg.parallel.data_parallel})", flush=True)
    return subprocess.call(cmd, env=launch_env(cfg.world_size), cwd=ROOT)

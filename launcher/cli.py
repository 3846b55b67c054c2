"""The commands behind ./run.sh: `train [CONFIG]` (prepare data, then launch the pipeline)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from launcher.config import ConfigError, load_config  # noqa: E402

DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.yaml")


def launch_env(world_size: int) -> dict:
    """Environment of the ranks: the repo on PYTHONPATH; on CPU, cores split evenly over ranks
    (the deepspeed launcher leaves OMP_NUM_THREADS alone, and oversubscribed ranks ran 6× slower)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def deepspeed_command(world_size: int, script: str, script_args: list[str]) -> list[str]:
    """`deepspeed --num_gpus N script ARGS` on this node (no hostfile → local ranks only)."""
    from parallel.engine import free_port

    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [launcher, "--num_gpus", str(world_size), "--master_port", str(free_port()),
            os.path.join(ROOT, script), *script_args]


def cmd_train(args: argparse.Namespace) -> int:
    from data.prepare import prepare_data

    cfg = load_config(args.config, {"run_dir": args.run_dir} if args.run_dir else None)
    print(f"config {args.config} → run directory {cfg.run_dir}", flush=True)
    prepare_data(cfg.data, os.path.join(cfg.run_dir, "data"))
    cmd = deepspeed_command(cfg.world_size, "launcher/train.py",
                            ["--config", os.path.abspath(args.config), "--run-dir", os.path.abspath(cfg.run_dir)])
    print(f"launching {cfg.world_size} ranks: {' '.join(cmd)}", flush=True)
    return subprocess.call(cmd, env=launch_env(cfg.world_size), cwd=ROOT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh", description="deepnet-trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="prepare data and train (resumes an existing run directory)")
    train.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    train.add_argument("--run-dir", help="override run_dir of the config")
    args = parser.parse_args(argv)
    try:
        return {"train": cmd_train}[args.command](args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

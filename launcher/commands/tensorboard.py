"""./run.sh tensorboard [RUN_DIR] [--port N]: TensorBoard on a run's events (<run_dir>/tensorboard),
with the tensorboard of the project's environment (`tensorboard` alone is not on a shell's PATH
where the environment is not activated)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from launcher.launch import DEFAULT_RUN
from launcher.options import shown_path, user_path
from trainer.config import ConfigError

HELP = "TensorBoard on a run directory's events (loss, lr, gradient norm, tokens/s, validation, BLEU/chrF)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", default=DEFAULT_RUN, type=user_path,
                        help="run directory (default runs/default)")
    parser.add_argument("--port", type=int, default=6006, help="port to serve on (6006)")
    parser.add_argument("--bind-all", action="store_true", help="serve on every network interface, not only localhost")
    parser.add_argument("--inspect", action="store_true", help="print what the event files hold and exit")


def tensorboard_binary() -> str:
    """The tensorboard of the environment this Python runs in."""
    here = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    found = here if os.access(here, os.X_OK) else shutil.which("tensorboard")
    if found is None:
        raise ConfigError(f"{here}: no tensorboard in this environment; install requirements.txt (./run.sh does)")
    return found


def run(args: argparse.Namespace) -> int:
    logdir = os.path.join(args.run_dir, "tensorboard")
    if not os.path.isdir(logdir):
        raise ConfigError(f"{logdir}: no TensorBoard events there; give a run directory that has trained "
                          "(its tensorboard/ folder holds them)")
    command = [tensorboard_binary(), "--logdir", logdir]
    if args.inspect:
        command.append("--inspect")
    else:
        command += ["--port", str(args.port)] + (["--bind_all"] if args.bind_all else [])
        print(f"TensorBoard on {shown_path(logdir)}: http://localhost:{args.port}/ (Ctrl-C stops it)", flush=True)
    sys.stdout.flush()
    os.execv(command[0], command)

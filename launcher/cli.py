"""The commands behind ./run.sh. Each command is a module in launcher/commands/ that defines
`HELP` (one line), `add_arguments(parser)` and `run(args) -> int`; they are discovered, so adding
a command touches no other file."""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from data.errors import DataError  # noqa: E402
from launcher.config import ConfigError  # noqa: E402

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
            "--log_level", "error", os.path.join(ROOT, script), *script_args]


def commands() -> dict:
    import launcher.commands as package

    return {name: importlib.import_module(f"launcher.commands.{name}")
            for _, name, _ in pkgutil.iter_modules(package.__path__) if not name.startswith("_")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh", description="deepnet-trainer")
    sub = parser.add_subparsers(dest="command", required=True)
    table = commands()
    # Only the chosen command builds its arguments: some import torch to read their defaults,
    # which a command that stops on a bad config should not pay for.
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in sorted(table.items()):
        parser_ = sub.add_parser(name.replace("_", "-"), help=module.HELP, description=module.HELP)
        if name.replace("_", "-") == chosen:
            module.add_arguments(parser_)
    args = parser.parse_args(argv)
    try:
        return table[args.command.replace("-", "_")].run(args)
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or folder the command cannot use (permissions, a full disk)
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished work is kept and a rerun continues from it", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The commands behind ./run.sh. Each command is a module in launcher/commands/ that defines
`HELP` (one line), `add_arguments(parser)` and `run(args) -> int`; they are discovered, so adding
a command touches no other file. Commands run from the repository root; paths given on the command
line are resolved from the caller's folder (launcher/options.py)."""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys


import launcher.commands
from data.errors import DataError
from launcher.options import enter_root
from trainer.config import ConfigError


BROKEN_PIPE_EXIT = 128 + 13
"""The exit code of a command whose output was closed (`./run.sh train | head -3` before any rank
started): a shell's for a process ended by SIGPIPE, never 0, as the command did not finish."""


def commands() -> dict:
    return {name: importlib.import_module(f"launcher.commands.{name}")
            for _, name, _ in pkgutil.iter_modules(launcher.commands.__path__) if not name.startswith("_")}


def main(argv: list[str] | None = None) -> int:
    enter_root()
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
    except BrokenPipeError:  # the reader went away (`| head`): stopped where it was, as by SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return BROKEN_PIPE_EXIT
    except OSError as e:  # a file or folder the command cannot use (permissions, a full disk)
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; finished work is kept and a rerun continues from it", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

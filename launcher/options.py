"""Command-line options shared by several commands: paths as the caller means them, `--set`
overrides of a config, and the decoding options of `translate` and `eval`.

Paths on the command line are the caller's: ./run.sh changes to the repository root and passes
the folder it was called from in DEEPNET_CALLER_CWD; `enter_root` takes it, `user_path` resolves
against it, and `load_config(…, cwd=caller_cwd())` takes --set paths from it (paths inside a config
file are from the file's folder, docs/configuration.md#paths)."""
from __future__ import annotations

import argparse
import os

from launcher.launch import ROOT

CALLER_CWD_ENV = "DEEPNET_CALLER_CWD"
_caller_cwd: str | None = None


def enter_root() -> None:
    """Remember the caller's working directory (DEEPNET_CALLER_CWD from ./run.sh, else this
    process's) and work from the repository root, as every rank does."""
    global _caller_cwd
    _caller_cwd = os.environ.pop(CALLER_CWD_ENV, None) or os.getcwd()
    os.chdir(ROOT)


def caller_cwd() -> str:
    return _caller_cwd or os.getcwd()


def user_path(text: str) -> str:
    """A path given on the command line as its caller means it: `~` expanded, a relative one taken
    from the caller's working directory (the shell has already expanded an unquoted ~ and $VAR)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or folder")
    return os.path.normpath(os.path.join(caller_cwd(), os.path.expanduser(text)))


def shown_path(path: str) -> str:
    """`path` as the caller can paste it: relative to their folder where it lies below it, else
    absolute."""
    path = os.path.abspath(path)
    relative = os.path.relpath(path, caller_cwd())
    return path if relative == os.pardir or relative.startswith(os.pardir + os.sep) else relative


def config_path(text: str) -> str:
    """A config given on the command line: a path from the caller's folder or, where none exists,
    the name of a bundled config (`default`, `deepnet-100-100`: configs/<name>.yaml)."""
    path = user_path(text)
    bundled = os.path.join(ROOT, "configs", text if text.endswith(".yaml") else f"{text}.yaml")
    if not os.path.exists(path) and os.sep not in text and os.path.isfile(bundled):
        return bundled
    return path


def add_config_arguments(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """The config a command reads (positional; optional when there is a default), --run-dir and
    --set, shared by train, prepare and slurm."""
    what = "YAML run config: a path, or the name of a bundled one in configs/ (e.g. default)"
    if default is None:
        parser.add_argument("config", type=config_path, help=what)
    else:
        parser.add_argument("config", nargs="?", default=default, type=config_path,
                            help=f"{what}; default {os.path.relpath(default, ROOT)}")
    parser.add_argument("--run-dir", type=user_path, help="override run_dir of the config")
    add_set_argument(parser)


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                        help="change one key of the config, e.g. --set train.max_steps=400 (repeatable; "
                             "typed and checked like the YAML file)")


def run_dir_override(args: argparse.Namespace) -> dict | None:
    return {"run_dir": args.run_dir} if getattr(args, "run_dir", None) else None


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Search options shared by translate and eval."""
    from model.decoding import DecodeOptions

    d = DecodeOptions()
    group = parser.add_argument_group("decoding")
    group.add_argument("--beam", type=int, default=d.beam, help=f"beam size (default {d.beam})")
    group.add_argument("--greedy", action="store_true", help="greedy search (same as --beam 1)")
    group.add_argument("--lenpen", type=float, default=d.lenpen,
                       help=f"length penalty: score = Σ log p / length^lenpen (default {d.lenpen})")
    group.add_argument("--max-len-a", type=float, default=d.max_len_a,
                       help=f"output at most a·|source| + b tokens (default a={d.max_len_a})")
    group.add_argument("--max-len-b", type=int, default=d.max_len_b, help=f"(default b={d.max_len_b})")
    group.add_argument("--max-tokens", type=int, default=d.max_tokens,
                       help=f"source tokens per batch (default {d.max_tokens})")
    group.add_argument("--threads", type=int, default=0,
                       help="CPU threads (default 0: the cores the load average shows idle, at least 1)")


def decode_options(args: argparse.Namespace):
    """The DecodeOptions of the command line (and the thread count applied)."""
    import torch

    from model.decoding import DecodeOptions
    from translate.translator import idle_cores

    if args.threads < 0:
        raise ValueError("--threads must be >= 0")
    torch.set_num_threads(args.threads or idle_cores())
    options = DecodeOptions(beam=1 if args.greedy else args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                            max_len_b=args.max_len_b, max_tokens=args.max_tokens)
    options.validate()
    return options

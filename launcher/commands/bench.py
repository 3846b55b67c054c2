"""./run.sh bench TARGET [ARGS]: `data` (data pipeline throughput) or `train` (layouts grid).

Before a benchmark that reads a run config starts, its config gets the checks of the command it
measures (`bench train` and `bench schedules` prepare data and launch ranks: those of ./run.sh
train), `--set KEY=VALUE` applies to it, and paths in ARGS are the caller's (launcher/options.py)."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import tempfile

from launcher.launch import DEFAULT_CONFIG, ROOT
from launcher.options import user_path
from trainer.config import ConfigError

HELP = "benchmarks: 'bench data' (preparation and loader throughput), 'bench train' (layout grid on CPU; the paper's shapes in bf16 on a GPU), 'bench schedules' (1F1B vs ZB-H1, steps interleaved in one launch), 'bench startup' (launch to first step of one pipeline stage), 'bench model' (the plain model's training step, eager against compiled, or against another commit's model, steps interleaved), 'bench ops' (kernel operations per layer and per step, host syncs, graph breaks and compilations: what predicts a GPU step's host time); --set KEY=VALUE changes the config of data, train, schedules, startup and ops"

TARGETS = {"data": "bench.data", "train": "bench.layouts", "schedules": "bench.schedules", "startup": "bench.startup",
           "model": "bench.model", "ops": "bench.ops"}

# The benchmarks that read a run config: where they take it (a flag, or 0: the first positional
# argument) and their default.
CONFIGS = {"data": ("--config", DEFAULT_CONFIG), "train": (0, DEFAULT_CONFIG), "schedules": (0, DEFAULT_CONFIG),
           "ops": (0, DEFAULT_CONFIG),
           "startup": ("--config", os.path.join(ROOT, "configs", "deepnet-500-500.yaml"))}
LAUNCHES = {"train", "schedules"}  # prepare the config's data into its run_dir and start ranks
PATH_FLAGS = {"data": {"--corpus", "--out"}, "train": {"--grid", "--out", "--work-dir"}, "schedules": {"--out"},
              "model": {"--out"}, "ops": {"--out"}}
SWITCHES = {"-h", "--help", "--profile"}  # flags of the benchmarks that take no value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark (--help)")


def split_arguments(target: str, argv: list[str]) -> tuple[list[str], list[str], int | None]:
    """(the benchmark's arguments with its path arguments resolved from the caller's folder, the
    --set items taken out of them, the index of the config path among them or None)."""
    where = CONFIGS.get(target, (None,))[0]
    paths = PATH_FLAGS.get(target, set()) | ({where} if isinstance(where, str) else set())
    out, sets, config_at, positional, i = [], [], None, 0, 0
    while i < len(argv):
        word = argv[i]
        flag, eq, value = word.partition("=")
        if flag == "--set":
            if not eq:
                if i + 1 == len(argv):
                    raise ConfigError("--set: give KEY=VALUE, e.g. --set train.max_steps=400")
                value, i = argv[i + 1], i + 1
            sets.append(value)
        elif word.startswith("-") and flag in paths:
            if not eq and i + 1 < len(argv):
                value, i = argv[i + 1], i + 1
            out += [flag, user_path(value)] if eq or value else [word]
            if flag == where:
                config_at = len(out) - 1
        elif word.startswith("-"):
            out.append(word)
            if not eq and flag not in SWITCHES and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                out.append(argv[i + 1])
                i += 1
        else:
            if where == positional and target in CONFIGS:
                out.append(user_path(word))
                config_at = len(out) - 1
            else:
                out.append(word)
            positional += 1
        i += 1
    return out, sets, config_at


def check(target: str, argv: list[str], config: str, sets: list[str]):
    """The config of `target` loaded with `sets`, and the checks of what the benchmark does with it."""
    from data.prepare import check_corpus
    from launcher.preflight import check_device, check_resume, check_run_dir, check_writable_folder
    from trainer.config import load_config

    cfg = load_config(config, sets=sets)
    out = next((argv[k + 1] for k, word in enumerate(argv[:-1]) if word == "--out"), None)
    if out is not None:
        check_writable_folder(out, "--out")
    if target in LAUNCHES:
        check_run_dir(cfg, config)
        check_resume(cfg, config)
        check_device(cfg, config)
        check_corpus(cfg.data)
    return cfg


@contextlib.contextmanager
def resolved(cfg, source: str):
    """`cfg` (with its --set items) as a config file the benchmark and its ranks read."""
    import yaml

    from trainer.config import to_dict

    with tempfile.TemporaryDirectory(prefix="deepnet-bench-") as folder:
        path = os.path.join(folder, os.path.basename(source))
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# {source}, resolved with --set by ./run.sh bench\n")
            yaml.safe_dump(json.loads(json.dumps(to_dict(cfg))), f, sort_keys=False)
        yield path


def run(args: argparse.Namespace) -> int:
    from parallel import accelerator

    module = TARGETS[args.target]
    if args.target == "train" and accelerator.gpu_available():
        module = "bench.gpu"  # the paper's shapes on one GPU, in bf16
    argv, sets, config_at = split_arguments(args.target, args.args)
    asks_help = any(word in ("-h", "--help") for word in argv)
    with contextlib.ExitStack() as stack:
        if args.target in CONFIGS and module != "bench.gpu" and not asks_help:
            where, default = CONFIGS[args.target]
            grid_config = args.target == "train" and config_at is None and "--grid" in argv
            if grid_config and sets:
                raise ConfigError("bench train --grid: give the config on the command line too, so that --set "
                                  "applies to it")
            if not grid_config:
                config = argv[config_at] if config_at is not None else default
                cfg = check(args.target, argv, config, sets)
                if sets:
                    path = stack.enter_context(resolved(cfg, config))
                    if config_at is not None:
                        argv[config_at] = path
                    else:
                        argv = [path, *argv] if where == 0 else [*argv, where, path]
        elif sets:
            raise ConfigError(f"--set: {module} reads no run config; --set applies to bench "
                              f"{', '.join(CONFIGS)} (on CPUs)")
        return importlib.import_module(module).main(argv)

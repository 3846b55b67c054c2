"""./run.sh bench NAME [ARGS]: the benchmarks of bench/ (and the GPU check, gpucheck/).

Each benchmark is one module of those folders that declares itself at top level, as plain data,

    BENCH = dict(name="data", help="preparation and loader throughput", config="--config",
                 paths=("--corpus", "--out"))

(the fields of `Bench` below) and has an entry point (`main(argv) -> int`, or the function `entry`
names); the modules are discovered, so adding a benchmark touches no other file. The declarations
are read from the modules' source (literal values only), not imported: bench/ sits above the
launcher (tests/test_imports.py), so a benchmark imports nothing of this command to declare itself,
and some benchmarks load torch when imported, which ./run.sh does not pay for; the chosen
benchmark's module is imported by name when it runs.

Before a benchmark that reads a run config starts, its config gets the checks of the command it
measures (one that `launches` prepares data and starts ranks: the checks of ./run.sh train),
`--set KEY=VALUE` applies to it, and paths in ARGS are the caller's (launcher/options.py)."""
from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import pkgutil
import tempfile

from launcher.launch import ROOT
from launcher.options import user_path
from trainer.config import ConfigError

PACKAGES = {package: os.path.join(ROOT, package) for package in ("bench", "gpucheck")}
"""The packages whose modules may declare a benchmark, and their folders."""
SWITCHES = {"-h", "--help"}  # flags of every benchmark that take no value


@dataclasses.dataclass(frozen=True)
class Bench:
    """What a benchmark module declares as `BENCH = dict(...)` (literal values only)."""

    name: str
    """./run.sh bench NAME."""
    help: str
    """One line for ./run.sh's help."""
    config: str | int | None = None
    """Where it takes a run config: a flag ("--config") or 0, its first positional argument; None:
    it reads none (then --set is refused)."""
    default_config: str = "configs/default.yaml"
    """The run config it reads when none is given, relative to the repository root."""
    config_in: tuple[str, ...] = ()
    """Flags whose file names the run config instead: given without the config, nothing is checked
    before the benchmark starts and --set is refused."""
    paths: tuple[str, ...] = ()
    """Flags whose value is a path (resolved from the caller's folder)."""
    switches: tuple[str, ...] = ()
    """Flags that take no value (besides -h and --help)."""
    launches: bool = False
    """It prepares the config's data into its run_dir and starts ranks: ./run.sh train's checks."""
    gpu: bool = False
    """It serves `bench NAME` where a GPU is available, in place of the module that declares the
    same name without `gpu`."""
    entry: str = "main"
    """Its function that takes the argument list and returns the exit code."""

    def __post_init__(self):
        for name in ("config_in", "paths", "switches"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


def declaration(path: str) -> Bench | None:
    """The `BENCH = dict(...)` a module's source makes at top level, or None."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if "BENCH" not in text:
        return None
    for node in ast.parse(text, path).body:
        if not (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["BENCH"]):
            continue
        where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
        call = node.value
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "dict" and not call.args):
            raise ValueError(f"{where}: BENCH must be dict(name=..., help=..., ...) (the fields of "
                             "launcher/commands/bench.py Bench)")
        try:
            return Bench(**{k.arg: ast.literal_eval(k.value) for k in call.keywords})
        except ValueError:
            raise ValueError(f"{where}: BENCH = dict(...) takes literal values only (./run.sh reads them "
                             "without importing the module)") from None
        except TypeError as e:
            raise ValueError(f"{where}: BENCH = dict(...): {e}") from None
    return None


def benches() -> dict[str, Bench]:
    """Dotted module name → its declaration, for every module of PACKAGES that declares a benchmark."""
    return declared(tuple(PACKAGES.items()))


@functools.cache
def declared(packages: tuple[tuple[str, str], ...]) -> dict[str, Bench]:
    """Dotted module name → its declaration, for every module of the (package, folder) pairs that
    declares a benchmark."""
    found, seen = {}, {}
    for package, folder in packages:
        for _, name, is_package in pkgutil.iter_modules([folder]):
            bench = None if is_package else declaration(os.path.join(folder, f"{name}.py"))
            if bench is None:
                continue
            module = f"{package}.{name}"
            other = seen.setdefault((bench.name, bench.gpu), module)
            if other != module:
                raise ValueError(f"{other.replace('.', '/')}.py and {module.replace('.', '/')}.py both declare "
                                 f"bench {bench.name}{' on GPUs' if bench.gpu else ''}")
            found[module] = bench
    return found


def names() -> list[str]:
    return sorted({bench.name for bench in benches().values()})


def modules(name: str) -> list[str]:
    """The modules behind `bench NAME`, the one for CPUs first."""
    found = sorted((bench.gpu, module) for module, bench in benches().items() if bench.name == name)
    return [module for _, module in found]


def serving(name: str, gpu: bool = False) -> tuple[str, Bench]:
    """(module, declaration) that runs `bench NAME`, on a machine with a GPU or without."""
    found = {bench.gpu: (module, bench) for module, bench in benches().items() if bench.name == name}
    return found[gpu] if gpu in found else next(iter(found.values()))


def _listed(words: list[str]) -> str:
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else "".join(words)


def help_text() -> str:
    parts = {}
    for bench in sorted(benches().values(), key=lambda b: (b.name, b.gpu)):
        parts.setdefault(bench.name, []).append(bench.help)
    configs = sorted({b.name for b in benches().values() if b.config is not None})
    text = "benchmarks: " + ", ".join(f"'bench {name}' ({'; '.join(helps)})" for name, helps in parts.items())
    return text + (f"; --set KEY=VALUE changes the config of {_listed(configs)}" if configs else "")


def __getattr__(name: str):
    if name == "HELP":  # read when asked: importing this module reads no benchmark
        return help_text()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=names())
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark (--help)")


def split_arguments(target: str, argv: list[str],
                    bench: Bench | None = None) -> tuple[list[str], list[str], int | None]:
    """(the benchmark's arguments with its path arguments resolved from the caller's folder, the
    --set items taken out of them, the index of the config path among them or None); `bench`:
    the declaration that reads them (default: the one of `bench TARGET` on CPUs)."""
    bench = bench or serving(target)[1]
    where = bench.config
    paths = set(bench.paths) | ({where} if isinstance(where, str) else set())
    switches = SWITCHES | set(bench.switches)
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
            if not eq and flag not in switches and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                out.append(argv[i + 1])
                i += 1
        else:
            if where == positional:
                out.append(user_path(word))
                config_at = len(out) - 1
            else:
                out.append(word)
            positional += 1
        i += 1
    return out, sets, config_at


def check(bench: Bench, argv: list[str], config: str, sets: list[str]):
    """The config of `bench` loaded with `sets`, and the checks of what the benchmark does with it."""
    from data.prepare import check_corpus
    from launcher.preflight import check_device, check_resume, check_run_dir, check_writable_folder
    from trainer.config import load_config

    cfg = load_config(config, sets=sets)
    out = next((argv[k + 1] for k, word in enumerate(argv[:-1]) if word == "--out"), None)
    if out is not None:
        check_writable_folder(out, "--out")
    if bench.launches:
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
    gpu = False
    if len(modules(args.target)) > 1:  # one serves GPUs
        from runtime import accelerator

        gpu = accelerator.gpu_available()
    module, bench = serving(args.target, gpu)
    argv, sets, config_at = split_arguments(args.target, args.args, bench)
    asks_help = any(word in ("-h", "--help") for word in argv)
    with contextlib.ExitStack() as stack:
        if bench.config is not None and not asks_help:
            given_in = next((flag for flag in bench.config_in if flag in argv), None) if config_at is None else None
            if given_in and sets:
                raise ConfigError(f"bench {args.target} {given_in}: give the config on the command line too, so "
                                  "that --set applies to it")
            if not given_in:
                config = argv[config_at] if config_at is not None else os.path.join(ROOT, bench.default_config)
                cfg = check(bench, argv, config, sets)
                if sets:
                    path = stack.enter_context(resolved(cfg, config))
                    if config_at is not None:
                        argv[config_at] = path
                    else:
                        where = bench.config
                        argv = [path, *argv] if where == 0 else [*argv, where, path]
        elif sets:
            configs = sorted({b.name for b in benches().values() if b.config is not None})
            raise ConfigError(f"--set: {module} reads no run config; --set applies to bench "
                              f"{', '.join(configs)} (on CPUs)")
        # The benchmark, imported by name as it starts (nothing of bench/ is imported before).
        return getattr(importlib.import_module(module), bench.entry)(argv)

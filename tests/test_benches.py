"""./run.sh bench NAME: every benchmark is one module of bench/ (or gpucheck/) that declares
`BENCH = dict(...)`, plain data importing nothing, and launcher/commands/bench.py finds them (their names, help, configs, path flags, launches, the
GPU variant of `bench train`) without importing them. A new benchmark needs its module only."""
from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import bench
import gpucheck
import launcher.cli
import launcher.options
from launcher.commands import bench as command
from launcher.commands.bench import Bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_module_that_declares_a_bench_is_discovered_as_it_declares_it():
    """What ./run.sh reads from the sources equals what the modules make when imported, and no
    module of bench/ or gpucheck/ makes a BENCH that is not found; none imports this command."""
    imported = {}
    for package in (bench, gpucheck):
        for _, name, is_package in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{name}")
            if not is_package and hasattr(module, "BENCH"):
                assert isinstance(module.BENCH, dict), name
                imported[module.__name__] = Bench(**module.BENCH)
                assert not hasattr(module, "Bench"), name  # it imports nothing to declare itself
    assert imported == command.benches()
    assert {f"bench.{m}" for m in ("data", "layouts", "gpu", "schedules", "startup", "model", "ops")} | {
        "gpucheck.check"} <= set(imported)
    for module, declared in imported.items():  # each names an entry point its module has
        assert callable(getattr(importlib.import_module(module), declared.entry)), module


def test_bench_train_is_the_layout_grid_on_cpus_and_gpu_py_on_a_gpu():
    assert command.modules("train") == ["bench.layouts", "bench.gpu"]
    assert command.serving("train", gpu=False)[0] == "bench.layouts"
    assert command.serving("train", gpu=True)[0] == "bench.gpu"
    assert command.serving("data", gpu=True)[0] == "bench.data"  # no GPU variant: the same module


def test_the_help_lists_every_bench_and_what_it_does():
    names = command.names()
    assert names == sorted({b.name for b in command.benches().values()})
    for declared in command.benches().values():
        assert f"'bench {declared.name}' (" in command.HELP and declared.help in command.HELP
    assert "'bench train' (layout grid on CPU; the paper's shapes in bf16 on a GPU)" in command.HELP
    assert command.HELP.endswith("--set KEY=VALUE changes the config of data, ops, schedules, startup and train")


def test_reading_the_declarations_imports_no_bench_and_no_torch():
    code = ("import sys; import launcher.commands.bench as b; b.HELP; b.names(); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] in ('bench', 'gpucheck')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.fixture
def extra(tmp_path, monkeypatch):
    """A package of benchmarks of its own, in place of bench/."""
    package = tmp_path / "extra_benches"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(command, "PACKAGES", {"extra_benches": str(package)})
    monkeypatch.chdir(tmp_path)  # the command works from the repository root; come back after
    monkeypatch.delenv(launcher.options.CALLER_CWD_ENV, raising=False)
    monkeypatch.setattr(launcher.options, "_caller_cwd", None)
    yield package
    for name in [m for m in sys.modules if m.startswith("extra_benches")]:
        del sys.modules[name]


def write(package, name: str, text: str) -> None:
    (package / f"{name}.py").write_text(textwrap.dedent(text))


HELLO = """
    BENCH = dict(name="hello", help="says hello{where}", paths=("--out",){gpu})


    def {entry}(argv):
        print("hello{where}", argv)
        return 0
"""


def test_a_new_bench_needs_only_its_module(extra, capsys, monkeypatch):
    write(extra, "hello", HELLO.format(where="", gpu="", entry="main"))
    write(extra, "helpers", "def util():\n    return 1\n")  # declares nothing: not a benchmark
    assert command.names() == ["hello"] and command.modules("hello") == ["extra_benches.hello"]
    assert command.HELP == "benchmarks: 'bench hello' (says hello)"
    assert launcher.cli.main(["bench", "hello", "--out", "sub", "word"]) == 0
    assert capsys.readouterr().out == f"hello ['--out', '{extra.parent / 'sub'}', 'word']\n"  # the caller's path
    assert launcher.cli.main(["bench", "hello", "--set", "train.lr=1"]) == 2
    assert "--set: extra_benches.hello reads no run config" in capsys.readouterr().err

    # and one that serves it on GPUs, with its own entry point
    write(extra, "hello_gpu", HELLO.format(where=" on a GPU", gpu=', gpu=True, entry="run_on_gpu"', entry="run_on_gpu"))
    command.declared.cache_clear()
    assert command.modules("hello") == ["extra_benches.hello", "extra_benches.hello_gpu"]
    assert "'bench hello' (says hello; says hello on a GPU)" in command.HELP
    from runtime import accelerator

    monkeypatch.setattr(accelerator, "gpu_available", lambda: True)
    assert launcher.cli.main(["bench", "hello"]) == 0
    assert capsys.readouterr().out == "hello on a GPU []\n"
    command.declared.cache_clear()


def test_a_declaration_takes_literal_values_and_one_module_per_name(extra):
    write(extra, "bad", """
        import os

        BENCH = dict(name="bad", help="no", default_config=os.path.join("configs", "x.yaml"))
    """)
    with pytest.raises(ValueError, match=r"bad.py:4: BENCH = dict\(\.\.\.\) takes literal values only"):
        command.benches()
    command.declared.cache_clear()
    write(extra, "bad", HELLO.format(where="", gpu="", entry="main"))
    write(extra, "hello", HELLO.format(where="", gpu="", entry="main"))
    with pytest.raises(ValueError, match=r"extra_benches/bad.py and extra_benches/hello.py both declare bench hello"):
        command.benches()
    command.declared.cache_clear()

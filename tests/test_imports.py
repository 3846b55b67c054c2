"""The project's imports point one way, and no two project modules import each other.

Floors, bottom up (a folder may import its own floor and the floors below it):
    schema/                              the standard library only (what a config field accepts)
    model/, runtime/                     schema/; model/ takes torch, numpy and the standard library
                                         only; runtime/ is what every rank process needs (the
                                         accelerator, process start and end, RNG streams, heartbeats)
    data/, parallel/                     model/, runtime/ (not each other)
    checkpoint/                          parallel/ and below (formats, conversions, init_from)
    trainer/, translate/, export/,       model/, runtime/, data/, parallel/, checkpoint/ (not each
    planner/                             other)
    launcher/                            everything above; no command module imports another
    bench/, gpucheck/, experiments/      anything
Every import is read with `ast` from the source, at module level and inside functions alike (a
function-local import is still an arrow), so nothing is imported to check it.
"""
from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("schema", "model", "runtime", "data", "parallel", "checkpoint", "trainer", "translate", "export",
            "planner", "launcher", "bench", "gpucheck", "experiments")
_BASE = {"schema", "model", "runtime", "data", "parallel", "checkpoint"}
MAY_IMPORT = {
    "schema": {"schema"},
    "model": {"schema", "model"},
    "runtime": {"schema", "runtime"},
    "data": {"schema", "model", "runtime", "data"},
    "parallel": {"schema", "model", "runtime", "parallel"},
    "checkpoint": {"schema", "model", "runtime", "parallel", "checkpoint"},
    "trainer": _BASE | {"trainer"},
    "translate": _BASE | {"translate"},
    "export": _BASE | {"export"},
    "planner": _BASE | {"planner"},
    "launcher": set(PACKAGES) - {"bench", "gpucheck", "experiments"},
    "bench": set(PACKAGES),
    "gpucheck": set(PACKAGES),
    "experiments": set(PACKAGES),
}
THIRD_PARTY = {"schema": set(), "model": {"torch", "numpy"}}  # what these floors may take besides the stdlib
COMMANDS = "launcher.commands."


def project_modules(root: str = ROOT) -> dict[str, str]:
    """Dotted module name → source path, for every .py file of the project's packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    parts = os.path.relpath(path, root)[:-3].split(os.sep)
                    if parts[-1] == "__init__":
                        parts = parts[:-1]
                    found[".".join(parts)] = path
    return found


def imports(path: str, module: str, is_package: bool, modules: dict) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in a file, at any depth; `from a import b` names the
    module a.b when there is one, else a."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parts = module.split(".")
                package = parts[:len(parts) - node.level + (1 if is_package else 0)]
                base = ".".join(package + ([base] if base else []))
            names = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
            out += [(name, node.lineno) for name in sorted(names)]
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args:
            # importlib.import_module(f"pkg.{name}") imports any module of pkg
            arg = node.args[0]
            prefix = arg.value if isinstance(arg, ast.Constant) else (
                arg.values[0].value if isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant)
                else None)
            if isinstance(prefix, str):
                out += [(name, node.lineno) for name in sorted(modules)
                        if name == prefix or (prefix.endswith(".") and name.startswith(prefix))]
    return out


@functools.lru_cache(maxsize=None)
def graph(root: str = ROOT) -> tuple[dict[str, set[str]], list[str]]:
    """Arrows between project modules, and every arrow that points the wrong way."""
    modules = project_modules(root)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    wrong = []
    stdlib = set(sys.stdlib_module_names)
    for module, path in modules.items():
        floor = module.split(".")[0]
        for name, line in imports(path, module, path.endswith("__init__.py"), modules):
            top = name.split(".")[0]
            where = f"{os.path.relpath(path, root)}:{line}"
            if top in PACKAGES:
                if top not in MAY_IMPORT[floor]:
                    wrong.append(f"{where}: {floor}/ imports {name} ({top}/ is not below {floor}/)")
                if module.startswith(COMMANDS) and name.startswith(COMMANDS) and name != module:
                    wrong.append(f"{where}: the command {module} imports the command {name} (shared code "
                                 "belongs below the commands)")
                if name in modules and name != module:
                    edges[module].add(name)
            elif floor in THIRD_PARTY and top and top not in stdlib and top not in THIRD_PARTY[floor]:
                allowed = ", ".join(sorted(THIRD_PARTY[floor]) + ["the standard library"])
                wrong.append(f"{where}: {floor}/ imports {name} ({floor}/ takes {allowed} only)")
    return edges, sorted(set(wrong))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_imports_point_down():
    _, wrong = graph()
    assert not wrong, "imports that point the wrong way:\n" + "\n".join(wrong)


def test_no_import_cycles():
    found = cycles(graph()[0])
    assert not found, "import cycles between project modules:\n" + "\n".join(" ↔ ".join(c) for c in found)


def test_the_walker_sees_function_local_imports_and_cycles(tmp_path):
    """The checks above on a small tree with one wrong arrow inside a function and one cycle."""
    for package, files in {"model": {"__init__.py": "", "a.py": "def f():\n    from parallel import b\n"},
                           "parallel": {"__init__.py": "", "b.py": "import model.a\nfrom parallel import c\n",
                                        "c.py": "def g():\n    import parallel.b\n"},
                           "launcher/commands": {"__init__.py": "", "x.py": "from launcher.commands.y import f\n",
                                                 "y.py": "def f():\n    pass\n"}}.items():
        (tmp_path / package).mkdir(parents=True)
        for name, text in files.items():
            (tmp_path / package / name).write_text(text)
    edges, wrong = graph(str(tmp_path))
    assert wrong == ["launcher/commands/x.py:1: the command launcher.commands.x imports the command "
                     "launcher.commands.y (shared code belongs below the commands)",
                     "model/a.py:2: model/ imports parallel.b (parallel/ is not below model/)"]
    assert cycles(edges) == [["model.a", "parallel.b", "parallel.c"]]


def test_cli_starts_without_torch():
    """Reading the command table (every command's module) loads neither torch nor DeepSpeed."""
    code = ("import sys; import launcher.cli as cli; cli.commands(); "
            "print(sorted(m for m in ('torch', 'deepspeed', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_no_file_is_over_450_lines():
    """A file past 450 lines is split where its parts have their own reasons (one way each)."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert len(tracked) > 100
    long = {}
    for name in tracked:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            lines = sum(1 for _ in f)
        if lines > 450:
            long[name] = lines
    assert not long, long

"""The DeepSpeed seam (parallel/deepspeed_seam.py): every DeepSpeed method the project overrides,
every private DeepSpeed name it calls, reads or sets, and every DeepSpeed module attribute it
replaces is listed there, and the installed DeepSpeed's source of each is the one reviewed.

What the code uses is found from the code itself: the classes of the project's modules that derive
from a DeepSpeed class (their overrides), the attribute accesses of every project module whose
name starts with one underscore and is one of those DeepSpeed classes' own (their methods and the
attributes their source assigns), and assignments to attributes of imported DeepSpeed modules."""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("runtime", "parallel", "checkpoint", "trainer", "translate", "export", "planner", "launcher", "data",
            "model")
DERIVED_IN = ("runtime", "parallel", "checkpoint", "trainer")  # where classes derive from DeepSpeed's


def _files(packages=PACKAGES):
    for package in packages:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in sorted(names):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield path, os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")


def _is_deepspeed(cls) -> bool:
    return cls.__module__.split(".")[0] == "deepspeed"


@pytest.fixture(scope="module")
def found():
    """(overrides, DeepSpeed classes) of the project's classes deriving from DeepSpeed's."""
    overrides, bases = {}, []
    for path, module_name in _files(DERIVED_IN):
        with open(path, encoding="utf-8") as f:
            if "deepspeed" not in f.read():
                continue
        module = importlib.import_module(module_name)
        for cls in vars(module).values():
            if not (inspect.isclass(cls) and cls.__module__ == module_name):
                continue
            ds = [base for base in cls.__mro__ if _is_deepspeed(base)]
            bases += [b for b in ds if b not in bases]
            for mine in (c for c in cls.__mro__ if c.__module__.split(".")[0] in DERIVED_IN):  # mixins too
                for attr in vars(mine):
                    if attr.startswith("__") and attr.endswith("__") or attr == "_abc_impl":
                        continue
                    owner = next((base for base in ds if attr in vars(base)), None)
                    if owner is not None:
                        overrides.setdefault(f"{owner.__module__}:{owner.__qualname__}.{attr}",
                                             f"{mine.__module__}.{mine.__name__}")
    return overrides, bases


def _private_names(bases) -> dict[str, str]:
    """Private name → `module:Class.name` of the DeepSpeed class that defines or assigns it."""
    names = {}
    for base in bases:
        try:
            text = inspect.getsource(base)
        except (OSError, TypeError):
            text = ""
        own = set(vars(base)) | set(re.findall(r"self\.(_[A-Za-z]\w*)\s*=", text))
        for name in own:
            if name.startswith("_") and not name.startswith("__"):
                names.setdefault(name, f"{base.__module__}:{base.__qualname__}.{name}")
    return names


def used(found) -> dict[str, str]:
    """Every DeepSpeed name the code relies on → where."""
    overrides, bases = found
    needed = {name: f"overridden by {where}" for name, where in overrides.items()}
    private = _private_names(bases)
    for path, module_name in _files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text, path)
        aliases = {}  # local names bound to DeepSpeed modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    try:
                        if inspect.ismodule(importlib.import_module(full)):
                            aliases[alias.asname or alias.name] = full
                    except ImportError:
                        pass
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("deepspeed"):
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private and "deepspeed" in text:
                needed.setdefault(private[node.attr], f"used by {module_name} (line {node.lineno})")
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    base = target.value if isinstance(target, ast.Attribute) else None
                    while isinstance(base, ast.Attribute):  # deepspeed.ops.__compatible_ops__
                        base = base.value
                    if isinstance(base, ast.Name) and base.id in aliases:
                        owner = ast.unparse(target.value)
                        module = aliases[base.id] + owner[len(base.id):]
                        needed.setdefault(f"{module}:{target.attr}", f"replaced by {module_name} (line {node.lineno})")
    return needed


def test_the_installed_deepspeed_is_the_reviewed_one():
    from parallel import deepspeed_seam as seam

    drift = seam.drifted()
    assert not drift, ("DeepSpeed's source of these differs from what the project was reviewed against; read "
                       "the change, adapt the project and refresh parallel/deepspeed_seam.py:\n" + "\n".join(drift))


def test_every_deepspeed_name_the_code_relies_on_is_listed(found):
    from parallel import deepspeed_seam as seam

    needed = used(found)
    listed = {s.name for s in seam.SEAMS}
    missing = {name: why for name, why in needed.items() if name not in listed}
    assert not missing, ("DeepSpeed names the code relies on that parallel/deepspeed_seam.py does not list "
                         "(add them; `python -m parallel.deepspeed_seam` prints the table with the digests):\n"
                         + "\n".join(f"{name}: {why}" for name, why in sorted(missing.items())))
    stale = sorted(s.name for s in seam.SEAMS if s.scanned and s.name not in needed)
    assert not stale, f"listed in parallel/deepspeed_seam.py but no longer used: {stale}"


def test_a_changed_deepspeed_method_is_named(monkeypatch):
    """The drift check compares sources, so a DeepSpeed method edited in place is caught and named."""
    from parallel import deepspeed_seam as seam

    name = next(s.name for s in seam.SEAMS if s.name.endswith("._exec_backward_pass"))
    real = seam.source
    monkeypatch.setattr(seam, "source", lambda n: real(n) + ("\n# changed" if n == name else ""))
    drift = seam.drifted()
    assert len(drift) == 1 and drift[0].startswith(f"{name}: its source differs")

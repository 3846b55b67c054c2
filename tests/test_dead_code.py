"""No code that only the tests use: every function, class, method and constant defined in the
project's packages is used by the project itself (a command, the ranks, a documented module), not
kept alive by a test alone. Read with `ast`: module-level names are followed through the imports
(`from a import b`, `a.b`), methods by their name (any `.name` or string naming it)."""
from __future__ import annotations

import ast
import os
import re
from collections import defaultdict

from tests.test_imports import ROOT, project_modules

_WORD = re.compile(r"[A-Za-z_]\w*")


def _definitions(tree: ast.Module) -> tuple[list[str], list[tuple[str, str]]]:
    """(module-level names, (class, method) pairs) a module defines."""
    names, methods = [], []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            if isinstance(node, ast.ClassDef):
                methods += [(node.name, sub.name) for sub in node.body
                            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))]
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return names, methods


def _uses(tree: ast.Module, module: str, modules: set[str]) -> tuple[set[tuple[str, str]], set[str]]:
    """((module, name) a file refers to, through its imports or in its own module; every attribute
    name and word of a string it holds)."""
    bound: dict[str, tuple[bool, object]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = (True, target) if target in modules else (False, (node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound[alias.asname or alias.name.split(".")[0]] = (True, alias.asname and alias.name or alias.name.split(".")[0])
    refs, words = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            refs.add((module, node.id))
            kind, target = bound.get(node.id, (None, None))
            if kind is False:
                refs.add(target)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
            chain, value = [], node
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and bound.get(value.id, (None,))[0] is True:
                prefix = bound[value.id][1]
                for part in reversed(chain):
                    if f"{prefix}.{part}" not in modules:
                        refs.add((prefix, part))
                        break
                    prefix = f"{prefix}.{part}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.update(_WORD.findall(node.value))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            refs.update((node.module, alias.name) for alias in node.names)
    return refs, words


def test_nothing_is_kept_only_for_the_tests():
    project = project_modules()
    tests = {f"tests.{os.path.relpath(os.path.join(folder, name), os.path.join(ROOT, 'tests'))[:-3].replace(os.sep, '.')}":
             os.path.join(folder, name)
             for folder, _, names in os.walk(os.path.join(ROOT, "tests")) for name in names if name.endswith(".py")}
    modules = set(project)
    trees = {name: ast.parse(open(path, encoding="utf-8").read()) for name, path in {**project, **tests}.items()}
    uses = {side: (set(), defaultdict(int)) for side in ("project", "tests")}
    for name, tree in trees.items():
        refs, words = _uses(tree, name, modules)
        side = "tests" if name in tests else "project"
        uses[side][0].update(refs)
        for word in words:
            uses[side][1][word] += 1
    only_tests = []
    for module in project:
        names, methods = _definitions(trees[module])
        only_tests += [f"{module}.{name}" for name in names
                       if (module, name) not in uses["project"][0] and (module, name) in uses["tests"][0]]
        only_tests += [f"{module}.{cls}.{method}" for cls, method in methods
                       if not method.startswith("__") and uses["project"][1][method] == 0 and uses["tests"][1][method]]
    assert only_tests == [], "used by nothing but the tests; remove them (and their tests) or use them"

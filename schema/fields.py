"""What a config field accepts, declared once in its annotation, and the one check of it.

Every section of the run config (model/config.py, data/config.py, parallel/config.py,
trainer/train_config.py, trainer/config.py) is a dataclass whose fields say what they accept next to the field: the type,
an enumeration as ``Literal[...]`` and bounds or any other rule as ``Annotated[int, Range(ge=1)]``
/ ``Annotated[str, Rule(test, text)]``. `coerce` checks one value against its annotation (the type,
converting what YAML gives where the meaning is plain, then the enumeration, finiteness and the
declared rules); `from_dict` builds a dataclass from a mapping with it, and `check_fields` checks a
dataclass built in code with it, so a field added later is checked by the same code. Every
problem is a ConfigError that names the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from schema.text import count

PATH_RULE = "a relative path in a config is from the config file's folder, with --set from yours"
"""How the path keys' relative values are read (trainer/config.py `anchor_path`); every error about
a path that is not there gives it."""

_BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt), ("le", "<=", operator.le),
           ("lt", "<", operator.lt))


class ConfigError(ValueError):
    """A config that cannot be used; the message names the file (where there is one) and the key."""


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric field (of each element of a tuple or list field)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def problem(self, value) -> str | None:
        """What is wrong with `value`, or None."""
        bounds = [(op, fn, getattr(self, name)) for name, op, fn in _BOUNDS if getattr(self, name) is not None]
        if all(fn(value, limit) for _, fn, limit in bounds):
            return None
        return "must be " + " and ".join(f"{op} {limit:g}" for op, _, limit in bounds)


@dataclass(frozen=True)
class Rule:
    """Any other rule of one field: `test(value)` is true for good values; `text` says what is."""

    test: Callable[[Any], bool]
    text: str

    def problem(self, value) -> str | None:
        return None if self.test(value) else self.text


Positive = Annotated[int, Range(ge=1)]
NonNegative = Annotated[int, Range(ge=0)]
Seed = Annotated[int, Range(ge=0, le=2**32 - 1)]  # numpy's generators take 32-bit seeds
Probability = Annotated[float, Range(ge=0.0, lt=1.0)]


def field_checks(annotation) -> tuple[Any, list]:
    """(the annotation without Annotated, the Range/Rule checks declared in it)."""
    if typing.get_origin(annotation) is Annotated:
        base, *extra = typing.get_args(annotation)
        return base, [x for x in extra if isinstance(x, (Range, Rule))]
    return annotation, []


def type_name(annotation) -> str:
    base, _ = field_checks(annotation)
    if typing.get_origin(base) is Literal:
        return "one of " + ", ".join(str(x) for x in typing.get_args(base))
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}
    return names.get(base, getattr(base, "__name__", str(base)))


def _typed(value, base, key: str, build):
    """`value` as type `base` (YAML's spellings converted where the meaning is plain), or a
    ConfigError naming `key`."""
    origin = typing.get_origin(base)
    if value is None:
        raise ConfigError(f"{key} has no value; give {type_name(base)} or remove the key")
    if origin is Literal:
        choices = typing.get_args(base)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        raise ConfigError(f"{key}={value!r}: must be one of {', '.join(str(c) for c in choices)}")
    if base is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        # YAML 1.1 reads 5e-4 (no dot) as a string; take it as the number it spells.
        try:
            return float(value)
        except ValueError:
            pass
        except OverflowError:
            raise ConfigError(f"{key}={value!r}: too large; give a finite number") from None
    if base in (int, bool, str) and type(value) is base:
        return value
    if base is dict and isinstance(value, dict):
        return dict(value)
    if origin is dict and isinstance(value, dict):
        item = typing.get_args(base)[1]
        return {str(k): build(item, v, f"{key}.{k}") if dataclasses.is_dataclass(item) else v
                for k, v in value.items()}
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        args = typing.get_args(base)
        if origin is tuple and len(args) != len(value):
            raise ConfigError(f"{key}: expected {count(len(args), 'value')}, got {len(value)}")
        items = [coerce(args[0] if origin is list else args[i], v, f"{key}[{i}]", build) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (list, tuple):
        raise ConfigError(f"{key}={value!r}: expected a list ([a, b])")
    raise ConfigError(f"{key}={value!r}: expected {type_name(base)}")


def coerce(annotation, value, key: str, build=None):
    """`value` checked against a field's `annotation`: its type (converted from what YAML gives
    where the meaning is plain), then the enumeration, finiteness and the declared Range/Rule of
    it or of each element. Returns the typed value; raises ConfigError naming `key`. `build(cls,
    mapping, key)` makes nested dataclasses (inside a dict field)."""
    base, checks = field_checks(annotation)
    typed = _typed(value, base, key, build)
    for item in typed if isinstance(typed, (list, tuple)) else [typed]:
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{key}={value!r}: must be a finite number")
        for check in checks:
            if (problem := check.problem(item)) is not None:
                raise ConfigError(f"{key}={value!r}: {problem}")
    return typed


def check_fields(obj, section: str) -> None:
    """Raise ConfigError naming ``section.key`` for the first field of the config dataclass `obj`
    that is not what its annotation accepts (nested dataclasses are checked by their own call)."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not dataclasses.is_dataclass(value):
            coerce(hints[f.name], value, f"{section}.{f.name}", lambda cls, v, key: v)


def leaf_keys(cls, prefix: str = "") -> list[str]:
    """The dotted name of every key of the dataclass tree `cls` (sections walked into; a mapping
    field such as clusters: is one key)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    keys = []
    for f in dataclasses.fields(cls):
        typ = hints[f.name]
        keys += leaf_keys(typ, f"{prefix}{f.name}.") if dataclasses.is_dataclass(typ) else [prefix + f.name]
    return keys


def did_you_mean(word, prefix: str, known: list[str], root=None, aliases: dict | None = None) -> str:
    """' (did you mean KEY?)' for the unknown key `prefix + word` (known: the keys of its section),
    or ''. With `root`, the dataclass of the whole config, the words people use for a key
    (`aliases`: learning_rate → train.lr) and a key of this name in another section (top-level
    precision → parallel.precision) come first; then the nearest spelling in the section, then
    the nearest key name anywhere."""
    norm = str(word).strip().lower().replace("-", "_")
    options: list[str] = []
    keys = leaf_keys(root) if root is not None else []
    if root is not None:
        options = list((aliases or {}).get(norm, ())) or [k for k in keys if k.rpartition(".")[2] == norm]
    if not options:
        options = [prefix + close for close in difflib.get_close_matches(str(word), known, n=1)]
    if not options and keys:
        names = list(dict.fromkeys(k.rpartition(".")[2] for k in keys))
        close = difflib.get_close_matches(norm, names, n=1, cutoff=0.75)
        options = [k for k in keys if close and k.rpartition(".")[2] == close[0]]
    return f" (did you mean {' or '.join(options)}?)" if options else ""


def from_dict(cls, values: dict, where: str, prefix: str = "", *, root=None, aliases: dict | None = None):
    """Build dataclass `cls` from a mapping read from file `where`; `prefix` is the key path of
    the mapping ("model."). Unknown keys, wrong types, values outside the enumeration or bounds
    declared in the field annotations and broken rules of the dataclass raise a ConfigError that
    names the file and the key; an unknown key's hint (`did_you_mean`) searches the whole config
    `root` (default `cls` at the top level) and `aliases`."""
    root = cls if root is None and not prefix else root
    section = prefix.rstrip(".") or "the top level"
    if values is None:
        raise ConfigError(f"{where}: {section} is empty; give its keys or remove it")
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: {section} must be a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls, include_extras=True)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [str(k) for k in values if k not in known]
    if unknown:
        hint = did_you_mean(unknown[0], prefix, known, root, aliases)
        raise ConfigError(f"{where}: unknown key {prefix}{unknown[0]}{hint}; the keys{' of ' + section if prefix else ''} "
                          f"are {', '.join(known)}")

    def build(item_cls, mapping, key):  # an entry of a mapping field (clusters.NAME): its own keys only
        return from_dict(item_cls, mapping, where, f"{key}.")

    kwargs = {}
    for name, value in values.items():
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = from_dict(typ, value, where, f"{prefix}{name}.", root=root, aliases=aliases)
            continue
        try:
            kwargs[name] = coerce(typ, value, f"{prefix}{name}", build)
        except ConfigError as e:
            raise ConfigError(e.args[0] if e.args[0].startswith(f"{where}:") else f"{where}: {e}") from None
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: {prefix}{missing[0]} is required; give it a value")
    try:
        obj = cls(**kwargs)
        check_fields(obj, prefix.rstrip(".") or "run")
    except ValueError as e:
        raise ConfigError(f"{where}: {str(e).removeprefix('run.')}") from None
    return obj


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls` (its source's string literal right
    after the field), whitespace folded; '' for a field without one."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {f.name: "" for f in dataclasses.fields(cls)}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def accepts(annotation) -> str:
    """What a field accepts, in words: its type or enumeration and its declared bounds and rules."""
    base, checks = field_checks(annotation)
    text = type_name(annotation).replace("True", "true").replace("False", "false")
    origin = typing.get_origin(base)
    if origin in (list, tuple):
        args = [a for a in typing.get_args(base) if a is not Ellipsis]
        text = f"a list of {type_name(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    parts = [text]
    for check in checks:
        if isinstance(check, Range):
            bounds = [f"{op} {_number(getattr(check, name))}" for name, op, _ in _BOUNDS if getattr(check, name) is not None]
            parts.append(" and ".join(bounds))
        else:
            parts.append(check.text.removeprefix("must be ").removeprefix("must "))
    return ", ".join(parts)


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"

"""Run configuration: YAML → the composite of the sections each folder owns (model/config.py,
data/config.py, parallel/config.py, trainer/train_config.py), validated, with errors that name the file and key. This
module only reads the file, builds the sections and checks the rules across them."""
from __future__ import annotations

import copy
import dataclasses
import os
import re
import stat
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any

import yaml

from data.config import GETTEXT_PREFIX, DataConfig
from model.config import ModelConfig
from parallel.config import ParallelConfig
from parallel.schedules import SCHEDULES
from schema.fields import ConfigError, NonNegative, Positive, Rule, coerce, did_you_mean, field_checks, from_dict
from trainer.key_aliases import KEY_ALIASES
from trainer.train_config import TrainConfig

FolderPath = Annotated[str, Rule(lambda v: bool(v.strip()) and "\0" not in v, "must be a folder path")]
MAX_CONFIG_BYTES = 1 << 20  # a run config is a few hundred bytes; anything this large is not one


@dataclass(kw_only=True)
class ClusterLayout:
    """A named layout under a config's `clusters:`, applied by `./run.sh slurm CONFIG --cluster NAME`.

    The same model and optimisation, laid out for one cluster: its sections override the config's
    own, and nodes × gpus_per_node must equal the resulting pipeline × tensor × data ranks."""

    nodes: Positive
    """Nodes of the SLURM job."""
    gpus_per_node: NonNegative
    """GPUs per node; one rank per GPU."""
    gpu: str = ""
    """The device the layout was sized for (v100-32gb, a100-80gb, h100-80gb); informative."""
    parallel: dict = field(default_factory=dict)
    """Keys of `parallel` this cluster changes."""
    data: dict = field(default_factory=dict)
    """Keys of `data` this cluster changes (usually max_tokens, the micro-batch size)."""
    train: dict = field(default_factory=dict)
    """Keys of `train` this cluster changes (usually micro_batches)."""


@dataclass(kw_only=True)
class RunConfig:
    run_dir: FolderPath = "runs/{config}"
    """Where data, checkpoints, logs and the summary go; `{config}` is the config file's name without
    its extension, so that a copied config gets a run of its own. An existing run directory is resumed."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    clusters: dict[str, ClusterLayout] = field(default_factory=dict)
    """Named layouts of this config for particular clusters (see ClusterLayout); optional."""

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.pipeline_stages * p.tensor_parallel * p.data_parallel


def to_dict(obj) -> dict:
    return dataclasses.asdict(obj)


def with_cluster(values: dict, name: str, where: str) -> dict:
    """Raw config `values` with the sections of its `clusters.<name>` layout applied on top."""
    layouts = values.get("clusters") or {}
    if name not in layouts:
        raise ConfigError(f"{where}: no layout {name!r} under clusters:; choose one of {sorted(layouts)}"
                          if layouts else f"{where}: this config has no clusters: section")
    merged = copy.deepcopy(values)
    for section in ("parallel", "data", "train"):
        merged.setdefault(section, {}).update(layouts[name].get(section) or {})
    return merged


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: a key must be a name, not {key!r}")
            if key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} is given twice; keep one")
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str) -> dict:
    """The mapping of a YAML config file; anything that is not one (a missing path, a folder, a
    special or binary file, an empty file, bad YAML, a key given twice) is a one-line ConfigError."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"{os.path.abspath(path)}: no such config file (a relative path on the command line is "
                          "from your folder; a bundled config may be named alone, e.g. default)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{path}: is a folder; give a YAML config file (configs/ lists the bundled ones)")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{path}: not a regular file; give a YAML config file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {info.st_size:,} bytes is not a run config (they are a few hundred "
                          "bytes); give a YAML config file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path} line {line}: not UTF-8 text (a binary file?); give a YAML config file") from None
    if "\0" in text:
        raise ConfigError(f"{path} line {text[:text.index(chr(0))].count(chr(10)) + 1}: contains a NUL byte "
                          "(a binary file?); give a YAML config file")
    try:
        values = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except ConfigError as e:
        raise ConfigError(f"{path} {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path} line {mark.line + 1}" if mark else path
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a run config") from None
    if values is None:
        raise ConfigError(f"{path}: the config is empty; copy configs/default.yaml and change what you need")
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a config is a mapping of sections (run_dir, model, data, parallel, "
                          f"train), got {type(values).__name__}")
    return values


# ---- command-line overrides: --set KEY=VALUE ---------------------------------------------------

def parse_set(item: str) -> tuple[str, Any]:
    """`a.b.c=VALUE` → ("a.b.c", VALUE read as YAML reads a value: 400 an integer, 5e-4 and 1.5 numbers,
    true a boolean, [de, fr] a list, anything else a string; nothing after `=` is no value)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key or not all(part.isidentifier() for part in key.split(".")):
        raise ConfigError(f"--set {item}: give KEY=VALUE with a dotted key, e.g. --set train.max_steps=400")
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader) if text.strip() else None  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, ConfigError):
        raise ConfigError(f"--set {item}: the value is not valid YAML; quote it, e.g. --set '{key}=\"...\"'") from None
    return key, value


def _set_annotation(key: str):
    """The annotation of the field `key` names (None inside a free-form mapping such as clusters:,
    which from_dict checks); ConfigError for a key the config does not have or a whole section."""
    cls, parts = RunConfig, key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(cls, include_extras=True)
        here = ".".join(parts[:i + 1])
        if part not in hints:
            section = f" of {'.'.join(parts[:i])}" if i else ""
            prefix = "".join(f"{p}." for p in parts[:i])
            hint = did_you_mean(part, prefix, list(hints), RunConfig, KEY_ALIASES)
            raise ConfigError(f"--set {key}: unknown key {here}{hint}; the keys{section} are {', '.join(hints)}")
        annotation = hints[part]
        if dataclasses.is_dataclass(annotation):
            if i == len(parts) - 1:
                first = dataclasses.fields(annotation)[0].name
                raise ConfigError(f"--set {key}: {here} is a section; set one of its keys, "
                                  f"e.g. --set {here}.{first}=VALUE")
            cls = annotation
            continue
        if i < len(parts) - 1:
            base = field_checks(annotation)[0]
            if base is dict or typing.get_origin(base) is dict:
                return None
            raise ConfigError(f"--set {key}: {here} is a single value, not a section; use --set {here}=VALUE")
        return annotation
    return None


def apply_sets(values: dict, sets: list[str], cwd: str | None = None, name: str | None = None) -> dict:
    """The raw config mapping `values` with every `--set KEY=VALUE` of `sets` applied (later ones
    win). Each value is checked against its field's annotation by the same code as the YAML file
    (schema/fields.py), so an unknown key or a value of the wrong type or range is a ConfigError that
    names `--set KEY`; rules across keys are checked when the whole config is built. A relative
    path (PATH_KEYS) is taken from `cwd`, the caller's folder (default this process's); `{config}` in
    run_dir is `name`, the config file's name without its extension."""
    for item in sets:
        key, value = parse_set(item)
        annotation = _set_annotation(key)
        if value is None:
            raise ConfigError(f"--set {key}: no value after '='; give one, e.g. --set {key}=VALUE")
        if annotation is not None:
            try:
                if key in PATH_KEYS:
                    value = anchor_path(value, key, cwd or os.getcwd(), name)
                coerce(annotation, value, key)
            except ConfigError as e:
                raise ConfigError(f"--set {e}") from None
        *sections, name = key.split(".")
        node = values
        for i, part in enumerate(sections):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {'.'.join(sections[:i + 1])} in the config is not a mapping "
                                  f"({child!r}); fix the file first")
            node = child
        node[name] = value
    return values


# ---- paths -------------------------------------------------------------------------------------

PATH_KEYS = ("run_dir", "data.corpus", "data.spm_model", "train.init_from")
"""The keys that name files or folders: `~` and `$VARS` expand in them (`expand_path`), and a relative
one is made absolute (`anchor_path`): written in a config file, from the file's folder; given with
--set or by a program (`overrides`), from the caller's folder (docs/configuration.md#paths)."""
BUNDLED_PREFIX = "bundled:"
CONFIG_NAME = "{config}"
"""In run_dir: the config file's name without its extension (runs/{config} in configs/mine.yaml is runs/mine)."""
_UNSET_VARIABLE = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_path(value, key: str):
    """`value` with `~`, `~user`, `$VAR` and `${VAR}` expanded (after `gettext:` in data.corpus);
    ConfigError naming `key` for a variable that is not set or a user that does not exist. Values
    that are not strings are left to the type check."""
    if not isinstance(value, str):
        return value
    prefix = GETTEXT_PREFIX if key == "data.corpus" and value.startswith(GETTEXT_PREFIX) else ""
    path = os.path.expandvars(os.path.expanduser(value[len(prefix):]))
    if path.startswith("~"):
        raise ConfigError(f"{key}={value!r}: {path.split(os.sep)[0]} names no user's home folder; "
                          "write the path out")
    unset = _UNSET_VARIABLE.search(path)
    if unset:
        raise ConfigError(f"{key}={value!r}: the environment variable {unset.group(1).strip('{}')} is not set; "
                          "set it, or write the path out")
    return prefix + path


def anchor_path(value, key: str, base: str, name: str | None = None):
    """`value` (expanded) as an absolute path, a relative one taken from the folder `base` (after
    `gettext:` in data.corpus; `bundled:…` names no path); `{config}` in run_dir is `name`, the
    config file's name without its extension."""
    if key == "run_dir" and isinstance(value, str) and CONFIG_NAME in value:
        if name is None:
            raise ConfigError(f"run_dir={value!r}: {CONFIG_NAME} stands for a config file's name, and there is "
                              "no config file here; write the folder out")
        value = value.replace(CONFIG_NAME, name)
    value = expand_path(value, key)
    if not isinstance(value, str) or value.startswith(BUNDLED_PREFIX):
        return value
    prefix = GETTEXT_PREFIX if key == "data.corpus" and value.startswith(GETTEXT_PREFIX) else ""
    path = value[len(prefix):]
    return prefix + (os.path.normpath(os.path.join(base, path)) if path.strip() else path)


def _anchor_paths(values: dict, where: str, base: str, name: str | None, skip: set[str] = frozenset()) -> None:
    """The path keys of the raw mapping `values` (but those in `skip`) made absolute from the folder
    `base` (`{config}` in run_dir: `name`)."""
    for key in PATH_KEYS:
        if key in skip:
            continue
        *sections, leaf = key.split(".")
        node = values
        for part in sections:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            try:
                node[leaf] = anchor_path(node[leaf], key, base, name)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None


def _has(values: dict, key: str) -> bool:
    *sections, name = key.split(".")
    for part in sections:
        values = values.get(part) if isinstance(values, dict) else None
    return isinstance(values, dict) and name in values


def config_name(path: str) -> str:
    """What `{config}` in run_dir stands for: the config file's name without its extension."""
    return os.path.splitext(os.path.basename(path))[0]


def load_config(path: str, overrides: dict | None = None, cluster: str | None = None,
                sets: list[str] | None = None, cwd: str | None = None) -> RunConfig:
    """Read a YAML run config; `overrides` is a nested dict applied on top (e.g. --run-dir, tests);
    `sets` are `--set KEY=VALUE` items applied after it (`apply_sets`; they also win over a
    cluster's layout); `cluster` selects one of the config's `clusters:` layouts. `~` and `$VARS`
    expand in the path keys (PATH_KEYS), and relative ones are made absolute: the file's from its
    folder, those of `overrides` and `sets` from `cwd` (the caller's folder; default this process's).
    Every layout is validated."""
    values = read_yaml(path)
    base, cwd = os.path.dirname(os.path.abspath(path)), cwd or os.getcwd()
    name = config_name(path)
    values.setdefault("run_dir", RunConfig.run_dir)  # the default too is from the file's folder
    overrides = copy.deepcopy(overrides or {})
    sets = list(sets or [])
    replaced = {parse_set(item)[0] for item in sets} | {key for key in PATH_KEYS if _has(overrides, key)}
    _anchor_paths(values, path, base, name, skip=replaced)  # (what --set or overrides replace is not the file's)
    _anchor_paths(overrides, path, cwd, name)
    for section, items in overrides.items():
        if isinstance(items, dict) and isinstance(values.get(section), dict):
            values[section].update(items)
        else:
            values[section] = items
    apply_sets(values, sets, cwd, name)
    where = f"{path} with --set {' '.join(sets)}" if sets else path
    cfg = from_dict(RunConfig, values, where, aliases=KEY_ALIASES)
    validate(cfg, where)
    for name, layout in cfg.clusters.items():
        at = f"{where}: clusters.{name}"
        merged = with_cluster(values, name, at)
        _anchor_paths(merged, at, base, name)
        laid_out = from_dict(RunConfig, merged, at, aliases=KEY_ALIASES)
        validate(laid_out, at)
        if layout.nodes * layout.gpus_per_node != laid_out.world_size:
            raise ConfigError(f"{at}: nodes × gpus_per_node = {layout.nodes} × {layout.gpus_per_node} "
                              f"must equal pipeline_stages × tensor_parallel × data_parallel = "
                              f"{laid_out.world_size}")
    if cluster is not None:
        laid_out = with_cluster(values, cluster, where)
        _anchor_paths(laid_out, where, base, name)
        apply_sets(laid_out, sets, cwd, name)
        cfg = from_dict(RunConfig, laid_out, where, aliases=KEY_ALIASES)
        validate(cfg, f"{where} with clusters.{cluster}")
    return cfg


def check_run_config(values: dict, where: str) -> None:
    """Raise ConfigError, naming the key, when the mapping `values` (a whole run config, as
    written by a program rather than read from a file) is not a valid run config."""
    validate(from_dict(RunConfig, values, where, aliases=KEY_ALIASES), where)


def validate(cfg: RunConfig, where: str) -> None:
    """Rules across keys and sections (each field's own type and bounds are checked when read)."""
    m, d, p, t = cfg.model, cfg.data, cfg.parallel, cfg.train
    if t.init_from and not d.spm_model:  # a fine-tuned model keeps the token ids its source learnt
        d.spm_model = t.init_from
    try:
        m.validate() if m.vocab_size else dataclasses.replace(m, vocab_size=1).validate()
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if m.vocab_size and m.vocab_size < d.vocab_size:
        raise ConfigError(f"{where}: model.vocab_size={m.vocab_size} is below data.vocab_size={d.vocab_size}, "
                          "so some token ids would have no embedding; set model.vocab_size: 0 (taken from the data)")
    for key, value in (("model.heads", m.heads), ("model.ffn_dim", m.ffn_dim),
                       ("model.vocab_size" if m.vocab_size else "data.vocab_size", m.vocab_size or d.vocab_size)):
        if value % p.tensor_parallel:
            raise ConfigError(f"{where}: parallel.tensor_parallel={p.tensor_parallel} must divide {key}={value}")
    longest = max(d.max_source_len, d.max_target_len)
    if m.max_positions < longest:
        raise ConfigError(f"{where}: model.max_positions={m.max_positions} is below the longest sequence "
                          f"the data allows (data.max_source_len/max_target_len = {longest}); raise it")
    schedule = SCHEDULES[p.schedule]
    if not schedule.pending_bounds and p.zb_max_pending_w != 0:
        takes = ", ".join(s.name for s in SCHEDULES.values() if s.pending_bounds)
        raise ConfigError(f"{where}: parallel.zb_max_pending_w={p.zb_max_pending_w} applies to parallel.schedule: "
                          f"{takes} only (the schedule is {p.schedule}); remove the key or set schedule: {takes}")
    if schedule.splits_backward and t.instrument_interval > 0:
        keeps = ", ".join(s.name for s in SCHEDULES.values() if not s.splits_backward)
        raise ConfigError(f"{where}: train.instrument_interval > 0 records per-layer gradients from autograd's "
                          f"accumulation hooks, which {p.schedule}'s deferred weight gradients bypass; set it to 0 "
                          f"or use parallel.schedule: {keeps}")
    beyond = sorted(s for s in set(t.trace_steps) if s > t.max_steps)
    if beyond:
        raise ConfigError(f"{where}: train.trace_steps={t.trace_steps} names step {beyond[0]}, beyond "
                          f"train.max_steps={t.max_steps}; choose steps within 1..{t.max_steps}")
    n_layers = m.encoder_layers + m.decoder_layers
    if p.pipeline_stages > n_layers:
        raise ConfigError(f"{where}: parallel.pipeline_stages={p.pipeline_stages} exceeds the model's "
                          f"{n_layers} encoder and decoder layers (a stage holds at least one)")
    if p.partition_method.startswith("type:"):
        check_type_partition(cfg, where)


def check_type_partition(cfg: RunConfig, where: str) -> None:
    """`partition_method: type:REGEX` as DeepSpeed applies it (its `regex` module, case-insensitive
    search in the class names of the pipeline layers): it must match a layer and give every stage
    at least one layer, or the ranks fail after they started."""
    import regex
    from deepspeed.runtime.utils import partition_balanced

    from parallel.pipeline import layer_specs

    pattern = cfg.parallel.partition_method[len("type:"):]
    try:
        search = regex.compile(pattern, regex.IGNORECASE).search
    except regex.error as e:
        raise ConfigError(f"{where}: parallel.partition_method={cfg.parallel.partition_method!r}: {e}") from None
    names = [spec.typename.__name__ for spec in layer_specs(dataclasses.replace(cfg.model, vocab_size=16), 0)]
    weights = [int(bool(search(name))) for name in names]
    if not any(weights):
        raise ConfigError(f"{where}: parallel.partition_method={cfg.parallel.partition_method!r} matches none of the "
                          f"pipeline layers ({', '.join(sorted(set(names)))})")
    parts = partition_balanced(weights, cfg.parallel.pipeline_stages)
    if any(a == b for a, b in zip(parts, parts[1:])):
        raise ConfigError(f"{where}: parallel.partition_method={cfg.parallel.partition_method!r} leaves a pipeline "
                          "stage without layers; use cost (the default)")


"""Run configuration: YAML → validated dataclasses, with errors that name the file and key."""
from __future__ import annotations

import copy
import dataclasses
import os
import typing
from dataclasses import dataclass, field

import yaml

from data.config import DataConfig
from model.config import ModelConfig


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model is laid out over processes."""

    pipeline_stages: int = 1
    """pp: number of pipeline stages (depth partitions)."""
    tensor_parallel: int = 1
    """tp: megatron-core tensor parallelism inside each stage (heads, FFN columns and the
    vocabulary are split tp ways; tp must divide model.heads, model.ffn_dim and the vocabulary)."""
    data_parallel: int = 1
    """dp: number of model replicas. Processes launched = pipeline_stages × tensor_parallel ×
    data_parallel."""
    zero_stage: int = 1
    """ZeRO stage; DeepSpeed's pipeline engine accepts 0 or 1. Stage 1 also gives the correct
    global gradient norm under pp > 1 (DeepSpeed's fp32 stage-0 path does not)."""
    activation_checkpoint_interval: int = 0
    """Recompute activations every this many layers in backward (0 = off)."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16 (bf16 on GPUs; on CPUs without bf16 instructions it is ~3× slower)."""
    partition_method: str = "cost"
    """cost (FLOP model, decoder layer ≈ 4/3 encoder layer, output layer ∝ vocabulary) |
    parameters | uniform | type:REGEX (DeepSpeed's methods)."""
    schedule: str = "1f1b"
    """Pipeline schedule: 1f1b (DeepSpeed's) | zb-h1 (zero-bubble ZB-H1: each backward split into
    the input gradient, run at once, and the weight gradients, run later to fill the pipeline's
    idle time; same activation memory as 1F1B's first stage; see parallel/zero_bubble.py)."""


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and bookkeeping."""

    max_steps: int = 1000
    """Optimizer steps to run."""
    micro_batches: int = 1
    """Micro-batches per optimizer step per replica (DeepSpeed gradient_accumulation_steps)."""
    lr: float = 5e-4
    """Peak learning rate, reached at the end of the warm-up."""
    warmup_steps: int = 4000
    """Linear warm-up length; afterwards lr decays as 1/sqrt(step) (inverse square root)."""
    adam_betas: tuple[float, float] = (0.9, 0.98)
    """Adam β₁, β₂."""
    adam_eps: float = 1e-8
    """Adam ε."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    clip_norm: float = 0.0
    """Clip the global gradient norm to this value (0 = no clipping; the norm is still logged)."""
    seed: int = 1
    """Seed of the weights (layer i uses seed + i) and of the data order."""
    log_interval: int = 10
    """Print loss, lr, gradient norm and tokens/s every this many steps."""
    valid_interval: int = 100
    """Compute the validation loss every this many steps (and at the end)."""
    save_interval: int = 500
    """Save a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (oldest deleted first)."""
    instrument_interval: int = 0
    """Log the stability instruments (model update ‖ΔF‖ on a probe batch, per-layer gradient
    norms, LayerNorm input sizes; see launcher/stability.py) every this many steps; 0 = off."""


@dataclass(kw_only=True)
class ClusterLayout:
    """A named layout under a config's `clusters:`, applied by `./run.sh slurm CONFIG --cluster NAME`.

    The same model and optimisation, laid out for one cluster: its sections override the config's
    own, and nodes × gpus_per_node must equal the resulting pipeline × tensor × data ranks."""

    nodes: int
    """Nodes of the SLURM job."""
    gpus_per_node: int
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
    run_dir: str = "runs/default"
    """Where data, checkpoints, logs and the summary go. An existing run directory is resumed."""
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


def _coerce(value, typ, where: str):
    """Check/convert one YAML value against a dataclass field type."""
    origin = typing.get_origin(typ)
    if origin is typing.Union or str(typ).startswith("typing.Optional"):
        return value
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is bool and isinstance(value, bool):
        return value
    if typ is str and isinstance(value, str):
        return value
    if typ is dict and isinstance(value, dict):
        return dict(value)
    if origin is dict and isinstance(value, dict):
        item = typing.get_args(typ)[1]
        return {str(k): from_dict(item, v, f"{where}.{k}") if dataclasses.is_dataclass(item) else v
                for k, v in value.items()}
    if origin in (list, tuple) and isinstance(value, (list, tuple)):
        args = typing.get_args(typ)
        if origin is tuple and len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
        items = [_coerce(v, args[0] if origin is list else args[i], f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    raise ConfigError(f"{where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")


def from_dict(cls, values: dict, where: str):
    """Build dataclass `cls` from a mapping; unknown keys and wrong types raise ConfigError."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
    kwargs = {}
    for name, value in values.items():
        typ = hints[name]
        if dataclasses.is_dataclass(typ):
            kwargs[name] = from_dict(typ, value, f"{where}.{name}")
        else:
            kwargs[name] = _coerce(value, typ, f"{where}.{name}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


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


def load_config(path: str, overrides: dict | None = None, cluster: str | None = None) -> RunConfig:
    """Read a YAML run config; `overrides` is a nested dict applied on top (e.g. from tests);
    `cluster` selects one of the config's `clusters:` layouts. Every layout is validated."""
    if not os.path.exists(path):
        raise ConfigError(f"{path}: no such config file (configs/ lists the bundled ones)")
    with open(path, encoding="utf-8") as f:
        try:
            values = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    for section, items in (overrides or {}).items():
        if isinstance(items, dict):
            values.setdefault(section, {}).update(items)
        else:
            values[section] = items
    cfg = from_dict(RunConfig, values, path)
    validate(cfg, path)
    for name, layout in cfg.clusters.items():
        where = f"{path}: clusters.{name}"
        laid_out = from_dict(RunConfig, with_cluster(values, name, where), where)
        validate(laid_out, where)
        if layout.nodes * layout.gpus_per_node != laid_out.world_size:
            raise ConfigError(f"{where}: nodes × gpus_per_node = {layout.nodes} × {layout.gpus_per_node} "
                              f"must equal pipeline_stages × tensor_parallel × data_parallel = "
                              f"{laid_out.world_size}")
    if cluster is not None:
        cfg = from_dict(RunConfig, with_cluster(values, cluster, path), path)
    return cfg


def validate(cfg: RunConfig, where: str) -> None:
    p, t = cfg.parallel, cfg.train
    if min(p.pipeline_stages, p.tensor_parallel, p.data_parallel) < 1:
        raise ConfigError(f"{where}: parallel.pipeline_stages, tensor_parallel and data_parallel must be >= 1")
    for key, value in (("model.heads", cfg.model.heads), ("model.ffn_dim", cfg.model.ffn_dim),
                       ("data.vocab_size", cfg.data.vocab_size)):
        if value % p.tensor_parallel:
            raise ConfigError(f"{where}: parallel.tensor_parallel={p.tensor_parallel} must divide {key}={value}")
    if p.zero_stage not in (0, 1):
        raise ConfigError(f"{where}: parallel.zero_stage={p.zero_stage}: DeepSpeed's pipeline engine "
                          "supports ZeRO stage 0 or 1 only")
    if p.zero_stage == 0 and p.pipeline_stages > 1 and t.clip_norm > 0 and p.precision == "fp32":
        raise ConfigError(f"{where}: parallel.zero_stage=0 with fp32, pipeline_stages > 1 and "
                          "train.clip_norm > 0 computes a wrong gradient norm in DeepSpeed 0.19; "
                          "use zero_stage: 1")
    if p.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"{where}: parallel.precision={p.precision!r}: use fp32, bf16 or fp16")
    if p.schedule not in ("1f1b", "zb-h1"):
        raise ConfigError(f"{where}: parallel.schedule={p.schedule!r}: use 1f1b or zb-h1")
    if p.schedule == "zb-h1" and p.precision != "fp32":
        raise ConfigError(f"{where}: parallel.schedule=zb-h1 supports precision fp32 only (DeepSpeed's bf16/fp16 "
                          "optimizers copy gradients right after each backward); use fp32 or schedule: 1f1b")
    if p.schedule == "zb-h1" and t.instrument_interval > 0:
        raise ConfigError(f"{where}: train.instrument_interval > 0 records per-layer gradients from autograd's "
                          "accumulation hooks, which zb-h1's deferred weight gradients bypass; set it to 0 "
                          "or use parallel.schedule: 1f1b")
    if p.activation_checkpoint_interval < 0:
        raise ConfigError(f"{where}: parallel.activation_checkpoint_interval must be >= 0")
    if t.instrument_interval < 0:
        raise ConfigError(f"{where}: train.instrument_interval must be >= 0 (0 turns the instruments off)")
    if t.micro_batches < 1 or t.max_steps < 1:
        raise ConfigError(f"{where}: train.micro_batches and train.max_steps must be >= 1")
    n_layers = cfg.model.encoder_layers + cfg.model.decoder_layers + 2
    if p.pipeline_stages > n_layers:
        raise ConfigError(f"{where}: parallel.pipeline_stages={p.pipeline_stages} exceeds the "
                          f"{n_layers} pipeline layers of the model")
    try:
        probe = dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, 1))
        probe.validate()
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None

"""Run configuration: YAML → validated dataclasses, with errors that name the file and key."""
from __future__ import annotations

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
    data_parallel: int = 1
    """dp: number of model replicas. Processes launched = pipeline_stages × data_parallel."""
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


@dataclass(kw_only=True)
class RunConfig:
    run_dir: str = "runs/default"
    """Where data, checkpoints, logs and the summary go. An existing run directory is resumed."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.pipeline_stages * self.parallel.data_parallel


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


def load_config(path: str, overrides: dict | None = None) -> RunConfig:
    """Read a YAML run config; `overrides` is a nested dict applied on top (e.g. from tests)."""
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
    return cfg


def validate(cfg: RunConfig, where: str) -> None:
    p, t = cfg.parallel, cfg.train
    if p.pipeline_stages < 1 or p.data_parallel < 1:
        raise ConfigError(f"{where}: parallel.pipeline_stages and parallel.data_parallel must be >= 1")
    if p.zero_stage not in (0, 1):
        raise ConfigError(f"{where}: parallel.zero_stage={p.zero_stage}: DeepSpeed's pipeline engine "
                          "supports ZeRO stage 0 or 1 only")
    if p.zero_stage == 0 and p.pipeline_stages > 1 and t.clip_norm > 0 and p.precision == "fp32":
        raise ConfigError(f"{where}: parallel.zero_stage=0 with fp32, pipeline_stages > 1 and "
                          "train.clip_norm > 0 computes a wrong gradient norm in DeepSpeed 0.19; "
                          "use zero_stage: 1")
    if p.precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"{where}: parallel.precision={p.precision!r}: use fp32, bf16 or fp16")
    if p.activation_checkpoint_interval < 0:
        raise ConfigError(f"{where}: parallel.activation_checkpoint_interval must be >= 0")
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

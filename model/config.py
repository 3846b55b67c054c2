"""Model configuration: one dataclass, every field documented.

Config fields declare what they accept in their annotation, next to the field: the type, an
enumeration as ``Literal[...]`` and bounds as ``Annotated[int, Range(ge=1)]``. `check_fields`
checks any config dataclass against its annotations, so a field added later is checked by the
same code (its type always, its bounds as soon as it declares them). Floats must be finite.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

_BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt), ("le", "<=", operator.le),
           ("lt", "<", operator.lt))


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


def field_checks(annotation) -> tuple[Any, list]:
    """(the annotation without Annotated, the Range/Rule checks declared in it)."""
    if typing.get_origin(annotation) is Annotated:
        base, *extra = typing.get_args(annotation)
        return base, [x for x in extra if isinstance(x, (Range, Rule))]
    return annotation, []


def field_problem(annotation, value) -> str | None:
    """What is wrong with a type-correct `value` of a field annotated `annotation`, or None."""
    base, checks = field_checks(annotation)
    if typing.get_origin(base) is Literal and value not in typing.get_args(base):
        return "must be one of " + ", ".join(str(x) for x in typing.get_args(base))
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, float) and not math.isfinite(item):
            return "must be a finite number"
        for check in checks:
            if (problem := check.problem(item)) is not None:
                return problem
    return None


def check_fields(obj, section: str) -> None:
    """Raise ValueError naming ``section.key`` for the first field of the config dataclass `obj`
    that breaks the enumeration or bounds declared in its annotation (or is a non-finite float)."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not dataclasses.is_dataclass(value) and (problem := field_problem(hints[f.name], value)):
            raise ValueError(f"{section}.{f.name}={value!r}: {problem}")


Positive = Annotated[int, Range(ge=1)]
NonNegative = Annotated[int, Range(ge=0)]
Seed = Annotated[int, Range(ge=0, le=2**32 - 1)]  # numpy's generators take 32-bit seeds
Probability = Annotated[float, Range(ge=0.0, lt=1.0)]
Norm = Literal["deepnorm", "deepnorm-xavier-1.15", "deepnorm-torchscale", "postln", "preln", "postln-init", "subln", "branchnorm"]
"""The strategies of model/norms.py (a test keeps the two lists equal)."""


@dataclass(kw_only=True)
class ModelConfig:
    """An encoder-decoder Transformer for translation (fairseq-style, shared vocabulary)."""

    encoder_layers: Positive = 6
    """N, the number of encoder layers."""
    decoder_layers: Positive = 6
    """M, the number of decoder layers."""
    d_model: Annotated[int, Range(ge=4)] = 512
    """Width of the residual stream (and of the shared embedding); the sinusoidal position
    table needs at least 4."""
    heads: Positive = 8
    """Attention heads; must divide d_model."""
    ffn_dim: Positive = 2048
    """Inner width of the feed-forward network."""
    vocab_size: NonNegative = 0
    """Joint vocabulary size; 0 means 'take it from the SentencePiece model of the data'."""
    norm: Norm = "deepnorm"
    """Normalisation strategy: deepnorm | deepnorm-xavier-1.15 | postln | preln | postln-init |
    subln | branchnorm (formulas in model/norms.py)."""
    branchnorm_max_norm_step: Positive = 4000
    """BranchNorm's T: the branch is normalised with weight 1 − t/T and is plain Post-LN from
    optimizer step T on (norm: branchnorm only)."""
    dropout: Probability = 0.1
    """Dropout on embeddings and on the output of every residual branch."""
    attention_dropout: Probability = 0.0
    """Dropout on attention probabilities."""
    activation_dropout: Probability = 0.0
    """Dropout after the FFN activation."""
    activation: Literal["relu", "gelu"] = "relu"
    """FFN activation: relu | gelu."""
    max_positions: Positive = 1024
    """Longest sequence the sinusoidal position table covers."""
    pad_id: Literal[0] = 0
    """Padding token id (the data pipeline fixes pad=0, unk=1, bos=2, eos=3)."""
    label_smoothing: Probability = 0.1
    """ε of the label-smoothed cross-entropy (torch's definition: ε spread uniformly over V)."""
    layernorm_eps: Annotated[float, Range(gt=0.0, lt=1.0)] = 1e-5
    """ε inside every LayerNorm."""

    def validate(self) -> None:
        """Raise ValueError naming the offending key when a value or the shape is impossible."""
        check_fields(self, "model")
        from model.norms import resolve  # the strategy's own checks (a renamed strategy says so)

        resolve(self.norm, self.encoder_layers, self.decoder_layers, self.branchnorm_max_norm_step)
        if self.d_model % self.heads:
            raise ValueError(f"model.heads={self.heads} must divide model.d_model={self.d_model}")
        if self.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (> 0) before building the model")

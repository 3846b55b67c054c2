"""Precision as one record, built once from `parallel.precision` and passed where it is needed:
the dtypes of parameters, activations (what travels between stages), gradients and optimizer
state, loss scaling, the bytes each takes, and DeepSpeed's flags for it. Everything that depends
on the precision reads these fields — the config's allowed names, DeepSpeed's config
(parallel/engine_config.py), the trainer's optimizer (parallel/optimizer.py: its loss scaler and
its master copy), the stage messages (parallel/pipeline.py `message_layout`), the check before
launch (launcher/preflight.py) and the planner's bytes per parameter (planner/planner.py) — never
the name, so an entry added to PRECISIONS is taken everywhere alike (tests/test_precision.py).

Every precision trains with fp32 master weights, fp32 gradient accumulation (FlatOptimizer's flat
buffer, parallel/optimizer.py) and fp32 Adam moments; bf16 and fp16 keep the module's weights, the
activations and the stage messages in 16 bits; fp16 scales the loss dynamically (DeepSpeed's
scaler, from 2^16) so that small gradients survive the rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

DTYPES = {"fp32": ("float32", 4), "bf16": ("bfloat16", 2), "fp16": ("float16", 2)}
"""The dtypes a record may name: short name → (torch's name, bytes per element). Names, not torch
objects, so that the config, the command line and the planner read the records without importing
torch."""


def _torch_dtype(short: str):
    import torch

    return getattr(torch, DTYPES[short][0])


@dataclass(frozen=True)
class Precision:
    name: str
    """As `parallel.precision` names it."""
    math: str
    """The dtype (DTYPES' short name) of the module's weights, its activations and the messages
    between stages — DeepSpeed casts the module to it (its bf16 / fp16 flags, `deepspeed_config`) —
    and the arithmetic a GPU datasheet prices (planner/devices.py `peak_tflops` keys)."""
    loss_scaling: bool
    """Dynamic loss scaling (DeepSpeed's scaler, from 2^16): FlatOptimizer gets a scaler and the
    engine scales the loss's gradient."""
    grad_math: str = "fp32"
    """Where gradients accumulate over micro-batches and are reduced, clipped and stepped:
    FlatOptimizer's flat buffer (it is built for fp32 only and refuses another) and DeepSpeed's
    `grad_accum_dtype`."""
    master_math: str = "fp32"
    """The optimizer's weights and Adam's moments (FlatOptimizer: fp32 only)."""

    @property
    def dtype(self):
        """`math` as a torch dtype."""
        return _torch_dtype(self.math)

    @property
    def grad_dtype(self):
        return _torch_dtype(self.grad_math)

    @property
    def master_dtype(self):
        return _torch_dtype(self.master_math)

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight, activation or message element."""
        return DTYPES[self.math][1]

    @property
    def low(self) -> bool:
        """Weights and activations in fewer bits than the master weights (bf16, fp16)."""
        return self.element_bytes < DTYPES[self.master_math][1]

    @property
    def master_copy(self) -> bool:
        """The optimizer keeps its own copy of the weights; where the module's weights are in the
        master dtype (fp32), its master partition is the weights themselves."""
        return self.math != self.master_math

    def state_bytes(self) -> dict[str, int]:
        """Bytes per parameter of a stage's shard by where they live, for FlatOptimizer (every
        precision's optimizer, parallel/optimizer.py): `kept` all the time (the weights and the
        flat gradient buffer), `grads` during a backward (autograd's gradients in the weights'
        dtype, until folded into the buffer), `kept_dp` all the time and divided by dp under ZeRO-1
        (the master copy, where there is one, and Adam's two moments), `step` at the reduction
        (the buffer converted to the communication dtype, the weights' one, where it differs)."""
        grad, master = DTYPES[self.grad_math][1], DTYPES[self.master_math][1]
        return {"kept": self.element_bytes + grad, "grads": self.element_bytes,
                "kept_dp": master * (2 + self.master_copy),
                "step": self.element_bytes if self.math != self.grad_math else 0}

    def deepspeed_config(self) -> dict:
        """DeepSpeed's keys for this precision. Its flags select the engine's paths (the bf16 and
        fp16 casts of the module, fp16's loss scaling in the backward); the optimizer they would
        select is replaced by FlatOptimizer (parallel/engine.py), for which `grad_accum_dtype`
        matters only where DeepSpeed's own optimizers run (the A/B runs: bf16 then accumulates in
        fp32 as FlatOptimizer does)."""
        return {"bf16": {"enabled": self.math == "bf16"},
                "data_types": {"grad_accum_dtype": self.grad_math if self.math == "bf16" else None},
                "fp16": {"enabled": self.math == "fp16", "initial_scale_power": 16,
                         "loss_scale": 0 if self.loss_scaling else 1.0}}


PRECISIONS = {p.name: p for p in (Precision("fp32", "fp32", False), Precision("bf16", "bf16", False),
                                  Precision("fp16", "fp16", True))}
"""Every precision `parallel.precision` may name."""


def precision_of(name: str) -> Precision:
    """The record of `parallel.precision` = `name`."""
    return PRECISIONS[name]


def precision_names() -> str:
    """The allowed names, as messages list them."""
    return " | ".join(PRECISIONS)

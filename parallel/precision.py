"""Precision as one record, built once from `parallel.precision` and passed where it is needed:
the dtypes of parameters, activations (what travels between stages), gradients and optimizer
state, loss scaling, the bytes an element takes, and DeepSpeed's flags for it.

Every precision trains with fp32 master weights, fp32 gradient accumulation (FlatOptimizer's flat
buffer, parallel/optimizer.py) and fp32 Adam moments; bf16 and fp16 keep the module's weights, the
activations and the stage messages in 16 bits; fp16 scales the loss dynamically (DeepSpeed's
scaler, from 2^16) so that small gradients survive the rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    name: str
    """fp32 | bf16 | fp16, as `parallel.precision` names it."""
    dtype: torch.dtype
    """The module's weights, its activations and the messages between stages."""
    loss_scaling: bool
    """fp16's dynamic loss scale."""
    grad_dtype: torch.dtype = torch.float32
    """Where gradients accumulate over micro-batches and are reduced, clipped and stepped."""
    master_dtype: torch.dtype = torch.float32
    """The optimizer's weights and Adam's moments."""

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight, activation or message element."""
        return torch.finfo(self.dtype).bits // 8

    @property
    def low(self) -> bool:
        """Weights and activations in 16 bits (bf16, fp16)."""
        return self.dtype != torch.float32

    def deepspeed_config(self) -> dict:
        """DeepSpeed's keys for this precision. Its flags select the engine's paths (the bf16 and
        fp16 casts of the module, fp16's loss scaling in the backward); the optimizer they would
        select is replaced by FlatOptimizer (parallel/engine.py), for which `grad_accum_dtype`
        matters only where DeepSpeed's own optimizers run (the A/B runs: bf16 then accumulates in
        fp32 as FlatOptimizer does)."""
        return {"bf16": {"enabled": self.name == "bf16"},
                "data_types": {"grad_accum_dtype": "fp32" if self.name == "bf16" else None},
                "fp16": {"enabled": self.name == "fp16", "initial_scale_power": 16}}


PRECISIONS = {p.name: p for p in (Precision("fp32", torch.float32, False), Precision("bf16", torch.bfloat16, False),
                                  Precision("fp16", torch.float16, True))}


def precision_of(name: str) -> Precision:
    """The record of `parallel.precision` = `name`."""
    return PRECISIONS[name]

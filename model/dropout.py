"""Dropout for the model's layers: torch's on accelerators, a hashed mask on CPUs.

On a CPU torch draws one Bernoulli number per element (`bernoulli_`, ~7.5 ns per element on this
project's 2-core EPYC: a fifth of a 100L-100L d=64 training step, whose matmuls are tiny). The
kernel in `model/csrc/dropout.cpp` decides element i by a hash of (i, seed), one 64-bit seed per
call drawn from torch's default CPU generator, ~0.7 ns per element, and adds DeepNorm's α·x in
the same pass. Same statistics as torch's dropout (keep probability 1 − round(p·2³²)/2³², kept
values scaled by 1/(1 − p)), reproducible under `torch.manual_seed`, restored by activation
checkpointing and DeepSpeed's model-parallel RNG tracker like torch's draws; the masks differ
from torch's. No library offers a CPU dropout that is not per-element Bernoulli draws.

The kernel is built with the attention kernel, on first use (model/kernels.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.kernels import enabled, kernels


def _usable(y: torch.Tensor, p: float) -> bool:
    return y.is_cpu and y.dtype in (torch.float32, torch.float64) and p < 1.0 and enabled()


class _DropoutAdd(torch.autograd.Function):
    """alpha · x + dropout(y) (x None: dropout(y)) with the hashed mask."""

    @staticmethod
    def forward(ctx, x, y, alpha: float, p: float):
        k = kernels()
        ctx.seed, ctx.alpha, ctx.p = k.draw_seed(), alpha, p
        return k.dropout_add(y, x, alpha, p, ctx.seed)

    @staticmethod
    def backward(ctx, grad):
        with_x = ctx.needs_input_grad[0]
        gx, gy = kernels().dropout_add_backward(grad, ctx.alpha, ctx.p, ctx.seed, with_x)
        return (gx if with_x else None), gy, None, None


def dropout(y: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if not training or p == 0.0:
        return y
    if _usable(y, p):
        return _DropoutAdd.apply(None, y, 0.0, p)
    return F.dropout(y, p, True)


def dropout_add(x: torch.Tensor, y: torch.Tensor, alpha: float, p: float, training: bool) -> torch.Tensor:
    """alpha · x + dropout(y), in one pass over memory on CPUs."""
    if training and p > 0.0 and x.shape == y.shape and x.dtype == y.dtype and _usable(y, p):
        return _DropoutAdd.apply(x, y, alpha, p)
    y = dropout(y, p, training)
    return x + y if alpha == 1.0 else alpha * x + y


class Dropout(nn.Dropout):
    """`nn.Dropout` (same `p`, same train/eval switch) computed by `dropout`; `add` is the
    residual form alpha · x + dropout(y)."""

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return dropout(y, self.p, self.training)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether `add` on tensors like x runs the one-pass kernel."""
        return self.training and self.p > 0.0 and _usable(x, self.p)

    def add(self, x: torch.Tensor, y: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        return dropout_add(x, y, alpha, self.p, self.training)

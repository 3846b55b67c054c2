"""Dropout for the model's layers: torch's on accelerators, a hashed mask on CPUs.

On a CPU torch draws one Bernoulli number per element (`bernoulli_`, ~7.5 ns per element on this
project's 2-core EPYC: a fifth of a 100L-100L d=64 training step, whose matmuls are tiny). The
kernel in `model/csrc/dropout.cpp` decides element i by a hash of (i, seed), one 64-bit seed per
call drawn from torch's default CPU generator, ~0.7 ns per element, and adds DeepNorm's α·x in
the same pass. Same statistics as torch's dropout (keep probability 1 − round(p·2³²)/2³², kept
values scaled by 1/(1 − p)), reproducible under `torch.manual_seed`, restored by activation
checkpointing and DeepSpeed's model-parallel RNG tracker like torch's draws; the masks differ
from torch's. No library offers a CPU dropout that is not per-element Bernoulli draws.

The kernel is compiled on first use (torch.utils.cpp_extension, ~30 s, cached per CPU model in
torch's extension directory, `TORCH_EXTENSIONS_DIR`): a run's first step, or the test suite's
start. Where it cannot be built, torch's dropout runs instead and one warning says why.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "dropout.cpp")
_kernels: object | None = None
_failed: str | None = None
_torch_only = False


@contextlib.contextmanager
def torch_dropout():
    """Within: torch's dropout, the model's op before the hashed kernel (`./run.sh bench model`
    compares the two)."""
    global _torch_only
    saved, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = saved


def _cpu_model() -> str:
    """The CPU model and its flags (the build uses -march=native: one build per kind of CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha256((platform.machine() + "".join(lines)).encode()).hexdigest()[:10]


def kernels():
    """The compiled CPU kernels, or None (with one warning) where they cannot be built."""
    global _kernels, _failed
    if _kernels is None and _failed is None:
        try:
            from torch.utils.cpp_extension import load

            here = os.path.dirname(sys.executable)  # the virtualenv's ninja (a DeepSpeed requirement)
            if shutil.which("ninja") is None and shutil.which("ninja", path=here):
                os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
            log.info("loading the CPU dropout kernel (compiled once per CPU model, ~30 s): %s", SOURCE)
            builder = logging.getLogger("torch.utils.cpp_extension")  # its compiler banner: ours says it
            level = builder.level
            builder.setLevel(logging.ERROR)
            try:
                _kernels = load(name=f"deepnet_dropout_{_cpu_model()}", sources=[SOURCE],
                                extra_cflags=["-O3", "-march=native"], verbose=False)
            finally:
                builder.setLevel(level)
        except Exception as error:  # no compiler, no ninja, a read-only cache: torch's dropout
            lines = str(error).strip().splitlines()
            _failed = f"{type(error).__name__}: {lines[-1] if lines else ''}"
            log.warning("fast CPU dropout unavailable: could not build %s with g++ and ninja (%s); using "
                        "torch's dropout (same statistics, slower on CPUs)", SOURCE, _failed)
    return _kernels


def _usable(y: torch.Tensor, p: float) -> bool:
    return not _torch_only and y.is_cpu and y.dtype in (torch.float32, torch.float64) and p < 1.0 and kernels() is not None


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

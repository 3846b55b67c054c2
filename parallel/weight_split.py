"""B/W-split backward for the zero-bubble schedule (parallel/schedule_engine.py).

`split_weight_gradients(module, store)` gives every weight-bearing module of a built stage
(nn.Linear, affine nn.LayerNorm, the shared embedding's lookup and its tied output projection,
megatron-core's column/row-parallel linears, the vocabulary-parallel embedding, the sharded
LayerNorm) a replacement forward through an autograd Function whose backward returns the input
gradient only and hands the weight-gradient computation, with the tensors it needs, to a
`WeightGradStore`. The model's own code is unchanged: the replacement computes exactly what the
original forward computes (tests/test_zero_bubble.py compares outputs bit for bit and gradients
with autograd's).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from model.layers import SharedEmbedding
from parallel.tensor import TensorParallelLayerNorm, VocabParallelLookup


class WeightGradStore:
    """Weight-gradient work deferred by the split backward, grouped by micro-batch.

    Work is deferred only inside `collect(k)` (the engine's BackwardPass of micro-batch k); a
    backward anywhere else computes weight gradients at once, as plain autograd would.

    Only the matmul weight gradients (dW = gᵀ·x of linears and of the tied output projection) are
    deferred by default. The cheap ones (biases, LayerNorm affines, the embedding lookup) are
    computed inside B: deferring them would gain the schedule almost no time and hold each
    one's input and output gradient until W (a LayerNorm's are as large as a linear's).
    `defer_cheap=True` defers those too.

    `only` (ids of weights; None: every weight) limits deferral to those weights' dW, the others'
    being computed inside B: `defer_share` picks a share of a stage's matmul work that way, so a
    stage can defer part of its W for part of the memory.
    """

    def __init__(self, defer_cheap: bool = False) -> None:
        self.defer_cheap = defer_cheap
        self.only: set[int] | None = None
        self._open: list[Callable[[], None]] | None = None
        self._groups: dict[int, list[Callable[[], None]]] = {}

    @contextlib.contextmanager
    def collect(self, micro_batch: int):
        self._open = self._groups.setdefault(micro_batch, [])
        try:
            yield
        finally:
            self._open = None

    def deferring(self, cheap: bool = False) -> bool:
        """Whether weight-gradient work of this kind is deferred now."""
        return self._open is not None and (self.defer_cheap or not cheap)

    def defer(self, work: Callable[[], None], cheap: bool = False, weight: torch.Tensor | None = None) -> None:
        if self.deferring(cheap) and (self.only is None or weight is None or id(weight) in self.only):
            self._open.append(work)
        else:
            work()

    def defer_share(self, weights: list[torch.Tensor], share: float) -> None:
        """Defer only the dW of the last of `weights` (the split matmul weights in forward order,
        so the first in backward) that make up `share` of their elements (∝ their dW FLOPs);
        share 1 defers all."""
        if share >= 1.0:
            self.only = None
            return
        target, taken, chosen = share * sum(w.numel() for w in weights), 0, set()
        for w in reversed(weights):
            if taken >= target:
                break
            chosen.add(id(w))
            taken += w.numel()
        self.only = chosen

    def run(self, micro_batch: int) -> None:
        group = self._groups.pop(micro_batch, [])
        # Outside backward grad mode is on: without no_grad autograd would record each dW = gᵀ·x
        # (x is an activation that requires grad) and the .grad it accumulates into would keep
        # every micro-batch's x and g alive until the optimizer step clears the gradients.
        with torch.no_grad():
            while group:  # drop each closure (and the tensors it holds) as soon as it has run
                group.pop(0)()

    def flush(self) -> None:
        for micro_batch in sorted(self._groups):
            self.run(micro_batch)

    def pending(self) -> int:
        return sum(len(group) for group in self._groups.values())


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add `grad` to `param.grad` as autograd's AccumulateGrad would."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _linear_weight_grad(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.requires_grad:
        _accumulate(weight, g.reshape(-1, g.size(-1)).t().mm(x.reshape(-1, x.size(-1))))


def _bias_grad(g: torch.Tensor, bias: torch.Tensor) -> None:
    if bias.requires_grad:
        _accumulate(bias, g.reshape(-1, g.size(-1)).sum(0))


class _SplitLinear(torch.autograd.Function):
    """y = x·Wᵀ + b; backward returns dx = g·W and defers dW = gᵀ·x, db = Σ g."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)  # recomputed under activation checkpointing; weights are not
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        gx = g.matmul(ctx.weight) if ctx.needs_input_grad[0] else None
        if ctx.bias is not None:
            ctx.store.defer(functools.partial(_bias_grad, g, ctx.bias), cheap=True)
        ctx.store.defer(functools.partial(_linear_weight_grad, x, g, ctx.weight), weight=ctx.weight)
        return gx, None, None, None


class _SplitLayerNorm(torch.autograd.Function):
    """LayerNorm through aten's own kernels: B asks native_layer_norm_backward for dx only, W for
    dγ, dβ only, so both equal autograd's gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps, store):
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, mean, rstd)
        ctx.weight, ctx.bias, ctx.shape, ctx.store = weight, bias, shape, store
        return out

    @staticmethod
    def backward(ctx, g):
        x, mean, rstd = ctx.saved_tensors
        w, b, shape = ctx.weight, ctx.bias, ctx.shape
        if not ctx.store.deferring(cheap=True):  # all three in one call, as autograd does
            gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
                g, x, shape, mean, rstd, w, b, [ctx.needs_input_grad[0], w is not None, b is not None])
            if w is not None and w.requires_grad:
                _accumulate(w, gw)
            if b is not None and b.requires_grad:
                _accumulate(b, gb)
            return gx, None, None, None, None, None
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.ops.aten.native_layer_norm_backward(g, x, shape, mean, rstd, w, b, [True, False, False])[0]

        def weight_grad() -> None:
            _, gw, gb = torch.ops.aten.native_layer_norm_backward(
                g, x, shape, mean, rstd, w, b, [False, w is not None, b is not None])
            if w is not None and w.requires_grad:
                _accumulate(w, gw)
            if b is not None and b.requires_grad:
                _accumulate(b, gb)

        ctx.store.defer(weight_grad, cheap=True)
        return gx, None, None, None, None, None


class _SplitEmbedding(torch.autograd.Function):
    """Row lookup E[tokens]; the token ids have no gradient, so its whole backward is W."""

    @staticmethod
    def forward(ctx, tokens, weight, padding_idx, store):
        ctx.save_for_backward(tokens)
        ctx.weight, ctx.padding_idx, ctx.store = weight, padding_idx, store
        return F.embedding(tokens, weight, padding_idx=padding_idx)

    @staticmethod
    def backward(ctx, g):
        (tokens,) = ctx.saved_tensors
        weight, pad = ctx.weight, ctx.padding_idx

        def weight_grad() -> None:
            _accumulate(weight, torch.ops.aten.embedding_dense_backward(
                g, tokens, weight.size(0), -1 if pad is None else pad, False))

        ctx.store.defer(weight_grad, cheap=True)
        return None, None, None, None


class _SplitAffine(torch.autograd.Function):
    """y = x·w + b over the last dimension (TensorParallelLayerNorm's affine); W: dw = Σ g·x, db = Σ g."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return x * weight + bias

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        dims = tuple(range(g.dim() - 1))

        def weight_grad() -> None:
            _accumulate(weight, (g * x).sum(dims))
            _accumulate(bias, g.sum(dims))

        ctx.store.defer(weight_grad, cheap=True)
        return g * weight, None, None, None


class _SplitBias(torch.autograd.Function):
    """y = x + b (the bias a row-parallel linear adds after its all-reduce); W: db = Σ g."""

    @staticmethod
    def forward(ctx, x, bias, store):
        ctx.bias, ctx.store = bias, store
        return x + bias

    @staticmethod
    def backward(ctx, g):
        bias = ctx.bias
        ctx.store.defer(lambda: _accumulate(bias, g.sum(tuple(range(g.dim() - 1)))), cheap=True)
        return g, None, None


@torch.compiler.disable  # inside a compiled layer: a graph break, the split run as it is
def _linear_forward(module: nn.Linear, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    return _SplitLinear.apply(x, module.weight, module.bias, store)


def _layer_norm_forward(module: nn.LayerNorm, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    return _SplitLayerNorm.apply(x, module.weight, module.bias, list(module.normalized_shape), module.eps, store)


def _lookup(module: SharedEmbedding, store: WeightGradStore, tokens: torch.Tensor) -> torch.Tensor:
    """SharedEmbedding.lookup with its backward split (its forward is unchanged around it)."""
    return _SplitEmbedding.apply(tokens, module.weight, module.pad_id, store)


def _logits(module: SharedEmbedding, store: WeightGradStore, h: torch.Tensor) -> torch.Tensor:
    return _SplitLinear.apply(h, module.weight, None, store)


# megatron-core's tensor-parallel layers as parallel/tensor.py builds them: the same collectives
# around the same local matmuls as megatron's forward, with the matmuls split.

@torch.compiler.disable  # inside a compiled layer: a graph break, the split run as it is
def _column_forward(module: nn.Module, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    """ColumnParallelLinear: input copied to the region (all-reduce of dx in backward)."""
    from parallel.tensor import megatron

    x = megatron()[1].copy_to_tensor_model_parallel_region(x, group=module.tp_group)
    return _SplitLinear.apply(x, module.weight, module.bias, store)


@torch.compiler.disable  # inside a compiled layer: a graph break, the split run as it is
def _row_forward(module: nn.Module, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    """RowParallelLinear (input already split): local matmul, all-reduce, then the bias."""
    from parallel.tensor import megatron

    y = megatron()[1].reduce_from_tensor_model_parallel_region(
        _SplitLinear.apply(x, module.weight, None, store), group=module.tp_group)
    return y if module.bias is None else _SplitBias.apply(y, module.bias, store)


def _vocab_parallel_lookup(vocab: VocabParallelLookup, store: WeightGradStore, tokens: torch.Tensor) -> torch.Tensor:
    """VocabParallelLookup (megatron's masked local lookup + all-reduce) with the lookup split."""
    from parallel.tensor import megatron

    lookup = vocab.module
    outside = (tokens < lookup.vocab_start_index) | (tokens >= lookup.vocab_end_index)
    local = tokens.clone() - lookup.vocab_start_index
    local[outside] = 0
    rows = _SplitEmbedding.apply(local, lookup.weight, None, store)
    rows[outside, :] = 0.0
    return megatron()[1].reduce_from_tensor_model_parallel_region(rows, group=vocab.group)


def _vocab_parallel_logits(vocab: VocabParallelLookup, store: WeightGradStore, h: torch.Tensor) -> torch.Tensor:
    from parallel.tensor import megatron

    h = megatron()[1].copy_to_tensor_model_parallel_region(h, group=vocab.group)
    return _SplitLinear.apply(h, vocab.module.weight, None, store)


def _tp_layer_norm_forward(module: nn.Module, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    """TensorParallelLayerNorm.forward with its affine split."""
    from torch.distributed.nn.functional import all_reduce

    mean = all_reduce(x.sum(dim=-1, keepdim=True), group=module.group) / module.full_dim
    centred = x - mean
    var = all_reduce((centred * centred).sum(dim=-1, keepdim=True), group=module.group) / module.full_dim
    return _SplitAffine.apply(centred * torch.rsqrt(var + module.eps), module.weight, module.bias, store)


def split_weight_gradients(module: nn.Module, store: WeightGradStore) -> int:
    """Give every weight-bearing module under `module` a forward whose backward defers W to
    `store`; returns how many modules were split. Raises if a trainable parameter is left that
    no split covers (its gradient would still be computed in B, silently unsplit).

    LayerNorms keep their own forward unless the store defers the cheap gradients
    (`defer_cheap`): their affine gradients belong to B then, which autograd computes as it is,
    and inside a compiled layer they stay fused with the residual add (a split module is a graph
    break: `torch.compiler.disable` on the split linears, whose autograd functions hand work to
    the store, which no graph can hold)."""
    covered: set[int] = set()
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.forward = functools.partial(_linear_forward, sub, store)
        elif type(sub) is nn.LayerNorm and sub.elementwise_affine:
            if store.defer_cheap:  # otherwise autograd's own backward: its dγ, dβ are in B anyway
                sub.forward = functools.partial(_layer_norm_forward, sub, store)
        elif type(sub) is SharedEmbedding and isinstance(sub.lookup, VocabParallelLookup):
            vocab = sub.lookup
            sub.lookup = functools.partial(_vocab_parallel_lookup, vocab, store)
            sub.logits = functools.partial(_vocab_parallel_logits, vocab, store)
        elif type(sub) is SharedEmbedding:
            sub.lookup = functools.partial(_lookup, sub, store)
            sub.logits = functools.partial(_logits, sub, store)
        elif type(sub) is TensorParallelLayerNorm:
            if store.defer_cheap:
                sub.forward = functools.partial(_tp_layer_norm_forward, sub, store)
        elif "ColumnParallelLinear" in (bases := {c.__name__ for c in type(sub).__mro__}):
            sub.forward = functools.partial(_column_forward, sub, store)
        elif "RowParallelLinear" in bases:
            sub.forward = functools.partial(_row_forward, sub, store)
        else:
            continue
        covered.update(id(p) for p in sub.parameters(recurse=False))
        count += 1
    missing = [name for name, p in module.named_parameters() if p.requires_grad and id(p) not in covered]
    if missing:
        raise ValueError(f"a schedule with weight passes (parallel.schedule) cannot split the backward of "
                         f"{missing[:5]} ({len(missing)} parameters); use one whose order has none")
    return count


def matmul_weights(module: nn.Module) -> list[torch.Tensor]:
    """The weights of the linears (plain and tensor-parallel) under `module`, in module order:
    the dW that WeightGradStore defers by default, bar the tied output projection's."""
    return [sub.weight for sub in module.modules()
            if type(sub) is nn.Linear or {"ColumnParallelLinear", "RowParallelLinear"} & {c.__name__ for c in type(sub).__mro__}]

"""The zero-bubble pipeline schedule ZB-H1 (Qi et al., ICLR 2024, arXiv 2401.10241) on DeepSpeed.

1F1B's backward of a micro-batch does two things: B, the gradient of the stage's input, which the
previous stage waits for, and W, the gradients of the stage's weights, which nothing waits for
until the optimizer step. ZB-H1 runs B on the critical path and schedules W later, into the slots
where 1F1B idles at the end of a step. With F, B and W of equal cost its idle time per stage is
(p − 1) units against 1F1B's 3(p − 1) units, for the same in-flight activation count as 1F1B's
first stage (p micro-batches).

Three pieces, applied from outside the model:

* `split_weight_gradients(module, store)` gives every weight-bearing module of a built stage
  (nn.Linear, affine nn.LayerNorm, the shared embedding's lookup and its tied output projection) a
  replacement forward through an autograd Function whose backward returns the input gradient
  only and hands the weight-gradient computation, with the tensors it needs, to a
  `WeightGradStore`. The model's own code is unchanged: the replacement computes exactly what the
  original forward computes (tests/test_zero_bubble.py compares outputs bit for bit and gradients
  with autograd's).
* `ZeroBubbleH1Schedule`, a DeepSpeed `PipeSchedule` that adds one instruction, `WeightPass`.
* `ZeroBubbleEngine`, a `PipelineEngine` that runs each BackwardPass while the store collects the
  micro-batch's W work, runs it at WeightPass, and flushes whatever is left into `.grad` before
  the tied-weight and data-parallel gradient reductions and the optimizer step (so ZeRO-1, the
  global-norm clipping and the tied embedding see complete gradients).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch.nn.functional as F
from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from torch import nn

from model.layers import SharedEmbedding
from parallel.tensor import TensorParallelLayerNorm, VocabParallelLookup
from parallel.zb_timeline import simulate, zb_h1_order


# ---------------------------------------------------------------- deferred weight gradients


class WeightGradStore:
    """Weight-gradient work deferred by the split backward, grouped by micro-batch.

    Work is deferred only inside `collect(k)` (the engine's BackwardPass of micro-batch k); a
    backward anywhere else computes weight gradients at once, as plain autograd would.

    Only the matmul weight gradients (dW = gᵀ·x of linears and of the tied output projection) are
    deferred by default. The cheap ones (biases, LayerNorm affines, the embedding lookup) are
    computed inside B: deferring them would gain the schedule almost no time and hold each
    one's input and output gradient until W (a LayerNorm's are as large as a linear's).
    `defer_cheap=True` defers those too.
    """

    def __init__(self, defer_cheap: bool = False) -> None:
        self.defer_cheap = defer_cheap
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

    def defer(self, work: Callable[[], None], cheap: bool = False) -> None:
        if self.deferring(cheap):
            self._open.append(work)
        else:
            work()

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
        ctx.store.defer(functools.partial(_linear_weight_grad, x, g, ctx.weight))
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

def _column_forward(module: nn.Module, store: WeightGradStore, x: torch.Tensor) -> torch.Tensor:
    """ColumnParallelLinear: input copied to the region (all-reduce of dx in backward)."""
    from parallel.tensor import megatron

    x = megatron()[1].copy_to_tensor_model_parallel_region(x, group=module.tp_group)
    return _SplitLinear.apply(x, module.weight, module.bias, store)


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
    no split covers (its gradient would still be computed in B, silently unsplit)."""
    covered: set[int] = set()
    count = 0
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.forward = functools.partial(_linear_forward, sub, store)
        elif type(sub) is nn.LayerNorm and sub.elementwise_affine:
            sub.forward = functools.partial(_layer_norm_forward, sub, store)
        elif type(sub) is SharedEmbedding and isinstance(sub.lookup, VocabParallelLookup):
            vocab = sub.lookup
            sub.lookup = functools.partial(_vocab_parallel_lookup, vocab, store)
            sub.logits = functools.partial(_vocab_parallel_logits, vocab, store)
        elif type(sub) is SharedEmbedding:
            sub.lookup = functools.partial(_lookup, sub, store)
            sub.logits = functools.partial(_logits, sub, store)
        elif type(sub) is TensorParallelLayerNorm:
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
        raise ValueError(f"parallel.schedule=zb-h1 cannot split the backward of {missing[:5]} "
                         f"({len(missing)} parameters); use parallel.schedule: 1f1b")
    return count


# ---------------------------------------------------------------- the schedule


class WeightPass(ds_schedule.BufferOpInstruction):
    """Compute the deferred weight gradients of the micro-batch in `buffer_id` into `.grad`."""


def stage_instructions(stages: int, micro_batches: int, stage: int,
                       max_pending: int | None = None) -> list[list[ds_schedule.PipeInstruction]]:
    """DeepSpeed instructions of one stage for one training step of ZB-H1.

    Point-to-point transfers in DeepSpeed block until the peer takes part, so both ends of every
    link must meet their transfers in the same order. Each transfer gets the time at which the
    simulated schedule produces its data (the end of the sending F or B); both stages place it at
    that time in their stream, ahead of compute starting then, ties broken by one global key. All
    transfers then happen in one global order, which cannot deadlock.
    """
    p, m, s = stages, micro_batches, stage
    timeline = simulate(p, m, order=functools.partial(zb_h1_order, max_pending=max_pending))
    events: list[tuple[tuple, list]] = []
    for start, end, kind, j in timeline[s]:
        if kind == "F":
            load = [ds_schedule.LoadMicroBatch(j)] if s in (0, p - 1) else []
            events.append(((start, 1, 0, 0, j), load + [ds_schedule.ForwardPass(j)]))
            if s < p - 1:
                events.append(((end, 0, s, 0, j), [ds_schedule.SendActivation(j)]))
        elif kind == "B":
            events.append(((start, 1, 0, 0, j), [ds_schedule.BackwardPass(j)]))
            if s > 0:
                events.append(((end, 0, s - 1, 1, j), [ds_schedule.SendGrad(j)]))
        else:
            events.append(((start, 1, 0, 0, j), [WeightPass(j)]))
    if s > 0:  # activations from the previous stage, at the time it produced them
        for _, end, kind, j in timeline[s - 1]:
            if kind == "F":
                events.append(((end, 0, s - 1, 0, j), [ds_schedule.RecvActivation(j)]))
    if s < p - 1:  # gradients from the next stage
        for _, end, kind, j in timeline[s + 1]:
            if kind == "B":
                events.append(((end, 0, s, 1, j), [ds_schedule.RecvGrad(j)]))
    events.sort(key=lambda e: e[0])
    steps = [cmds for _, cmds in events]
    steps.append([ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()])
    return steps


class ZeroBubbleH1Schedule(ds_schedule.PipeSchedule):
    """ZB-H1 as a DeepSpeed schedule; buffer i holds micro-batch i. `max_pending` as in
    parallel/zb_timeline.py's zb_h1_order (None: the paper's order)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, max_pending: int | None = None):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.max_pending = max_pending

    def steps(self):
        yield from stage_instructions(self.stages, self.micro_batches, self.stage_id, self.max_pending)

    def num_pipe_buffers(self) -> int:
        return max(self.micro_batches, 2)


# ---------------------------------------------------------------- the engine


class ZeroBubbleEngine(PipelineEngine):
    """PipelineEngine running ZeroBubbleH1Schedule with B/W-split backward passes.

    Besides WeightPass, two pieces of DeepSpeed's per-engine state become per micro-batch, since
    ZB-H1 may receive other messages between a RecvGrad and its BackwardPass, or run another
    forward between the last stage's F and B: the received output gradient (DeepSpeed receives it
    into a buffer shared with the next receive) and the last stage's loss.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_grads = WeightGradStore()
        self.split_modules = split_weight_gradients(self.module, self.weight_grads)
        self._received_grads: dict[int, object] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []

    max_pending_w: int | None = 0
    """Bound on the W a stage keeps waiting (zb_h1_order's max_pending). 0 (default): every W
    right after its own B, so every stage holds at most its 1F1B memory (the W's tensors are
    fewer than its micro-batch's activations); None: the paper's order, stage s keeps s pending,
    which fills more of the bubble when the stages are balanced, at s micro-batches' W tensors
    more on stage s."""

    def _train_schedule(self):
        return ZeroBubbleH1Schedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id,
                                    max_pending=self.max_pending_w)

    def _exec_forward_pass(self, buffer_id):
        PipelineEngine._exec_forward_pass(self, buffer_id)
        if self.is_last_stage() and self.module.training:
            self._losses[buffer_id] = self.loss

    def _exec_recv_grads(self, buffer_id):
        PipelineEngine._exec_recv_grads(self, buffer_id)
        grad = self.grad_layer
        self._received_grads[buffer_id] = grad.clone() if torch.is_tensor(grad) else [g.clone() for g in grad]

    def _exec_backward_pass(self, buffer_id):
        if self.is_last_stage():
            self.loss = self._losses.pop(buffer_id)
        else:
            self.grad_layer = self._received_grads.pop(buffer_id)
        # The first stage sends no gradient, and its W follows its B at once in ZB-H1: deferring
        # would gain nothing and hold every layer's W tensors at the same time, so its backward
        # computes W inline (layer by layer, as 1F1B does).
        deferring = self.weight_grads.collect(buffer_id) if not self.is_first_stage() else contextlib.nullcontext()
        with deferring:
            PipelineEngine._exec_backward_pass(self, buffer_id)
        # DeepSpeed frees these when a buffer slot is reused (1F1B has 2 slots); here every
        # micro-batch has its own slot, so the last stage's logits and the first stage's tokens
        # are dropped now.
        if self.is_last_stage():
            self.pipe_buffers["outputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_weight_pass(self, buffer_id):
        self.weight_grads.run(buffer_id)

    @contextlib.contextmanager
    def _nonblocking_sends(self):
        """DeepSpeed's point-to-point send blocks until the peer receives (gloo and NCCL alike), so
        a stage that finished B would idle in SendGrad until the previous stage reaches its
        RecvGrad, instead of running its W. While a training send instruction runs, p2p.send
        posts an isend instead; the tensors are kept until the sends complete, which is waited
        for before the step's reductions. Receives stay blocking and every send is posted in the
        order of the blocking schedule, so the transfer order on each link is unchanged."""
        if not self.module.training:
            yield
            return
        blocking = ds_p2p.send

        def isend(tensor, dest_stage, async_op=False):
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]  # free what went
            work = ds_comm.isend(tensor, self.grid.stage_to_global(stage_id=dest_stage))
            self._sends.append((work, tensor))

        ds_p2p.send = isend
        try:
            yield
        finally:
            ds_p2p.send = blocking

    def _exec_send_activations(self, buffer_id):
        with self._nonblocking_sends():
            PipelineEngine._exec_send_activations(self, buffer_id)

    def _exec_send_grads(self, buffer_id):
        with self._nonblocking_sends():
            PipelineEngine._exec_send_grads(self, buffer_id)

    def _exec_reduce_tied_grads(self):
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self.weight_grads.flush()  # every W is in .grad before any reduction
        PipelineEngine._exec_reduce_tied_grads(self)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.RecvGrad: _exec_recv_grads,
        ds_schedule.SendActivation: _exec_send_activations,
        ds_schedule.SendGrad: _exec_send_grads,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        WeightPass: _exec_weight_pass,
    }


def initialize(module, optimizer, lr_scheduler, config: dict) -> ZeroBubbleEngine:
    """`deepspeed.initialize` for a PipelineModule, building a ZeroBubbleEngine (deepspeed 0.19.8
    hard-codes PipelineEngine there; these are the steps of its pipeline branch)."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.tensor_parallel.init_utils import merge_tp_model_init_into_config

    deepspeed.zero.partition_parameters.shutdown_init_context()
    merge_tp_model_init_into_config(config, None, None, dist)
    mpu = module.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, module)
    engine = ZeroBubbleEngine(args=None, model=module, optimizer=optimizer, model_parameters=None,
                              training_data=None, lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=None,
                              collate_fn=None, config=config, config_class=config_class)
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine

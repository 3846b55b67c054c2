"""The zero-bubble pipeline schedule ZB-H1 (Qi et al., ICLR 2024, arXiv 2401.10241) on DeepSpeed.

1F1B's backward of a micro-batch does two things: B, the gradient of the stage's input, which the
previous stage waits for, and W, the gradients of the stage's weights, which nothing waits for
until the optimizer step. ZB-H1 runs B on the critical path and schedules W later, into the slots
where 1F1B idles at the end of a step. With F, B and W of equal cost its idle time per stage is
(p − 1) units against 1F1B's 3(p − 1) units, for the same in-flight activation count as 1F1B's
first stage (p micro-batches).

Three pieces, applied from outside the model:

* `split_weight_gradients(module, store)` (parallel/weight_split.py) gives every weight-bearing
  module of a built stage a forward whose backward returns the input gradient only and hands the
  weight-gradient work to a `WeightGradStore` (parallel/parallelize.py applies it for a schedule
  that `splits_backward`, parallel/schedules.py).
* `ZeroBubbleH1Schedule`, a DeepSpeed `PipeSchedule` that adds one instruction, `WeightPass`.
* `ZeroBubbleEngine`, a `PipelineEngine` that runs each BackwardPass while the store collects the
  micro-batch's W work, runs it at WeightPass, and flushes whatever is left into `.grad` before
  the tied-weight and data-parallel gradient reductions and the optimizer step (so ZeRO-1, the
  global-norm clipping and the tied embedding see complete gradients).

Every precision accumulates through the trainer's optimizer (parallel/optimizer.py FlatOptimizer):
after each backward it folds the gradients in `.grad` into its fp32 buffer and frees them; the
engine folds again after each WeightPass and after the final flush (`fold_lp_grads`), so every
micro-batch's W is added to the fp32 sum on its own, in micro-batch order, as 1F1B adds each
micro-batch's whole gradient: bf16 and fp16 give 1F1B's sums. (Left in `.grad` until the next
backward, a W would meet that micro-batch's gradient there and be added to it in bf16 first.)

The output projection's weight gradient is computed inside the chunked loss's forward and reaches
the tied embedding in the last layer's backward (parallel/loss.py): it is part of F and B, never
deferred; `weight_split`'s split of `SharedEmbedding.logits` serves only callers of `logits`.

The order of F, B and W on each stage is tuned to the model (parallel/zb_timeline.py's
`tuned_schedule`): the first training step runs the paper's order; the engine times each stage's
F, B and W in its second step, every rank takes the same per-stage means (one all-reduce), and
from the third step on each stage runs the candidate that finishes soonest at those costs, the
one holding the least memory among those within 0.5% of it. Where W is cheaper than F and B (on
CPUs W is 0.3–0.45 of F + B, not the paper's ½) that is a filled order (zb_timeline.filled_order):
the first stage too keeps a W pending, and every stage but the last runs its pending W while it
waits for a gradient in the cooldown; the first stage's pending W may be a share of its matmuls'
dW (the last layers'), the rest computed inside B, which fills its wait for less memory.
"""
from __future__ import annotations

import contextlib
import time

import torch
from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe import p2p as ds_p2p
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from parallel.engine import TrainerEngine
from parallel.weight_split import matmul_weights
from parallel.zb_timeline import fixed, simulate, tuned_schedule
from runtime import accelerator

# ---------------------------------------------------------------- the schedule


class WeightPass(ds_schedule.BufferOpInstruction):
    """Compute the deferred weight gradients of the micro-batch in `buffer_id` into `.grad`."""


def stage_instructions(stages: int, micro_batches: int, stage: int, orders: list[list[tuple[str, int]]] | None = None,
                       cost: list[dict[str, float]] | None = None) -> list[list[ds_schedule.PipeInstruction]]:
    """DeepSpeed instructions of one stage for one training step of ZB-H1, running `orders` (per
    stage, as zb_timeline's; default: the paper's) timed at `cost` (default: unit costs).

    Point-to-point transfers in DeepSpeed block until the peer takes part, so both ends of every
    link must meet their transfers in the same order. Each transfer gets the time at which the
    simulated schedule produces its data (the end of the sending F or B); both stages place it at
    that time in their stream, ahead of compute starting then, ties broken by one global key. All
    transfers then happen in one global order, which cannot deadlock.
    """
    p, m, s = stages, micro_batches, stage
    timeline = simulate(p, m, cost, fixed(orders or tuned_schedule(p, m)[0]))
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
    """ZB-H1 as a DeepSpeed schedule; buffer i holds micro-batch i. `orders` and `cost` as in
    stage_instructions."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int,
                 orders: list[list[tuple[str, int]]] | None = None, cost: list[dict[str, float]] | None = None):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.orders, self.cost = orders, cost
        self._steps: list[list[ds_schedule.PipeInstruction]] | None = None

    def steps(self):
        if self._steps is None:  # built once: the engine runs the same schedule every step until it retunes
            self._steps = stage_instructions(self.stages, self.micro_batches, self.stage_id, self.orders, self.cost)
        yield from self._steps

    def num_pipe_buffers(self) -> int:
        return max(self.micro_batches, 2)


# ---------------------------------------------------------------- the engine


class ZeroBubbleEngine(TrainerEngine):
    """The trainer's PipelineEngine (parallel/engine.py) running ZeroBubbleH1Schedule with B/W-split backward passes.

    Besides WeightPass, two pieces of DeepSpeed's per-engine state become per micro-batch, since
    ZB-H1 may receive other messages between a RecvGrad and its BackwardPass, or run another
    forward between the last stage's F and B: the received output gradient (DeepSpeed receives it
    into a buffer shared with the next receive) and the last stage's loss.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.flat_optimizer and (self.bfloat16_enabled() or self.fp16_enabled()):
            raise ValueError("parallel.schedule=zb-h1 in bf16/fp16 needs the trainer's optimizer (FlatOptimizer): "
                             "DeepSpeed's own copies gradients after each backward, before a deferred W exists")
        split = getattr(self.module, "weight_split", None)
        if split is None:
            raise ValueError("ZeroBubbleEngine runs a stage whose weight gradients are split: build it with "
                             "parallel/parallelize.py (parallel.schedule: zb-h1)")
        self.weight_grads, self.split_modules = split  # the store and the split modules (parallelize, step 4)
        self._matmul_weights = matmul_weights(self.module)
        self._received_grads: dict[int, object] = {}
        self._losses: dict[int, torch.Tensor] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []
        self.zb_cost: list[dict[str, float]] | None = None
        """Per-stage mean seconds of F, B and W per micro-batch measured at `tune_step` (None before)."""
        self._schedule: tuple | None = None  # (key, orders, share, whether this stage defers W, schedule)
        self._timings: dict[str, float] | None = None
        self._split_backward = not self.is_first_stage()
        self._deferred_share = 1.0  # what the store was last told to defer (the first stage)
        self._train_batches = 0

    max_pending_w: int | None = 0
    """Bound on the W a stage keeps waiting (zb_timeline's `max_pending`). 0 (default): every W
    right after its own B, so every stage holds at most its 1F1B memory (the W's tensors are
    fewer than its micro-batch's activations); None: no bound beyond the orders' own (the paper's
    s pending on stage s, or s + 1 in the filled order), which fills more of the
    bubble, at that many micro-batches' W tensors more on a stage."""

    tune_step: int = 2
    """The training step (counted from this engine's first) whose F, B and W times choose the
    order; the first step warms up. 0: never tune (the paper's order capped at max_pending_w)."""

    def _tuned(self) -> tuple:
        """(key, orders, share, defers, schedule), rebuilt only when the costs, the bound or the
        micro-batch count change."""
        key = (self.micro_batches, self.max_pending_w, repr(self.zb_cost))
        if self._schedule is None or self._schedule[0] != key:
            orders, share = tuned_schedule(self.num_stages, self.micro_batches, self.zb_cost, self.max_pending_w)
            mine = orders[self.stage_id]
            defers = any(kind == "B" and mine[i + 1:i + 2] != [("W", j)] for i, (kind, j) in enumerate(mine))
            schedule = ZeroBubbleH1Schedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                            stage_id=self.stage_id, orders=orders, cost=self.zb_cost)
            self._schedule = key, orders, share, defers, schedule
        return self._schedule

    @property
    def zb_orders(self) -> list[list[tuple[str, int]]]:
        """Every stage's order of F, B and W for a training step (the same on every rank)."""
        return self._tuned()[1]

    @property
    def zb_share(self) -> float:
        """The share of its W (by matmul size) the first stage defers when its order defers any;
        the rest it computes inside B."""
        return self._tuned()[2]

    def _train_schedule(self):
        _, _, share, defers, schedule = self._tuned()
        timing = self._timings is not None
        # The first stage sends no gradient: split only when its order defers a W, or to time B and
        # W apart; otherwise its backward computes W inline (layer by layer, as 1F1B does) and
        # never holds every layer's W tensors at once. When its order defers, only `share` of its
        # W (the last layers' matmuls) waits; all of it while timing.
        self._split_backward = not self.is_first_stage() or defers or timing
        if self.is_first_stage() and (1.0 if timing else share) != self._deferred_share:
            self._deferred_share = 1.0 if timing else share
            self.weight_grads.defer_share(self._matmul_weights, self._deferred_share)
        return schedule

    def train_batch(self, data_iter=None):
        self._train_batches += 1
        tuning = self._train_batches == self.tune_step and self.max_pending_w != 0 and self.num_stages > 1
        stop_timing = None
        if tuning:
            self._timings = {"F": 0.0, "B": 0.0, "W": 0.0}
            stop_timing = self.observe(self._timed)
        try:
            loss = super().train_batch(data_iter)
        finally:
            timings, self._timings = self._timings, None
            if stop_timing is not None:
                stop_timing()
        if tuning:
            self._tune(timings)
        return loss

    def _tune(self, timings: dict[str, float]) -> None:
        """Every rank's stage F, B, W seconds per micro-batch, averaged per stage over the ranks
        that run it (one all-reduce over all ranks; rank 0's result broadcast so that every rank
        builds its order from the same bits)."""
        rows = torch.zeros(self.num_stages, 3, dtype=torch.float64, device=self.device)
        rows[self.stage_id] = torch.tensor([timings[k] / self.micro_batches for k in "FBW"], dtype=torch.float64)
        ds_comm.all_reduce(rows)
        ds_comm.broadcast(rows, src=0)
        rows /= ds_comm.get_world_size() // self.num_stages
        self.zb_cost = [dict(zip("FBW", row)) for row in rows.tolist()]

    _PHASES = {"ForwardPass": "F", "BackwardPass": "B", "WeightPass": "W"}

    @contextlib.contextmanager
    def _timed(self, name: str, kwargs: dict):
        """The seconds of each F, B and W instruction of the tuning step (an `observe` hook)."""
        kind = self._PHASES.get(name)
        if kind is None:
            yield
            return
        clock = time.process_time if accelerator.on_host() else time.perf_counter
        accelerator.synchronize()
        start = clock()
        yield
        accelerator.synchronize()
        self._timings[kind] += clock() - start

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
        deferring = self.weight_grads.collect(buffer_id) if self._split_backward else contextlib.nullcontext()
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
        self._fold()

    def _fold(self) -> None:
        """The W just written to `.grad` into the optimizer's fp32 buffer (module docstring)."""
        if self.flat_optimizer:
            self.optimizer.fold_lp_grads()

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
            TrainerEngine._exec_send_activations(self, buffer_id)  # this trainer's sends (parallel/pipe_io.py)

    def _exec_send_grads(self, buffer_id):
        with self._nonblocking_sends():
            PipelineEngine._exec_send_grads(self, buffer_id)

    def _exec_reduce_tied_grads(self):
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        left = self.weight_grads.pending()
        self.weight_grads.flush()  # every W is in .grad, and folded, before any reduction
        if left:
            self._fold()
        PipelineEngine._exec_reduce_tied_grads(self)

    _INSTRUCTION_MAP = {
        **TrainerEngine._INSTRUCTION_MAP,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.RecvGrad: _exec_recv_grads,
        ds_schedule.SendActivation: _exec_send_activations,
        ds_schedule.SendGrad: _exec_send_grads,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        WeightPass: _exec_weight_pass,
    }

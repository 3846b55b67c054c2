"""The engine every pipeline schedule runs on: the trainer's PipelineEngine (parallel/engine.py
`TrainerEngine`) executing the DeepSpeed instruction stream that parallel/pipe_schedule.py generates
from the schedule's per-stage orders (parallel/schedules.py, parallel/zb_timeline.py): schedules
differ only in their orders.

What it adds to DeepSpeed's engine, all of it needed by some order and harmless to the others:

* `_train_schedule` (DeepSpeed's hard-codes TrainSchedule) returns the generated `OrderSchedule`
  of the orders the schedule chooses at the costs measured so far (`Schedule.choose`).
* A split backward: `BackwardPass(split=True)` runs B, the gradient of the stage's input, while the
  stage's weight-gradient store (parallel/weight_split.py; `parallelize` splits every
  weight-bearing module for a schedule whose orders have W) collects the micro-batch's W work,
  which `WeightPass` runs later; an unsplit `BackwardPass` is DeepSpeed's. Whatever W is left is
  flushed into `.grad` before the tied-weight and data-parallel reductions and the optimizer step,
  so ZeRO-1, the global-norm clipping and the tied embedding see complete gradients.
* Per micro-batch state: DeepSpeed keeps one received output gradient (its receive buffer, shared
  with the next receive) and one last-stage loss, enough for TrainSchedule, where each RecvGrad is
  followed by its BackwardPass and each last-stage forward by its backward. An order may receive
  another gradient first (it is then copied out of the shared buffer) or run another forward.
* Non-blocking sends (`isend`, waited for before the reductions), so a stage that finished B runs
  its W or its next forward instead of blocking until the peer receives.
* Tuning: for a schedule offering several orders (ZB-H1's candidates within
  `parallel.zb_max_pending_w`), the engine times every stage's F, B and W in its second step, one
  all-reduce gives every rank the same per-stage means, and from the third step on each stage runs
  the candidate that the simulation finishes soonest at those costs, among those within 0.5% of
  the soonest the one holding the least memory. Where W is cheaper than F and B (on CPUs W is
  0.3-0.45 of F + B) that is a filled order (zb_timeline.filled_order), whose first stage may defer
  a share of its matmuls' dW (the last layers'), the rest computed inside B.

Every precision accumulates through the trainer's optimizer (parallel/optimizer.py FlatOptimizer):
after each backward it folds the gradients in `.grad` into its fp32 buffer and frees them; the
engine folds again after each WeightPass and after the final flush (`fold_lp_grads`), so every
micro-batch's W is added to the fp32 sum on its own, in the order of the W, as 1F1B adds each
micro-batch's whole gradient: with W in micro-batch order bf16 and fp16 give 1F1B's sums. (Left in
`.grad` until the next backward, a W would meet that micro-batch's gradient there and be added to
it in bf16 first.) The output projection's weight gradient is computed inside the chunked loss's
forward and reaches the tied embedding in the last layer's backward (parallel/loss.py): it is part
of F and B, never deferred.
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
from parallel.pipe_schedule import OrderSchedule, WeightPass, fused
from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES, Schedule
from parallel.weight_split import matmul_weights
from runtime import accelerator


class ScheduleEngine(TrainerEngine):
    """TrainerEngine running the schedule's generated instruction stream (module docstring)."""

    schedule: Schedule = SCHEDULES[DEFAULT_SCHEDULE]
    """The schedule it runs (parallelize sets it from parallel.schedule)."""

    max_pending_w: int | None = 0
    """Bound on the W a stage keeps waiting, for a schedule with pending bounds (zb_timeline's
    `max_pending`; parallel.zb_max_pending_w, None for -1). 0 (default): every W right after its own
    B, so every stage holds at most its 1F1B memory (the W's tensors are fewer than its
    micro-batch's activations); None: no bound beyond the orders' own."""

    tune_step: int = 2
    """The training step (counted from this engine's first) whose F, B and W times choose among the
    schedule's orders; the first step warms up. 0: never tune (the first candidate)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        split = getattr(self.module, "weight_split", None)
        # the store and the split modules (parallelize, step 4), for a schedule whose orders have W
        self.weight_grads, self.split_modules = split if split is not None else (None, 0)
        self._matmul_weights = matmul_weights(self.module) if split is not None else []
        self._received_grads: dict[int, object] = {}
        self._shared_grads: set[int] = set()  # received grads still in DeepSpeed's receive buffer
        self._losses: dict[int, torch.Tensor] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []
        self.measured_costs: list[dict[str, float]] | None = None
        """Per-stage mean seconds of F, B and W per micro-batch measured at `tune_step` (None before)."""
        self._built: tuple | None = None  # (key, orders, share, whether the first stage defers W, schedule)
        self._timings: dict[str, float] | None = None
        self._deferred_share = 1.0  # what the store was last told to defer (the first stage)
        self._train_batches = 0

    def _plan(self) -> tuple:
        """(key, orders, share, defers, OrderSchedule), rebuilt only when the schedule, the costs,
        the bound, the micro-batch count or timing change."""
        timing = self._timings is not None
        key = (self.schedule.name, self.micro_batches, self.max_pending_w, repr(self.measured_costs), timing)
        if self._built is None or self._built[0] != key:
            if self.schedule.splits_backward:
                if self.weight_grads is None:
                    raise ValueError(f"parallel.schedule={self.schedule.name} defers weight gradients: build the stage "
                                     "with parallel/parallelize.py, which splits them")
                if not self.flat_optimizer and self.module.precision.low:
                    raise ValueError(f"parallel.schedule={self.schedule.name} in {self.module.precision.name} needs the trainer's "
                                     "optimizer (FlatOptimizer): DeepSpeed's own copies gradients after each backward, "
                                     "before a deferred W exists")
            orders, share, _ = self.schedule.choose(self.num_stages, self.micro_batches, self.measured_costs,
                                                    self.max_pending_w)
            # The first stage sends no gradient: the generator makes its B + own W one unsplit
            # backward (layer by layer, as 1F1B does, never holding every layer's W tensors), unless
            # the engine times B and W apart.
            defers = any(kind == "B" for kind, _ in (orders[0] if timing else fused(orders[0])))
            schedule = OrderSchedule(orders, self.stage_id, self.measured_costs, fuse=not timing)
            self._built = key, orders, share, defers, schedule
        return self._built

    @property
    def orders(self) -> list[list[tuple[str, int]]]:
        """Every stage's order of F, B, W and BW for a training step (the same on every rank)."""
        return self._plan()[1]

    @property
    def deferred_share(self) -> float:
        """The share of its W (by matmul size) the first stage defers when its order defers any;
        the rest it computes inside B."""
        return self._plan()[2]

    def _train_schedule(self):
        _, _, share, defers, schedule = self._plan()
        if self.is_first_stage() and self.weight_grads is not None:
            # When its order defers, only `share` of its W (the last layers' matmuls) waits; all of it while timing.
            want = 1.0 if self._timings is not None or not defers else share
            if want != self._deferred_share:
                self._deferred_share = want
                self.weight_grads.defer_share(self._matmul_weights, want)
        return schedule

    def train_batch(self, data_iter=None):
        self._train_batches += 1
        tuning = (self._train_batches == self.tune_step and self.num_stages > 1
                  and self.schedule.tunes(self.num_stages, self.micro_batches, self.max_pending_w))
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
        self.measured_costs = [dict(zip("FBW", row)) for row in rows.tolist()]

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
        # DeepSpeed receives into one buffer (dynamic shapes: views of `_grad_layer_buf`): a gradient
        # still waiting for its backward is copied out before this receive overwrites it. Orders
        # that run each backward right after its receive (1F1B) copy nothing.
        for key in self._shared_grads:
            grad = self._received_grads[key]
            self._received_grads[key] = grad.clone() if torch.is_tensor(grad) else [g.clone() for g in grad]
        self._shared_grads.clear()
        PipelineEngine._exec_recv_grads(self, buffer_id)
        self._received_grads[buffer_id] = self.grad_layer
        self._shared_grads.add(buffer_id)

    def _exec_backward_pass(self, buffer_id, split: bool = False):
        """DeepSpeed's backward of the micro-batch in `buffer_id`; `split`: B only, its W collected
        for a later WeightPass."""
        if self.is_last_stage():
            self.loss = self._losses.pop(buffer_id)
        else:
            self.grad_layer = self._received_grads.pop(buffer_id)
            self._shared_grads.discard(buffer_id)
        deferring = self.weight_grads.collect(buffer_id) if split else contextlib.nullcontext()
        with deferring:
            PipelineEngine._exec_backward_pass(self, buffer_id)
        # DeepSpeed frees these when a buffer slot is reused; a slot here is reused only after the
        # micro-batch is done, so the last stage's decoder stream and labels and the first stage's
        # tokens are dropped now.
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
        if self.weight_grads is not None and self.weight_grads.pending():
            self.weight_grads.flush()  # every W is in .grad, and folded, before any reduction
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

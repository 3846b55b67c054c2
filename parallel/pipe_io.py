"""Moving micro-batches into and between stages without waiting for the device.

DeepSpeed's pipeline engine (0.19.8 runtime/pipe/engine.py) does three things per micro-batch
that make the host wait for the device:
- `_exec_load_micro_batch` clones each input on the host and copies it from pageable memory (a
  synchronous copy on GPUs);
- with `dynamic_shape` (this pipeline's micro-batches change shape), every activation send is
  preceded by its shape metadata, which the receiver reads back with `.item()` / `.tolist()`
  (eight reads per micro-batch at pp = 2), then receives into a buffer it clones.

Every rank of this trainer builds the same batch stream (trainer/trainer.py), so each stage can
know every message's shape without being told: before a step the trainer hands the engine the
shapes of the step's micro-batches (`expect`), the pipeline module turns them into the message's
(shape, dtype) list (parallel/pipeline.py `TranslationPipe.message_layout`), and sends and
receives go straight into tensors of those shapes, in micro-batch order (every schedule receives
a stage's activations in that order). Inputs arrive pinned (the trainer pins them on GPUs) and
are copied without blocking. When the engine was told nothing (a caller that drives it
directly), DeepSpeed's own instructions run.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine


class MessageIO:
    """Mixed into the trainer's PipelineEngine (parallel/ds_engine.py)."""

    _expected: Iterator[list[tuple[tuple[int, ...], torch.dtype]]] | None = None

    def expect(self, shapes: list[tuple[torch.Size, torch.Size]] | None) -> None:
        """The (source, target input) shapes of the micro-batches the next train_batch or
        eval_batch runs, in order (for that call only); None: learn them from the sender
        (DeepSpeed's way)."""
        layout = getattr(self.module, "message_layout", None)
        self._expected = None if shapes is None or layout is None else iter([layout(*s) for s in shapes])

    def train_batch(self, *args, **kwargs):
        try:
            return super().train_batch(*args, **kwargs)
        finally:
            self._expected = None  # told for one batch only

    def eval_batch(self, *args, **kwargs):
        try:
            return super().eval_batch(*args, **kwargs)
        finally:
            self._expected = None

    def _exec_load_micro_batch(self, buffer_id):
        if self._expected is None:
            return super()._exec_load_micro_batch(buffer_id)
        batch = self._next_batch()
        if self.is_first_stage():
            self.pipe_buffers["inputs"][buffer_id] = tuple(x.to(self.device, non_blocking=True) for x in batch[0])
        if self.is_last_stage():
            self.pipe_buffers["labels"][buffer_id] = tuple(x.to(self.device, non_blocking=True) for x in batch[1])

    def _exec_send_activations(self, buffer_id):
        if self._expected is None:
            return super()._exec_send_activations(buffer_id)
        for tensor in self.pipe_buffers["outputs"][buffer_id]:
            p2p.send(tensor, self.next_stage)

    def _exec_recv_activations(self, buffer_id):
        if self._expected is None:
            return super()._exec_recv_activations(buffer_id)
        received = []
        for shape, dtype in next(self._expected):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            p2p.recv(tensor, self.prev_stage)
            tensor.requires_grad = tensor.is_floating_point()
            received.append(tensor)
        self.pipe_buffers["inputs"][buffer_id] = tuple(received)


# The engine dispatches instructions through this class-level table, not by method lookup, so an
# override takes effect only through it.
MessageIO._INSTRUCTION_MAP = {
    **PipelineEngine._INSTRUCTION_MAP,
    schedule.LoadMicroBatch: MessageIO._exec_load_micro_batch,
    schedule.SendActivation: MessageIO._exec_send_activations,
    schedule.RecvActivation: MessageIO._exec_recv_activations,
}

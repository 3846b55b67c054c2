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

What a stage sends must be what was announced: the receiver allocates the announced shapes and
dtype, and the transfer itself compares nothing. Without a check, on gloo, a stage whose message
was bfloat16 while its parameters (and so the announcement) were float32 completed the step with
the bytes received into the float32 buffer, and a micro-batch announced one token longer than sent
failed only later, in the last stage's loss; NCCL does not match a send's size with its receive's
either. So each send compares its tensors' shapes and dtypes with the announcement
(`check_message`: host metadata only, no device work, no sync) and raises one ValueError naming the
micro-batch, the announced and the sent (shape, dtype) lists. Every rank is told the same shapes
(the trainer's ranks build the same batch stream), so the sender's check covers the receiver.
"""
from __future__ import annotations

import torch
from deepspeed.runtime.pipe import p2p, schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from schema.text import count

Layout = list[tuple[tuple[int, ...], torch.dtype]]
"""A stage message's (shape, dtype) per tensor."""


def _describe(layout: Layout) -> str:
    return "[" + ", ".join(f"{tuple(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in layout) + "]"


def check_message(announced: list[Layout], index: int, tensors, stage: int) -> None:
    """Raise ValueError when `tensors`, stage `stage`'s message of micro-batch `index` (counted
    from 0 in the step), differ in number, shape or dtype from `announced[index]`. Reads the
    tensors' metadata on the host only: no operation reaches the device."""
    actual = [(tuple(t.shape), t.dtype) for t in tensors]
    if index < len(announced) and actual == announced[index]:
        return
    expected = _describe(announced[index]) if index < len(announced) else f"nothing ({count(len(announced), 'micro-batch', 'micro-batches')})"
    raise ValueError(f"pipeline stage {stage} sends micro-batch {index} as {_describe(actual)}, but {expected} was "
                     "announced (engine.expect and the module's message_layout); the next stage receives into "
                     "the announced shapes and dtypes")


class MessageIO:
    """Mixed into the trainer's PipelineEngine (parallel/engine.py)."""

    _expected: list[Layout] | None = None
    _received = 0  # micro-batches of the announced step received so far
    _sent = 0

    def expect(self, shapes: list[tuple[torch.Size, torch.Size]] | None) -> None:
        """The (source, target input) shapes of the micro-batches the next train_batch or
        eval_batch runs, in order (for that call only); None: learn them from the sender
        (DeepSpeed's way)."""
        layout = getattr(self.module, "message_layout", None)
        self._expected = (None if shapes is None or layout is None
                          else [[(tuple(shape), dtype) for shape, dtype in layout(*s)] for s in shapes])
        self._received = self._sent = 0

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
        outputs = self.pipe_buffers["outputs"][buffer_id]
        check_message(self._expected, self._sent, outputs, self.stage_id)
        self._sent += 1
        for tensor in outputs:
            p2p.send(tensor, self.next_stage)

    def _exec_recv_activations(self, buffer_id):
        if self._expected is None:
            return super()._exec_recv_activations(buffer_id)
        received = []
        layout = self._expected[self._received]
        self._received += 1
        for shape, dtype in layout:
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

"""Recording a timeline of chosen training steps on every rank, on one clock for all ranks.

`StepTracer` watches the pipeline engine through `TrainerEngine.observe` (the one way to watch the
schedule) only while a traced step runs: it registers its hook when the step begins and removes it
when the step ends, so an untraced step dispatches exactly as without a tracer (no hook is called,
nothing is recorded: `calls` counts the hook's calls, and the tests count them). Each instruction
becomes a span: a forward (F), an input-gradient backward (B), a weight-gradient pass (W) or an
unsplit backward (BW) with its micro-batch and the stage's layers; each send and receive (a
receive's span is its wait: it blocks until the peer's message is there); the loads, the
tied-embedding and data-parallel reductions and the optimizer step. The trainer adds host spans
(the data loader, the step).

Clocks. On the host a span is `time.perf_counter_ns()` at the hook's entry and exit. On a GPU it is
a pair of CUDA events recorded on the current stream, so the span is the device's time, and the
step gets no host sync: the events are read once, after the step (`end`), against a reference event
recorded on an idle stream before it. Ranks of one node share the monotonic clock, ranks of
different nodes do not, so each rank's offset to rank 0's clock is measured over the process group
before the first traced step (`clock_offsets`, an NTP-style ping-pong: the round trip with the
least delay bounds the offset to ± half its delay) and again after the last one (the drift).

Micro-batches. DeepSpeed's instructions name a pipeline buffer, not a micro-batch (1F1B reuses
min(p − s, m) buffers); every schedule runs a stage's forwards in micro-batch order (the data
iterator and the previous stage's sends are in that order), so the k-th forward is micro-batch k,
and every later instruction on its buffer (backward, weight pass, sends, the receive of its output
gradient) belongs to it until the next forward reuses the buffer; a load or a receive of
activations belongs to the forward that follows on its buffer.
"""
from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable

import torch

from runtime import accelerator

INSTRUCTIONS: dict[str, tuple[str, str]] = {
    "ForwardPass": ("compute", "F"), "BackwardPass": ("compute", "B"), "WeightPass": ("compute", "W"),
    "SendActivation": ("send", "send activation"), "SendGrad": ("send", "send gradient"),
    "RecvActivation": ("recv", "receive activation"), "RecvGrad": ("recv", "receive gradient"),
    "LoadMicroBatch": ("load", "load"), "ReduceTiedGrads": ("reduce", "tied-embedding all-reduce"),
    "ReduceGrads": ("reduce", "data-parallel all-reduce"), "OptimizerStep": ("optimizer", "optimizer step"),
}
"""Instruction class name → (category, label). Categories: compute, send, recv (a wait), load,
reduce, optimizer; the trainer's host spans add data and step."""

Span = tuple[str, str, "int | None", int, int]
"""(label, category, micro-batch or None, start ns, end ns) on rank 0's clock."""


class HostClock:
    """Spans timed on the host: what a CPU rank computes is done when its call returns."""

    device = False

    def __init__(self, now: Callable[[], int]):
        self.mark = now

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass

    @staticmethod
    def ns(mark: int) -> int:
        return mark


class DeviceClock:
    """Spans timed by device events on the current stream: nothing in the step waits for them."""

    device = True

    def __init__(self, now: Callable[[], int]):
        self.now = now

    def begin(self) -> None:
        accelerator.synchronize()  # before the step: the stream is idle, so the reference runs now
        self.reference = accelerator.timing_event()
        self.reference.record()
        self.reference_ns = self.now()

    @staticmethod
    def mark():
        event = accelerator.timing_event()
        event.record()
        return event

    def finish(self) -> None:
        accelerator.synchronize()  # after the step: every event has happened

    def ns(self, mark) -> int:
        return self.reference_ns + round(self.reference.elapsed_time(mark) * 1e6)  # elapsed_time: ms


def clock_offsets(rounds: int = 5, now: Callable[[], int] = time.perf_counter_ns) -> tuple[int, int]:
    """(offset, uncertainty) in ns of this rank's clock `now` to rank 0's: rank 0 exchanges `rounds`
    round trips with each other rank in turn (t1 sent, t2 received there, t3 sent back, t4
    received); offset = ((t2 − t1) + (t3 − t4)) / 2 of the round trip with the least delay
    (t4 − t1) − (t3 − t2), which bounds the true offset to ± delay / 2 (the uncertainty). A
    collective: every rank calls it. Rank 0 gets (0, 0)."""
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    device = accelerator.device()
    result = torch.zeros(2, dtype=torch.int64, device=device)
    for peer in range(1, world):
        if rank == 0:
            samples = []
            for _ in range(rounds):
                stamp = torch.zeros(2, dtype=torch.int64, device=device)
                t1 = now()
                dist.send(stamp, peer)
                dist.recv(stamp, peer)
                accelerator.synchronize()
                t4 = now()
                t2, t3 = stamp.tolist()
                samples.append((((t2 - t1) + (t3 - t4)) // 2, (t4 - t1) - (t3 - t2)))
            offset, delay = min(samples, key=lambda s: s[1])
            dist.send(torch.tensor([offset, max(delay, 0) // 2 + 1], dtype=torch.int64, device=device), peer)
        elif rank == peer:
            for _ in range(rounds):
                stamp = torch.zeros(2, dtype=torch.int64, device=device)
                dist.recv(stamp, 0)
                accelerator.synchronize()
                t2 = now()
                stamp = torch.tensor([t2, now()], dtype=torch.int64).to(device)
                dist.send(stamp, 0)
            dist.recv(result, 0)
    offset, uncertainty = result.tolist()
    return offset, uncertainty


class StepTracer:
    """Records the spans of the steps in `steps` on this rank (module docstring). The trainer calls
    `begin(step)` before a traced step and `end()` after it; `records()` gathers every rank's."""

    def __init__(self, engine, steps: Iterable[int], layout, now: Callable[[], int] = time.perf_counter_ns):
        self.engine, self.layout, self.now = engine, layout, now
        self.steps = sorted(set(steps))
        self.clock = HostClock(now) if accelerator.on_host() else DeviceClock(now)
        self.recorded: dict[int, list[Span]] = {}
        self.calls = 0
        """Hook calls: one per instruction of a traced step, none otherwise."""
        self.offsets: list[tuple[int, int]] = []  # (offset, uncertainty) before the first and after the last step
        self._raw: list | None = None
        self._host: list[Span] = []
        self._step: int | None = None
        self._remove: Callable[[], None] | None = None

    def wants(self, step: int) -> bool:
        """Whether `step` (counted from 1: the step that makes the trainer's step count `step`) is
        to be traced and was not yet."""
        return step in self.steps and step not in self.recorded

    def pending(self) -> list[int]:
        return [s for s in self.steps if s not in self.recorded]

    def begin(self, step: int) -> None:
        if not self.offsets:
            self.offsets.append(clock_offsets(now=self.now))
        self._step, self._raw, self._host = step, [], []
        self.clock.begin()
        self._step_start = self.now()
        self._store = getattr(self.engine, "weight_grads", None)
        self._remove = self.engine.observe(self._hook)

    @contextlib.contextmanager
    def _hook(self, name: str, kwargs: dict):
        self.calls += 1
        # A split backward hands weight-gradient work to the engine's store (parallel/weight_split.py):
        # what a backward deferred, and what a weight pass ran, tell B from BW and an empty W.
        store = self._store if name in ("BackwardPass", "WeightPass") else None
        before = store.pending() if store is not None else 0
        start = self.clock.mark()
        yield
        end = self.clock.mark()
        self._raw.append((name, kwargs.get("buffer_id"), start, end, (store.pending() if store else 0) - before))

    @contextlib.contextmanager
    def span(self, label: str, category: str):
        """A host span of this step (the data loader)."""
        start = self.now()
        yield
        self._host.append((label, category, None, start, self.now()))

    def end(self) -> None:
        """After the step: read the spans (on a GPU the one wait for the device), label them."""
        self._remove()
        self._remove = None
        stop = self.now()
        self.clock.finish()
        spans = self._host + [(f"step {self._step}", "step", None, self._step_start, stop)]
        for label, category, micro_batch, start, end in label_micro_batches(self._raw):
            spans.append((label, category, micro_batch, self.clock.ns(start), self.clock.ns(end)))
        offset = self.offsets[0][0]
        self.recorded[self._step] = sorted(((a, b, c, s - offset, e - offset) for a, b, c, s, e in spans),
                                           key=lambda span: (span[3], -span[4]))
        self._raw = None

    def record(self) -> dict:
        """This rank's part of the trace: where it sits, its clock, its spans by step."""
        module = self.engine.module
        layout = self.layout
        return {"rank": layout.rank, "stage": layout.stage, "replica": layout.replica, "tp_rank": layout.tp_rank,
                "host": socket.gethostname(), "device": str(accelerator.device()), "device_clock": self.clock.device,
                "layers": module.stage_layers(layout.stage) if hasattr(module, "stage_layers") else "",
                "clock": {"offset_ns": self.offsets[0][0], "uncertainty_ns": self.offsets[0][1],
                          "offset_after_ns": self.offsets[-1][0], "uncertainty_after_ns": self.offsets[-1][1]},
                "steps": {str(step): [list(s) for s in spans] for step, spans in sorted(self.recorded.items())}}

    def records(self) -> list[dict] | None:
        """Every rank's `record` on rank 0 (None elsewhere), after measuring the clock offsets again.
        A collective: every rank calls it once its last traced step ended."""
        self.offsets.append(clock_offsets(now=self.now))
        dist = torch.distributed
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self.record(), gathered, dst=0)
        return gathered


def label_micro_batches(raw: list[tuple]) -> list[tuple[str, str, int | None, object, object]]:
    """(label, category, micro-batch, start, end) of each instruction (name, buffer, start, end,
    change of the deferred weight-gradient work) of a step, in order (module docstring: the k-th
    forward is micro-batch k). A backward that deferred nothing is BW (it computed its weight
    gradients itself); a weight pass that ran nothing is no compute (category other)."""
    of_buffer: dict[int, int] = {}
    waiting: dict[int, list[int]] = {}  # buffer → loads and receives of activations awaiting its forward
    forwards = 0
    out: list[list] = []
    for name, buffer, start, end, deferred in raw:
        category, label = INSTRUCTIONS.get(name, ("other", name))
        if name == "BackwardPass" and deferred <= 0:
            label = "BW"
        elif name == "WeightPass" and deferred >= 0:
            category, label = "other", "weight pass (nothing deferred)"
        micro_batch = of_buffer.get(buffer)
        if name in ("LoadMicroBatch", "RecvActivation"):
            waiting.setdefault(buffer, []).append(len(out))
            micro_batch = None
        elif name == "ForwardPass":
            micro_batch = of_buffer[buffer] = forwards
            forwards += 1
            for i in waiting.pop(buffer, []):
                out[i][2] = micro_batch
        out.append([label, category, micro_batch, start, end])
    return [tuple(row) for row in out]

"""DeepSpeed instructions from per-stage compute orders: the one generator every schedule runs through.

A schedule is a per-stage order of F, B, W and BW (parallel/zb_timeline.py; parallel/schedules.py
names them), as torch.distributed.pipelining's schedules are tables of actions that one runtime
executes. `stage_instructions` turns every stage's order into the stream of DeepSpeed
`PipeInstruction`s of one stage, which parallel/schedule_engine.py's engine runs:

* compute: F → `LoadMicroBatch` (first and last stage) and `ForwardPass`; BW → `BackwardPass`;
  B → `BackwardPass(split=True)` (the input gradient only, the weight gradients deferred); W →
  `WeightPass`. On the first stage, which sends no gradient, a B followed at once by its own W
  is one unsplit backward: nothing waits for its input gradient, and it holds no W tensors.
* transfers: `SendActivation` after each F and `SendGrad` after each B or BW (not from the last
  and the first stage), `RecvActivation` and `RecvGrad` for what the neighbours send. DeepSpeed's
  receives block until the peer sends (its sends too, unless the engine posts them as isend), so
  both ends of a link must meet their transfers in the same order. Each transfer gets the time at
  which the orders' simulated timeline (`simulate` at `cost`, unit costs by default) produces its
  data, the end of the sending F or B; both stages place it at that time, ahead of compute
  starting then, ties broken by one key (time, link, direction, micro-batch) that both ends share.
  Every stage then meets its transfers in one global order, and every compute comes after the
  receives it needs (they end no later than it starts) and before the sends it feeds (each op
  lasts > 0 in the simulation): the outstanding transfer of smallest key always finds both ends at
  it, so no valid order (`check_orders`, and `simulate` without deadlock) can deadlock.
* buffers: a micro-batch takes a slot at its first instruction on the stage and frees it after
  its last (its SendGrad, its backward on the first stage, or its W), so the stage needs as many
  slots as it has micro-batches in flight (`num_pipe_buffers`): 1F1B's min(p − s, m) (+1 where a
  receive precedes the send that frees a slot), GPipe's m.
* the step ends with `ReduceTiedGrads`, `ReduceGrads` and `OptimizerStep`, as DeepSpeed's
  TrainSchedule does.

For 1F1B the generated stream runs each stage's forwards and backwards in TrainSchedule's order
(tests/test_pipe_schedule.py), and training with it gives TrainSchedule's losses, clipped norms
and parameters bit for bit (tests/test_schedules.py).
"""
from __future__ import annotations

import functools
import heapq

from deepspeed.runtime.pipe import schedule as ds

from parallel.zb_timeline import Op, per_stage_costs, check_orders, fixed, simulate


class WeightPass(ds.BufferOpInstruction):
    """Compute the deferred weight gradients of the micro-batch in `buffer_id` into `.grad`."""


def fused(order: list[Op]) -> list[Op]:
    """The first stage's order with each B that its own W follows at once made one BW."""
    out: list[Op] = []
    for op in order:
        if op[0] == "W" and out and out[-1] == ("B", op[1]):
            out[-1] = ("BW", op[1])
        else:
            out.append(op)
    return out


def _positive(cost, stages: int) -> list[dict[str, float]]:
    """Per-stage costs with every op lasting > 0, so that each send comes after the op producing
    its data (placement only: the order of a stage's compute is the order's)."""
    costs = per_stage_costs(stages, cost)
    floor = 1e-6 * max((v for c in costs for v in c.values() if v > 0), default=1.0)
    return [{k: max(v, floor) for k, v in c.items()} for c in costs]


def stage_instructions(orders: list[list[Op]], stage: int, cost: dict | list[dict] | None = None,
                       fuse: bool = True) -> tuple[list[list[ds.PipeInstruction]], int]:
    """(the steps of DeepSpeed instructions of stage `stage` for one training step of `orders`,
    the pipe buffers they use); module docstring. `cost`: per-stage F, B, W (BW = B + W unless
    given) placing the transfers; `fuse`: the first stage's B + own W as one backward (off while
    the engine times B and W apart). Each buffer instruction carries its `micro_batch`."""
    p, s = len(orders), stage
    m = sum(1 for kind, _ in orders[0] if kind == "F")
    check_orders(orders, m)
    if fuse:
        orders = [fused(orders[0]), *orders[1:]]
    timeline = simulate(p, m, _positive(cost, p), fixed(orders))
    # (key, instruction factories, micro-batch); key (time, 0 transfer | 1 compute, link, 0 act | 1 grad, j)
    events: list[tuple[tuple, list, int]] = []
    for start, end, kind, j in timeline[s]:
        if kind == "F":
            load = [ds.LoadMicroBatch] if s in (0, p - 1) else []
            events.append(((start, 1, 0, 0, j), load + [ds.ForwardPass], j))
            if s < p - 1:
                events.append(((end, 0, s, 0, j), [ds.SendActivation], j))
        elif kind in ("B", "BW"):
            backward = functools.partial(ds.BackwardPass, split=True) if kind == "B" else ds.BackwardPass
            events.append(((start, 1, 0, 0, j), [backward], j))
            if s > 0:
                events.append(((end, 0, s - 1, 1, j), [ds.SendGrad], j))
        else:
            events.append(((start, 1, 0, 0, j), [WeightPass], j))
    if s > 0:  # activations from the previous stage, at the time it produced them
        events += [((end, 0, s - 1, 0, j), [ds.RecvActivation], j) for _, end, kind, j in timeline[s - 1] if kind == "F"]
    if s < p - 1:  # gradients from the next stage
        events += [((end, 0, s, 1, j), [ds.RecvGrad], j) for _, end, kind, j in timeline[s + 1] if kind in ("B", "BW")]
    events.sort(key=lambda e: e[0])
    last = {j: i for i, (_, _, j) in enumerate(events)}
    free: list[int] = []
    slot_of: dict[int, int] = {}
    slots = 0
    steps = []
    for i, (_, factories, j) in enumerate(events):
        if j not in slot_of:
            if free:
                slot_of[j] = heapq.heappop(free)
            else:
                slot_of[j], slots = slots, slots + 1
        cmds = [make(slot_of[j]) for make in factories]
        for cmd in cmds:
            cmd.micro_batch = j
        steps.append(cmds)
        if last[j] == i:
            heapq.heappush(free, slot_of.pop(j))
    steps.append([ds.ReduceTiedGrads(), ds.ReduceGrads(), ds.OptimizerStep()])
    return steps, max(slots, 1)


class OrderSchedule(ds.PipeSchedule):
    """A DeepSpeed PipeSchedule of one stage running `orders` (every stage's; stage_instructions)."""

    def __init__(self, orders: list[list[Op]], stage_id: int, cost: dict | list[dict] | None = None, fuse: bool = True):
        micro_batches = sum(1 for kind, _ in orders[0] if kind == "F")
        super().__init__(micro_batches=micro_batches, stages=len(orders), stage_id=stage_id)
        self.orders = orders
        self._steps, self._buffers = stage_instructions(orders, stage_id, cost, fuse)

    def steps(self):
        yield from self._steps

    def num_pipe_buffers(self) -> int:
        return self._buffers

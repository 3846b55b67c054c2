"""The pipeline schedules by name: what `parallel.schedule` may say. A schedule is its per-stage
compute order and one entry here (docs/pipeline.md, "Adding a schedule"): one engine runs every
order (parallel/schedule_engine.py, through the instruction generator parallel/pipe_schedule.py),
and what a schedule costs comes from its order through the timeline simulator
(parallel/zb_timeline.py): its in-flight activations, its pending weight passes and its bubble,
for the planner, the benchmarks and the reports. The config's check, `parallelize`, the planner's
candidates and the equivalence tests read this registry; no other module names a schedule.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from parallel.zb_timeline import (Candidate, Op, Order, choose, gpipe_order, one_f_one_b_order, schedule_candidates,
                                  zb_h1_order, zb_h2_order)

Candidates = Callable[[int, int, "int | None"], list[Candidate]]
"""(stages, micro-batches, bound on pending W) → the orders the engine may choose from, least memory first."""


@dataclass(frozen=True)
class Schedule:
    name: str
    """As `parallel.schedule` names it."""
    title: str
    """As text names it (1F1B, ZB-H1)."""
    summary: str
    order: Order
    """Its compute order of one stage, (stages, micro-batches, stage) → [('F' | 'B' | 'W' | 'BW', j)]:
    'BW' is an unsplit backward, 'B' and 'W' a split one (input gradient, then weight gradients)."""
    candidates: Candidates | None = None
    """Orders to choose from at the costs the engine measures (the first step runs the first; the
    engine times F, B and W in its second step and runs the soonest from the third); None: `order`
    only, never tuned."""
    pending_bounds: tuple[int | None, ...] = ()
    """The bounds of waiting W (`parallel.zb_max_pending_w`; None: unbounded) that `candidates`
    takes and the planner offers; empty: the key does not apply (it must stay 0)."""

    @functools.cached_property
    def splits_backward(self) -> bool:
        """Its order has weight passes (W): `parallelize` gives every weight-bearing module a split
        backward (parallel/weight_split.py), the planner prices the pending W's tensors, and
        per-layer gradient instruments (which read autograd's accumulation) cannot run."""
        return any(kind == "W" for s in range(4) for kind, _ in self.order(4, 8, s))

    def choices(self, stages: int, micro_batches: int, bound: int | None = None) -> list[Candidate]:
        """The candidate orders at this size (`candidates`, or `order` alone)."""
        if self.candidates is not None:
            return self.candidates(stages, micro_batches, bound)
        return [([self.order(stages, micro_batches, s) for s in range(stages)], 1.0)]

    def tunes(self, stages: int, micro_batches: int, bound: int | None = None) -> bool:
        """Whether the candidates' orders differ, so that measured costs can choose among them."""
        choices = self.choices(stages, micro_batches, bound)
        return any(orders != choices[0][0] for orders, _ in choices[1:])

    def choose(self, stages: int, micro_batches: int, cost: dict | list[dict] | None = None,
               bound: int | None = None) -> tuple[list[list[Op]], float, float]:
        """(every stage's order, the first stage's deferred share, makespan) the engine runs at
        `cost` (per-stage F, B, W, BW; unit costs by default): the candidate finishing soonest, the
        one holding the least memory among those within 0.5% of it."""
        return choose(self.choices(stages, micro_batches, bound), micro_batches, cost)


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("1f1b", "1F1B", "one forward, one backward (PipeDream-flush; DeepSpeed's TrainSchedule): at most p − s "
             "micro-batches in flight on stage s", one_f_one_b_order),
    Schedule("zb-h1", "ZB-H1", "zero-bubble ZB-H1 (Qi et al. 2024): each backward split into the input gradient, run at "
             "once, and the weight gradients, run later in the pipeline's idle time; 1F1B's activation memory",
             zb_h1_order, candidates=schedule_candidates, pending_bounds=(0, None)),
    Schedule("gpipe", "GPipe", "every forward, then every backward (Huang et al. 2019), the pipeline papers' baseline: "
             "all m micro-batches in flight on every stage, 1F1B's bubble", gpipe_order),
    Schedule("zb-h2", "ZB-H2", "zero-bubble ZB-H2 (Qi et al. 2024): ZB-H1 with twice the warm-up forwards and pending "
             "weight passes, which fill the start and the tail; no idle time but the stages' skew while T_W >= T_B / 2, "
             "at about twice ZB-H1's activation memory (2p - 1 micro-batches per stage)", zb_h2_order),
)}
"""Every schedule `parallel.schedule` may name."""

DEFAULT_SCHEDULE = "1f1b"
"""The schedule of a config that names none, and of every unpipelined layout."""


def schedule_of(name: str) -> Schedule:
    return SCHEDULES[name]


UNIT = {"F": 1.0, "B": 1.0, "W": 1.0}

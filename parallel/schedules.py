"""The pipeline schedules by name: what `parallel.schedule` may say, and what each schedule
provides to the code that builds, validates, simulates and plans it. Adding a schedule is its
engine (or instruction stream) in a module of its own, its per-stage compute order for the
timeline simulator (parallel/zb_timeline.py), and one entry here (docs/pipeline.md, "Adding a
schedule"); the config's check, `parallelize`, the planner's candidates, the simulator and the
equivalence tests read this registry.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from parallel.zb_timeline import Order, one_f_one_b_order, zb_h1_order


@dataclass(frozen=True)
class Schedule:
    name: str
    """As `parallel.schedule` names it."""
    title: str
    """As text names it (1F1B, ZB-H1)."""
    summary: str
    engine: str
    """`module:Class` of the engine that runs it (a TrainerEngine, parallel/engine.py), imported
    when an engine is built (its module may import DeepSpeed)."""
    order: Order
    """Its compute order of one stage, (stages, micro-batches, stage) → [('F' | 'B' | 'W' | 'BW', j)],
    for the timeline simulator and the planner; 'BW' is an unsplit backward."""
    splits_backward: bool = False
    """Its backward is split into the input gradient (B) and the weight gradients (W), which may wait:
    `parallelize` gives every weight-bearing module a split backward (parallel/weight_split.py), the
    planner prices the pending W's tensors, and per-layer gradient instruments (which read
    autograd's accumulation) cannot run."""
    pending_bounds: tuple[int | None, ...] = ()
    """The bounds of waiting W (`parallel.zb_max_pending_w`; None: unbounded) the planner offers;
    empty: the key does not apply (it must stay 0)."""

    def engine_class(self) -> type:
        module, _, name = self.engine.partition(":")
        return getattr(importlib.import_module(module), name)


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("1f1b", "1F1B", "DeepSpeed's one-forward-one-backward (TrainSchedule)", "parallel.engine:TrainerEngine",
             one_f_one_b_order),
    Schedule("zb-h1", "ZB-H1", "zero-bubble ZB-H1: each backward split into the input gradient, run at once, and the weight "
                      "gradients, run later in the pipeline's idle time (parallel/zero_bubble.py)",
             "parallel.zero_bubble:ZeroBubbleEngine", zb_h1_order, splits_backward=True, pending_bounds=(0, None)),
)}
"""Every schedule `parallel.schedule` may name."""

DEFAULT_SCHEDULE = "1f1b"
"""The schedule of a config that names none, and of every unpipelined layout."""


def schedule_of(name: str) -> Schedule:
    return SCHEDULES[name]



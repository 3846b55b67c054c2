"""Helpers the schedule tests share: statistics of one stage's order of F, B, W and BW, and
ZB-H1's tuned choice without its makespan (parallel/zb_timeline.py)."""
from __future__ import annotations

from parallel.zb_timeline import Op, choose, held_states, schedule_candidates


def pending_peak(order: list[tuple[str, int]]) -> int:
    """Most micro-batches whose W is still pending when a stage starts a B (its memory beyond
    1F1B's: the micro-batch in B turns its activations into its own W tensors)."""
    backwards = weights = peak = 0
    for kind, _ in order:
        if kind == "B":
            peak = max(peak, backwards - weights)
            backwards += 1
        elif kind == "W":
            weights += 1
    return peak


def activation_peak(order: list[Op]) -> int:
    """Most micro-batches a stage holds between F and B (1F1B: min(p − s, m); GPipe: m)."""
    return max((a for a, _ in held_states(order)), default=0)


def tuned_schedule(stages: int, micro_batches: int, cost=None, max_pending: int | None = None):
    """ZB-H1's (orders, share) the engine chooses at `cost` (parallel/zb_timeline.py `choose`)."""
    return choose(schedule_candidates(stages, micro_batches, max_pending), micro_batches, cost)[:2]

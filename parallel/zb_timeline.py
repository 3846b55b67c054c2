"""Per-stage compute orders of 1F1B and ZB-H1 (parallel/schedules.py names them) and their timelines (no DeepSpeed import: the
planner uses them too). Ops are ('F' | 'B' | 'W' | 'BW', micro-batch): forward, input gradient,
weight gradients, and 1F1B's unsplit backward."""
from __future__ import annotations

from collections import deque
from typing import Callable

Order = Callable[[int, int, int], list[tuple[str, int]]]


def zb_h1_order(stages: int, micro_batches: int, stage: int, max_pending: int | None = None) -> list[tuple[str, int]]:
    """ZB-H1's compute order of one stage.

    1F1B's order of F and B (stage s runs min(p − 1 − s, m) forwards first, then alternates), with
    the W of micro-batch j placed right after the B of micro-batch j + s: the last stage, whose
    1F1B activations are fewest (1 micro-batch), holds the most pending W (p − 1), the first stage
    none. So every stage holds at most p micro-batches between F and W, 1F1B's first-stage peak,
    and the W left over at the end fill the cooldown where 1F1B idles. With F, B and W of equal
    cost a step takes 3m + p − 1 units, the (p − 1)·(T_F + T_B − T_W) bubble of the paper.

    `max_pending` bounds the W a stage keeps waiting (W of j after B of j + min(s, max_pending)).
    With 0 every W follows its own B (after the B's gradient went out), so each stage holds at
    most 1F1B's activations of that stage (a W's tensors are fewer than its micro-batch's
    activations); with equal costs a step then takes 3m + 2(p − 1) units.
    """
    p, m, s = stages, micro_batches, stage
    delay = s if max_pending is None else min(s, max_pending)
    warmup = min(p - 1 - s, m)
    order = [("F", k) for k in range(warmup)]
    forwards, weights = warmup, 0
    for b in range(m):
        if forwards < m:
            order.append(("F", forwards))
            forwards += 1
        order.append(("B", b))
        if b >= delay:
            order.append(("W", weights))
            weights += 1
    order += [("W", k) for k in range(weights, m)]
    return order


def one_f_one_b_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """1F1B (DeepSpeed's TrainSchedule): warm-up forwards, then F and whole backward alternating."""
    warmup = min(stages - 1 - stage, micro_batches)
    order = [("F", k) for k in range(warmup)]
    for b in range(micro_batches):
        if warmup + b < micro_batches:
            order.append(("F", warmup + b))
        order.append(("BW", b))
    return order


def filled_order(stages: int, micro_batches: int, stage: int, max_pending: int | None = None,
                 lean: bool = False) -> list[tuple[str, int]]:
    """ZB-H1 with one more W pending per stage than the paper's order, used to fill waits.

    1F1B's order of F and B; the W of micro-batch j after the B of j + s + 1 on stage s (capped
    at `max_pending`), so the first stage defers W too. In the cooldown (no forward left), every
    stage but the last runs all its pending W before each B: that B waits for the next stage's
    gradient, and the W fill the wait where zb_h1_order's first stage idles (its last backward
    then is B + one W). Best when W is cheaper than F and B. `lean`: only the first stage keeps
    one more than the paper's order (1 instead of 0), the others the paper's s."""
    p, m, s = stages, micro_batches, stage
    delay = max(s, 1) if lean else s + 1
    if max_pending is not None:
        delay = min(delay, max_pending)
    warmup = min(p - 1 - s, m)
    order = [("F", k) for k in range(warmup)]
    forwards, weights = warmup, 0
    for b in range(m):
        cooldown = forwards >= m
        if not cooldown:
            order.append(("F", forwards))
            forwards += 1
        if cooldown and s < p - 1:
            order += [("W", k) for k in range(weights, b)]
            weights = b
        order.append(("B", b))
        if b - weights >= delay:
            order.append(("W", weights))
            weights += 1
    order += [("W", k) for k in range(weights, m)]
    return order


FIRST_STAGE_SHARES = (0.125, 0.25, 0.5, 1.0)
"""Shares of its W the first stage may defer in the lean filled order (the rest runs inside B)."""


def schedule_candidates(stages: int, micro_batches: int,
                        max_pending: int | None = None) -> list[tuple[list[list[tuple[str, int]]], float]]:
    """(per-stage orders, share of the first stage's W it defers), by the memory they hold: the
    paper's order; the lean filled order with the first stage deferring each of
    FIRST_STAGE_SHARES of its W; the filled order. All capped at `max_pending`."""
    p, m = stages, micro_batches
    paper = [zb_h1_order(p, m, s, max_pending) for s in range(p)]
    lean = [filled_order(p, m, s, max_pending, lean=True) for s in range(p)]
    filled = [filled_order(p, m, s, max_pending) for s in range(p)]
    return [(paper, 1.0)] + [(lean, share) for share in FIRST_STAGE_SHARES] + [(filled, 1.0)]


def with_first_stage_share(cost: dict[str, float] | list[dict[str, float]] | None, stages: int,
                           share: float) -> list[dict[str, float]]:
    """Per-stage costs when the first stage defers only `share` of its W (the rest runs in B)."""
    costs = [{k: c[k] for k in ("F", "B", "W")} for c in _stage_costs(stages, cost)]
    first = costs[0]
    costs[0] = {"F": first["F"], "B": first["B"] + (1.0 - share) * first["W"], "W": share * first["W"]}
    return costs


def tuned_schedule(stages: int, micro_batches: int, cost: dict[str, float] | list[dict[str, float]] | None = None,
                   max_pending: int | None = None,
                   tolerance: float = 0.005) -> tuple[list[list[tuple[str, int]]], float]:
    """The ZB-H1 orders of every stage, and the share of its W the first stage defers, that
    finish a step soonest at `cost` (per-stage F, B, W seconds; unit costs by default), among
    schedule_candidates: the first of them (the least memory) within `tolerance` of the soonest.
    At unit costs that is the paper's order. All candidates are fixed patterns: chosen on costs
    measured in one step they stay good when later steps' costs move by ±10% (a list schedule
    fitted to the measured costs did not)."""
    return tuned_schedule_span(stages, micro_batches, cost, max_pending, tolerance)[:2]


def tuned_schedule_span(stages: int, micro_batches: int, cost: dict[str, float] | list[dict[str, float]] | None = None,
                        max_pending: int | None = None,
                        tolerance: float = 0.005) -> tuple[list[list[tuple[str, int]]], float, float]:
    """tuned_schedule's (orders, share) and the makespan of that choice."""
    p, m = stages, micro_batches
    candidates = schedule_candidates(p, m, max_pending)
    spans = [max(ops[-1][1] for ops in simulate(p, m, with_first_stage_share(cost, p, share), fixed(orders)))
             for orders, share in candidates]
    best = min(spans)
    return next((*choice, span) for choice, span in zip(candidates, spans) if span <= best * (1.0 + tolerance))


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


def fixed(orders: list[list[tuple[str, int]]]) -> Order:
    """The `Order` that returns these per-stage orders."""
    return lambda _stages, _micro_batches, stage: list(orders[stage])


def _stage_costs(p: int, cost: dict[str, float] | list[dict[str, float]] | None) -> list[dict[str, float]]:
    """One cost dict per stage with F, B, W (unit by default) and BW = B + W unless given."""
    costs = []
    for c in (cost if isinstance(cost, list) else [cost] * p):
        c = {"F": 1.0, "B": 1.0, "W": 1.0, **(c or {})}
        c.setdefault("BW", c["B"] + c["W"])
        costs.append(c)
    return costs


def _dependency(kind: str, s: int, j: int, p: int) -> tuple[str, int, int] | None:
    """The op whose end an op of stage s on micro-batch j waits for (None: the first forward)."""
    if kind == "F":
        return ("F", s - 1, j) if s > 0 else None
    if kind in ("B", "BW"):
        return ("B", s + 1, j) if s < p - 1 else ("F", s, j)
    return ("B", s, j)


def simulate(stages: int, micro_batches: int, cost: dict[str, float] | list[dict[str, float]] | None = None,
             order: Order = zb_h1_order) -> list[list[tuple[float, float, str, int]]]:
    """Start and end of every op of every stage when an op starts as soon as its stage is free
    and its input has arrived (transfers free): per stage [(start, end, kind, micro-batch)].
    `cost` gives F, B, W (BW defaults to B + W), for all stages or one dict per stage; unit
    costs by default. O(p·m)."""
    p = stages
    costs = _stage_costs(p, cost)
    orders = [order(p, micro_batches, s) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    waiting: dict[tuple[str, int, int], int] = {}
    position, free = [0] * p, [0.0] * p
    timeline: list[list[tuple[float, float, str, int]]] = [[] for _ in range(p)]
    ready = deque(range(p))
    while ready:
        s = ready.popleft()
        while position[s] < len(orders[s]):
            kind, j = orders[s][position[s]]
            dep = _dependency(kind, s, j, p)
            if dep is not None and dep not in done:
                waiting[dep] = s
                break
            start = max(free[s], done[dep] if dep else 0.0)
            end = start + costs[s][kind]
            key = ("B" if kind == "BW" else kind, s, j)
            done[key] = end
            free[s] = end
            timeline[s].append((start, end, kind, j))
            position[s] += 1
            if key in waiting:
                ready.append(waiting.pop(key))
    if any(position[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError(f"pipeline order deadlocks at pp={p}, m={micro_batches}")
    return timeline

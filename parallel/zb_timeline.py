"""The pipeline schedules' per-stage compute orders (parallel/schedules.py names them), what an
order holds and the timeline simulator that runs any of them (no DeepSpeed import: the planner and
the benchmarks use them too; parallel/pipe_schedule.py turns orders into DeepSpeed instructions).

An order is one stage's list of ops ('F' | 'B' | 'W' | 'BW', micro-batch): forward, input gradient,
weight gradients, and an unsplit backward (B and W in one). A valid set of orders (`check_orders`)
runs each micro-batch's F once per stage, in micro-batch order (the first stage loads and the last
stage reads labels in that order), and either its BW or its B and then its W; `simulate` runs it
(or says it deadlocks). The name is historical: the module began with ZB-H1's timeline.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

Op = tuple[str, int]
Order = Callable[[int, int, int], list[Op]]
"""(stages, micro-batches, stage) → that stage's ops."""
Candidate = tuple[list[list[Op]], float]
"""Every stage's order and the share of its W the first stage defers (the rest runs inside its B)."""


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


def gpipe_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """GPipe (Huang et al. 2019): every forward, then every (unsplit) backward, in micro-batch order.
    Every stage holds all m micro-batches' activations at once; its bubble is 1F1B's, (p − 1)
    slots of m + p − 1."""
    return [("F", j) for j in range(micro_batches)] + [("BW", j) for j in range(micro_batches)]


def zb_h2_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """ZB-H2 (Qi et al., ICLR 2024, arXiv 2401.10241): ZB-H1 with twice the warm-up and twice the
    pending weight passes. Stage s runs 2(p − 1 − s) + 1 forwards before its first B, which fills
    its wait for the first gradient with work; then, per micro-batch, B, the W of the micro-batch 2s
    earlier and the next F; the W left over fill the tail (the last stage keeps 2(p − 1)).

    At equal costs every stage is busy from its first forward to its last W, the paper's
    parallelogram: the only idle time is the (p − 1)·T_F skew between the first and the last stage
    that a step closed by one collective (the clipping norm, the tied gradients) cannot avoid, so
    a step takes 3m + p − 1 units. For other costs it idles (p − 1)·max(0, T_B − 2·T_W) beyond that
    skew, where ZB-H1 idles (p − 1)·max(0, T_B − T_W). Every stage holds up to 2p − 1 micro-batches
    between F and W (the first stage 2p − 1 in flight, the last one in flight and 2p − 2 W
    pending): about twice ZB-H1's p."""
    p, m, s = stages, micro_batches, stage
    warmup = min(2 * (p - 1 - s) + 1, m)
    order = [("F", k) for k in range(warmup)]
    forwards, weights = warmup, 0
    for b in range(m):
        order.append(("B", b))
        if b >= 2 * s:
            order.append(("W", weights))
            weights += 1
        if forwards < m:
            order.append(("F", forwards))
            forwards += 1
    order += [("W", k) for k in range(weights, m)]
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
    costs = per_stage_costs(stages, cost)  # with BW, an unsplit backward's cost
    if share != 1.0:
        first = costs[0]
        costs[0] = {**first, "B": first["B"] + (1.0 - share) * first["W"], "W": share * first["W"]}
    return costs


def choose(candidates: list[Candidate], micro_batches: int, cost: dict[str, float] | list[dict[str, float]] | None = None,
           tolerance: float = 0.005) -> tuple[list[list[Op]], float, float]:
    """(orders, first-stage share, makespan) of the first candidate (candidates come by the memory
    they hold, least first) that finishes within `tolerance` of the soonest at `cost` (per-stage F,
    B, W seconds; unit costs by default). For ZB-H1 at unit costs that is the paper's order. Its
    candidates are fixed patterns: chosen on costs measured in one step they stay good when later
    steps' costs move by ±10% (a list schedule fitted to the measured costs did not)."""
    if len(candidates) == 1:
        orders, share = candidates[0]
        return orders, share, span_of(orders, micro_batches, with_first_stage_share(cost, len(orders), share))
    spans = [span_of(orders, micro_batches, with_first_stage_share(cost, len(orders), share)) for orders, share in candidates]
    best = min(spans)
    return next((*choice, span) for choice, span in zip(candidates, spans) if span <= best * (1.0 + tolerance))


def span_of(orders: list[list[Op]], micro_batches: int, cost: dict[str, float] | list[dict[str, float]] | None = None) -> float:
    """Makespan of these orders at `cost` (unit costs by default)."""
    return max(ops[-1][1] for ops in simulate(len(orders), micro_batches, cost, fixed(orders)))


def held_states(order: list[Op]) -> list[tuple[int, int]]:
    """What a stage holds, as (micro-batches between F and B, micro-batches between B and W), after
    each F and when each B starts (the micro-batch in B still counts as between F and B: its B
    turns its activations into its W tensors): the moments where memory can peak. An unsplit
    backward (BW) frees its micro-batch at once. Only the states no other exceeds in both."""
    acts = pending = 0
    states = set()
    for kind, _ in order:
        if kind == "F":
            acts += 1
            states.add((acts, pending))
        elif kind == "B":
            states.add((acts, pending))
            acts, pending = acts - 1, pending + 1
        elif kind == "BW":
            states.add((acts, pending))
            acts -= 1
        else:
            pending -= 1
    frontier, most_pending = [], -1
    for acts_, pending_ in sorted(states, key=lambda x: (-x[0], -x[1])):
        if pending_ > most_pending:
            frontier.append((acts_, pending_))
            most_pending = pending_
    return sorted(frontier)


def forwards_first(order: list[Op]) -> bool:
    """Whether every forward of the stage precedes its first backward (then no gradient exists yet
    while activations grow)."""
    kinds = [kind for kind, _ in order]
    return "F" not in kinds[next((i for i, k in enumerate(kinds) if k in ("B", "BW")), len(kinds)):]


def check_orders(orders: list[list[Op]], micro_batches: int) -> None:
    """Raise ValueError (one line naming the stage) unless every stage runs F of micro-batches
    0, 1, ..., m − 1 in that order and, for each, either BW or B and then W, each once after its F;
    then `simulate` says whether the orders deadlock."""
    m = micro_batches
    for s, order in enumerate(orders):
        forwards = [j for kind, j in order if kind == "F"]
        if forwards != list(range(m)):
            raise ValueError(f"stage {s}: forwards must run micro-batches 0..{m - 1} once each, in order; got {forwards}")
        seen: dict[int, str] = {}
        for kind, j in order:
            done = seen.get(j, "")
            if kind not in ("F", "B", "W", "BW") or (kind == "F") != (done == "") or (kind == "W") != (done == "FB") \
                    or (kind in ("B", "BW") and done != "F"):
                raise ValueError(f"stage {s}: {kind}{j} out of place (after {done or 'nothing'} of micro-batch {j}); "
                                 "each micro-batch runs F, then BW or B then W, once")
            seen[j] = done + ("B" if kind == "B" else "BW" if kind == "BW" else kind)
        if len(seen) != m or any(v != "FBW" for v in seen.values()):
            raise ValueError(f"stage {s}: every micro-batch needs its F and its backward (BW, or B and W)")


def fixed(orders: list[list[tuple[str, int]]]) -> Order:
    """The `Order` that returns these per-stage orders."""
    return lambda _stages, _micro_batches, stage: list(orders[stage])


def per_stage_costs(p: int, cost: dict[str, float] | list[dict[str, float]] | None) -> list[dict[str, float]]:
    """One cost dict per stage with F, B, W (unit by default) and BW = B + W unless given."""
    costs = []
    for c in (cost if isinstance(cost, list) else [cost] * p):
        c = {"F": 1.0, "B": 1.0, "W": 1.0, **(c or {})}
        c.setdefault("BW", c["B"] + c["W"])
        costs.append(c)
    return costs


def simulate(stages: int, micro_batches: int, cost: dict[str, float] | list[dict[str, float]] | None = None,
             order: Order = zb_h1_order) -> list[list[tuple[float, float, str, int]]]:
    """Start and end of every op of every stage when an op starts as soon as its stage is free
    and its input has arrived (transfers free): per stage [(start, end, kind, micro-batch)]. An F
    waits for the previous stage's F, a B or BW for the next stage's B or BW (the last stage's for
    its own F), a W for its own B. `cost` gives F, B, W (BW defaults to B + W), for all stages or
    one dict per stage; unit costs by default. O(p·m); the planner runs it for every layout."""
    p, m = stages, micro_batches
    costs = per_stage_costs(p, cost)
    orders = [order(p, m, s) for s in range(p)]
    forward_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    backward_end: list[list[float | None]] = [[None] * m for _ in range(p)]
    waiting: dict[tuple[int, int, int], int] = {}  # (0 forward | 1 backward, stage, j) → the stage waiting for it
    position, free = [0] * p, [0.0] * p
    timeline: list[list[tuple[float, float, str, int]]] = [[] for _ in range(p)]
    ready = deque(range(p))
    while ready:
        s = ready.popleft()
        ops, pos, t, c, line = orders[s], position[s], free[s], costs[s], timeline[s]
        while pos < len(ops):
            kind, j = ops[pos]
            if kind == "F":
                need = (0, s - 1, j) if s > 0 else None
            elif kind == "W":
                need = (1, s, j)
            else:
                need = (1, s + 1, j) if s < p - 1 else (0, s, j)
            if need is not None:
                ready_at = (forward_end if need[0] == 0 else backward_end)[need[1]][j]
                if ready_at is None:
                    waiting[need] = s
                    break
                t = max(t, ready_at)
            end = t + c[kind]
            line.append((t, end, kind, j))
            t = end
            pos += 1
            if kind != "W":
                done = (0 if kind == "F" else 1, s, j)
                (forward_end if kind == "F" else backward_end)[s][j] = end
                if done in waiting:
                    ready.append(waiting.pop(done))
        position[s], free[s] = pos, t
    if any(position[s] < len(orders[s]) for s in range(p)):
        raise RuntimeError(f"pipeline order deadlocks at pp={p}, m={micro_batches}")
    return timeline

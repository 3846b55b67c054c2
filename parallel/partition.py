"""Balanced pipeline partition: contiguous stages whose heaviest stage is as light as possible.

DeepSpeed's `partition_balanced` (deepspeed/runtime/utils.py, 0.19.8) is a dynamic programme over
(layer, stage, split point), O(n²·p) in Python: for the 1,002 plan layers of 500L-500L it takes
minutes at pp=64, on every rank at start-up (docs/benchmarks.md). What a pipeline's
step time depends on is the heaviest stage (the bottleneck), and that optimum has a direct
O(n + p·log n·log(1/ε)) solution:

  - `fits(limit)`: can the layers be cut into at most p contiguous stages of cost ≤ limit?
    Greedily, each stage takes as many layers as fit: the last layer of a stage starting at prefix
    sum P is found by bisection on the prefix sums (P + limit), so a check costs O(p·log n).
  - The smallest feasible limit is found by bisection between max(cost) and sum(cost) (the
    answer is one of the stage sums, so it is then read off the greedy cut exactly).
  - The cut actually used places stage boundaries left to right, closing a stage when the next
    layer would exceed the bottleneck or when every later stage still needs one layer; then,
    walking right to left, each boundary moves left while that lowers the heavier of its two
    neighbours' costs without exceeding the bottleneck. The bottleneck stays optimal, and the
    light stages the greedy leaves at the end get a share of the work.

Ties aside, the bottleneck equals or beats DeepSpeed's (its programme minimises the spread
max − min rather than the max; tests/test_partition.py compares both on random cost vectors).
"""
from __future__ import annotations

import bisect
import itertools

from model.config import ModelConfig
from model.flops import layer_costs


def _stage_ends(prefix: list[float], limit: float, parts: int) -> list[int] | None:
    """Greedy cut with at most `parts` stages of cost ≤ limit (stage ends as prefix indices),
    or None when it needs more stages."""
    n = len(prefix) - 1
    ends, start = [], 0
    while start < n:
        if len(ends) == parts:
            return None
        # the furthest end whose stage [start, end) costs ≤ limit: bisection on the prefix sums,
        # then settled by the stage sums themselves (P + limit may round the other way)
        end = max(bisect.bisect_right(prefix, prefix[start] + limit, lo=start + 1) - 1, start + 1)
        while end > start + 1 and prefix[end] - prefix[start] > limit:
            end -= 1
        while end < n and prefix[end + 1] - prefix[start] <= limit:
            end += 1
        if prefix[end] - prefix[start] > limit:
            return None  # one layer alone exceeds the limit
        ends.append(end)
        start = end
    return ends


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Stage bounds [0, b1, …, n] (num_parts + 1 indices) minimising the heaviest stage's cost.

    Every stage gets at least one layer when there are at least as many layers as stages; with
    fewer layers, stages are one layer each and the rest empty (as DeepSpeed's partition_uniform).
    """
    n = len(weights)
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be >= 1")
    if any(w < 0 for w in weights):
        raise ValueError("layer costs must be >= 0")
    if n <= num_parts:
        return [min(p, n) for p in range(num_parts + 1)]
    prefix = [0.0, *itertools.accumulate(float(w) for w in weights)]
    lo, hi = max(weights), prefix[-1]
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        if _stage_ends(prefix, mid, num_parts) is None:
            lo = mid
        else:
            hi = mid
    # the optimum is a stage sum: the heaviest stage of the feasible greedy cut at `hi`
    ends = _stage_ends(prefix, hi, num_parts)
    limit = max(prefix[e] - prefix[s] for s, e in zip([0, *ends], ends))
    return _spread(prefix, limit, num_parts)


def _spread(prefix: list[float], limit: float, parts: int) -> list[int]:
    """A cut into exactly `parts` non-empty stages of cost ≤ limit, with the slack shared out."""
    n = len(prefix) - 1
    bounds = [0]
    for i in range(1, n):
        stage = prefix[i + 1] - prefix[bounds[-1]]
        if len(bounds) < parts and (stage > limit or n - i == parts - len(bounds)):
            bounds.append(i)
    bounds.append(n)
    # Move boundaries left (right to left) while that lowers max(left stage, right stage).
    for k in range(parts - 1, 0, -1):
        while bounds[k] - 1 > bounds[k - 1]:
            b = bounds[k]
            left, right = prefix[b] - prefix[bounds[k - 1]], prefix[bounds[k + 1]] - prefix[b]
            moved_left, moved_right = prefix[b - 1] - prefix[bounds[k - 1]], prefix[bounds[k + 1]] - prefix[b - 1]
            if max(moved_left, moved_right) < max(left, right) and moved_right <= limit:
                bounds[k] = b - 1
            else:
                break
    return bounds


def stage_bounds(cfg: ModelConfig, pp: int) -> list[int]:
    """The pipeline partition of `cfg` into `pp` stages: plan indices where stages start (pp + 1
    bounds), balancing model/flops.py's `layer_costs`. The trainer's pipeline module
    (parallel/pipeline.py) and the planner both call this, so they cut the same stages.

    Stages are cut only before an encoder or decoder layer: the embedding goes with the first
    encoder layer, a final LayerNorm with the layer before it and the output layer (with its loss)
    with the last decoder layer, so every stage holds at least one of them. A stage of the output
    layer alone (which its loss can make as heavy as a stage, on narrow models) would hold nothing
    but the tied embedding's copy, whose gradient DeepSpeed's own optimizers leave out of a stage's
    norm."""
    from model.transformer import layer_plan

    costs = layer_costs(cfg)
    starts = [i for i, layer in enumerate(layer_plan(cfg)) if layer.kind in ("encoder", "decoder")][1:]
    edges = [0, *starts, len(costs)]  # the units: plan layers between two possible cuts
    units = [sum(costs[a:b]) for a, b in itertools.pairwise(edges)]
    return [edges[i] for i in partition_balanced(units, pp)]

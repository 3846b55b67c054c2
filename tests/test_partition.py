"""The balanced pipeline partition (parallel/partition.py) against DeepSpeed's and an exact optimum."""
from __future__ import annotations

import itertools
import random

import pytest

from parallel.partition import partition_balanced


def bottleneck(weights: list[float], bounds: list[int]) -> float:
    """The cost of the heaviest stage of a partition given as stage bounds (p + 1 indices)."""
    return max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))


def exact_bottleneck(weights: list[float], parts: int) -> float:
    """The smallest possible heaviest stage (min-max linear partition), O(n²·p) programme."""
    n = len(weights)
    prefix = [0.0, *itertools.accumulate(weights)]
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for j in range(1, parts + 1):
        for i in range(j, n + 1):
            best[j][i] = min(max(best[j - 1][k], prefix[i] - prefix[k]) for k in range(j - 1, i))
    return best[parts][n]


def random_costs(rng: random.Random, trial: int) -> list[float]:
    n = rng.randint(1, 30)
    if trial % 3 == 0:
        return [rng.random() for _ in range(n)]
    if trial % 3 == 1:  # many ties
        return [float(rng.randint(1, 5)) for _ in range(n)]
    return [rng.choice([1.0, 4 / 3, 10.0]) for _ in range(n)]  # encoder, decoder, output-like


def test_bottleneck_is_optimal_and_never_worse_than_deepspeeds_on_random_costs():
    from deepspeed.runtime.utils import partition_balanced as deepspeed_partition

    rng = random.Random(13)
    strictly_better = 0
    for trial in range(300):
        weights, parts = random_costs(rng, trial), rng.randint(1, 8)
        bounds = partition_balanced(weights, parts)
        n = len(weights)
        assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == n
        assert all(a < b for a, b in itertools.pairwise(bounds)) if n >= parts else bounds == [
            min(p, n) for p in range(parts + 1)]
        if n < parts:
            continue
        ours = bottleneck(weights, bounds)
        theirs = bottleneck(weights, [int(b) for b in deepspeed_partition(weights, parts)])
        assert ours == pytest.approx(exact_bottleneck(weights, parts), rel=1e-12), (weights, parts)
        assert ours <= theirs * (1 + 1e-12), (weights, parts)
        strictly_better += ours < theirs * (1 - 1e-12)
    assert strictly_better > 0  # DeepSpeed's programme minimises max − min, not the max


def test_a_thousand_layers_into_64_stages_take_a_bisection_of_greedy_cuts(monkeypatch):
    """The cost is counted, not timed: one greedy cut (O(p log n)) per bisection step of the
    bottleneck, about 45 for a relative precision of 1e-12, whatever the depth."""
    import parallel.partition as partition
    from model.flops import layer_costs
    from planner.planner import named_model

    costs = layer_costs(named_model("deepnet-500-500"))
    assert len(costs) == 1002
    cut, calls = partition._stage_ends, []
    monkeypatch.setattr(partition, "_stage_ends", lambda *a: calls.append(a) or cut(*a))
    bounds = partition_balanced(costs, 64)
    assert 30 <= len(calls) <= 60, len(calls)  # seen 47
    assert bottleneck(costs, bounds) <= sum(costs) / 64 + max(costs)  # within one layer of perfect
    assert all(a < b for a, b in itertools.pairwise(bounds))


def test_small_plans_get_deepspeeds_partition_where_it_is_optimal():
    """Where DeepSpeed's cut already has the smallest bottleneck (the bundled 6L-6L models), the
    stages are the same as before, so checkpoints of earlier runs keep their stage files."""
    from deepspeed.runtime.utils import partition_balanced as deepspeed_partition

    from model.config import ModelConfig
    from model.flops import layer_costs

    compared = 0
    for layers, d, vocab in ((6, 128, 4000), (6, 64, 1000), (12, 128, 4000), (6, 512, 4000)):
        cfg = ModelConfig(encoder_layers=layers, decoder_layers=layers, d_model=d, heads=4, ffn_dim=4 * d,
                          vocab_size=vocab)
        costs = layer_costs(cfg)
        for parts in (2, 3, 4):
            theirs = [int(b) for b in deepspeed_partition(costs, parts)]
            if bottleneck(costs, theirs) == pytest.approx(exact_bottleneck(costs, parts), rel=1e-12):
                assert partition_balanced(costs, parts) == theirs, (layers, d, parts)
                compared += 1
    assert compared >= 10

"""The instruction generator (parallel/pipe_schedule.py) in one process: for every schedule of the
registry and for random valid orders the generated streams are complete and cannot deadlock under
blocking point-to-point transfers; 1F1B's stream runs DeepSpeed TrainSchedule's compute order; the
pipe buffers are the order's in-flight micro-batches; invalid orders are one line."""
import random

import pytest
from deepspeed.runtime.pipe import schedule as ds

from parallel.pipe_schedule import WeightPass, fused, stage_instructions
from parallel.schedules import SCHEDULES
from parallel.zb_timeline import check_orders, fixed, one_f_one_b_order, simulate
from tests.orders import activation_peak

GRID = [(p, m) for p in range(1, 6) for m in range(1, 10)]


def run_blocking(orders: list, cost=None, fuse: bool = True) -> list[int]:
    """Execute every stage's stream with rendezvous transfers (a send completes only when the peer
    is at the matching receive) and check each instruction's data dependencies; the buffers used."""
    p, m = len(orders), sum(1 for kind, _ in orders[0] if kind == "F")
    built = [stage_instructions(orders, s, cost, fuse) for s in range(p)]
    streams = [[c for step in steps for c in step] for steps, _ in built]
    pos = [0] * p
    state = [{"F": set(), "B": set(), "W": set(), "act": set(), "grad": set()} for _ in range(p)]
    while any(pos[s] < len(streams[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if pos[s] == len(streams[s]):
                continue
            cmd, st = streams[s][pos[s]], state[s]
            j = getattr(cmd, "micro_batch", None)
            if isinstance(cmd, ds.ForwardPass):
                assert s == 0 or j in st["act"]
                st["F"].add(j)
            elif isinstance(cmd, ds.BackwardPass):
                assert j in st["F"] and (s == p - 1 or j in st["grad"])
                st["B"].add(j)
                if not cmd.kwargs.get("split"):
                    st["W"].add(j)  # an unsplit backward computes W too
            elif isinstance(cmd, WeightPass):
                assert j in st["B"]
                st["W"].add(j)
            elif isinstance(cmd, (ds.SendActivation, ds.SendGrad)):
                peer = s + 1 if isinstance(cmd, ds.SendActivation) else s - 1
                want = ds.RecvActivation if isinstance(cmd, ds.SendActivation) else ds.RecvGrad
                other = streams[peer][pos[peer]] if pos[peer] < len(streams[peer]) else None
                if not (isinstance(other, want) and other.micro_batch == j):
                    continue  # blocked until the peer reaches the matching receive
                assert j in st["F" if want is ds.RecvActivation else "B"]
                state[peer]["act" if want is ds.RecvActivation else "grad"].add(j)
                pos[peer] += 1
            elif isinstance(cmd, (ds.RecvActivation, ds.RecvGrad)):
                continue  # completed by the matching send
            elif isinstance(cmd, (ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep)):
                assert st["W"] == set(range(m))  # every W before the reductions
            pos[s] += 1
            moved = True
        assert moved, f"deadlock at pp={p}, m={m}: positions {pos}"
    for st in state:
        assert st["F"] == st["B"] == st["W"] == set(range(m))
    return [buffers for _, buffers in built]


def every_order(p: int, m: int):
    """(label, orders) of every candidate of every registry schedule at each of its bounds."""
    for name, spec in SCHEDULES.items():
        for bound in spec.pending_bounds or (0,):
            for i, (orders, _) in enumerate(spec.choices(p, m, bound)):
                yield f"{name}(w={bound})#{i}", orders


@pytest.mark.parametrize("p,m", GRID)
def test_every_registry_order_completes_without_deadlock(p, m):
    """At equal costs, at unequal ones (as after tuning) and with zero-cost ops; the first stage's B +
    own W fused (training) and apart (the tuning step)."""
    unequal = [{"F": 1.0 + 0.3 * s, "B": 0.7, "W": 0.1 * s} for s in range(p)]
    for label, orders in every_order(p, m):
        for cost in (None, unequal, {"F": 0.0, "B": 0.0, "W": 0.0}):
            for fuse in (True, False):
                run_blocking(orders, cost, fuse)


def random_orders(p: int, m: int, rng: random.Random) -> list:
    """Valid orders no rule would write: a random list schedule (a random stage runs a random ready
    op: F in micro-batch order, backwards in any order, split or not, W any time after its B)."""
    orders = [[] for _ in range(p)]
    forwarded, backed, pending = [0] * p, [set() for _ in range(p)], [set() for _ in range(p)]
    while any(len(o) < 2 * m + sum(1 for k, _ in o if k == "B") for o in orders):
        options = []
        for s in range(p):
            j = forwarded[s]
            if j < m and (s == 0 or forwarded[s - 1] > j):
                options.append((s, "F", j))
            for j in range(forwarded[s]):
                if j not in backed[s] and (s == p - 1 or j in backed[s + 1]):
                    options += [(s, "B", j), (s, "BW", j)]
            options += [(s, "W", j) for j in pending[s]]
        s, kind, j = rng.choice(options)
        orders[s].append((kind, j))
        if kind == "F":
            forwarded[s] += 1
        elif kind == "W":
            pending[s].discard(j)
        else:
            backed[s].add(j)
            if kind == "B":
                pending[s].add(j)
    return orders


@pytest.mark.parametrize("seed", range(40))
def test_random_valid_orders_complete_without_deadlock(seed):
    rng = random.Random(seed)
    p, m = rng.randint(1, 5), rng.randint(1, 8)
    orders = random_orders(p, m, rng)
    check_orders(orders, m)
    cost = [{"F": rng.uniform(0.1, 2), "B": rng.uniform(0.1, 2), "W": rng.uniform(0, 1)} for _ in range(p)]
    buffers = run_blocking(orders, cost)
    for s, n in enumerate(buffers):
        assert activation_peak(fused(orders[s]) if s == 0 else orders[s]) <= n


@pytest.mark.parametrize("p,m", GRID)
def test_generated_1f1b_runs_train_schedules_compute_order(p, m):
    """Per stage the generated 1F1B stream runs DeepSpeed TrainSchedule's forwards and backwards in
    its order (the k-th ForwardPass and BackwardPass of TrainSchedule are micro-batch k), its
    backward is DeepSpeed's unsplit BackwardPass, and it uses at most one buffer slot more than
    TrainSchedule's min(p − s, m) (a receive placed before the send that frees a slot)."""
    orders = [one_f_one_b_order(p, m, s) for s in range(p)]
    for s in range(p):
        steps, buffers = stage_instructions(orders, s)
        ours = [(type(c).__name__, c.micro_batch, c.kwargs.get("split", False)) for step in steps for c in step
                if isinstance(c, (ds.ForwardPass, ds.BackwardPass, WeightPass))]
        counts, theirs = {"ForwardPass": 0, "BackwardPass": 0}, []
        for step in ds.TrainSchedule(micro_batches=m, stages=p, stage_id=s):
            for c in step:
                if isinstance(c, (ds.ForwardPass, ds.BackwardPass)):
                    name = type(c).__name__
                    theirs.append((name, counts[name], False))
                    counts[name] += 1
        assert ours == theirs
        assert min(p - s, m) <= buffers <= min(p - s, m) + 1
        assert [type(c) for c in steps[-1]] == [ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]


def test_buffers_are_the_orders_in_flight_micro_batches():
    """GPipe-like orders (all forwards first) hold every micro-batch on every stage: m slots."""
    p, m = 3, 5
    orders = [[("F", j) for j in range(m)] + [("BW", j) for j in range(m)] for _ in range(p)]
    assert run_blocking(orders) == [m] * p


@pytest.mark.parametrize("orders,message", [
    ([[("F", 1), ("F", 0), ("BW", 0), ("BW", 1)]], "forwards must run micro-batches 0..1 once each, in order"),
    ([[("F", 0), ("F", 1), ("W", 0), ("BW", 1)]], "W0 out of place"),
    ([[("F", 0), ("F", 1), ("B", 0), ("BW", 1)]], "every micro-batch needs its F and its backward"),
    ([[("F", 0), ("F", 1), ("BW", 0), ("B", 0), ("BW", 1)]], "B0 out of place"),
])
def test_invalid_orders_are_one_line(orders, message):
    with pytest.raises(ValueError, match=message):
        stage_instructions(orders, 0)


def test_an_order_that_deadlocks_is_refused():
    """Stage 0 waits for the gradient of micro-batch 1 before sending micro-batch 1's activation."""
    orders = [[("F", 0), ("BW", 1), ("F", 1), ("BW", 0)], [("F", 0), ("F", 1), ("BW", 0), ("BW", 1)]]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(2, 2, None, fixed(orders))


def test_first_stage_backward_and_its_own_w_run_as_one_backward():
    assert fused([("F", 0), ("F", 1), ("B", 0), ("W", 0), ("B", 1), ("F", 2), ("W", 1)]) == \
        [("F", 0), ("F", 1), ("BW", 0), ("B", 1), ("F", 2), ("W", 1)]

"""GPipe and ZB-H2, the two schedules users compare against 1F1B and ZB-H1, from their orders (one
process; their training against the single process is tests/test_schedules.py): their shape, their
bubble and memory in the simulator, and the planner pricing each from its order and proposing ZB-H2
where it fits and is faster."""
import pytest

from parallel.schedules import SCHEDULES
from parallel.zb_timeline import held_states, one_f_one_b_order, simulate, span_of
from tests.orders import activation_peak

UNIT = {"F": 1.0, "B": 1.0, "W": 1.0}


def orders(name: str, p: int, m: int, bound=0) -> list:
    return SCHEDULES[name].choices(p, m, bound)[0][0]


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 8) for m in (3, p, 2 * p - 1, 4 * p)])
def test_zb_h2_warms_up_with_2p_minus_2s_minus_1_forwards_and_defers_w_by_2s(p, m):
    for s, order in enumerate(orders("zb-h2", p, m)):
        kinds = [kind for kind, _ in order]
        assert kinds.index("B") == min(2 * (p - 1 - s) + 1, m)  # forwards before the first B
        backs = [i for i, (kind, _) in enumerate(order) if kind == "B"]
        for i, (kind, j) in enumerate(order):
            if kind == "W" and j + 2 * s < m:  # right after the B of j + 2s (and before its F)
                assert order[backs[j + 2 * s] + 1] == ("W", j)
        if m >= 2 * p - 1:
            assert max(a + w for a, w in held_states(order)) == 2 * p - 1  # micro-batches between F and W
    assert activation_peak(orders("zb-h2", p, m)[0]) == min(2 * p - 1, m)  # the first stage's in flight
    assert max(w for _, w in held_states(orders("zb-h2", p, m)[-1])) == min(2 * (p - 1), m - 1)


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 8) for m in (2 * p - 1, 2 * p, 4 * p)])
def test_zb_h2_at_equal_costs_idles_only_the_stages_skew(p, m):
    """A parallelogram: stage s works without a gap from its first forward at s to its last W at
    s + 3m; the step, closed by one collective, takes 3m + p − 1 units, the least any schedule can
    (the last stage cannot start before p − 1 forwards and has 3m units of work)."""
    timeline = simulate(p, m, UNIT, lambda _p, _m, s: orders("zb-h2", p, m)[s])
    for s, ops in enumerate(timeline):
        assert ops[0][0] == s and ops[-1][1] == s + 3 * m
        assert all(a[1] == b[0] for a, b in zip(ops, ops[1:]))
    assert max(ops[-1][1] for ops in timeline) == 3 * m + p - 1


@pytest.mark.parametrize("p", [3, 4, 8])
@pytest.mark.parametrize("w", [0.2, 0.3, 0.5, 0.7, 1.0])
def test_zb_h2_fills_the_tail_while_w_is_half_of_b(p, w):
    """Beyond the skew ZB-H2 idles (p − 1)·max(0, T_B − 2·T_W); ZB-H1 (the engine's choice among
    its orders, no bound) idles more whenever T_W < T_B."""
    m, cost = 4 * p, {"F": 1.0, "B": 1.0, "W": w}
    bound = (p - 1) * cost["F"] + m * (1.0 + 1.0 + w)
    h2 = span_of(orders("zb-h2", p, m), m, cost)
    assert h2 - bound == pytest.approx((p - 1) * max(0.0, 1.0 - 2 * w), abs=1e-9)
    _, _, h1 = SCHEDULES["zb-h1"].choose(p, m, cost, None)
    assert h1 > h2 + 1e-9 if w < 1.0 else h1 == pytest.approx(h2)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 5)])
def test_gpipe_holds_every_micro_batch_for_1f1bs_step(p, m):
    for cost in ({"F": 1.0, "BW": 2.0}, {"F": 0.4, "BW": 1.3}):
        gp = orders("gpipe", p, m)
        assert [activation_peak(o) for o in gp] == [m] * p
        assert span_of(gp, m, cost) == pytest.approx(span_of([one_f_one_b_order(p, m, s) for s in range(p)], m, cost))
        assert span_of(gp, m, cost) == pytest.approx((m + p - 1) * (cost["F"] + cost["BW"]))


def test_planner_prices_each_from_its_order_and_proposes_zb_h2_where_it_fits():
    """24L-24L d=1024 on 16 H100s: every schedule of the best layout priced (GPipe: 1F1B's step at
    m micro-batches in flight; ZB-H2: faster than ZB-H1, about twice its activations); with 12 GiB
    per GPU ZB-H2 is proposed, with 10.5 GiB it no longer fits and ZB-H1 is."""
    from model.config import ModelConfig
    from planner.devices import device
    from planner.planner import search

    cfg = ModelConfig(encoder_layers=24, decoder_layers=24, d_model=1024, heads=16, ffn_dim=4096, vocab_size=32000)
    best = {}
    for memory in (12, 10.5):
        dev = device("h100-80gb", memory_gib=memory)
        fits, too_big = search(cfg, 16, dev, 0.4, global_tokens=131072, seq_len=32, microbatch_tokens=(2048, 4096),
                               precision="bf16")
        best[memory] = fits[0]
        lay = fits[0].layout
        same = {p.layout.schedule_name: p for p in fits + too_big
                if p.layout == type(lay)(**{**lay.__dict__, "schedule": p.layout.schedule,
                                            "zb_max_pending": p.layout.zb_max_pending})}
        assert {name.split("(")[0] for name in same} == set(SCHEDULES)
        h2, h1, one, gp = same["zb-h2"], same["zb-h1(w=-1)"], same["1f1b"], same["gpipe"]
        assert h2.time["total"] < h1.time["total"] < one.time["total"]
        assert gp.time["total"] == pytest.approx(one.time["total"], rel=1e-9) and gp.peak_bytes > one.peak_bytes
        m = lay.micro_batches
        for s in range(lay.pp):
            assert max(a for a, _ in gp.time["pipeline"]["held"][s]) == m
            assert max(a + w for a, w in h2.time["pipeline"]["held"][s]) == min(2 * lay.pp - 1, m)
    assert best[12].layout.schedule == "zb-h2"
    assert best[10.5].layout.schedule == "zb-h1" and best[10.5].layout.zb_max_pending is None

"""ZB-H1 in the planner and the replay of measured costs (no launch; the check against a CPU run
is tests/test_zb_planner_cpu.py).

* The planner's simulation at m = p + 2 micro-batches, extended by F + B + W per further one,
  equals the full simulation for every order it uses.
* Its ZB-H1 model: a smaller bubble than 1F1B's for the same work (FLOP model), each stage's
  memory 1F1B's plus its pending W tensors; the bound 0 costs no memory; the split's measured own
  cost lengthens ZB-H1's work.
* `./run.sh plan` for the 3.2B model on 128 H100s proposes a zero-bubble schedule and shows the step time it
  gains against 1F1B in the same layout; the config keys it prints give that schedule.
* A paper config with schedule: zb-h1 in bf16 passes the pre-launch checks of `./run.sh slurm`.
* `bench schedules --measure-costs` on this CPU at a tiny width and `--replay` of its file.
"""
import json
import os

import pytest

from model.config import ModelConfig
from parallel.zb_timeline import filled_order, fixed, one_f_one_b_order, simulate, with_first_stage_share
from tests.orders import tuned_schedule


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("cost", [{"F": 1.0, "B": 1.0, "W": 1.0}, {"F": 1.0, "B": 1.3, "W": 0.6},
                                  {"F": 0.5, "B": 1.0, "W": 0.2}, {"F": 1.6, "B": 0.1, "W": 0.05}])
def test_extrapolated_span_equals_the_full_simulation(p, cost):
    """Every registry schedule (each pending bound) at equal stages grows by one micro-batch's work
    per micro-batch once past its warm-up: the planner's span is the full simulation of the order
    it chose (a tuning schedule's choice made at p + 2 is within the engine's 0.5% of the fastest
    candidate at m), and what it holds is that order's at m."""
    from parallel.schedules import SCHEDULES
    from planner.zb import extrapolated_span, order_memory

    for name, spec in SCHEDULES.items():
        unsplit = {"F": cost["F"], "BW": cost["B"] + cost["W"]}
        c = cost if spec.splits_backward else unsplit
        for bound in spec.pending_bounds or (0,):
            for m in sorted({1, max(1, p - 1), p + 2, p + 3, 2 * p + 1, 2 * p + 5, 4 * p + 1}):
                span, memory = extrapolated_span(name, p, m, c, bound)
                m_choice = min(m, p + 2)
                index = spec.choices(p, m_choice, bound).index(spec.choose(p, m_choice, c, bound)[:2])
                candidates = spec.choices(p, m, bound)
                orders, share = candidates[index]
                full = max(ops[-1][1] for ops in simulate(p, m, with_first_stage_share(c, p, share), fixed(orders)))
                assert span == pytest.approx(full, rel=1e-12), (name, bound, m)
                assert span <= min(max(ops[-1][1] for ops in simulate(p, m, with_first_stage_share(c, p, f), fixed(o)))
                                   for o, f in candidates) * 1.005 + 1e-12
                assert memory == order_memory(orders, share)


def test_planner_models_zb_h1_bubble_and_memory():
    from planner.devices import device
    from planner.planner import Candidate, pipeline_phase, stage_kinds, stage_memory, step_time, weight_grad_bytes

    cfg = ModelConfig(encoder_layers=12, decoder_layers=12, d_model=512, heads=8, ffn_dim=2048, vocab_size=32000)
    dev = device("a100-80gb")
    base = Candidate(pp=4, tp=1, dp=1, micro_batches=8, sequences=8, src_len=64, tgt_len=64, precision="bf16")
    zb = Candidate(**{**base.__dict__, "schedule": "zb-h1", "zb_max_pending": None})  # no bound: the tuned order
    t1, tz = step_time(cfg, base, dev, 0.4), step_time(cfg, zb, dev, 0.4)
    assert t1["bubble_fraction"] == pytest.approx(3 / 11)
    # FLOP model: W is the weight matmuls (≈ F on the layers), the output layer all F (its loss
    # computes its gradients in the forward): the bubble falls to 0.54 of 1F1B's
    assert tz["pipeline"]["source"].startswith("FLOP model")
    assert 0.4 * t1["bubble_fraction"] < tz["bubble_fraction"] < 0.6 * t1["bubble_fraction"]
    assert tz["total"] < t1["total"]
    # the same work: only the idle time shrinks
    assert tz["total"] - tz["bubble"] == pytest.approx(t1["total"] - t1["bubble"], rel=1e-9)
    for stage in range(4):
        extra = stage_memory(cfg, zb, stage, dev)["activations"] - stage_memory(cfg, base, stage, dev)["activations"]
        held = sum(weight_grad_bytes(cfg, k, 8, 64, 64, 2) for k in stage_kinds(cfg, 4)[stage])
        pending = pipeline_phase(cfg, zb, dev)["held"]
        # the paper's order: stage s holds s pending W while 1F1B's p − s micro-batches are in flight
        assert (4 - stage, stage) in pending[stage] and max(a for a, _ in pending[stage]) == 4 - stage
        assert extra == pytest.approx(stage * held)
    # the default bound 0: 1F1B's memory on every stage, a bubble between the two
    zb0 = Candidate(**{**base.__dict__, "schedule": "zb-h1"})
    t0 = step_time(cfg, zb0, dev, 0.4)
    assert tz["bubble_fraction"] < t0["bubble_fraction"] < t1["bubble_fraction"]
    for stage in range(4):
        assert stage_memory(cfg, zb0, stage, dev)["peak"] == stage_memory(cfg, base, stage, dev)["peak"]
    # measured costs whose split costs 20% more than the unsplit backward lengthen ZB-H1's work
    layer = {"F": 1.0, "B": 1.6, "W": 1.0, "F_1f1b": 1.0, "BW": 2.0}
    costly = {"encoder": layer, "decoder": layer, "output": {"F": 3.0, "B": 0.0, "W": 0.0, "F_1f1b": 3.0, "BW": 0.0}}
    tc = step_time(cfg, zb, dev, 0.4, zb_costs=costly)
    assert tc["pipeline"]["source"] == "given"
    assert tc["total"] - tc["bubble"] > 1.05 * (t1["total"] - t1["bubble"])


def test_weight_passes_of_the_output_layer_and_embedding_cost_nothing():
    """The output layer's weight gradient is computed in its loss's forward (parallel/loss.py), the
    embedding's inside B: neither holds W tensors nor has W work."""
    from planner.zb import flop_costs, weight_flops, weight_grad_bytes

    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=64, heads=4, ffn_dim=256, vocab_size=1000)
    for kind in ("output", "embed", "encoder_norm"):
        assert weight_grad_bytes(cfg, kind, 4, 16, 16, 2) == 0 and weight_flops(cfg, kind, 16, 16) == 0
    out = flop_costs(cfg, 16, 16)["output"]
    assert out["W"] == out["B"] == 0 and out["F"] == out["F_1f1b"] > 0


def test_plan_proposes_a_zero_bubble_schedule_for_the_3_2b_model_on_128_h100s(capsys):
    """The best plan splits its backward (a zero-bubble schedule of the registry: which one is the
    planner's to say), shows its step time against 1F1B's and every other schedule's in the same
    layout, and the config keys it prints give that schedule."""
    from launcher.cli import main
    from parallel.schedules import SCHEDULES

    assert main(["plan", "deepnet-100-100-1024", "--gpus", "128", "--gpu", "h100-80gb"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| pp")]
    assert any("zb-h1(w=-1)" in r for r in rows)
    best = text.split("Best: ")[1].split(" —")[0].split()[-1]  # its schedule, as the table names it
    name = best.split("(")[0]
    assert SCHEDULES[name].splits_backward
    gain = next(line for line in text.splitlines() if line.startswith("- Schedules of this layout"))
    assert all(f"; {n}" in gain or f": {n}" in gain for n in SCHEDULES)
    one = float(gain.split("; 1f1b ")[1].split(" s")[0])
    zb = float(gain.split(best + " ")[1].split(" s")[0])
    assert zb < one  # the step time it gains, shown against 1F1B in the same layout
    assert f"schedule: {name}" in text and f"--set parallel.schedule={name}" in text
    assert ("zb_max_pending_w: -1" in text) == bool(SCHEDULES[name].pending_bounds)


def test_paper_config_with_zb_h1_in_bf16_passes_the_pre_launch_checks(tmp_path):
    from launcher.cli import main
    from tests.bad_inputs import good_corpus
    from trainer.config import load_config

    corpus = good_corpus(tmp_path)
    run_dir = str(tmp_path / "run")
    config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "deepnet-100-100-1024.yaml")
    assert main(["slurm", config, "--cluster", "h100-80gb-x32", "--run-dir", run_dir, "--set", f"data.corpus={corpus}",
                 "--set", "parallel.schedule=zb-h1", "--set", "parallel.zb_max_pending_w=-1"]) == 0
    job = load_config(os.path.join(run_dir, "slurm", "config.yaml"))
    assert (job.parallel.schedule, job.parallel.zb_max_pending_w, job.parallel.precision) == ("zb-h1", -1, "bf16")


@pytest.fixture(scope="module")
def tiny_costs(tmp_path_factory):
    """--measure-costs on this CPU at d = 32 (about 20 s: eager only)."""
    from bench.schedules import main

    out = tmp_path_factory.mktemp("zb-costs")
    assert main(["--measure-costs", "eager", "--model", "deepnet-100-100-1024", "--d-model", "32", "--sequences", "2",
                 "--seq-len", "8", "--timed", "2", "--repeats", "1", "--out", str(out)]) == 0
    with open(out / "zb-costs.json") as f:
        return out, json.load(f)


def test_measure_costs_times_every_layer_kind_split_and_unsplit(tiny_costs):
    _, costs = tiny_costs
    assert costs["device"] == "cpu" and costs["precision"] == "fp32" and costs["model"]["d_model"] == 32
    kinds = costs["modes"]["eager"]
    assert set(kinds) == {"embed", "encoder", "decoder", "output"}
    for kind in ("encoder", "decoder"):
        c = kinds[kind]
        assert c["F"] > 0 and c["B"] > 0 and c["W"] > 0 and c["F_1f1b"] > 0 and c["BW"] > 0
    # nothing of the output layer and the embedding waits for W: the store's empty pass only
    for kind in ("embed", "output"):
        assert kinds[kind]["W"] < 0.05 * (kinds[kind]["F"] + kinds[kind]["B"])


def test_replay_turns_measured_costs_into_bubbles_and_memory(tiny_costs):
    from bench.schedules import main
    from bench.zb_replay import paper_micro_batches, replay_one, stage_costs

    out, costs = tiny_costs
    assert paper_micro_batches() == [4, 8, 16, 32]
    assert main(["--replay", str(out / "zb-costs.json"), "--pp", "2,4", "--micro-batches", "8", "--out", str(out)]) == 0
    with open(out / "zb-replay.json") as f:
        rows = json.load(f)["rows"]
    assert [(r["pp"], r["micro_batches"]) for r in rows] == [(2, 8), (4, 8)]
    for r in rows:
        s = r["schedules"]
        assert s["zb-h1(w=0)"]["largest_stage_gib"] == s["1f1b"]["largest_stage_gib"]  # bound 0: 1F1B's memory
        assert s["zb-h1(w=-1)"]["largest_stage_gib"] >= s["1f1b"]["largest_stage_gib"]
        assert 0 < s["1f1b"]["bubble"] < 1
    # the replay is the schedules' simulation on the stages' summed costs
    per_stage = stage_costs(costs, "eager", 2)
    kinds = costs["modes"]["eager"]
    assert per_stage[0]["F"] + per_stage[1]["F"] == pytest.approx(
        kinds["embed"]["F"] + 100 * kinds["encoder"]["F"] + 100 * kinds["decoder"]["F"] + kinds["output"]["F"])
    one = replay_one(costs, "eager", 2, 8)["schedules"]["1f1b"]
    assert one["schedule"] == "1f1b" and one["bound"] == 0
    ones = [{"F": c["F_1f1b"], "BW": c["BW"]} for c in per_stage]
    assert one["step_s"] == pytest.approx(max(ops[-1][1] for ops in simulate(2, 8, ones, one_f_one_b_order)))
    text = (out / "zb-replay.md").read_text()
    assert "| 2 | 8 |" in text and "| 4 | 8 |" in text


def test_planner_takes_the_engines_order_and_its_pending_w():
    """The planner's choice is zb_timeline's: equal F, B, W at pp = 2, m = 8: the paper's order (the
    last stage holds one pending W; 3m + p − 1 = 25 units); W at 0.6 of F: the filled order (the
    first stage one, the last two; 21.8 units); the bound 0: none pending, m·(F + B + W) + (p − 1)·(F + B)
    = 22.8."""
    from planner.zb import extrapolated_span

    def pending(memory):
        return [max(w for _, w in held) for held in memory["held"]]

    span, memory = extrapolated_span("zb-h1", 2, 8, {"F": 1.0, "B": 1.0, "W": 1.0}, None)
    assert span == pytest.approx(25.0) and pending(memory) == [0, 1] and memory["first_share"] == 1.0
    span, memory = extrapolated_span("zb-h1", 2, 8, {"F": 1.0, "B": 1.0, "W": 0.6}, None)
    assert span == pytest.approx(21.8) and pending(memory) == [1, 2]
    span, memory = extrapolated_span("zb-h1", 2, 8, {"F": 1.0, "B": 1.0, "W": 0.6}, 0)
    assert span == pytest.approx(22.8) and pending(memory) == [0, 0]
    orders, share = tuned_schedule(2, 8, {"F": 1.0, "B": 1.0, "W": 0.6})
    assert orders == [filled_order(2, 8, s) for s in range(2)] and share == 1.0

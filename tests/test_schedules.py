"""Every pipeline schedule of the registry (parallel/schedules.py) against the single process, and a
schedule added in a temporary module taken by the config, the planner, the simulator and this
equivalence test without another line.

Two launches of 4 ranks (tests/dist/schedules_worker.py): pp = 2 × tp = 2 (4 micro-batches,
activation checkpointing every layer) and
pp = 4 (8 micro-batches, more than a ZB-H2 first stage's 2p − 1 warm-up forwards), ZeRO-1, every
step clipped. Each trains every schedule, the added one and DeepSpeed's own 1F1B (PipelineEngine
running its TrainSchedule) in fp32, and at pp = 4 every registry schedule and DeepSpeed's 1F1B in
bf16 too. Checked:

* fp32: every schedule's per-step losses, clipped norms and parameters equal the single process's;
* the generated 1F1B (parallel/pipe_schedule.py on parallel/schedule_engine.py) equals DeepSpeed's
  TrainSchedule bit for bit (losses, norms, every parameter; fp32 in both launches, bf16 at pp = 4):
  the generator can replace TrainSchedule;
* bf16: every registry schedule whose backwards and W run in micro-batch order equals 1F1B in bf16
  bit for bit (each W folded on its own, in that order);
* the first stage's pipe buffers are its order's in-flight micro-batches.
"""
import json

import pytest
import torch

from parallel.pipe_schedule import fused
from parallel.schedules import SCHEDULES
from parallel.zb_timeline import held_states, simulate, span_of
from tests.conftest import launch, write_run_config
from tests.reference import assert_parameters_equal, assert_steps_equal, load_params, reference_run
from trainer.config import ConfigError, load_config

STEPS, CLIP = 3, 0.05
ADDED = "test-lifo"
MODULE = '''"""A schedule as a user adds one: its order and its registry entry, nothing else."""
from parallel.schedules import Schedule


def lifo_order(stages, micro_batches, stage):
    """All forwards, then the input gradients last micro-batch first, then every weight pass."""
    m = micro_batches
    return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))] + [("W", j) for j in range(m)]


SCHEDULE = Schedule("test-lifo", "LIFO", "all forwards, backwards last in first out, weight passes at the end",
                    lifo_order)
'''
NAMES = [*SCHEDULES, ADDED]
LAYOUTS = {"pp2tp2": ({"pipeline_stages": 2, "tensor_parallel": 2, "activation_checkpoint_interval": 1}, 4, "fp32"),
           "pp4": ({"pipeline_stages": 4}, 8, "fp32,bf16")}
"""(parallel section, micro-batches, precisions): recomputing every layer under tensor parallelism;
bf16 at pp = 4 only, to keep the suite short (tests/test_zero_bubble_equivalence.py runs bf16
under tensor parallelism)."""


def bubble_fraction(stages: int, micro_batches: int, cost: dict[str, float], schedule: str = "zb-h1") -> float:
    """Idle fraction of a step under the registry's schedule of that name, 1 − m·(F + B + W) / the
    simulated makespan, all stages costing `cost`."""
    makespan = max(ops[-1][1] for ops in simulate(stages, micro_batches, cost, SCHEDULES[schedule].order))
    return 1.0 - micro_batches * (cost["F"] + cost["B"] + cost["W"]) / makespan


@pytest.fixture(scope="module")
def added(tmp_path_factory):
    """The temporary module's schedule, in the registry for this module's tests; its file."""
    from tests.dist.schedules_worker import register

    path = tmp_path_factory.mktemp("added") / "added_schedule.py"
    path.write_text(MODULE)
    assert register(str(path)) == ADDED
    yield str(path)
    del SCHEDULES[ADDED]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, added, tiny_data, tmp_path_factory):
    parallel, micro_batches, precisions = LAYOUTS[request.param]
    work = tmp_path_factory.mktemp(f"schedules-{request.param}")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data, parallel=parallel,
                              train={"micro_batches": micro_batches, "clip_norm": CLIP, "lr": 0.001,
                                     "save_interval": 1000})
    out = str(work / "result.json")
    proc = launch(4, "tests.dist.schedules_worker", ["--config", config, "--out", out, "--steps", str(STEPS),
                                                    "--schedule-module", added, "--precisions", precisions])
    assert proc.returncode == 0, "schedules worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)
    return result, out, reference_run(load_config(config), STEPS), parallel["pipeline_stages"], micro_batches


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_equals_the_single_process(name, run):
    result, out, ref, pp, m = run
    got = result[f"{name}/fp32"]
    assert got["engine"] == "ScheduleEngine" and got["schedule"] == name
    assert [[tuple(op) for op in o] for o in got["orders"]] == SCHEDULES[name].choices(pp, m, 0)[0][0]  # the config's bound 0
    assert_steps_equal(got, ref, clipped_at=CLIP)
    assert_parameters_equal(load_params(f"{out}.{name}.fp32"), ref)
    # the first stage's buffers: its micro-batches between their first and last instruction
    first = [tuple(op) for op in got["orders"][0]]
    assert got["buffers"] == max(a + w for a, w in held_states(fused(first)))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_generated_1f1b_is_deepspeeds_train_schedule_bit_for_bit(precision, run):
    result, out, ref, _, _ = run
    if f"1f1b/{precision}" not in result:
        pytest.skip(f"{precision} runs at pp = 4")
    ours, theirs = result[f"1f1b/{precision}"], result[f"deepspeed/{precision}"]
    assert (ours["engine"], theirs["engine"]) == ("ScheduleEngine", "TrainerEngine")
    assert theirs["orders"] is None  # DeepSpeed's TrainSchedule ran
    assert ours["loss"] == theirs["loss"] and ours["grad_norm"] == theirs["grad_norm"]
    assert ours["grad_norm"][0] > CLIP and theirs["skipped_steps"] == 0
    a, b = load_params(f"{out}.1f1b.{precision}"), load_params(f"{out}.deepspeed.{precision}")
    assert set(a) == set(b) and a
    for key, value in b.items():
        assert torch.equal(a[key], value), key
    if precision == "bf16":
        assert ours["loss"][-1] != pytest.approx(ref["loss"][-1], rel=1e-6)  # bf16 ran


def in_micro_batch_order(orders: list) -> bool:
    """Every stage runs its backwards, and its W, in micro-batch order: then each micro-batch's
    gradients reach the fp32 sums in 1F1B's order."""
    return all([j for kind, j in order if kind == kind_] == sorted(j for kind, j in order if kind == kind_)
               for order in orders for kind_ in ("B", "BW", "W"))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_in_bf16_equals_1f1b(name, run):
    """Bit for bit where its backwards and W run in micro-batch order, else within bf16's rounding."""
    result, out, _, _, _ = run
    if "1f1b/bf16" not in result:
        pytest.skip("bf16 runs at pp = 4")
    got, base = result[f"{name}/bf16"], result["1f1b/bf16"]
    if not in_micro_batch_order([[tuple(op) for op in o] for o in got["orders"]]):
        assert got["loss"] == pytest.approx(base["loss"], rel=1e-2)
        return
    assert got["loss"] == base["loss"] and got["grad_norm"] == base["grad_norm"]
    a, b = load_params(f"{out}.{name}.bf16"), load_params(f"{out}.1f1b.bf16")
    for key, value in b.items():
        assert value.dtype == torch.bfloat16 and torch.equal(a[key], value), key


@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_has_an_order_the_simulator_runs(name, added):
    """Its order keeps every dependency (no deadlock) and does each micro-batch's work once."""
    unit = {"F": 1.0, "B": 1.0, "W": 1.0}
    for p, m in ((2, 4), (4, 8)):
        order = [SCHEDULES[name].order(p, m, s) for s in range(p)]
        for stage in order:
            assert sorted(j for kind, j in stage if kind == "F") == list(range(m))
        assert 0 <= bubble_fraction(p, m, unit, name) < 1


def test_the_config_accepts_the_registry_and_its_rules(tmp_path, tiny_data, added):
    config = write_run_config(str(tmp_path / "c.yaml"), str(tmp_path / "run"), tiny_data)
    for name, schedule in SCHEDULES.items():
        assert load_config(config, sets=[f"parallel.schedule={name}"]).parallel.schedule == name
        if not schedule.pending_bounds:
            with pytest.raises(ConfigError, match="zb_max_pending_w=1 applies to parallel.schedule"):
                load_config(config, sets=[f"parallel.schedule={name}", "parallel.zb_max_pending_w=1"])
        if schedule.splits_backward:
            with pytest.raises(ConfigError, match="instrument_interval > 0"):
                load_config(config, sets=[f"parallel.schedule={name}", "train.instrument_interval=1"])
    assert ADDED in SCHEDULES and SCHEDULES[ADDED].splits_backward
    with pytest.raises(ConfigError, match=f"must be one of {', '.join(SCHEDULES)}") as error:
        load_config(config, sets=["parallel.schedule=gpipe-x"])
    assert ADDED in str(error.value)


def test_the_planner_prices_the_added_schedule_from_its_order(added):
    """Offered for every pipelined layout; its memory from its order (all m forwards in flight on
    every stage, then every micro-batch's W pending), its bubble from the simulator."""
    from model.config import ModelConfig
    from planner.devices import device
    from planner.planner import Candidate, candidate_layouts, plan

    cfg = ModelConfig(encoder_layers=4, decoder_layers=4, d_model=256, heads=4, ffn_dim=1024, vocab_size=8000)
    dev = device("a100-80gb")
    layouts = candidate_layouts(cfg, 8, dev, global_tokens=65536, seq_len=64, microbatch_tokens=(2048,),
                                precision="bf16")
    assert {c.schedule for c in layouts if c.pp > 1} == set(SCHEDULES)
    assert all(c.schedule == "1f1b" for c in layouts if c.pp == 1)
    base = Candidate(pp=4, tp=1, dp=1, micro_batches=8, sequences=16, src_len=64, tgt_len=64, precision="bf16")
    one, lifo = plan(cfg, base, dev, 0.4), plan(cfg, Candidate(**{**base.__dict__, "schedule": ADDED}), dev, 0.4)
    for held in lifo.time["pipeline"]["held"]:  # at the first B: 8 in flight; at the last: 7 W pending
        assert (8, 0) in held and (1, 7) in held and all(a + w == 8 for a, w in held)
    assert one.time["pipeline"]["held"] == [[(4 - s, 0)] for s in range(4)]
    assert all(lifo.memory[s]["activations"] > one.memory[s]["activations"] for s in range(4))
    assert lifo.memory[3]["activations"] > 2 * one.memory[3]["activations"]  # 8 in flight against 1
    # the bubble: its order simulated at the planner's per-stage costs
    cost = lifo.time["pipeline"]["cost"]
    orders = [SCHEDULES[ADDED].order(4, 8, s) for s in range(4)]
    # (the planner simulates proportions rounded to 3 decimals: one simulation for many layouts)
    assert lifo.time["bubble_fraction"] == pytest.approx(1 - 8 * sum(cost.values()) / span_of(orders, 8, cost), rel=1e-3)

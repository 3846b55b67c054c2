"""Every pipeline schedule of the registry (parallel/schedules.py) against the single process.

One launch of 2 ranks (tests/dist/schedules_worker.py) trains the same pp = 2 run under each
registered schedule; each one's per-step losses, clipped global gradient norms (every step
clipped) and final parameters must equal the single-process reference. A schedule added to the
registry is covered here without another line; tests/test_zero_bubble_equivalence.py checks
ZB-H1's orders, precisions and tensor parallelism in depth.
"""
import json

import pytest

from parallel.schedules import SCHEDULES
from parallel.zb_timeline import simulate
from tests.conftest import launch, write_run_config
from tests.reference import assert_parameters_equal, assert_steps_equal, load_params, reference_run
from trainer.config import ConfigError, load_config

STEPS, CLIP = 3, 0.05


def bubble_fraction(stages: int, micro_batches: int, cost: dict[str, float], schedule: str = "zb-h1") -> float:
    """Idle fraction of a step under the registry's schedule of that name, 1 − m·(F + B + W) / the
    simulated makespan, all stages costing `cost`."""
    makespan = max(ops[-1][1] for ops in simulate(stages, micro_batches, cost, SCHEDULES[schedule].order))
    return 1.0 - micro_batches * (cost["F"] + cost["B"] + cost["W"]) / makespan


@pytest.fixture(scope="module")
def schedules_run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("schedules")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data,
                              train={"micro_batches": 4, "clip_norm": CLIP, "lr": 0.001, "save_interval": 1000})
    out = str(work / "result.json")
    proc = launch(2, "tests.dist.schedules_worker", ["--config", config, "--out", out, "--steps", str(STEPS)])
    assert proc.returncode == 0, "schedules worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)
    return result, out, reference_run(load_config(config), STEPS)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_equals_the_single_process(name, schedules_run):
    result, out, ref = schedules_run
    got = result[name]
    assert got["engine"] == got["engine_of_registry"]
    assert_steps_equal(got, ref, clipped_at=CLIP)
    assert_parameters_equal(load_params(f"{out}.{name}"), ref)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_has_an_order_the_simulator_runs(name):
    """Its order keeps every dependency (no deadlock) and does each micro-batch's work once."""
    unit = {"F": 1.0, "B": 1.0, "W": 1.0}
    for p, m in ((2, 4), (4, 8)):
        order = [SCHEDULES[name].order(p, m, s) for s in range(p)]
        for stage in order:
            assert sorted(j for kind, j in stage if kind == "F") == list(range(m))
        assert 0 <= bubble_fraction(p, m, unit, name) < 1


def test_the_config_accepts_the_registry_and_its_rules(tmp_path, tiny_data):
    config = write_run_config(str(tmp_path / "c.yaml"), str(tmp_path / "run"), tiny_data)
    for name, schedule in SCHEDULES.items():
        assert load_config(config, sets=[f"parallel.schedule={name}"]).parallel.schedule == name
        if not schedule.pending_bounds:
            with pytest.raises(ConfigError, match="zb_max_pending_w=1 applies to parallel.schedule"):
                load_config(config, sets=[f"parallel.schedule={name}", "parallel.zb_max_pending_w=1"])
        if schedule.splits_backward:
            with pytest.raises(ConfigError, match="instrument_interval > 0"):
                load_config(config, sets=[f"parallel.schedule={name}", "train.instrument_interval=1"])
    with pytest.raises(ConfigError, match=f"must be one of {', '.join(SCHEDULES)}"):
        load_config(config, sets=["parallel.schedule=gpipe"])

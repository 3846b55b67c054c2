"""pp=2 × dp=2 (4 ranks on the real deepspeed launcher) equals the single-process model.

Each replica takes its own micro-batches of the global batch; the token-weighted loss, the
clipped global gradient norm and the parameters must still be those of one process running the
whole global batch.
"""
import json

import pytest

from trainer.config import load_config
from tests.conftest import launch, write_run_config
from tests.reference import assert_parameters_equal, load_params, reference_run

STEPS = 3


def test_pp2_dp2_equals_single_process(tiny_data, tmp_path):
    config = write_run_config(str(tmp_path / "pp2dp2.yaml"), str(tmp_path / "run"), tiny_data,
                              parallel={"pipeline_stages": 2, "data_parallel": 2},
                              train={"micro_batches": 2, "clip_norm": 0.05, "lr": 0.001})
    out = str(tmp_path / "result.json")
    proc = launch(4, "tests.dist.pipeline_worker",
                  ["--config", config, "--out", out, "--steps", str(STEPS), "--save-at", "1", "--only-plain"])
    assert proc.returncode == 0, "pipeline worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)["plain"]
    ref = reference_run(load_config(config), STEPS)

    got = result["uninterrupted"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert min(ref["grad_norm"]) > 0.05  # clipping was active
    # 4 micro-batches per step were split over the replicas: each rank saw different shapes
    assert all(len(step) == 4 for step in got["shapes"])

    assert_parameters_equal(load_params(f"{out}.params"), ref, atol=1e-6)

    assert result["resumed"]["loss"] == pytest.approx(got["loss"][1:], rel=1e-6)

"""The trainer's engine without ZeRO (parallel.zero_stage: 0) gives the single-process numbers.

At ZeRO stage 0, parallel/optimizer.py's FlatOptimizer keeps its master weights and Adam moments
whole on every replica (a partition count of 1: each replica steps every weight and gathers
nothing), and the engine's reduction, global-norm clipping and zero_grad are the optimizer's.
Four launches on the real deepspeed launcher with ZeRO stage 0 in fp32, every step clipped: pp = 1
on one rank, pp = 1 with two replicas (the gradients all-reduced, each replica's partition group a
group of one), pp = 2 (the norm summed over the stages with the tied embedding counted once, where
DeepSpeed's own clipping without ZeRO counts only the first stage) and pp = 2 × tp = 2 (the
tensor-parallel shards summed once, the replicated parameters once). Losses, clipped norms and
parameters equal the single-process reference; a run resumed from a checkpoint (the optimizer
state kept in the model-states file, as DeepSpeed does without ZeRO) reproduces the uninterrupted
losses.
"""
import pytest

from trainer.config import load_config
from tests.conftest import run_worker, write_run_config
from tests.reference import assert_parameters_equal, assert_steps_equal, load_params, reference_run

STEPS, SAVE_AT, CLIP = 4, 2, 0.05


@pytest.fixture(scope="module", params=[(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 1, 2)],
                ids=["pp1-dp1", "pp1-dp2", "pp2-dp1", "pp2-tp2"])
def zero0_run(request, tiny_data, tmp_path_factory):
    pp, dp, tp = request.param
    work = tmp_path_factory.mktemp(f"zero0-pp{pp}-dp{dp}-tp{tp}")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data,
                              parallel={"pipeline_stages": pp, "data_parallel": dp, "tensor_parallel": tp,
                                        "zero_stage": 0, "precision": "fp32"},
                              train={"micro_batches": 4 // dp, "clip_norm": CLIP, "lr": 0.001,
                                     "save_interval": 1000})
    out = str(work / "result.json")
    result = run_worker(pp * dp * tp, "tests.dist.pipeline_worker", out,
                        ["--config", config, "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--only-plain"])
    return result["plain"], load_params(f"{out}.params"), reference_run(load_config(config), STEPS)


def test_zero0_losses_and_clipped_norms_equal_single_process(zero0_run):
    got, _, ref = zero0_run
    assert got["optimizer"] == "FlatOptimizer"
    # the norm is reported without ZeRO too (DeepSpeed leaves it unset there)
    assert_steps_equal(got["uninterrupted"], ref, clipped_at=CLIP)
    assert got["uninterrupted"]["loss"][-1] < got["uninterrupted"]["loss"][0]


def test_zero0_parameters_equal_single_process(zero0_run):
    _, params, ref = zero0_run
    assert_parameters_equal(params, ref, atol=1e-6)


def test_zero0_resumed_run_reproduces_uninterrupted_losses(zero0_run):
    got = zero0_run[0]
    assert got["resumed_from"] == SAVE_AT
    assert got["resumed"]["loss"] == pytest.approx(got["uninterrupted"]["loss"][SAVE_AT:], rel=1e-6)

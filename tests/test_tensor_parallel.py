"""Tensor parallelism (megatron-core layers inside pipeline stages) computes the unsharded numbers.

Launch 1 (2 ranks, tp=2): the vocabulary-parallel smoothed loss equals torch's; sharded init
equals the plain model's slices; loss and every gradient equal the plain model's; the trainer's
losses and clipped norms equal the single-process reference; a dropout run with activation
checkpointing resumes with identical losses.
Launch 2 (4 ranks, pp=2 × tp=2): losses, clipped global gradient norms and parameters equal the
single-process reference over 3 steps.
"""
import json

import pytest

from trainer.config import load_config
from tests.conftest import launch, write_run_config
from tests.reference import assert_parameters_equal, load_params, reference_run

TP_MODEL = {"heads": 4, "ffn_dim": 64}  # both divisible by 2; the tiny vocabulary (600) too


@pytest.fixture(scope="module")
def tp2(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("tp2")
    config = write_run_config(str(work / "tp2.yaml"), str(work / "run"), tiny_data, model=TP_MODEL,
                              parallel={"pipeline_stages": 1, "tensor_parallel": 2},
                              train={"micro_batches": 2, "clip_norm": 0.05, "lr": 0.001})
    out = str(work / "result.json")
    proc = launch(2, "tests.dist.tensor_parallel_worker", ["--config", config, "--out", out, "--steps", "4"])
    assert proc.returncode == 0, "tensor-parallel worker failed (its output is above)"
    with open(out) as f:
        return json.load(f), config


def test_vocab_parallel_smoothed_loss_equals_torch(tp2):
    r = tp2[0]["vocab_loss"]
    assert r["loss"] == pytest.approx(r["ref"], rel=1e-6)
    assert r["grad_rel"] < 1e-6 and r["grad_h_rel"] < 1e-6


def test_sharded_init_equals_unsharded_slices(tp2):
    init = tp2[0]["gradients"]["init_rel"]
    assert len(init) > 20
    assert max(init.values()) == 0.0


@pytest.mark.parametrize("check", ["gradients", "subln_gradients"])
def test_tp2_loss_and_every_gradient_equal_tp1(tp2, check):
    g = tp2[0][check]
    assert g["loss"] == pytest.approx(g["ref"], rel=1e-6)
    assert g["n_params"] == g["n_plain"]
    # The key bias has an exactly-zero true gradient (softmax ignores q·b_k): compare it in
    # absolute terms against the largest gradient; every other gradient relatively.
    for name, value in g["grad_rel"].items():
        if name.endswith("k_proj.bias"):
            assert g["grad_abs"][name] <= 1e-6 * g["grad_max"], name
        else:
            assert value <= 1e-5, name


def test_tp2_training_equals_single_process(tp2):
    result, config = tp2
    ref = reference_run(load_config(config), 4)
    got = result["training"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert min(ref["grad_norm"]) > 0.05


def test_tp2_checkpoint_resumes_with_identical_losses_under_dropout(tp2):
    r = tp2[0]["resume"]
    assert r["resumed_from"] == 2
    assert r["resumed"]["loss"] == pytest.approx(r["uninterrupted"]["loss"][2:], rel=1e-6)


def test_tp2_activation_checkpointing_recomputes_identical_dropout(tp2):
    with_ckpt = tp2[0]["resume"]["uninterrupted"]
    without = tp2[0]["dropout_no_checkpointing"]
    assert with_ckpt["loss"] == pytest.approx(without["loss"], rel=1e-6)
    assert with_ckpt["grad_norm"] == pytest.approx(without["grad_norm"], rel=1e-6)
    # dropout really acted: the losses differ from the dropout-free training run
    assert with_ckpt["loss"][0] != pytest.approx(tp2[0]["training"]["loss"][0], rel=1e-4)


def test_pp2_tp2_equals_single_process(tiny_data, tmp_path):
    config = write_run_config(str(tmp_path / "pp2tp2.yaml"), str(tmp_path / "run"), tiny_data, model=TP_MODEL,
                              parallel={"pipeline_stages": 2, "tensor_parallel": 2},
                              train={"micro_batches": 2, "clip_norm": 0.05, "lr": 0.001})
    out = str(tmp_path / "result.json")
    proc = launch(4, "tests.dist.pipeline_worker",
                  ["--config", config, "--out", out, "--steps", "3", "--save-at", "1", "--only-plain"])
    assert proc.returncode == 0, "pipeline worker failed (its output is above)"
    with open(out) as f:
        got = json.load(f)["plain"]
    ref = reference_run(load_config(config), 3)
    assert got["uninterrupted"]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["uninterrupted"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert got["resumed"]["loss"] == pytest.approx(got["uninterrupted"]["loss"][1:], rel=1e-6)
    assert_parameters_equal(load_params(f"{out}.params"), ref, atol=1e-6)

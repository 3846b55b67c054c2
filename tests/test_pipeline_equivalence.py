"""Pipelines on the real deepspeed launcher compute the single-process numbers.

Launch 1 (pp=2): per-step losses and clipped global gradient norms equal the single-process
reference (relative difference ≤ 1e-5) over steps whose batch shapes vary; parameters after the
steps equal the reference's and training moved every one; a run resumed from a checkpoint
reproduces the uninterrupted losses; activation checkpointing changes nothing; the partition is
the planner's.
Launch 2 (pp=3, an uneven partition: 4, 2 and 2 plan layers): with dropout on everywhere and
checkpointing every layer, losses, norms and parameters equal a single-process reference that
draws each stage's dropout from that stage's stream (tests/reference.py) — so every layer must
draw its own masks; the same without checkpointing; resumed runs replay the masks; the trainer's
pipeline module cuts several other shapes exactly as the planner does.
"""
import copy

import pytest
import torch

from trainer.config import load_config
from planner.planner import stage_bounds
from tests.conftest import run_worker, write_run_config
from tests.reference import assert_parameters_equal, assert_steps_equal, load_params, reference_run

STEPS, SAVE_AT = 5, 2
PP3_STEPS = 3
DROPOUT = 0.1


@pytest.fixture(scope="module")
def pp2_run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("pp2")
    # clip_norm far below the gradient norm, so every step is clipped; 3 micro-batches per step.
    config = write_run_config(str(work / "pp2.yaml"), str(work / "run"), tiny_data,
                              train={"micro_batches": 3, "clip_norm": 0.05, "lr": 0.001, "save_interval": 1000})
    out = str(work / "result.json")
    result = run_worker(2, "tests.dist.pipeline_worker", out,
                        ["--config", config, "--steps", str(STEPS), "--save-at", str(SAVE_AT),
                         "--scenarios", "plain,activation_checkpointing,zero1_deepspeed,zero1_fallback"])
    result["deepspeed_params"] = load_params(f"{out}.deepspeed")
    cfg = load_config(config)
    reference = reference_run(cfg, STEPS)  # sets cfg.model.vocab_size from the data, as the trainer does
    return result, load_params(f"{out}.params"), reference, cfg


@pytest.fixture(scope="module")
def pp3_run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("pp3")
    config = write_run_config(str(work / "pp3.yaml"), str(work / "run"), tiny_data,
                              parallel={"pipeline_stages": 3},
                              train={"micro_batches": 3, "clip_norm": 0.05, "lr": 0.001, "save_interval": 1000})
    out = str(work / "result.json")
    result = run_worker(3, "tests.dist.pipeline_worker", out,
                        ["--config", config, "--steps", str(PP3_STEPS), "--save-at", "1",
                         "--scenarios", "dropout,partitions"])
    cfg = load_config(config)
    cfg.model.dropout = cfg.model.attention_dropout = cfg.model.activation_dropout = DROPOUT
    bounds = result["dropout"]["partition"]
    staged = reference_run(copy.deepcopy(cfg), PP3_STEPS, stage_bounds=bounds)
    return result, load_params(f"{out}.dropout"), staged, cfg


def test_batches_change_shape_between_steps_and_micro_batches(pp2_run):
    shapes = pp2_run[0]["plain"]["uninterrupted"]["shapes"]
    assert len({tuple(map(tuple, micro)) for step in shapes for micro in step}) > 3
    assert any(len({tuple(x[0]) for x in step}) > 1 for step in shapes)  # within one step


def test_pp2_losses_and_clipped_norms_equal_single_process(pp2_run):
    result, _, ref, _ = pp2_run
    got = result["plain"]["uninterrupted"]
    assert_steps_equal(got, ref, clipped_at=0.05)
    assert got["loss"][-1] < got["loss"][0]  # it learns


def test_pp2_parameters_after_training_equal_single_process(pp2_run):
    _, params, ref, _ = pp2_run
    assert_parameters_equal(params, ref)


def test_pp2_resumed_run_reproduces_uninterrupted_losses(pp2_run):
    result = pp2_run[0]["plain"]
    assert result["resumed_from"] == SAVE_AT
    assert len(result["resumed"]["loss"]) == STEPS - SAVE_AT
    assert result["resumed"]["loss"] == pytest.approx(result["uninterrupted"]["loss"][SAVE_AT:], rel=1e-6)
    assert result["resumed"]["lr"] == pytest.approx(result["uninterrupted"]["lr"][SAVE_AT:], rel=1e-9)


def test_pp2_flat_optimizer_matches_deepspeeds_zero1(pp2_run):
    """ZeRO-1 in fp32 runs as parallel/optimizer.py's FlatOptimizer; DeepSpeed's own ZeRO-1
    optimizer, on the same launch, computes the same steps up to the order of fp32 sums: it takes
    the global norm over each replica's partition in fp64 and clips by 1 / ((‖g‖ + 1e-6) / c),
    FlatOptimizer over the whole buffer in fp32 (DeepSpeed's BF16_Optimizer's way) by
    c / (‖g‖ + 1e-6). Measured: losses and norms equal to 1e-7 relative. Weights: Adam moves an
    element whose gradient is near zero by up to lr per step whatever its size, so the last-bit
    differences of the two norms show there as a few 1e-5 after 5 steps at lr 1e-3 (measured ≤ 3.1e-5;
    tests/reference.py assert_parameters_equal has the argument); a wrong gradient moves elements
    by whole steps (≥ 1e-3)."""
    result, params, _, _ = pp2_run
    assert result["plain"]["optimizer"] == "FlatOptimizer"
    flat, shipped = result["plain"]["uninterrupted"], result["zero1_deepspeed"]
    assert flat["loss"] == pytest.approx(shipped["loss"], rel=1e-6)
    assert flat["grad_norm"] == pytest.approx(shipped["grad_norm"], rel=1e-6)
    assert flat["lr"] == shipped["lr"]
    assert sorted(params) == sorted(result["deepspeed_params"])
    for name in params:
        torch.testing.assert_close(params[name], result["deepspeed_params"][name], rtol=0, atol=5e-5, msg=name)


def test_flat_optimizer_copies_a_rebound_master_back_into_the_weights(pp2_run):
    result = pp2_run[0]
    fallback, flat = result["zero1_fallback"], result["plain"]["uninterrupted"]
    # fp32 at one replica: the master copy was the weights' memory, until the test rebound it
    assert fallback["shared_before"] is True and fallback["shared_after"] is False
    assert fallback["loss"] == flat["loss"] and fallback["grad_norm"] == flat["grad_norm"]


def test_activation_checkpointing_gives_identical_losses(pp2_run):
    result = pp2_run[0]
    assert result["activation_checkpointing"]["loss"] == pytest.approx(
        result["plain"]["uninterrupted"]["loss"], rel=1e-6)


def test_pp2_partition_is_the_planners(pp2_run):
    result, _, _, cfg = pp2_run
    parts = result["plain"]["partition"]
    assert parts == stage_bounds(cfg.model, 2)
    assert parts[0] == 0 and 0 < parts[1] < parts[2]


def test_pp3_uneven_partition_with_dropout_equals_staged_reference(pp3_run):
    result, params, staged, cfg = pp3_run
    parts = result["dropout"]["partition"]
    sizes = [b - a for a, b in zip(parts, parts[1:])]
    assert len(sizes) == 3 and len(set(sizes)) > 1, sizes  # uneven
    assert_steps_equal(result["dropout"]["uninterrupted"], staged, clipped_at=0.05)
    assert_parameters_equal(params, staged)


def test_pp3_dropout_without_checkpointing_equals_staged_reference(pp3_run):
    result, _, staged, cfg = pp3_run
    # without checkpointing: the same numbers (recomputation replayed every mask)
    assert_steps_equal(result["dropout_no_checkpointing"], staged, rel=1e-6)
    # dropout acted: the dropout-free reference differs
    plain_cfg = copy.deepcopy(cfg)
    plain_cfg.model.dropout = plain_cfg.model.attention_dropout = plain_cfg.model.activation_dropout = 0.0
    assert reference_run(plain_cfg, 1)["loss"][0] != pytest.approx(staged["loss"][0], rel=1e-4)


def test_pp3_resumed_run_replays_the_dropout_masks(pp3_run):
    result = pp3_run[0]["dropout"]
    assert result["resumed_from"] == 1
    assert result["resumed"]["loss"] == pytest.approx(result["uninterrupted"]["loss"][1:], rel=1e-6)


def test_trainer_and_planner_cut_the_same_stages(pp3_run):
    from model.config import ModelConfig
    from tests.dist.pipeline_worker import PARTITION_SHAPES

    result, _, _, cfg = pp3_run
    assert result["dropout"]["partition"] == stage_bounds(cfg.model, 3)
    assert set(result["partitions"]) == set(PARTITION_SHAPES)
    for name, shape in PARTITION_SHAPES.items():
        assert result["partitions"][name] == stage_bounds(ModelConfig(**shape), 3), name

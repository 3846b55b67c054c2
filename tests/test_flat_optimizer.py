"""parallel/optimizer.py's FlatOptimizer: DeepSpeed's BF16_Optimizer's numbers with a few
operations a step, its checkpoints, and fp16's loss scaling.

Launch 1 (deepspeed launcher, 2 ranks, tests/dist/flat_worker.py): bf16 at pp = 2 and at
pp = 1 × dp = 2 (ZeRO-1 partitions), each trained twice from the same weights and batches, with
DeepSpeed's BF16_Optimizer and with FlatOptimizer: losses, clipped norms, every parameter and
every fp32 master partition equal bit for bit. The pp = 2 run's checkpoint resumes to the same
losses, consolidates to its trained weights, and reshards to pp = 1 × dp = 2 (DeepSpeed's
universal checkpoint), which trains on. fp16 (where DeepSpeed's CPU accelerator takes it): a
forced overflow skips the step (weights, learning rate kept; counted; the scale halved; no
divergence event), the next step applies.
Launch 2 (one process, tests/dist/ops_worker.py): aten operations per step beyond the model at
6L-6L with 4 micro-batches (bench/ops.py, bench/counting.py), against bounds at what FlatOptimizer reaches,
and DeepSpeed's BF16_Optimizer's count on the same step: its per-tensor work, which the count must
see (else a bound met would prove nothing).
"""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, TINY_MODEL, run_worker, write_run_config

STEPS, SAVE_AT, CLIP = 4, 2, 0.05
# Operations per step beyond the model at 6L-6L, 4 micro-batches, pp = dp = 1, as measured
# (docs/pipeline.md): the optimizer's (with its fold, norm, clip, step and the guard's all-reduce)
# and in all (the pipeline engine's own added). DeepSpeed's BF16_Optimizer takes 2,566 on that step (docs/bench/ops-default.md).
OPTIMIZER_OPS = {"fp32": 37, "bf16": 44, "fp16": 50}
OPS = {"fp32": 66, "bf16": 73, "fp16": 79}


def fp16_unsupported() -> str | None:
    """Why fp16 cannot run here (DeepSpeed's accelerator lists its dtypes), or None."""
    import torch
    from deepspeed.accelerator import get_accelerator

    supported = get_accelerator().supported_dtypes()
    if torch.float16 in supported:
        return None
    return (f"DeepSpeed's {get_accelerator().device_name()} accelerator supports {supported} on this "
            "machine, not torch.float16")


@pytest.fixture(scope="module")
def flat_run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("flat")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data,
                              parallel={"pipeline_stages": 2, "data_parallel": 1, "zero_stage": 1},
                              train={"micro_batches": 4, "clip_norm": CLIP, "lr": 0.001, "save_interval": 1000})
    args = ["--config", config, "--steps", str(STEPS), "--save-at", str(SAVE_AT)]
    return run_worker(2, "tests.dist.flat_worker", str(work / "result.json"), args + ([] if fp16_unsupported() else ["--fp16"]))


@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_bf16_equals_deepspeeds_bf16_optimizer_bit_for_bit(flat_run, layout):
    run = flat_run[layout]
    ds, flat = run["deepspeed"], run["flat"]
    assert (ds["optimizer"], flat["optimizer"]) == ("BF16_Optimizer", "FlatOptimizer")
    assert flat["loss"] == ds["loss"] and flat["grad_norm"] == ds["grad_norm"] and flat["lr"] == ds["lr"]
    assert all(n > CLIP for n in flat["grad_norm"])  # every step clipped
    assert flat["loss"][-1] < flat["loss"][0]
    assert run["tensors"] > 50 and run["different_tensors"] == []


def test_bf16_checkpoint_resumes_to_the_same_losses(flat_run):
    resumed, flat = flat_run["resume"], flat_run["pp2"]["flat"]
    assert resumed["optimizer"] == "FlatOptimizer" and resumed["from"] == SAVE_AT
    assert resumed["loss"] == flat["loss"][SAVE_AT:] and resumed["grad_norm"] == flat["grad_norm"][SAVE_AT:]


def test_bf16_checkpoint_consolidates_to_the_trained_weights(flat_run):
    c = flat_run["consolidate"]
    assert c["step"] == STEPS and c["names"] and c["different"] == []


def test_bf16_checkpoint_reshards_to_pp1_dp2_and_trains_on(flat_run):
    """Resharded, the master weights and Adam moments are the checkpoint's; the pp = 1 × dp = 2
    layout then sums the same gradients in another order (the tied embedding's two parts in one
    stage, bf16 rounding of the replicas' halves), so its losses follow the pp = 2 run's within
    tests/test_bf16.py's bound for a different layout (1e-4), not bit for bit."""
    r, flat = flat_run["reshard"], flat_run["pp2"]["flat"]
    assert r["optimizer"] == "FlatOptimizer" and r["from"] == SAVE_AT
    assert r["loss"] == pytest.approx(flat["loss"][SAVE_AT:], rel=1e-4)
    assert r["grad_norm"] == pytest.approx(flat["grad_norm"][SAVE_AT:], rel=2.0**-10)


def test_fp16_overflow_skips_the_step_and_counts_it(flat_run):
    reason = fp16_unsupported()
    if reason:
        pytest.skip(reason)
    f = flat_run["fp16"]
    assert f["overflow"] and f["loss_scale_overflow"]
    assert f["skipped_steps"] == 1 and f["changed_by_overflow"] == [] and f["lr_kept"]
    assert f["scale_after"] == 2.0**39 and f["events"] == 0
    assert f["skipped_after"] == 1 and f["changed_by_third"] == f["tensors"]  # step 3 applied, every tensor moved
    assert abs(f["third"] - f["first"]) < 0.05 * f["first"] and f["third_norm"] > 0


@pytest.fixture(scope="module")
def op_counts(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("ops")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data,
                              model={**TINY_MODEL, "encoder_layers": 6, "decoder_layers": 6},
                              parallel={"pipeline_stages": 1, "data_parallel": 1, "zero_stage": 1},
                              train={"micro_batches": 4, "clip_norm": CLIP, "lr": 0.001, "save_interval": 1000})
    out = str(work / "ops.json")
    precisions = "fp32,bf16" + ("" if fp16_unsupported() else ",fp16")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "tests.dist.ops_worker", "--config", config, "--out", out,
                           "--precisions", precisions, "--deepspeed-bf16"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_operations_per_step_beyond_the_model_stay_at_the_measured_count(op_counts, precision):
    if precision not in op_counts:
        pytest.skip(fp16_unsupported())
    c = op_counts[precision]
    assert c["optimizer_class"] == "FlatOptimizer"
    assert c["optimizer"] <= OPTIMIZER_OPS[precision], c["beyond_model_ops"]
    assert c["beyond_model"] <= OPS[precision], c["beyond_model_ops"]
    assert c["accumulate"] == 0  # every backward's gradient taken by autograd as it is


def test_the_count_tells_deepspeeds_bf16_optimizer_apart(op_counts):
    ds, flat = op_counts["deepspeed_bf16"], op_counts["bf16"]
    assert ds["optimizer_class"] == "BF16_Optimizer"
    assert ds["model"] == flat["model"]  # the same model work on both
    # per tensor: a conversion and an add per micro-batch, a norm and a multiply per step
    assert ds["optimizer"] >= (2 * ds["micro_batches"] + 2) * ds["tensors"] > 10 * flat["beyond_model"]

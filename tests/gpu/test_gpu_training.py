"""The real engine on one CUDA GPU against the CPU fp32 reference (tests/reference.py).

One launch of tests/gpu/gpu_worker.py trains the tiny model of the CPU suite for STEPS steps in
fp32, bf16 and fp16 (2 micro-batches per step, batches of changing shapes, every step clipped).
Tolerances, relative to the CPU fp32 reference:
  - fp32: losses 1e-4, clipped gradient norms 1e-3. Both sides are IEEE fp32 (PyTorch keeps TF32
    off for matrix products by default); kernels sum in other orders (~1e-7 per operation), and
    five Adam steps carry that into the parameters, far below these bounds.
  - bf16: losses 2e-2, gradient norms 1e-1. bf16 keeps 8 significant bits (unit roundoff 2^-8
    ≈ 3.9e-3): the weights, every activation and the logits are rounded to it, so the loss moves
    by a few roundoffs (measured ≤ 1e-2 on CPU, tests/test_bf16.py); gradient norms sum squares of
    bf16 gradients and move more. fp16: loss of the first step 1e-2 (10 significant bits, but the
    loss scale must not change the value).
  - resume: losses of a resumed run equal the uninterrupted ones within 1e-5 (the attention
    backward kernels may accumulate in another order from run to run on a GPU).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.gpu_results import read_jsonl
from runtime import accelerator
from tests.conftest import ROOT, launch, write_run_config
from tests.reference import reference_run
from trainer.config import load_config

pytestmark = pytest.mark.gpu

STEPS, SAVE_AT = 5, 2
TRAIN = {"micro_batches": 2, "clip_norm": 0.05, "lr": 0.001, "save_interval": 1000}


@pytest.fixture(scope="module")
def gpu_run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("gpu")
    config = write_run_config(str(work / "gpu.yaml"), str(work / "run"), tiny_data,
                              parallel={"pipeline_stages": 1}, train=TRAIN)
    out = str(work / "result.json")
    proc = launch(1, "tests.gpu.gpu_worker",
                  ["--config", config, "--out", out, "--steps", str(STEPS), "--save-at", str(SAVE_AT)])
    assert proc.returncode == 0, "GPU worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)
    with torch.device(accelerator.HOST):
        reference = reference_run(load_config(config), STEPS)
    return result, reference, config, out


@pytest.mark.parametrize("precision,loss_rel,norm_rel", [("fp32", 1e-4, 1e-3), ("bf16", 2e-2, 1e-1)])
def test_training_matches_cpu_fp32_reference(gpu_run, precision, loss_rel, norm_rel):
    result, ref, _, _ = gpu_run
    got = result[precision]["uninterrupted"]
    assert len(got["loss"]) == STEPS
    for step in range(STEPS):
        assert got["loss"][step] == pytest.approx(ref["loss"][step], rel=loss_rel), f"{precision} step {step + 1}"
        assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=norm_rel), \
            f"{precision} step {step + 1} gradient norm"
        assert ref["grad_norm"][step] > TRAIN["clip_norm"]  # clipping was active
    assert got["loss"][-1] < got["loss"][0]


def test_bf16_really_ran_in_bf16(gpu_run):
    result, ref, _, out = gpu_run
    diffs = [abs(a - b) / b for a, b in zip(result["bf16"]["uninterrupted"]["loss"], ref["loss"])]
    assert max(diffs) > 1e-5  # fp32 arithmetic would have matched to ~1e-7
    params = torch.load(f"{out}.bf16.pt", weights_only=True)
    weight = params["encoder_layers.0.ffn.fc1.weight"]
    assert torch.equal(weight, weight.bfloat16().float())  # the model's weights are bf16 values


def test_fp16_overflow_steps_are_skipped_and_counted(gpu_run):
    result, ref, _, _ = gpu_run
    fp16 = result["fp16"]["uninterrupted"]
    overflows = sum(fp16["overflow"])
    assert overflows >= 1, f"a start scale of 2^24 should overflow fp16 gradients: {fp16['scale']}"
    assert fp16["skipped_steps"] == overflows
    for step, overflow in enumerate(fp16["overflow"]):
        unchanged = fp16["checksum"][step + 1] == fp16["checksum"][step]
        assert unchanged == overflow, f"step {step + 1}: overflow {overflow} but parameters unchanged {unchanged}"
    assert fp16["scale"][-1] < fp16["scale"][0]  # the dynamic scaler backed off
    assert fp16["overflow"][-1] is False  # and training resumed
    # Until the first applied step the parameters are the initial ones: the loss is the reference's
    # first-step loss on the same batches, whatever the loss scale.
    assert fp16["loss"][0] == pytest.approx(ref["loss"][0], rel=1e-2)
    assert all(torch.isfinite(torch.tensor(fp16["loss"])))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_every_tensor_is_on_the_gpu(gpu_run, precision):
    result = gpu_run[0][precision]
    assert result["engine_device"].startswith(accelerator.GPU)
    assert result["backend"] == "nccl"
    assert set(result["input_devices"]) == {accelerator.GPU}, result["input_devices"]
    assert set(result["state_devices"]) == {accelerator.GPU}, result["state_devices"]
    assert result["state_devices"][accelerator.GPU] > 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_resume_reproduces_losses(gpu_run, precision):
    result = gpu_run[0][precision]
    assert result["resumed_from"] == SAVE_AT
    assert result["resumed"]["loss"] == pytest.approx(result["uninterrupted"]["loss"][SAVE_AT:], rel=1e-5)
    assert result["resumed"]["lr"] == pytest.approx(result["uninterrupted"]["lr"][SAVE_AT:], rel=1e-9)


def test_consolidate_and_beam_search_on_the_gpu(gpu_run, tmp_path):
    from checkpoint.checkpoints import consolidate, load_model
    from model.decoding import DecodeOptions, generate
    from translate.translator import Translator

    _, _, config, _ = gpu_run
    run_dir = load_config(config).run_dir + "-fp32"
    path = str(tmp_path / "model.pt")
    consolidate(run_dir, path)
    translator = Translator(load_model(path))
    assert next(translator.model.parameters()).device.type == accelerator.GPU
    texts = ["Open the file", "Save the document as a new file", "Quit", "Print the selected pages"]
    options = DecodeOptions(beam=5, lenpen=1.0, max_len_a=1.0, max_len_b=10)
    hyps_gpu, tokens = translator.translate(texts, ["de", "fr", "de", "fr"], options)
    assert tokens > 0 and all(h for h in hyps_gpu)
    tok = translator.tokenizer
    sources = [tok.encode_source(t, lang) for t, lang in zip(texts, ["de", "fr", "de", "fr"])]
    on_gpu = generate(translator.model, sources, options, bos=tok.bos_id, eos=tok.eos_id, banned=list(tok.tags.values()))
    on_host = generate(load_model(path).model.to(accelerator.HOST), sources, options, bos=tok.bos_id,
                       eos=tok.eos_id, banned=list(tok.tags.values()))
    for a, b in zip(on_gpu, on_host):
        assert a.tokens == b.tokens
        assert a.score == pytest.approx(b.score, rel=1e-4, abs=1e-5)


def test_peak_memory_within_the_planners_prediction(tmp_path):
    """A 6L-6L d=512 bf16 step (4,096-token micro-batches) against planner/planner.py: the
    planner counts tensors, not the allocator's rounding and cuBLAS workspaces: ±10% (measured on an
    H200: 2.91 GiB against 2.94 predicted; docs/bench/gpu-h200/results.jsonl)."""
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--worker", "6L-6L-d512:eager", "--tokens", "4096",
                           "--steps", "2", "--warmup", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = read_jsonl(str(tmp_path / "rows.jsonl"))  # the worker's one measurement (bench/gpu.py)
    measured, predicted = record["row"]["peak_memory_bytes"], record["meta"]["planner_peak_bytes"]
    assert 0.9 <= measured / predicted <= 1.1, f"measured {measured / 2**30:.2f} GiB, planner {predicted / 2**30:.2f} GiB"


def test_pp2_over_nccl_matches_reference(tiny_data, tmp_path):
    if accelerator.gpu_count() < 2:
        pytest.skip(f"pp=2 with NCCL needs 2 GPUs; this machine has {accelerator.gpu_count()}")
    config = write_run_config(str(tmp_path / "pp2.yaml"), str(tmp_path / "run"), tiny_data, train=TRAIN)
    out = str(tmp_path / "result.json")
    proc = launch(2, "tests.dist.pipeline_worker",
                  ["--config", config, "--out", out, "--steps", str(STEPS), "--save-at", str(SAVE_AT), "--only-plain"])
    assert proc.returncode == 0, "pp=2 worker failed (its output is above)"
    with open(out) as f:
        got = json.load(f)["plain"]["uninterrupted"]
    ref = reference_run(load_config(config), STEPS)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-4)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)

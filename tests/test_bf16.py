"""bf16 training of the real trainer at pp=2 on CPU, against a single-process bf16 reference.

The reference follows DeepSpeed 0.19.8's BF16_Optimizer (runtime/bf16_optimizer.py), whose rules
the trainer's optimizer keeps (parallel/optimizer.py's FlatOptimizer, a BF16_Optimizer equal to it
bit for bit: tests/test_flat_optimizer.py):
  - weights are bf16; the fp32 master copy is made from them (so it starts at bf16 values);
  - per micro-batch: bf16 gradients are cleared, backward runs in bf16, and each gradient is
    added, converted to fp32, into an fp32 accumulator (`_update_hp_grad`);
  - after the last micro-batch: the global L2 norm of the fp32 gradients, clipping by
    max_norm / (norm + 1e-6), the client AdamW step on the fp32 master weights, then the bf16
    weights are the master weights rounded to bf16 (`update_lp_params`).
The loss is the label-smoothed sum in fp32 over bf16 logits, as in the trainer.

Tolerance. bf16 keeps 8 significant bits: one rounding moves a value by at most 2^-9 relative
(≈ 2.0e-3). The pipeline computes the same operations on the same bf16 values; what differs is
the order of a few additions: the tied embedding's gradient is the sum of the input-embedding
and output-projection parts, each rounded to bf16 on its own stage and summed in fp32 across
stages, where the single process sums them in bf16 (one more rounding, ≤ 2^-9 per element of
that one gradient), and kernels on sliced inputs may accumulate in another order. Those
per-element errors have random signs, so the global norm, a root of a sum over ~8·10^4 squares,
moves by a small fraction of one rounding: bound 2^-10 (≈ 9.8e-4, half a rounding; inside a
stage the layers pass the encoder and decoder streams as separate tensors, joined into one only
at stage boundaries, so more sums run in another order than the single process's: measured
2.8e-4 at step 1 and 7.8e-4 at step 2). The
loss moves only through parameters changed by those gradients after Adam's normalisation and a
rounding to bf16 (most elements round back to the same bf16 value): bound 1e-4. Measured on
this corpus over 4 steps: losses ≤ 4.3e-5, norms ≤ 2.8e-4 apart. The same run against the fp32
reference is 1.3e-5..2.5e-4 apart in loss and 9e-4..3.6e-3 in norm: outside these bounds at the
worst step and on average over the steps, so the check tells bf16 from fp32
(test_the_tolerance_separates_bf16_from_fp32).

bf16 vs fp32 over 50 steps (same initial weights and batches, clip 1.0): per step
|loss_bf16 − loss_fp32| ≤ 1% of loss_fp32 (the band; measured ≤ 0.045%), both curves fall by more
than 0.5 nat (7.01 → 6.13 measured), and they are not identical.
"""
import json
import os

import pytest
import torch

from data.batching import BatchStream, PairDataset
from data.prepare import load_manifest
from model.transformer import EncoderDecoder, smoothed_loss_sum
from parallel.engine_config import adamw, inverse_sqrt
from tests.conftest import launch, write_run_config
from tests.reference import reference_run
from trainer.config import load_config

STEPS, CURVE_STEPS = 4, 50
LOSS_REL, NORM_REL = 1e-4, 2.0**-10
BAND = 0.01


def bf16_reference_run(cfg, steps: int) -> dict:
    """The trainer's recipe in one process with BF16_Optimizer's precision rules (module doc)."""
    data_dir = os.path.join(cfg.run_dir, "data")
    cfg.model.vocab_size = cfg.model.vocab_size or load_manifest(data_dir)["vocab_size"]
    model = EncoderDecoder(cfg.model, seed=cfg.train.seed).to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().clone().requires_grad_(True) for p in params]
    t = cfg.train
    opt = adamw(master, t)  # the trainer's client optimizer (fused where torch has the kernel)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt(t.warmup_steps))
    stream = BatchStream(PairDataset(os.path.join(data_dir, "train")), cfg.data.max_tokens, cfg.data.seed,
                         cfg.data.sampling_temperature)
    m = t.micro_batches * cfg.parallel.data_parallel
    out = {"loss": [], "grad_norm": []}
    for _ in range(steps):
        batches = stream.next_step(m)
        total = sum(int(b["ntokens"]) for b in batches)
        accumulated = [torch.zeros_like(w) for w in master]
        step_loss = 0.0
        for b in batches:
            model.zero_grad(set_to_none=True)
            loss = smoothed_loss_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], cfg.model.pad_id,
                                     cfg.model.label_smoothing) * torch.tensor(1.0 / total)
            loss.backward()
            for acc, p in zip(accumulated, params):
                if p.grad is not None:
                    acc.add_(p.grad.float())
            step_loss += loss.item()
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in accumulated]))
        if t.clip_norm > 0:
            coef = t.clip_norm / (norm + 1e-6)
            if coef < 1:
                for g in accumulated:
                    g.mul_(coef)
        for w, g in zip(master, accumulated):
            w.grad = g
        opt.step()
        sched.step()
        with torch.no_grad():
            for p, w in zip(params, master):
                p.copy_(w)  # rounded to bf16
        out["loss"].append(step_loss)
        out["grad_norm"].append(norm.item())
    return out


@pytest.fixture(scope="module")
def bf16_run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("bf16")
    # Every step clipped; 3 micro-batches of changing shapes per step.
    config = write_run_config(str(work / "bf16.yaml"), str(work / "run"), tiny_data,
                              train={"micro_batches": 3, "clip_norm": 0.05, "lr": 0.001, "save_interval": 1000})
    out = str(work / "result.json")
    proc = launch(2, "tests.dist.bf16_worker", ["--config", config, "--out", out, "--steps", str(STEPS),
                                                  "--curve-steps", str(CURVE_STEPS)])
    assert proc.returncode == 0, "bf16 worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)
    return result, bf16_reference_run(load_config(config), STEPS), config


def test_bf16_trains_with_the_flat_bf16_optimizer(bf16_run):
    result, _, _ = bf16_run
    # FlatOptimizer is DeepSpeed's BF16_Optimizer with its per-tensor work folded into flat
    # operations; its equality with DeepSpeed's own is tests/test_flat_optimizer.py's.
    assert result["short"]["optimizer"] == "FlatOptimizer"
    shapes = result["short"]["shapes"]
    assert len({tuple(map(tuple, micro)) for step in shapes for micro in step}) > 3  # lengths change


def test_pp2_bf16_losses_and_clipped_norms_match_the_bf16_reference(bf16_run):
    result, ref, _ = bf16_run
    got = result["short"]
    for step in range(STEPS):
        assert got["loss"][step] == pytest.approx(ref["loss"][step], rel=LOSS_REL), f"step {step + 1} loss"
        assert ref["grad_norm"][step] > 0.05  # clipping was active
        assert got["grad_norm"][step] == pytest.approx(ref["grad_norm"][step], rel=NORM_REL), f"step {step + 1} norm"


def test_the_tolerance_separates_bf16_from_fp32(bf16_run):
    result, _, config = bf16_run
    fp32 = reference_run(load_config(config), STEPS)
    got = result["short"]
    worst_loss = max(abs(a - b) / b for a, b in zip(got["loss"], fp32["loss"]))
    assert worst_loss > LOSS_REL
    norm_gaps = [abs(a - b) / b for a, b in zip(got["grad_norm"], fp32["grad_norm"])]
    assert max(norm_gaps) > NORM_REL and sum(norm_gaps) / len(norm_gaps) > NORM_REL, norm_gaps


def test_bf16_and_fp32_curves_stay_within_the_band_for_50_steps(bf16_run):
    curves = bf16_run[0]["curves"]
    bf16, fp32 = curves["bf16"]["loss"], curves["fp32"]["loss"]
    assert len(bf16) == len(fp32) == CURVE_STEPS
    for step, (a, b) in enumerate(zip(bf16, fp32)):
        assert abs(a - b) <= BAND * b, f"step {step + 1}: bf16 {a:.4f} vs fp32 {b:.4f}"
    assert fp32[0] - fp32[-1] > 0.5 and bf16[0] - bf16[-1] > 0.5
    assert bf16 != fp32  # bf16 really ran

"""The single-process reference the parallel runs are compared with, and the comparisons.

`reference_run` applies exactly the trainer's recipe with plain PyTorch (model/step.py's
`plain_step`): the same batch stream, the token-weighted label-smoothed loss over the global batch,
AdamW, inverse-sqrt LR, global-norm clipping by torch.nn.utils.clip_grad_norm_, BranchNorm's step
counter; optionally the stability instruments of model/instruments.py, and dropout drawn the way
a pipeline draws it.

Dropout in a pipeline: each stage's rank draws from its own stream (runtime/rng.py
`seed_dropout(seed, stage, replica)`), layer after layer, micro-batch after micro-batch
(activation checkpointing replays a forward's draws and restores the stream, so it changes
nothing). `reference_run(..., stage_bounds=b)` walks the layer plan and switches to stage s's
stream for the layers of stage s, so a pipeline with dropout must reproduce its losses exactly —
and would not if, say, every layer drew the same masks.
"""
from __future__ import annotations

import bisect
import contextlib
import glob
import os

import pytest
import torch

from data.batching import BatchStream, PairDataset, eval_batches
from data.prepare import load_manifest
from model.layers import padding_mask, split_fused_projections
from model.norms import set_training_step
from model.step import plain_step
from model.transformer import EncoderDecoder, layer_plan
from parallel.engine_config import inverse_sqrt
from parallel.tensor import merge_shards
from runtime.rng import seed_dropout


class StageStreams:
    """The default-RNG stream of each pipeline stage, swapped in for that stage's layers."""

    def __init__(self, seed: int, stages: int):
        outer = torch.get_rng_state()
        self.states = []
        for stage in range(stages):
            seed_dropout(seed, stage, 0)
            self.states.append(torch.get_rng_state())
        torch.set_rng_state(outer)
        self.current: int | None = None

    def enter(self, stage: int) -> None:
        if stage != self.current:
            if self.current is not None:
                self.states[self.current] = torch.get_rng_state()
            torch.set_rng_state(self.states[stage])
            self.current = stage

    def leave(self) -> None:
        if self.current is not None:
            self.states[self.current] = torch.get_rng_state()
            self.current = None


def staged_forward(model: EncoderDecoder, bounds: list[int], streams: StageStreams, src: torch.Tensor,
                   tgt_in: torch.Tensor) -> torch.Tensor:
    """EncoderDecoder.forward layer by layer along the plan, each layer in its stage's stream."""
    mask = padding_mask(src, model.cfg.pad_id)
    enc = dec = logits = None
    for i, layer in enumerate(layer_plan(model.cfg)):
        streams.enter(bisect.bisect_right(bounds, i) - 1)
        if layer.kind == "embed":
            enc, dec = model.embed(src), model.embed(tgt_in)
        elif layer.kind == "encoder":
            enc = model.encoder_layers[layer.index](enc, mask)
        elif layer.kind == "encoder_norm":
            enc = model.encoder_norm(enc)
        elif layer.kind == "decoder":
            dec = model.decoder_layers[layer.index](dec, enc, mask)
        elif layer.kind == "decoder_norm":
            dec = model.decoder_norm(dec)
        else:
            logits = model.embed.logits(dec)
    streams.leave()
    return logits


def reference_run(cfg, steps: int, *, instruments: bool = False, stage_bounds: list[int] | None = None) -> dict:
    """Train `steps` steps in one process. Returns per-step loss, clipped global gradient norm, lr,
    the largest |gradient| of any key bias (`k_bias_grad`) and of any parameter (`grad_max`), the
    initial and final parameters; with `instruments`, ‖ΔF‖, LayerNorm inputs and per-layer
    gradient norms on the dev split's middle batch (`delta_f`, `ln_input`, `layer_grad`)."""
    data_dir = os.path.join(cfg.run_dir, "data")
    cfg.model.vocab_size = cfg.model.vocab_size or load_manifest(data_dir)["vocab_size"]
    model = EncoderDecoder(cfg.model, seed=cfg.train.seed)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.adam_betas, eps=t.adam_eps,
                            weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt(t.warmup_steps))
    stream = BatchStream(PairDataset(os.path.join(data_dir, "train")), cfg.data.max_tokens,
                         cfg.data.seed, cfg.data.sampling_temperature)
    m = t.micro_batches * cfg.parallel.data_parallel
    out = {"loss": [], "grad_norm": [], "lr": [], "k_bias_grad": [], "grad_max": [], "adam_eps": t.adam_eps,
           "init": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    monitor = None
    if instruments:
        from model.instruments import ProbeMonitor

        dev = eval_batches(PairDataset(os.path.join(data_dir, "dev")), cfg.data.max_tokens)
        monitor = ProbeMonitor(model, dev[len(dev) // 2], cfg.model.pad_id)
        first = monitor.measure()
        out.update(delta_f=[first["delta_f"]], ln_input=[first["ln_input"]], layer_grad=[None])
    streams = StageStreams(t.seed, len(stage_bounds) - 1) if stage_bounds else None

    def record_gradients():  # the step's gradients before clipping
        grads = split_fused_projections({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        out["k_bias_grad"].append(max(float(g.abs().max()) for n, g in grads.items() if n.endswith("k_proj.bias")))
        out["grad_max"].append(max(float(g.abs().max()) for g in grads.values()))

    forward = (lambda src, tgt_in: staged_forward(model, stage_bounds, streams, src, tgt_in)) if streams else None
    for step in range(steps):
        set_training_step(model, step)
        batches = stream.next_step(m)
        with monitor.gradients() if monitor else contextlib.nullcontext() as grads:
            done = plain_step(model, batches, opt, scheduler=sched, forward=forward, after_backward=record_gradients,
                              clip_norm=t.clip_norm if t.clip_norm > 0 else float("inf"))
        set_training_step(model, step + 1)
        out["lr"].append(done.lr)
        out["loss"].append(done.loss)
        out["grad_norm"].append(done.grad_norm.item())
        if monitor:
            measured = monitor.measure()
            out["delta_f"].append(measured["delta_f"])
            out["ln_input"].append(measured["ln_input"])
            out["layer_grad"].append(grads.result())
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def load_params(prefix: str) -> dict[str, torch.Tensor]:
    """The parameters a worker dumped as `<prefix>.stage<s>.tp<t>.pt`, tensor-parallel shards merged."""
    params = {}
    stages = sorted({p[len(prefix) + len(".stage"):].split(".")[0] for p in glob.glob(f"{prefix}.stage*.pt")})
    for stage in stages:
        paths = sorted(glob.glob(f"{prefix}.stage{stage}.tp*.pt"))
        params.update(merge_shards([torch.load(path, weights_only=True) for path in paths]))
    return params


def assert_parameters_equal(got: dict[str, torch.Tensor], ref: dict, rtol: float = 1e-4, atol: float = 5e-5) -> None:
    """Every trained parameter equals the reference's, and training moved every one of them.

    Adam divides each gradient by its own running RMS, so an element whose gradient is tiny moves
    by up to lr per step whatever its size: the fp32 rounding differences between summation
    orders then show as differences of a few 1e-5 (measured ≤ 3.1e-5 after 5 steps at lr 1e-3);
    a wrong gradient moves its elements by whole steps (≥ 1e-3), hence atol.

    The key biases are compared against their own bound. Softmax is invariant to adding the same
    number to every score of a query, and q·(k_j + b_k) = q·k_j + q·b_k adds q·b_k to all of them:
    b_k's true gradient is exactly 0, and what autograd returns is rounding noise G (the reference
    asserts G ≤ 1e-6 of the largest gradient). Adam moves an element by at most lr·|m̂|/(√v̂ + ε)
    ≤ lr·G/ε per step, so both runs must keep b_k within Σ lr·min(1, 10·G/ε) of its initial value
    (factor 10: the other run's noise), and within twice that of each other.
    """
    assert set(got) == set(ref["params"])
    eps = ref["adam_eps"]
    noise = max(ref["k_bias_grad"])
    assert noise <= 1e-6 * min(ref["grad_max"]), "the key bias must have a zero gradient"
    k_bound = sum(lr * min(1.0, 10 * noise / eps) for lr in ref["lr"])
    for name, value in ref["params"].items():
        start = ref["init"][name]
        if name.endswith("k_proj.bias"):
            assert (got[name] - start).abs().max() <= k_bound, name
            assert (value - start).abs().max() <= k_bound, name
            assert (got[name] - value).abs().max() <= 2 * k_bound, name
            continue
        torch.testing.assert_close(got[name], value, rtol=rtol, atol=atol, msg=name)
        # training moved it (an embedding row per step at least; a frozen parameter would not move)
        assert not torch.equal(got[name], start), f"{name} did not change in training"


def assert_steps_equal(got: dict, ref: dict, rel: float = 1e-5, clipped_at: float | None = None) -> None:
    """Per-step losses and clipped global gradient norms equal the reference's."""
    assert len(got["loss"]) == len(ref["loss"])
    for step, (a, b) in enumerate(zip(got["loss"], ref["loss"])):
        assert a == pytest.approx(b, rel=rel), f"step {step + 1}: loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["grad_norm"], ref["grad_norm"])):
        if clipped_at is not None:
            assert b > clipped_at  # clipping was active
        assert a == pytest.approx(b, rel=rel), f"step {step + 1}: norm {a} vs reference {b}"

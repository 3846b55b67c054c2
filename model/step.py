"""One plain training step: the whole model in one process, no pipeline, no DeepSpeed.

    for each micro-batch: logits = model(src, tgt_in)
                          loss = Σ label-smoothed cross-entropy over its non-pad targets / N
                          loss.backward()
    [clip the global gradient norm]; optimizer step; [scheduler step]; gradients cleared

N is the number of target tokens of the step: by default the non-pad targets of all the
micro-batches given, which is the trainer's normalisation (parallel/pipeline.py: the summed loss
of every micro-batch over the target tokens of the global batch, `max(N, 1)`), so the step's loss
and gradient are those of the token-weighted mean over the global batch, as in fairseq. A caller
that trains on part of a global batch passes the global batch's count as `tokens`.

The single-process reference of the equivalence tests (tests/reference.py), the plain model of
the benchmarks (bench/model.py, bench/data.py, bench/worker.py) and the update-norm experiments
(experiments/update_norms.py) all train with this step.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from model.transformer import smoothed_loss_sum

PARTS = ("forward", "backward", "clipping", "optimizer")
"""The phases `plain_step` times when given a clock; forward includes the loss."""


@dataclasses.dataclass
class StepResult:
    loss: float
    """The step's loss: the micro-batches' normalised losses summed (Python floats, in order)."""
    grad_norm: torch.Tensor | None
    """The global gradient norm before clipping (clip_grad_norm_'s), None when not clipping."""
    lr: float
    """The learning rate of the optimizer's first parameter group in this step's update."""
    seconds: dict[str, float]
    """With a clock: its seconds per phase (PARTS); empty otherwise."""


def target_tokens(batches: list[dict], pad_id: int) -> int:
    """The non-pad target tokens of `batches` (what data/batching.py's `ntokens` counts)."""
    return sum(int((b["tgt_out"] != pad_id).sum()) for b in batches)


def plain_step(model: nn.Module, batches: list[dict], optimizer: torch.optim.Optimizer, *,
               tokens: int | None = None, clip_norm: float | None = None, scheduler=None,
               forward: Callable | None = None, loss_sum: Callable = smoothed_loss_sum,
               after_backward: Callable[[], None] | None = None,
               clock: Callable[[], float] | None = None) -> StepResult:
    """One training step of `model` (an EncoderDecoder: its `cfg` gives pad_id and
    label_smoothing) on `batches` (dicts with src, tgt_in, tgt_out).

    tokens: the step's target tokens (default: those of `batches`, `target_tokens`).
    clip_norm: clip the global gradient norm at this value (torch.nn.utils.clip_grad_norm_;
        `float("inf")` measures the norm without clipping); None: neither clip nor measure.
    scheduler: stepped after the optimizer.
    forward: (src, tgt_in) → logits instead of `model(src, tgt_in)`.
    loss_sum: (logits, tgt_out, pad_id, label_smoothing) → the summed loss (model/transformer.py
        `smoothed_loss_sum`; another model package's own).
    after_backward: called once every micro-batch's gradient is in, before clipping.
    clock: a clock (e.g. time.process_time) to time the phases with (StepResult.seconds).
    """
    cfg = model.cfg
    tokens = max(target_tokens(batches, cfg.pad_id) if tokens is None else tokens, 1)
    forward = forward or model
    seconds = dict.fromkeys(PARTS, 0.0) if clock else {}

    def timed(part: str, start: float) -> None:
        if clock:
            seconds[part] += clock() - start

    total = 0.0
    for b in batches:
        start = clock() if clock else 0.0
        loss = loss_sum(forward(b["src"], b["tgt_in"]), b["tgt_out"], cfg.pad_id, cfg.label_smoothing) / tokens
        timed("forward", start)
        start = clock() if clock else 0.0
        loss.backward()
        timed("backward", start)
        total += loss.item()
    if after_backward is not None:
        after_backward()
    start = clock() if clock else 0.0
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm) if clip_norm is not None else None
    timed("clipping", start)
    lr = optimizer.param_groups[0]["lr"]
    start = clock() if clock else 0.0
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad()
    timed("optimizer", start)
    return StepResult(loss=total, grad_norm=norm, lr=lr, seconds=seconds)

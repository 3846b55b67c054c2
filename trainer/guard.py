"""Divergence guard: a bad step never becomes an applied update (nor, therefore, a checkpoint).

A step is bad when its loss or its gradient norm is not finite, or its loss exceeds
`train.divergence_spike_factor` × the median loss of the last `train.divergence_window` applied
steps. The decision is taken inside DeepSpeed's optimizer step, after the gradients are reduced and
before any weight changes, on every rank together: one all-reduce of (loss share, non-finite flag)
over all ranks, so every stage and replica skips or applies the same update.

Where the decision hooks in (DeepSpeed 0.19.8):
  the trainer's FlatOptimizer (parallel/optimizer.py, every precision): its `step_gate`, called once
      per step after the global norm and before the update; True skips it. In fp16 a loss-scale
      overflow (non-finite scaled norm) is the scaler's own skip, not a divergence: the gate then
      checks the loss only, and `after_step` reports no event for it unless the loss is bad.
  ZeRO 1/2 (`DeepSpeedZeroOptimizer.step`): after `scaled_global_norm()` returns the global norm; a
      bad step sets `overflow`, and ZeRO's own overflow path clears the gradients and returns
      before the update (with fp32 it already treats a non-finite norm so; with bf16 it would not).
  BF16_Optimizer: when it collects the gradients for the norm; a bad step adds a NaN to them, so its
      own non-finite-norm path skips the update (which also catches a non-finite norm afterwards).
  no ZeRO, fp32 (the client optimizer itself): before `step()`, from the gradients' finiteness and
      the norm the engine computed for clipping; a bad step does not call it and sets `overflow`.
In every case the engine then counts a skipped step and does not advance the LR schedule.

The loss share is what the pipeline's last stage accumulated over its micro-batches
(`engine.total_loss`); summed over replicas and divided by micro-batches × replicas it is the
step's reported loss. The trainer applies the policy after the step (trainer/trainer.py).
"""
from __future__ import annotations

import math
import statistics

import torch

from parallel.layout import Layout
from trainer import signals


class DivergenceStop(RuntimeError):
    """Raised by the trainer under the `stop` policy (and after too many events); one line."""


class DivergenceGuard:
    def __init__(self, engine, train_cfg, layout: Layout):
        self.engine = engine
        self.layout = layout
        self.policy = train_cfg.divergence_policy
        self.factor = train_cfg.divergence_spike_factor
        self.window = train_cfg.divergence_window
        self.max_events = train_cfg.divergence_max_events
        self.scale = 1.0 / (engine.gradient_accumulation_steps() * layout.dp)
        self.recent: list[float] = []  # losses of the last applied steps, the same on every rank
        self.events: list[dict] = []
        self.pending: dict | None = None
        self.preempt = False
        """Whether any rank asked for a preemption checkpoint, as of the last decision (the flag
        travels in the decision's all-reduce: no collective of its own per step)."""
        self.step_loss: float | None = None
        """The last decided step's loss (mean over its micro-batches and replicas)."""
        self._install(engine.optimizer)

    # ---- state kept in checkpoints (the spike check's window must survive a resume) ----------
    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "events": list(self.events)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.recent = [float(x) for x in state.get("recent", [])]
            self.events = list(state.get("events", []))

    # ---- the decision, inside the optimizer step ---------------------------------------------
    def _flags(self, local_nonfinite: bool) -> torch.Tensor:
        """(this rank's share of the step's loss, its non-finite flag, its preemption flag), on the
        device, read from nothing on the host: the loss share stays a device tensor."""
        e = self.engine
        extra = torch.tensor([float(local_nonfinite), float(signals.stop.checkpoint)], dtype=torch.float64,
                             device=self.layout.device)
        if not self.layout.last_stage or self.layout.tp_rank != 0 or e.total_loss is None:
            return torch.cat([extra.new_zeros(1), extra])
        return torch.cat([e.total_loss.detach().reshape(1).to(torch.float64), extra])

    def decide_on_device(self, norm: torch.Tensor, scale: float = 1.0, scaled: bool = False) -> tuple[bool, float]:
        """The step's one host sync: the loss shares, the flags and `norm` (the global gradient
        norm as a device tensor, −1 when not finite; × `scale` under fp16's loss scaling) reduced
        and read together. Returns (skip the update, the norm as a float: unscaled, inf when not
        finite). `scaled`: a non-finite norm is the loss scaler's own overflow, not a divergence.
        Collective over all ranks."""
        flags = self._flags(False)
        torch.distributed.all_reduce(flags)
        loss, nonfinite, preempt, value = torch.cat([flags, norm.detach().reshape(1).to(torch.float64)]).tolist()
        finite = math.isfinite(value) and value != -1.0
        value = value / scale if finite else float("inf")
        skip = self._decide(loss * self.scale, nonfinite > 0, preempt > 0, None if not finite and scaled else value)
        return skip, value

    def decide(self, norm: float | None, local_nonfinite: bool = False) -> bool:
        """True when the update must not be applied (for optimizers that give the norm as a float).
        Collective over all ranks."""
        flags = self._flags(local_nonfinite)
        torch.distributed.all_reduce(flags)
        loss, nonfinite, preempt = flags.tolist()
        return self._decide(loss * self.scale, nonfinite > 0, preempt > 0, norm)

    def _decide(self, loss: float, nonfinite: bool, preempt: bool, norm: float | None) -> bool:
        self.preempt = preempt
        reason = None
        if not math.isfinite(loss):
            reason = f"loss is {loss}"
        elif norm is not None and not math.isfinite(norm):
            reason = f"gradient norm is {norm}"
        elif nonfinite:
            reason = "gradients are not finite"
        elif self.factor > 0 and len(self.recent) >= self.window:
            median = statistics.median(self.recent)
            if loss > self.factor * median:
                reason = (f"loss {loss:.4f} is {loss / median:.3g}× the median {median:.4f} of the last "
                          f"{self.window} steps (train.divergence_spike_factor={self.factor:g})")
        self.pending = {"loss": loss, "grad_norm": norm, "reason": reason}
        self.step_loss = loss
        return reason is not None

    def _install(self, opt) -> None:
        if hasattr(opt, "step_gate"):  # parallel/optimizer.py's FlatOptimizer
            opt.step_gate = self.decide_on_device
        elif hasattr(opt, "scaled_global_norm"):  # ZeRO stage 1/2
            original = opt.scaled_global_norm

            def scaled_global_norm(*args, **kwargs):
                norm = original(*args, **kwargs)
                value = float(norm) / float(getattr(opt, "loss_scale", 1.0) or 1.0)
                if self.decide(value):
                    opt.overflow = True
                return norm

            opt.scaled_global_norm = scaled_global_norm
        elif hasattr(opt, "get_grads_for_norm") and hasattr(opt, "clear_hp_grads"):  # BF16_Optimizer
            original = opt.get_grads_for_norm

            def get_grads_for_norm(for_clipping=False):
                grads = original(for_clipping=for_clipping)
                if not for_clipping and self.decide(None):
                    poison = torch.full((1,), float("nan"), device=self.layout.device)
                    non_expert, expert = grads
                    grads = (list(non_expert) + [poison], expert)
                return grads

            opt.get_grads_for_norm = get_grads_for_norm
        else:  # the client optimizer, no ZeRO
            original = opt.step

            def step(*args, **kwargs):
                norm = self.engine._global_grad_norm if self.engine.gradient_clipping() > 0 else None
                # A non-finite gradient makes the clipping norm non-finite; without clipping, one
                # max-abs per tensor (foreach) instead of a check and a sync per tensor.
                local = False
                if norm is None:
                    grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
                    local = bool(grads) and not bool(
                        torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf")))).all())
                skip = self.decide(float(norm) if norm is not None else None, local)
                opt.overflow = skip
                return None if skip else original(*args, **kwargs)

            opt.step = step

    # ---- after the step -----------------------------------------------------------------------
    def after_step(self, step: int) -> dict | None:
        """The event of the step just taken (None when its update was applied)."""
        decided, self.pending = self.pending, None
        overflow = bool(getattr(self.engine.optimizer, "overflow", False))
        if decided is None:  # no decision point reached (e.g. fp16's own overflow check skipped it)
            if not overflow:
                return None
            decided = {"loss": float("nan"), "grad_norm": None, "reason": None}
        reason = decided["reason"]
        if reason is None and getattr(self.engine.optimizer, "loss_scale_overflow", False):
            return None  # fp16's loss scaler skipped the step and lowered the scale
        if reason is None and overflow:
            reason = "gradient norm is not finite"
        if reason is None:
            self.recent = (self.recent + [decided["loss"]])[-self.window:]
            return None
        norm = decided["grad_norm"]
        event = {"step": step, "reason": reason, "loss": decided["loss"],
                 "grad_norm": norm if norm is None or math.isfinite(norm) else str(norm), "policy": self.policy}
        if not math.isfinite(event["loss"]):
            event["loss"] = str(event["loss"])
        self.events.append(event)
        return event

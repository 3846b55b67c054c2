"""Divergence guard: a bad step never becomes an applied update (nor, therefore, a checkpoint).

A step is bad when its loss or its gradient norm is not finite, or its loss exceeds
`train.divergence_spike_factor` × the median loss of the last `train.divergence_window` applied
steps. The decision is taken inside the optimizer step, after the gradients are reduced and
before any weight changes, on every rank together: one all-reduce of (loss share, preemption
flag) over all ranks, so every stage and replica skips or applies the same update.

Where the decision hooks in (DeepSpeed 0.19.8):
  the trainer's FlatOptimizer (parallel/optimizer.py), which every engine the trainer builds uses,
      in every precision: its `step_gate`, called once per step after the global norm and before
      the update, reads the norm with the loss shares and preemption flags in the step's one host
      sync; True skips the update. In fp16 a loss-scale overflow (non-finite scaled norm) is the scaler's own skip, not
      a divergence: the gate then checks the loss only, and `after_step` reports no event for it
      unless the loss is bad.
  DeepSpeed's own optimizers, built only where a test sets `FlatOptimizer.enabled = False` (its A/B
      runs: ZeRO-1 in fp32, BF16_Optimizer in bf16), are hooked too, so that those runs decide and
      report their losses the way the trainer's runs do, which the tests compare them with (bf16:
      bit for bit). ZeRO-1 (`DeepSpeedZeroOptimizer.step`): after `scaled_global_norm()` returns
      the global norm; a bad step sets `overflow`, and ZeRO's own overflow path clears the
      gradients and returns before the update. BF16_Optimizer: when it collects the gradients for
      the norm; a bad step adds a NaN to them, so its own non-finite-norm path skips the update.
  Any other optimizer (at ZeRO stage 0 DeepSpeed's bare client optimizer or FP16_Optimizer) is
      refused with a TypeError.
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
from schema.text import count
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
        self._constants: dict[float, torch.Tensor] = {}
        self._install(engine.optimizer)

    # ---- state kept in checkpoints (the spike check's window must survive a resume) ----------
    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "events": list(self.events)}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.recent = [float(x) for x in state.get("recent", [])]
            self.events = list(state.get("events", []))

    # ---- the decision, inside the optimizer step ---------------------------------------------
    def _constant(self, value: float) -> torch.Tensor:
        """A one-element float64 device tensor of `value`, made once by a fill kernel (never copied
        from the host: `torch.tensor(x, device=…)` is a blocking host-to-device copy on a GPU)."""
        if value not in self._constants:
            self._constants[value] = torch.full((1,), value, dtype=torch.float64, device=self.layout.device)
        return self._constants[value]

    def _flags(self) -> torch.Tensor:
        """(this rank's share of the step's loss, its preemption flag), on the device, read from
        nothing on the host and copied from nothing there: the loss share stays a device tensor,
        the flag is one of two constant device tensors."""
        e = self.engine
        extra = self._constant(float(signals.stop.checkpoint))
        if not self.layout.last_stage or self.layout.tp_rank != 0 or e.total_loss is None:
            return torch.cat([self._constant(0.0), extra])
        return torch.cat([e.total_loss.detach().reshape(1).to(torch.float64), extra])

    def decide_on_device(self, norm: torch.Tensor, scale: float = 1.0, scaled: bool = False) -> tuple[bool, float]:
        """The step's one host sync: the loss shares, the preemption flags and `norm` (the global gradient
        norm as a device tensor, −1 when not finite; × `scale` under fp16's loss scaling) reduced
        and read together. Returns (skip the update, the norm as a float: unscaled, inf when not
        finite). `scaled`: a non-finite norm is the loss scaler's own overflow, not a divergence.
        Collective over all ranks."""
        flags = self._flags()
        torch.distributed.all_reduce(flags)
        loss, preempt, value = torch.cat([flags, norm.detach().reshape(1).to(torch.float64)]).tolist()
        finite = math.isfinite(value) and value != -1.0
        value = value / scale if finite else float("inf")
        skip = self._decide(loss * self.scale, preempt > 0, None if not finite and scaled else value)
        return skip, value

    def decide(self, norm: float | None) -> bool:
        """True when the update must not be applied (DeepSpeed's own optimizers: the norm as a
        float, or None where it is not known yet). Collective over all ranks."""
        flags = self._flags()
        torch.distributed.all_reduce(flags)
        loss, preempt = flags.tolist()
        return self._decide(loss * self.scale, preempt > 0, norm)

    def _decide(self, loss: float, preempt: bool, norm: float | None) -> bool:
        self.preempt = preempt
        reason = None
        if not math.isfinite(loss):
            reason = f"loss is {loss}"
        elif norm is not None and not math.isfinite(norm):
            reason = f"gradient norm is {norm}"
        elif self.factor > 0 and len(self.recent) >= self.window:
            median = statistics.median(self.recent)
            if loss > self.factor * median:
                reason = (f"loss {loss:.4f} is {loss / median:.3g}× the median {median:.4f} of the last "
                          f"{count(self.window, 'step')} (train.divergence_spike_factor={self.factor:g})")
        self.pending = {"loss": loss, "grad_norm": norm, "reason": reason}
        self.step_loss = loss
        return reason is not None

    def _install(self, opt) -> None:
        if hasattr(opt, "step_gate"):  # parallel/optimizer.py's FlatOptimizer
            opt.step_gate = self.decide_on_device
        elif hasattr(opt, "scaled_global_norm"):  # DeepSpeed's ZeRO optimizer (A/B runs)
            original = opt.scaled_global_norm

            def scaled_global_norm(*args, **kwargs):
                norm = original(*args, **kwargs)
                value = float(norm) / float(getattr(opt, "loss_scale", 1.0) or 1.0)
                if self.decide(value):
                    opt.overflow = True
                return norm

            opt.scaled_global_norm = scaled_global_norm
        elif hasattr(opt, "get_grads_for_norm") and hasattr(opt, "clear_hp_grads"):  # BF16_Optimizer (A/B runs)
            original = opt.get_grads_for_norm

            def get_grads_for_norm(for_clipping=False):
                grads = original(for_clipping=for_clipping)
                if not for_clipping and self.decide(None):
                    poison = torch.full((1,), float("nan"), device=self.layout.device)
                    non_expert, expert = grads
                    grads = (list(non_expert) + [poison], expert)
                return grads

            opt.get_grads_for_norm = get_grads_for_norm
        else:
            raise TypeError(f"the divergence guard has no decision point in {type(opt).__name__}: "
                            "the trainer's engines use parallel/optimizer.py's FlatOptimizer")

    # ---- after the step -----------------------------------------------------------------------
    def after_step(self, step: int) -> dict | None:
        """The event of the step just taken (None when its update was applied)."""
        decided, self.pending = self.pending, None
        if decided is None:  # nothing decided: every optimizer step of the hooked optimizers decides
            return None
        reason = decided["reason"]
        if reason is None and getattr(self.engine.optimizer, "loss_scale_overflow", False):
            return None  # FlatOptimizer in fp16: the loss scaler skipped the step and lowered the scale
        if reason is None and getattr(self.engine.optimizer, "overflow", False):
            # BF16_Optimizer (A/B runs) skipped a step whose norm it found non-finite after deciding
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

"""Stability instruments of a training run, on any pipeline × tensor × data layout.

Every `train.instrument_interval` steps (0 = off, nothing installed) the trainer records:
  * ‖ΔF‖ on a fixed probe batch (the middle dev batch), relative to the model at step 0,
  * the gradient norm of every encoder/decoder layer in that step,
  * the mean size of the residual LayerNorm inputs of every layer on the probe batch.
Definitions are in model/instruments.py. Each stage measures its own layers; the stage holding
the decoder's last layer (or final LayerNorm) measures ‖ΔF‖ on replica 0 (tensor-parallel rank 0:
the residual stream is replicated across tensor-parallel ranks); everything is gathered to global
rank 0, which writes the summary scalars through DeepSpeed's monitor (TensorBoard and
metrics/train/*.csv, beside loss and lr), every per-layer value to TensorBoard, and one long CSV
<run_dir>/metrics/stability.csv (step, quantity, layer, value).

F(x, θ_0) is kept in <run_dir>/metrics/stability_reference*.pt, so a resumed run keeps measuring
against step 0. A run that turns the instruments on later measures against the step it resumed at
(and says so).
"""
from __future__ import annotations

import contextlib
import csv
import os

import torch
from torch import nn

from model.instruments import GradNorms, LayerNormInputs, OutputCapture, probe_masks, update_sums
from model.transformer import layer_plan
from runtime import safe_load


def stage_layers(module: nn.Module, plan) -> dict[str, nn.Module]:
    """The plain encoder/decoder layers of this pipeline stage, by their plan name.
    `PipelineModule` registers plan layer i as child 'i'; the wrappers hold it as `.layer`."""
    return {plan[int(name)].name: child.layer for name, child in module.named_children()
            if name.isdigit() and plan[int(name)].kind in ("encoder", "decoder")}


def _is_sharded(p: torch.Tensor) -> bool:
    # megatron-core marks the parameters it splits across tensor-parallel ranks.
    return bool(getattr(p, "tensor_model_parallel", False))


class StabilityLogger:
    def __init__(self, trainer):
        from data.batching import eval_batches

        self.trainer = trainer
        self.engine, cfg = trainer.engine, trainer.cfg
        self.interval = cfg.train.instrument_interval
        self.pad_id = cfg.model.pad_id
        self.layers = stage_layers(trainer.module, layer_plan(cfg.model))
        self.layout = trainer.layout
        dev = eval_batches(trainer.valid_data, cfg.data.max_tokens)
        self.probe = dev[len(dev) // 2]  # typical lengths (the split is length-sorted)
        self.masks = probe_masks(self.probe["src"], self.probe["tgt_in"], self.pad_id)
        self.out_mask = self.probe["tgt_out"] != self.pad_id
        self.metrics_dir = os.path.join(cfg.run_dir, "metrics")
        self.ref_path = os.path.join(self.metrics_dir, "stability_reference.pt")
        # F is the output of the plan layer just before the output projection (the decoder's last
        # layer or final LayerNorm); its wrapper returns the in-stage flow (enc, dec, src, tgt_in,
        # mask) of parallel/pipeline.py, F = dec.
        last = dict(trainer.module.named_children()).get(str(len(layer_plan(cfg.model)) - 2))
        self.output_module = last if last is not None and self.layout.replica == self.layout.tp_rank == 0 else None
        self.measures_delta = self.output_module is not None
        self.reference: torch.Tensor | None = None

    # ---- the trainer's calls -----------------------------------------------------------------
    def due(self, step: int) -> bool:
        return step % self.interval == 0

    def start(self, step: int) -> None:
        """Take (step 0) or reload F(x, θ_0); log the starting point of a fresh run."""
        found = torch.tensor(0)
        if self.measures_delta and step > 0 and os.path.exists(self.ref_path):
            try:
                saved = safe_load.load(self.ref_path)  # tensors and numbers only: nothing in it runs
            except (safe_load.UnsafeFile, safe_load.UnreadableFile) as e:
                raise SystemExit(f"error: {e}; remove it to measure against this step") from None
            self.reference, found = saved["output"], torch.tensor(1)
        output, ln = self._measure()
        if self.measures_delta and self.reference is None:
            self.reference = output
            os.makedirs(self.metrics_dir, exist_ok=True)
            torch.save({"step": step, "output": output}, self.ref_path)
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
        if step > 0 and int(found) == 0 and self.layout.rank == 0:
            print(f"stability: no F(x, θ_0) from step 0 in {self.metrics_dir}; ‖ΔF‖ is measured "
                  f"against step {step}", flush=True)
        if step == 0:
            self._log(0, output, ln, None)

    def gradients(self, step: int):
        """Context for the train step that ends at `step`: per-layer gradient norms when due."""
        return GradNorms(self.layers) if self.due(step) else contextlib.nullcontext()

    def after_step(self, step: int, grads: GradNorms | None) -> None:
        if self.due(step):
            output, ln = self._measure()
            self._log(step, output, ln, grads)

    # ---- measuring ---------------------------------------------------------------------------
    def _measure(self) -> tuple[torch.Tensor | None, dict[str, float]]:
        with LayerNormInputs(self.layers, self.masks) as ln:
            output = self._probe()
        return output, ln.result()

    def _probe(self) -> torch.Tensor | None:
        """Forward the probe through the pipeline (eval mode); F on the stage that measures it.

        Eval mode draws no dropout masks. The engine's forward still advances DeepSpeed's
        micro-batch counter (which would reseed layers only with seed_layers, off here); the
        counter and the RNG state are put back, so that turning instruments on, or resuming with
        them, cannot change the training numbers."""
        b = self.probe
        ntok = max(int(self.out_mask.sum()), 1)
        batch = ((b["src"], b["tgt_in"]), (b["tgt_out"], torch.tensor(1.0 / ntok)))
        module, monitor = self.trainer.module, self.engine.monitor
        offset, rng = module.micro_offset, torch.get_rng_state()
        enabled, monitor.enabled = monitor.enabled, False  # keep the probe out of eval_loss
        select = lambda flow: flow[1]  # noqa: E731  (the decoder stream)
        capture = OutputCapture(self.output_module, select) if self.measures_delta else contextlib.nullcontext()
        try:
            with capture:
                self.engine.eval_batch(iter([batch]), num_micro_batches=1)
        finally:
            monitor.enabled = enabled
            module.micro_offset = offset
            torch.set_rng_state(rng)
        return capture.value if self.measures_delta else None

    def _log(self, step: int, output: torch.Tensor | None, ln: dict[str, float], grads: GradNorms | None) -> None:
        payload = {"stage": self.layout.stage, "dp": self.layout.replica, "tp": self.layout.tp_rank,
                   "ln": ln, "grad": self._grad_parts(grads), "delta": None}
        if self.measures_delta:
            payload["delta"] = update_sums(output, self.reference, self.out_mask)
        gathered = [None] * self.layout.world_size if self.layout.rank == 0 else None
        torch.distributed.gather_object(payload, gathered, dst=0)
        if gathered is not None:
            self._write(step, gathered)

    @staticmethod
    def _grad_parts(grads: GradNorms | None) -> dict[str, tuple[float, float]]:
        """Layer → (Σ‖g‖² of tensor-parallel-split parameters, Σ‖g‖² of replicated ones)."""
        if grads is None:
            return {}
        parts = {}
        for name, module in grads.layers.items():
            split = repl = 0.0
            for p in module.parameters():
                if p in grads.squares:
                    if _is_sharded(p):
                        split += grads.squares[p]
                    else:
                        repl += grads.squares[p]
            parts[name] = (split, repl)
        return parts

    # ---- rank 0 ------------------------------------------------------------------------------
    def _write(self, step: int, gathered: list[dict]) -> None:
        mine = [g for g in gathered if g["dp"] == 0]  # replica 0 speaks for the model
        grad_sq: dict[str, float] = {}
        ln: dict[str, float] = {}
        for g in mine:
            for name, (split, repl) in g["grad"].items():
                # split parameters: one shard per tp rank, add them all; replicated: count once
                grad_sq[name] = grad_sq.get(name, 0.0) + split + (repl if g["tp"] == 0 else 0.0)
            if g["tp"] == 0:
                ln.update(g["ln"])
        delta_sq, delta_n = next(g["delta"] for g in mine if g["delta"] is not None)
        rows = [("ln_input", name, value) for name, value in ln.items()]
        rows += [("grad_norm", name, value ** 0.5) for name, value in grad_sq.items()]
        summary = [("stability/delta_f", (delta_sq / max(delta_n, 1)) ** 0.5, step)]
        if ln:
            summary.append(("stability/ln_input_max", max(ln.values()), step))
        if grad_sq:
            summary.append(("stability/layer_grad_norm_max", max(grad_sq.values()) ** 0.5, step))
        monitor = self.engine.monitor
        monitor.write_events(summary)
        if monitor.tb_monitor is not None:
            monitor.tb_monitor.write_events([(f"stability/{q}/{name}", v, step) for q, name, v in rows])
        os.makedirs(self.metrics_dir, exist_ok=True)
        path = os.path.join(self.metrics_dir, "stability.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "quantity", "layer", "value"])
            writer.writerow([step, "delta_f", "model", summary[0][1]])
            writer.writerows([step, q, name, v] for q, name, v in sorted(rows))

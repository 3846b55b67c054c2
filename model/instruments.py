"""Stability instruments (DeepNet Section II, Figs. 2–4): the model update ‖ΔF‖, per-layer
gradient norms and the size of LayerNorm inputs.

Plain PyTorch; they work on any set of encoder/decoder layers, so the single-process model and a
pipeline stage (which holds only some layers) use the same code. Every instrument installs its
hooks only while it is used (a `with` block), so a run with instruments off pays nothing.

Definitions used in this project:

* F(x, θ) is the model's output on a fixed probe batch x: the output of the decoder stack (after
  its final LayerNorm, if the strategy has one), i.e. the input of the output projection, at every
  non-padding target position, with the model in eval mode (no dropout). This is the F of the
  paper's theorems, a stack of normalised sub-layers; the logits would add the update of the tied
  output embedding, which learns the target-token frequencies at the same pace at every depth and
  hides the depth effect the instrument is for.
  ‖ΔF‖ = ‖F(x, θ_t) − F(x, θ_0)‖₂ / √n, with n the probe's target tokens: the Frobenius norm of
  paper eq. 1 divided by a constant, i.e. the root-mean-square over tokens of the per-token
  change, so that its value does not depend on the probe's size.
* The gradient norm of a layer is ‖∇‖₂ over all of that layer's parameters, of the gradient
  accumulated over the step's micro-batches, before clipping (and, with data parallelism, of
  this replica's share before the all-reduce).
* The LayerNorm input size of a layer is the mean over non-padding positions of ‖x‖₂ for the
  input x of every residual LayerNorm of that layer (`Residual.norm`: after the sum in Post-LN
  styles, the residual stream itself in Pre-LN styles), averaged over the layer's sub-layers.
  The paper compares it with √d: far above √d, the gradient through LN vanishes.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from model.norms import Residual


def model_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The encoder and decoder layers of an `EncoderDecoder`, by their parameter prefix."""
    layers = {f"encoder_layers.{i}": m for i, m in enumerate(model.encoder_layers)}
    layers.update({f"decoder_layers.{i}": m for i, m in enumerate(model.decoder_layers)})
    return layers


def stack_of(layer_name: str) -> str:
    """'encoder' or 'decoder' for a layer name of the plan ('encoder_layers.3' → 'encoder')."""
    return layer_name.split("_", 1)[0]


def update_sums(output: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """(Σ over masked positions of ‖output − reference‖², number of positions). Kept as sums so
    that pieces (tensor-parallel vocabulary slices, several probe batches) can be added up."""
    diff = (output.detach().float() - reference.float())[mask]
    return float(diff.pow(2).sum()), int(mask.sum())


def update_norm(output: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """‖ΔF‖ of the module docstring: RMS over the masked positions of the per-position change."""
    squares, count = update_sums(output, reference, mask)
    return math.sqrt(squares / max(count, 1))


class GradNorms:
    """Per-layer gradient norms of the step whose backward pass(es) run inside the `with` block.

    A post-accumulate hook on every parameter sees each gradient autograd writes into p.grad and
    keeps the step's sum: where autograd accumulates into the same `.grad` (plain PyTorch, engines
    with gradient buffers), the latest `.grad` is that sum; where an optimizer takes each backward's
    gradient and frees `.grad` (parallel/optimizer.py), each new `.grad` is added to the sum kept
    here. The result is the norm of the gradient accumulated over all the step's micro-batches.
    """

    def __init__(self, layers: dict[str, nn.Module]):
        self.layers = layers
        self.sums: dict[nn.Parameter, torch.Tensor] = {}
        """Parameter → the step's gradient so far (fp32)."""
        self._seen: dict[nn.Parameter, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> GradNorms:
        for module in self.layers.values():
            for p in module.parameters():
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._record))
        return self

    def _record(self, p: torch.Tensor) -> None:
        grad = p.grad.detach()
        if self._seen.get(p) is p.grad or p not in self.sums:  # accumulated in place: the sum itself
            self.sums[p] = grad.float().clone()
        else:  # a fresh tensor: this backward's gradient alone
            self.sums[p] += grad.float()
        self._seen[p] = p.grad

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._seen.clear()

    @functools.cached_property
    def squares(self) -> dict[nn.Parameter, float]:
        """Parameter → ‖its step's gradient‖² (read once the step's backward passes are done)."""
        return {p: float(g.pow(2).sum()) for p, g in self.sums.items()}

    def result(self) -> dict[str, float]:
        """Layer name → gradient norm (layers that got no gradient are left out)."""
        out = {}
        for name, module in self.layers.items():
            squares = [self.squares[p] for p in module.parameters() if p in self.squares]
            if squares:
                out[name] = math.sqrt(sum(squares))
        return out


class LayerNormInputs:
    """Mean ‖x‖₂ of the residual LayerNorm inputs of each layer during the forwards in the block.

    `masks` maps 'encoder'/'decoder' to a [B, L] boolean tensor, True on real tokens, matching the
    positions the layers of that stack see (the source and the target-input tokens).
    """

    def __init__(self, layers: dict[str, nn.Module], masks: dict[str, torch.Tensor]):
        self.layers = layers
        self.masks = masks
        self._sums: dict[str, list[float]] = {}
        self._handles: list = []

    def __enter__(self) -> LayerNormInputs:
        for name, layer in self.layers.items():
            mask = self.masks[stack_of(name)]
            for module in layer.modules():
                if isinstance(module, Residual):
                    self._handles.append(module.norm.register_forward_pre_hook(self._hook(name, mask)))
        return self

    def _hook(self, name: str, mask: torch.Tensor):
        def record(_module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            x = inputs[0].detach()
            if x.shape[:2] != mask.shape:  # e.g. incremental decoding: not the probe's positions
                return
            norms = x.float().norm(dim=-1)[mask]
            total = self._sums.setdefault(name, [0.0, 0])
            total[0] += float(norms.sum())
            total[1] += int(norms.numel())
        return record

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def result(self) -> dict[str, float]:
        """Layer name → mean per-position ‖x‖₂ over its residual LayerNorm inputs."""
        return {name: s / max(n, 1) for name, (s, n) in self._sums.items()}


def probe_masks(src: torch.Tensor, tgt_in: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """The masks `LayerNormInputs` needs for a batch: real source and target-input tokens."""
    return {"encoder": src != pad_id, "decoder": tgt_in != pad_id}


class OutputCapture:
    """Keeps `select(output)` of `module`'s forward calls inside the `with` block (the last one)."""

    def __init__(self, module: nn.Module, select=lambda output: output):
        self.module, self.select = module, select
        self.value: torch.Tensor | None = None
        self._handle = None

    def __enter__(self) -> OutputCapture:
        def keep(_module, _inputs, output):
            self.value = self.select(output).detach().float()
        self._handle = self.module.register_forward_hook(keep)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def decoder_output_module(model: nn.Module) -> nn.Module:
    """The module of an `EncoderDecoder` whose output is F: the decoder's final LayerNorm, or its
    last layer when the strategy has no final LayerNorm."""
    return model.decoder_norm if model.decoder_norm is not None else model.decoder_layers[-1]


class ProbeMonitor:
    """All three instruments for the single-process `EncoderDecoder` on one fixed probe batch.

        monitor = ProbeMonitor(model, probe_batch, pad_id)   # records F(x, θ_0)
        with monitor.gradients() as grads:                   # around a training step's backward
            ...
        grads.result(); monitor.measure()                    # ‖ΔF‖ and LN inputs at θ_t
    """

    def __init__(self, model: nn.Module, batch: dict, pad_id: int):
        self.model = model
        self.src, self.tgt_in = batch["src"], batch["tgt_in"]
        self.mask = batch["tgt_out"] != pad_id
        self.layers = model_layers(model)
        self.masks = probe_masks(self.src, self.tgt_in, pad_id)
        self.reference = self._forward()

    def _forward(self) -> torch.Tensor:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), OutputCapture(decoder_output_module(self.model)) as out:
                self.model(self.src, self.tgt_in)
            return out.value
        finally:
            self.model.train(was_training)

    def gradients(self) -> GradNorms:
        return GradNorms(self.layers)

    def measure(self) -> dict:
        """{'delta_f': ‖ΔF‖, 'ln_input': {layer: mean ‖x‖₂}} at the current parameters."""
        with LayerNormInputs(self.layers, self.masks) as ln:
            output = self._forward()
        return {"delta_f": update_norm(output, self.reference, self.mask), "ln_input": ln.result()}

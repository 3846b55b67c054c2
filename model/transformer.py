"""The full encoder-decoder for single-process training and inference, and its layer plan.

The *layer plan* is the flat sequence embed → encoder layers → [encoder LN] → decoder layers →
[decoder LN] → output projection. The pipeline (`parallel/pipeline.py`) cuts this same sequence
into stages. Layer i of the plan is initialised right after `torch.manual_seed(seed + i)` in both
the plain model and the pipeline (parallel/pipeline.py sets it per layer spec), so a run starts from identical
weights whatever the pipeline layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelConfig
from model.layers import DecoderLayer, EncoderLayer, SharedEmbedding, padding_mask
from model.norms import StackNorm, resolve


@dataclass(frozen=True)
class LayerDef:
    """One entry of the layer plan."""

    kind: str
    """embed | encoder | encoder_norm | decoder | decoder_norm | output"""
    name: str
    """Parameter prefix of this layer in `EncoderDecoder` (the output layer reuses 'embed')."""
    index: int = 0
    """Position of an encoder/decoder layer within its stack (Post-LN-init scales by it)."""


def stack_norms(cfg: ModelConfig) -> tuple[StackNorm, StackNorm]:
    """The (encoder, decoder) normalisation records of `cfg.norm` (see model/norms.py)."""
    return resolve(cfg.norm, cfg.encoder_layers, cfg.decoder_layers, cfg.branchnorm_max_norm_step)


def layer_plan(cfg: ModelConfig) -> list[LayerDef]:
    enc_norm, dec_norm = stack_norms(cfg)
    plan = [LayerDef("embed", "embed")]
    plan += [LayerDef("encoder", f"encoder_layers.{i}", i) for i in range(cfg.encoder_layers)]
    if enc_norm.final_norm:
        plan.append(LayerDef("encoder_norm", "encoder_norm"))
    plan += [LayerDef("decoder", f"decoder_layers.{i}", i) for i in range(cfg.decoder_layers)]
    if dec_norm.final_norm:
        plan.append(LayerDef("decoder_norm", "decoder_norm"))
    plan.append(LayerDef("output", "embed"))
    return plan


def build_layer(cfg: ModelConfig, kind: str, index: int = 0) -> nn.Module:
    """Construct the module of one plan entry (consumes the RNG exactly as the plain model does);
    `index` is the layer's position in its stack (`LayerDef.index`)."""
    enc_norm, dec_norm = stack_norms(cfg)
    if kind in ("embed", "output"):
        return SharedEmbedding(cfg)
    if kind == "encoder":
        return EncoderLayer(cfg, enc_norm.layer(index))
    if kind == "decoder":
        return DecoderLayer(cfg, dec_norm.layer(index))
    if kind in ("encoder_norm", "decoder_norm"):
        return nn.LayerNorm(cfg.d_model, eps=cfg.layernorm_eps)
    raise ValueError(f"unknown layer kind {kind!r}")


class EncoderDecoder(nn.Module):
    """The plain (single-process) model. forward(src, tgt_in) → logits [B, T, V]."""

    def __init__(self, cfg: ModelConfig, seed: int = 1):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.encoder_layers = nn.ModuleList()
        self.decoder_layers = nn.ModuleList()
        self.encoder_norm: nn.Module | None = None
        self.decoder_norm: nn.Module | None = None
        for i, layer in enumerate(layer_plan(cfg)):
            if layer.kind == "output":
                continue  # tied to the embedding
            torch.manual_seed(seed + i)
            module = build_layer(cfg, layer.kind, layer.index)
            if layer.kind == "encoder":
                self.encoder_layers.append(module)
            elif layer.kind == "decoder":
                self.decoder_layers.append(module)
            else:
                setattr(self, layer.name, module)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = padding_mask(src, self.cfg.pad_id, self.embed.weight.dtype)
        x = self.embed(src)
        for layer in self.encoder_layers:
            x = layer(x, mask)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, mask

    def decode(self, tgt_in: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(tgt_in)
        for layer in self.decoder_layers:
            x = layer(x, enc, mask)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self.embed.logits(x)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        enc, mask = self.encode(src)
        return self.decode(tgt_in, enc, mask)


def smoothed_loss_sum(logits: torch.Tensor, target: torch.Tensor, pad_id: int, eps: float) -> torch.Tensor:
    """Sum over non-pad target tokens of torch's label-smoothed cross-entropy (computed in fp32)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1),
                           ignore_index=pad_id, label_smoothing=eps, reduction="sum")

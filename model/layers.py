"""Transformer building blocks in plain PyTorch: embeddings, attention, FFN, encoder/decoder layers.

No parallelism lives here; `parallel/` wraps these modules into pipeline stages.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import attention
from model.config import ModelConfig
from model.dropout import Dropout
from model.norms import StackNorm


def xavier_normal_linear(linear: nn.Linear, gain: float) -> None:
    """Xavier-normal weight with `gain` (std = gain·sqrt(2/(fan_in+fan_out))), zero bias."""
    nn.init.xavier_normal_(linear.weight, gain=gain)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


def sinusoidal_table(num_positions: int, dim: int) -> torch.Tensor:
    """The tensor2tensor/fairseq sinusoid table: sin in the first half, cos in the second."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    angles = torch.arange(num_positions, dtype=torch.float32)[:, None] * freq[None, :]
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    if dim % 2:
        table = torch.cat([table, torch.zeros(num_positions, 1)], dim=1)
    return table


class SharedEmbedding(nn.Module):
    """Token embedding shared by source, target and the output projection.

    embed(tokens) = dropout(√d · E[tokens] + P[positions]); E ~ N(0, d^-1/2), pad row zero.
    `lookup` (E[tokens]) and `logits` (h·Eᵀ) are the two operations on the weight; tensor
    parallelism (parallel/tensor.py) replaces them on the instance, the forward stays this one.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        nn.init.normal_(self.weight, mean=0.0, std=cfg.d_model**-0.5)
        with torch.no_grad():
            self.weight[cfg.pad_id].zero_()
        self.pad_id = cfg.pad_id
        self.scale = math.sqrt(cfg.d_model)
        self.register_buffer("positions", sinusoidal_table(cfg.max_positions, cfg.d_model), persistent=False)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        length = tokens.size(1)
        if offset + length > self.positions.size(0):
            raise ValueError(f"sequence of {offset + length} tokens exceeds model.max_positions="
                             f"{self.positions.size(0)}")
        x = self.scale * self.lookup(tokens)
        x = x + self.positions[offset:offset + length].to(x.dtype)
        return self.dropout(x)

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows E[tokens] (the pad row gets no gradient)."""
        return F.embedding(tokens, self.weight, padding_idx=self.pad_id)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Output projection tied to the embedding: h·Eᵀ."""
        return F.linear(h, self.weight)


class MultiheadAttention(nn.Module):
    """Attention with separate Q/K/V/O projections (each gets its own init gain)."""

    def __init__(self, cfg: ModelConfig, norm: StackNorm, where: str = "self_attn"):
        """`where` ('self_attn' or 'cross_attn') lets the strategy decide on an inner LayerNorm."""
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.dropout = cfg.attention_dropout
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(d, d) for _ in range(4))
        for name, lin in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj), ("o", self.out_proj)):
            xavier_normal_linear(lin, norm.gain(name))
        # Sub-LN's LayerNorm before the output projection (eq. 6); Identity for other strategies.
        self.inner_norm = norm.inner_norm(where, d, cfg.layernorm_eps)

    def forward(self, query: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None = None,
                causal: bool = False, cache: dict | None = None, static_kv: bool = False) -> torch.Tensor:
        """`mask` is boolean, broadcastable to [B, H, Tq, Tk], True where attention is allowed.

        Incremental decoding passes a `cache` dict (one per attention per layer). Self-attention
        (static_kv=False) appends this step's keys/values ([B, T, d]) to cache['k'/'v'] and attends
        to all of them (the query is the newest position, so no causal mask is needed);
        cross-attention (static_kv=True) projects the encoder output once and reuses it on later
        steps.
        """
        q = self.q_proj(query)
        if cache is not None and static_kv and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self.k_proj(memory), self.v_proj(memory)
            if cache is not None:
                if not static_kv and "k" in cache:
                    k = torch.cat([cache["k"], k], dim=1)
                    v = torch.cat([cache["v"], v], dim=1)
                cache["k"], cache["v"] = k, v
        if cache is not None and not static_kv:
            causal = causal and q.size(1) > 1  # a single new query may see every cached key
        out = attention(q, k, v, self.heads, mask, causal, self.dropout if self.training else 0.0)
        return self.out_proj(self.inner_norm(out))


class FeedForward(nn.Module):
    """FC2(act(FC1(x))) with dropout after the activation (and Sub-LN's inner LayerNorm)."""

    def __init__(self, cfg: ModelConfig, norm: StackNorm):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        xavier_normal_linear(self.fc1, norm.gain("fc1"))
        xavier_normal_linear(self.fc2, norm.gain("fc2"))
        self.act = F.relu if cfg.activation == "relu" else F.gelu
        self.dropout = Dropout(cfg.activation_dropout)
        # Sub-LN's LayerNorm before the second linear (eq. 8); Identity for other strategies.
        self.inner_norm = norm.inner_norm("ffn", cfg.ffn_dim, cfg.layernorm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.inner_norm(self.dropout(self.act(self.fc1(x)))))


class EncoderLayer(nn.Module):
    """Self-attention then FFN, each inside the stack's residual block."""

    def __init__(self, cfg: ModelConfig, norm: StackNorm):
        super().__init__()
        self.self_attn = MultiheadAttention(cfg, norm)
        self.self_attn_res = norm.residual(cfg.d_model, cfg.dropout, cfg.layernorm_eps)
        self.ffn = FeedForward(cfg, norm)
        self.ffn_res = norm.residual(cfg.d_model, cfg.dropout, cfg.layernorm_eps)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.self_attn_res(x, lambda h: self.self_attn(h, h, src_mask))
        return self.ffn_res(x, self.ffn)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the encoder output, FFN."""

    def __init__(self, cfg: ModelConfig, norm: StackNorm):
        super().__init__()
        self.self_attn = MultiheadAttention(cfg, norm)
        self.self_attn_res = norm.residual(cfg.d_model, cfg.dropout, cfg.layernorm_eps)
        self.cross_attn = MultiheadAttention(cfg, norm, "cross_attn")
        self.cross_attn_res = norm.residual(cfg.d_model, cfg.dropout, cfg.layernorm_eps)
        self.ffn = FeedForward(cfg, norm)
        self.ffn_res = norm.residual(cfg.d_model, cfg.dropout, cfg.layernorm_eps)

    def forward(self, x: torch.Tensor, enc: torch.Tensor, src_mask: torch.Tensor,
                cache: dict | None = None) -> torch.Tensor:
        """`cache` (incremental decoding): {} on the first step, then the same dict each step;
        x is then only the newest position(s)."""
        self_cache = cross_cache = None
        if cache is not None:
            self_cache = cache.setdefault("self", {})
            cross_cache = cache.setdefault("cross", {})
        x = self.self_attn_res(x, lambda h: self.self_attn(h, h, causal=True, cache=self_cache))
        x = self.cross_attn_res(x, lambda h: self.cross_attn(h, enc, src_mask, cache=cross_cache, static_kv=True))
        return self.ffn_res(x, self.ffn)


def source_mask(src_tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """[B, 1, 1, S] boolean mask, True on real (non-pad) source tokens."""
    return (src_tokens != pad_id)[:, None, None, :]


def padding_mask(src_tokens: torch.Tensor, pad_id: int) -> torch.Tensor | None:
    """`source_mask`, or None when no source token is padding: attention then runs unmasked
    (the same result, and SDPA skips reading and adding a mask in every attention call).
    Computed once per micro-batch and stage and handed to every layer."""
    real = src_tokens != pad_id
    return None if bool(real.all()) else real[:, None, None, :]

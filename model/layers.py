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
        self.dropout = nn.Dropout(cfg.dropout)

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
    """Attention whose input projections run as one matrix product: self-attention's queries, keys
    and values from one [3d, d] weight (`qkv_proj`), cross-attention's keys and values from one
    [2d, d] weight (`kv_proj`) next to its own `q_proj`. Each d × d block is initialised as its
    own projection (its init gain, its Xavier fans), and the state dict holds the standard
    separate `q_proj`, `k_proj`, `v_proj` entries: checkpoints, consolidated models and exports keep
    the layout other tools load, and either layout loads."""

    PARTS = {"self_attn": ("qkv_proj", ("q", "k", "v")), "cross_attn": ("kv_proj", ("k", "v"))}

    def __init__(self, cfg: ModelConfig, norm: StackNorm, where: str = "self_attn"):
        """`where` ('self_attn' or 'cross_attn') chooses the fused projections and lets the
        strategy decide on an inner LayerNorm."""
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.heads
        self.dropout = cfg.attention_dropout
        self.fused, self.parts = self.PARTS[where]
        if where == "cross_attn":
            self.q_proj = nn.Linear(d, d)
        setattr(self, self.fused, nn.Linear(d, d * len(self.parts)))
        self.out_proj = nn.Linear(d, d)
        for name in ("q", *self.parts, "o") if where == "cross_attn" else (*self.parts, "o"):
            weight, bias = self.projection(name)
            nn.init.xavier_normal_(weight, gain=norm.gain(name))  # fans of the d × d block
            nn.init.zeros_(bias)
        # Sub-LN's LayerNorm before the output projection (eq. 6); Identity for other strategies.
        self.inner_norm = norm.inner_norm(where, d, cfg.layernorm_eps)
        self._register_state_dict_hook(_split_projections)
        self._register_load_state_dict_pre_hook(_join_projections, with_module=True)

    def projection(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, bias) of projection `name` ('q', 'k', 'v', 'o'): views of the fused ones."""
        if name == "o" or (name == "q" and self.fused == "kv_proj"):
            linear = self.out_proj if name == "o" else self.q_proj
            return linear.weight, linear.bias
        fused = getattr(self, self.fused)
        rows = fused.weight.size(0) // len(self.parts)  # d, or d/tp on a tensor-parallel rank
        i = self.parts.index(name)
        return fused.weight[i * rows:(i + 1) * rows], fused.bias[i * rows:(i + 1) * rows]

    def forward(self, query: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor | None = None,
                causal: bool = False, cache: dict | None = None, static_kv: bool = False) -> torch.Tensor:
        """`mask` is additive and float, broadcastable to [B, H, Tq, Tk]: 0 where attention is
        allowed, −∞ where not (model/attention.py).

        Incremental decoding passes a `cache` dict (one per attention per layer). Self-attention
        (static_kv=False) appends this step's keys/values ([B, T, d]) to cache['k'/'v'] and attends
        to all of them (the query is the newest position, so no causal mask is needed);
        cross-attention (static_kv=True) projects the encoder output once and reuses it on later
        steps.
        """
        if self.fused == "qkv_proj":
            q, k, v = self.qkv_proj(query).chunk(3, dim=-1)
        else:
            q = self.q_proj(query)
            k = v = None
        if cache is not None and static_kv and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            if k is None:
                k, v = self.kv_proj(memory).chunk(2, dim=-1)
            if cache is not None:
                if not static_kv and "k" in cache:
                    k = torch.cat([cache["k"], k], dim=1)
                    v = torch.cat([cache["v"], v], dim=1)
                cache["k"], cache["v"] = k, v
        if cache is not None and not static_kv:
            causal = causal and q.size(1) > 1  # a single new query may see every cached key
        out = attention(q, k, v, self.heads, mask, causal, self.dropout if self.training else 0.0)
        return self.out_proj(self.inner_norm(out))


def _split_projections(module: MultiheadAttention, state: dict, prefix: str, local_metadata) -> None:
    """State dict hook: the fused projection's entries as the separate q/k/v_proj ones."""
    split_fused_projections(state, prefix)


def split_fused_projections(state: dict, prefix: str = "") -> dict:
    """`state` (in place, and returned) with every fused projection entry under `prefix`
    (`…qkv_proj.*`, `…kv_proj.*`) replaced by the separate q/k/v_proj entries."""
    for key in [k for k in state if k.startswith(prefix)]:
        head, _, param = key.rpartition(".")
        owner, _, fused = head.rpartition(".")
        parts = next((p for f, p in MultiheadAttention.PARTS.values() if f == fused), None)
        if parts is None or param not in ("weight", "bias"):
            continue
        for name, block in zip(parts, state.pop(key).chunk(len(parts), dim=0)):
            state[f"{owner}.{name}_proj.{param}" if owner else f"{name}_proj.{param}"] = block
    return state


def _join_projections(module: MultiheadAttention, state: dict, prefix: str, *args) -> None:
    """Load pre-hook: separate q/k/v_proj entries into the fused projection's."""
    for param in ("weight", "bias"):
        keys = [f"{prefix}{name}_proj.{param}" for name in module.parts]
        if all(key in state for key in keys):
            state[f"{prefix}{module.fused}.{param}"] = torch.cat([state.pop(key) for key in keys], dim=0)


class FeedForward(nn.Module):
    """FC2(act(FC1(x))) with dropout after the activation (and Sub-LN's inner LayerNorm)."""

    def __init__(self, cfg: ModelConfig, norm: StackNorm):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.d_model)
        xavier_normal_linear(self.fc1, norm.gain("fc1"))
        xavier_normal_linear(self.fc2, norm.gain("fc2"))
        self.act = F.relu if cfg.activation == "relu" else F.gelu
        self.dropout = nn.Dropout(cfg.activation_dropout)
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


def padding_mask(src_tokens: torch.Tensor, pad_id: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, 1, 1, S] additive attention mask in `dtype` (the activations'): 0 on real source tokens,
    −∞ on padding. Computed once per micro-batch and stage and handed to every layer, always (never
    None for a batch without padding: asking whether there is any would read a value back from the
    device, a host sync per micro-batch, and give compiled layers a second variant); additive
    rather than boolean, so that attention adds it as it is instead of converting it in every
    layer; a tensor of its own (not a view), which compiled layers need to reuse their graph when
    activation checkpointing recomputes them with a detached copy."""
    b, s = src_tokens.shape
    mask = torch.zeros((b, 1, 1, s), dtype=dtype, device=src_tokens.device)
    return mask.masked_fill_((src_tokens == pad_id)[:, None, None, :], float("-inf"))

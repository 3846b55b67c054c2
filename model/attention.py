"""Scaled dot-product attention over heads, on [B, T, H·D] projections, by torch's
`scaled_dot_product_attention` (flash or memory-efficient kernels on GPUs, its own on CPUs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None,
              causal: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q_h k_hᵀ / √D + mask) v_h for every head h, on q [B, Tq, H·D] and k, v [B, Tk, H·D];
    the result is [B, Tq, H·D]. `mask`: additive, in the activations' dtype, broadcastable to
    [B, H, Tq, Tk]: 0 where attention is allowed, −∞ where not (model/layers.py `padding_mask`
    makes the [B, 1, 1, Tk] source padding mask); None: everywhere. `causal`, applied only when
    `mask` is None: query i sees keys j ≤ i."""
    b, tq, width = q.shape

    def split(x):
        return x.view(b, x.size(1), heads, width // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask,
                                         is_causal=causal and mask is None, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(b, tq, width)

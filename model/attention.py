"""Scaled dot-product attention over heads, on [B, T, H·D] projections: the project's kernel for
short sequences on CPUs, torch's `scaled_dot_product_attention` everywhere else.

At the deep-narrow shapes trained on CPUs (100L-100L d=64: 32 tokens, 2 heads of 32) torch's CPU
flash kernel takes ~0.9–1.1 ms per forward + backward for 32 × 2 heads × 32 × 32, about four
times its arithmetic: it calls the BLAS once per tiny tile and zero-fills its gradient buffers.
`model/csrc/attention.cpp` computes each (batch, head) pair in L1-resident tiles with
register-blocked AVX2 products: 0.55–0.7 ms forward + backward there against SDPA's 0.95–1.05 ms
as the model calls them, and a 100L-100L d=64 training step at dropout 0 1.08–1.10× faster
(`./run.sh bench model`, steps alternated in one process; README "Speed"). It also
takes the projections in their [B, T, H·D] layout and returns its output in it, so the head
split and merge (two transposes and a copy, forward and backward) go away.

The kernel runs where it applies: CPU float32 tensors, queries and keys at most 64 long, head
width a multiple of 8 and at most 64, no attention dropout, and a mask that is None or the
key-padding mask of `model.layers.padding_mask` ([B, 1, 1, Tk] bool); causal masking is SDPA's
(query i sees keys j ≤ i). Its results equal SDPA's to float32 rounding (a different summation
order and its own e^x: ~1e-7 relative; tests/test_attention.py). Anything else, GPUs, other
dtypes, longer sequences, a CPU without AVX2/FMA or a machine that cannot build the kernels,
runs SDPA. Incremental decoding (one query against the cached keys) takes the kernel while at
most 64 keys are cached.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from model.kernels import enabled, kernels

_NO_MASK = torch.empty(0, dtype=torch.bool)


def _key_mask(mask: torch.Tensor | None, b: int, tk: int) -> torch.Tensor | None:
    """The [B, Tk] bool keep-mask the kernel takes, or None when `mask` is not a key-padding mask."""
    if mask is None:
        return _NO_MASK
    if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape) != (b, 1, 1, tk):
        return None
    return mask.reshape(b, tk).contiguous()


def _kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, dropout_p: float) -> bool:
    if dropout_p > 0.0 or not (q.is_cpu and q.dtype == torch.float32 and k.dtype == v.dtype == torch.float32):
        return False
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.size(0) != k.size(0) or q.size(2) != k.size(2):
        return False
    if not enabled():
        return False
    built = kernels()
    longest = built.short_attention_max if built.short_attention_available() else 0
    width = q.size(2)
    head_dim = width // heads
    return (head_dim * heads == width and head_dim % 8 == 0 and head_dim <= longest
            and 0 < q.size(1) <= longest and 0 < k.size(1) <= longest)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None = None,
              causal: bool = False, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q_h k_hᵀ / √D) v_h for every head h, on q [B, Tq, H·D] and k, v [B, Tk, H·D]; the
    result is [B, Tq, H·D]. `mask`: boolean, broadcastable to [B, H, Tq, Tk], True where attention
    is allowed (None: everywhere); `causal` (with no mask): query i sees keys j ≤ i."""
    b, tq, width = q.shape
    tk = k.size(1)
    if _kernel_applies(q, k, v, heads, dropout_p):
        keep = _key_mask(mask, b, tk)
        if keep is not None:
            def rows(x):
                return x if x.stride(-1) == 1 else x.contiguous()
            return kernels().short_attention(rows(q), rows(k), rows(v), heads, keep, causal and mask is None,
                                             (width // heads) ** -0.5)

    def split(x):
        return x.view(b, x.size(1), heads, width // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask,
                                         is_causal=causal and mask is None, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(b, tq, width)

"""Attention (model/attention.py, model/layers.py MultiheadAttention): the heads' softmax(QKᵀ/√D)V
written out in float64, with the additive padding mask, causally and across sequences of other
lengths; the fused Q/K/V projections equal three separate ones and keep the standard state dict."""
from __future__ import annotations

import pytest
import torch

from model.attention import attention
from model.config import ModelConfig
from model.layers import MultiheadAttention, padding_mask, split_fused_projections
from model.transformer import stack_norms


def _reference(q, k, v, heads, mask=None, causal=False):
    """softmax(q_h k_hᵀ / √D + mask) v_h per head, in float64, from the definition."""
    b, tq, width = q.shape
    d = width // heads
    out = torch.empty(b, tq, width, dtype=torch.float64)
    for h in range(heads):
        qh, kh, vh = (x[..., h * d:(h + 1) * d].double() for x in (q, k, v))
        scores = qh @ kh.transpose(1, 2) / d**0.5
        if mask is not None:
            scores = scores + mask[:, 0].double()
        if causal:
            scores = scores.masked_fill(torch.ones(tq, k.size(1)).triu(1).bool(), float("-inf"))
        out[..., h * d:(h + 1) * d] = scores.softmax(-1) @ vh
    return out


@pytest.mark.parametrize("tq,tk,causal", [(7, 7, False), (7, 7, True), (5, 9, False), (9, 5, False)])
def test_attention_is_the_softmax_of_scaled_scores_per_head(tq, tk, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, n, 32, generator=g) for n in (tq, tk, tk))
    src = torch.randint(4, 50, (3, tk), generator=g)
    src[0, tk - 2:] = 0  # padded keys
    mask = None if causal else padding_mask(src, 0)
    out = attention(q, k, v, 4, mask, causal)
    torch.testing.assert_close(out.double(), _reference(q, k, v, 4, mask, causal), rtol=1e-5, atol=1e-6)
    if mask is not None:  # a padded key gets no weight: changing it changes nothing
        v2 = v.clone()
        v2[0, tk - 1] += 100.0
        torch.testing.assert_close(attention(q, k, v2, 4, mask), out, rtol=0, atol=1e-6)


def test_the_padding_mask_is_additive_and_its_own_tensor():
    src = torch.tensor([[5, 6, 0], [7, 0, 0]])
    mask = padding_mask(src, 0, torch.bfloat16)
    assert mask.shape == (2, 1, 1, 3) and mask.dtype == torch.bfloat16 and mask._base is None
    assert mask[:, 0, 0].tolist() == [[0.0, 0.0, float("-inf")], [0.0, float("-inf"), float("-inf")]]


@pytest.mark.parametrize("where", ["self_attn", "cross_attn"])
def test_fused_projections_equal_separate_ones_and_keep_the_standard_state_dict(where):
    cfg = ModelConfig(d_model=32, heads=4, ffn_dim=64, vocab_size=50, dropout=0.0)
    torch.manual_seed(1)
    attn = MultiheadAttention(cfg, stack_norms(cfg)[1], where)
    state = attn.state_dict()
    assert {k for k in state if k.endswith("_proj.weight")} == {"q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                               "out_proj.weight"}
    x, memory = torch.randn(2, 6, 32), torch.randn(2, 8, 32)
    mem = x if where == "self_attn" else memory
    q = x @ state["q_proj.weight"].T + state["q_proj.bias"]
    k = mem @ state["k_proj.weight"].T + state["k_proj.bias"]
    v = mem @ state["v_proj.weight"].T + state["v_proj.bias"]
    expected = attention(q, k, v, 4) @ state["out_proj.weight"].T + state["out_proj.bias"]
    torch.testing.assert_close(attn(x, mem), expected, rtol=1e-5, atol=1e-6)
    # the standard layout loads into a fresh module (and so do the fused names, e.g. of an optimizer's state)
    torch.manual_seed(2)
    other = MultiheadAttention(cfg, stack_norms(cfg)[1], where)
    other.load_state_dict(state)
    torch.testing.assert_close(other(x, mem), attn(x, mem), rtol=0, atol=0)
    fused = {k: v for k, v in attn.named_parameters()}
    assert split_fused_projections(dict(fused)).keys() == state.keys()
    other.load_state_dict(fused)
    torch.testing.assert_close(other(x, mem), attn(x, mem), rtol=0, atol=0)

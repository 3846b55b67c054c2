"""Attention for short sequences on CPUs (model/attention.py, model/csrc/attention.cpp): torch's
SDPA results to float32 rounding, forward and gradients, wherever it is used; SDPA itself wherever
it is not; per-pair results independent of batch split, threads and strides."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import kernels as built
from model.attention import attention


def _sdpa(q, k, v, heads, mask=None, causal=False, dropout_p=0.0):
    b, tq, width = q.shape

    def split(x):
        return x.view(b, x.size(1), heads, width // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask,
                                         is_causal=causal and mask is None, dropout_p=dropout_p)
    return out.transpose(1, 2).reshape(b, tq, width)


def _inputs(b, tq, tk, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, heads * dim, generator=g) for n in (tq, tk, tk, tq)]


def _padding(b, tk):
    keep = torch.ones(b, tk, dtype=torch.bool)
    for i in range(b):
        keep[i, tk - (i % 5):] = False  # 0..4 padded keys at the end
    keep[-1, 1] = False  # and one in the middle
    return keep[:, None, None, :]


def _run(fn, q, k, v, go, dtype, **kw):
    leaves = [x.to(dtype).detach().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves, **kw)
    out.backward(go.to(dtype))
    return out, [out.detach().double()] + [x.grad.double() for x in leaves]


def _uses_kernel(out) -> bool:
    return "ShortAttention" in out.grad_fn.name()


def test_the_kernel_is_built_here():
    assert built.kernels() is not None and built.kernels().short_attention_available(), built._failed


@pytest.mark.parametrize("shape", [
    (4, 32, 32, 2, 32, False, False),  # the 100L-100L d=64 shape: encoder self- and decoder cross-attention
    (4, 32, 32, 2, 32, True, False),  # decoder self-attention
    (5, 31, 17, 2, 32, False, True),  # padded keys, Tq ≠ Tk, neither a multiple of 8
    (3, 7, 64, 4, 16, False, True),  # the longest keys
    (3, 64, 64, 1, 64, True, False),  # the longest queries, the widest head
    (2, 1, 9, 2, 8, False, False),  # one query (incremental decoding)
    (6, 20, 20, 3, 24, True, False),  # three heads of 24, causal
    (3, 12, 20, 2, 16, True, False),  # causal, more keys than queries (keys past the last query)
    (3, 20, 12, 2, 16, True, False),  # causal, more queries than keys
])
def test_matches_float64_as_closely_as_torchs_sdpa(shape):
    b, tq, tk, heads, dim, causal, pad = shape
    q, k, v, go = _inputs(b, tq, tk, heads, dim)
    mask = _padding(b, tk) if pad else None
    kw = {"heads": heads, "mask": mask, "causal": causal}
    out, ours = _run(attention, q, k, v, go, torch.float32, **kw)
    assert _uses_kernel(out)
    _, flash = _run(_sdpa, q, k, v, go, torch.float32, **kw)
    _, exact = _run(_sdpa, q, k, v, go, torch.float64, **kw)
    for name, a, f, e in zip(("out", "dq", "dk", "dv"), ours, flash, exact):
        err, torch_err = (a - e).abs().max().item(), (f - e).abs().max().item()
        assert err <= 2 * torch_err + 2e-7, (name, err, torch_err)  # float32 rounding, as torch's own
        assert err <= 4e-6 * max(1.0, e.abs().max().item()), (name, err)


def test_padded_keys_get_no_weight_and_no_gradient():
    q, k, v, go = _inputs(3, 6, 10, 2, 8)
    mask = _padding(3, 10)
    k2, v2 = k.clone(), v.clone()
    k2[~mask[:, 0, 0, :]] = 1e4  # what padding holds does not matter
    v2[~mask[:, 0, 0, :]] = -1e4
    _, a = _run(attention, q, k, v, go, torch.float32, heads=2, mask=mask)
    _, b = _run(attention, q, k2, v2, go, torch.float32, heads=2, mask=mask)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    padded = ~mask[:, 0, 0, :]
    assert a[2][padded].abs().max() == 0 and a[3][padded].abs().max() == 0


def test_a_row_that_sees_no_key_gives_zeros_not_nan():
    q, k, v, go = _inputs(2, 4, 5, 2, 8)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    mask[1] = False
    out, grads = _run(attention, q, k, v, go, torch.float32, heads=2, mask=mask)
    assert _uses_kernel(out)
    assert torch.isfinite(out).all() and out[1].abs().max() == 0
    assert all(torch.isfinite(g).all() and g[1].abs().max() == 0 for g in grads[1:])
    # as torch's SDPA does, so the result does not change with the sequence length
    _, theirs = _run(_sdpa, q, k, v, go, torch.float32, heads=2, mask=mask)
    assert all(t[1].abs().max() == 0 for t in theirs)


def test_results_do_not_depend_on_batch_split_threads_or_strides():
    q, k, v, go = _inputs(8, 24, 24, 2, 16)
    mask = _padding(8, 24)
    _, whole = _run(attention, q, k, v, go, torch.float32, heads=2, mask=mask)
    halves = [_run(attention, q[s], k[s], v[s], go[s], torch.float32, heads=2, mask=mask[s])[1]
              for s in (slice(0, 3), slice(3, 8))]
    for a, h0, h1 in zip(whole, *halves):
        assert torch.equal(a, torch.cat([h0, h1]))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _, two = _run(attention, q, k, v, go, torch.float32, heads=2, mask=mask)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(whole, two))
    # q a column slice of a wider tensor, k and v the two halves of one projection
    wide = torch.cat([q, torch.randn(8, 24, 5)], dim=2)
    kv = torch.cat([k, v], dim=2)
    leaves = [wide.detach().requires_grad_(), kv.detach().requires_grad_()]
    out = attention(leaves[0][:, :, :32], leaves[1][:, :, :32], leaves[1][:, :, 32:], 2, mask)
    out.backward(go.transpose(0, 1).contiguous().transpose(0, 1))  # a non-contiguous gradient
    assert _uses_kernel(out) and leaves[0][:, :, :32].stride(1) == 37
    assert torch.equal(out.detach().double(), whole[0])
    assert torch.equal(leaves[0].grad[:, :, :32].double(), whole[1]) and leaves[0].grad[:, :, 32:].abs().max() == 0
    assert torch.equal(leaves[1].grad.double(), torch.cat([whole[2], whole[3]], dim=2))


def test_keys_broadcast_over_the_batch_read_with_stride_0():
    q, k, v, _ = _inputs(4, 10, 12, 2, 8)
    q.requires_grad_()
    k1, v1 = k[:1], v[:1]
    out = attention(q, k1.expand(4, -1, -1), v1.expand(4, -1, -1), 2)
    assert _uses_kernel(out) and k1.expand(4, -1, -1).stride(0) == 0
    assert torch.equal(out, attention(q, k1.repeat(4, 1, 1), v1.repeat(4, 1, 1), 2))


def test_checkpointing_recomputes_the_same_gradients():
    q, k, v, go = _inputs(4, 16, 16, 2, 16)
    w = torch.randn(32, 32, requires_grad=True)

    def block(x):
        return attention(x @ w, k, v, 2, causal=True)

    x = q.clone().requires_grad_()
    block(x).backward(go)
    plain = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    checkpoint(block, x, use_reentrant=False).backward(go)
    assert torch.equal(x.grad, plain[0]) and torch.equal(w.grad, plain[1])


@pytest.mark.parametrize("case", ["long-keys", "long-queries", "head-12", "head-72", "dropout", "float64",
                                  "float-mask", "query-mask", "torch-ops"])
def test_everything_else_is_torchs_sdpa_exactly(case):
    b, tq, tk, heads, dim = 2, 8, 8, 2, 16
    tq, tk = {"long-keys": (8, 65), "long-queries": (65, 8)}.get(case, (tq, tk))
    dim = {"head-12": 12, "head-72": 72}.get(case, dim)
    dtype = torch.float64 if case == "float64" else torch.float32
    q, k, v, go = _inputs(b, tq, tk, heads, dim)
    mask = None
    if case == "float-mask":
        mask = torch.zeros(b, 1, 1, tk)
        mask[0, ..., -1] = float("-inf")
    if case == "query-mask":
        mask = torch.rand(b, 1, tq, tk, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., 0] = True
    kw = {"heads": heads, "mask": mask, "dropout_p": 0.2 if case == "dropout" else 0.0}
    torch.manual_seed(0)
    if case == "torch-ops":
        with built.torch_ops():
            out, ours = _run(attention, q, k, v, go, dtype, **kw)
    else:
        out, ours = _run(attention, q, k, v, go, dtype, **kw)
    assert not _uses_kernel(out)
    torch.manual_seed(0)
    _, theirs = _run(_sdpa, q, k, v, go, dtype, **kw)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))

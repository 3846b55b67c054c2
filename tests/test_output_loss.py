"""parallel/loss.py, the output layer and label-smoothed loss in chunks, against autograd through
full logits (F.linear, then torch's cross-entropy in fp32), in one process.

The chunked loss computes the logits' gradient in its forward, so it must scale that gradient by
what backward will bring (DeepSpeed divides the loss by the micro-batches per step and, in fp16,
multiplies it by the loss scale) before rounding it to the weights' precision, as autograd does:
otherwise every element is rounded once more in bf16, and fp16's small gradients underflow
(`expected_grad`)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import parallel.loss as chunked

V, N, D, GAS, EPS = 600, 96, 32, 3, 0.1


def _inputs(dtype):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(N, D, generator=gen).to(dtype)
    w = (torch.randn(V, D, generator=gen) * 0.3).to(dtype)
    target = torch.randint(1, V, (N,), generator=gen)
    target[::9] = 0  # padding
    return h, w, target


def _autograd(h0, w0, target, scale, loss_scale):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = F.cross_entropy(F.linear(h, w).float(), target, ignore_index=0, label_smoothing=EPS, reduction="sum")
    ((loss * scale / GAS) * loss_scale).backward()
    return float(loss.detach() * scale), h.grad.float(), w.grad.float()


def _chunked(h0, w0, target, scale, loss_scale, expected_grad, monkeypatch):
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * 20 * V)  # 20 tokens a chunk: 5 chunks
    loss = chunked.tied_output_loss_sum(chunked.tie_output_weight(h, w), target, 0, EPS, scale=scale,
                                        expected_grad=expected_grad)
    ((loss / GAS) * loss_scale).backward()
    return float(loss.detach()), h.grad.float(), w.grad.float()


def test_fp32_chunks_equal_full_logits(monkeypatch):
    h, w, target = _inputs(torch.float32)
    scale = torch.tensor(GAS / 5000.0)
    ref = _autograd(h, w, target, scale, 1.0)
    for expected in (1.0, float(np.float32(1) / np.float32(GAS))):
        got = _chunked(h, w, target, scale, 1.0, expected, monkeypatch)
        assert got[0] == pytest.approx(ref[0], rel=1e-6)
        for a, b in zip(got[1:], ref[1:]):
            assert float((a - b).abs().max() / b.abs().max()) < 1e-5  # fp32 sums in another order


@pytest.mark.parametrize("dtype,loss_scale", [(torch.bfloat16, 1.0), (torch.float16, 65536.0)], ids=["bf16", "fp16"])
def test_the_logits_gradient_is_scaled_as_autograd_scales_it_before_rounding(dtype, loss_scale, monkeypatch):
    h, w, target = _inputs(dtype)
    scale = torch.tensor(GAS / 5000.0)  # the trainer's m·dp / tokens; fp16: elements near 1e-8 before the loss scale
    _, ref_h, ref_w = _autograd(h, w, target, scale, loss_scale)
    expected = float(np.float32(loss_scale) / np.float32(GAS))  # TrainerEngine.loss_gradient
    _, got_h, got_w = _chunked(h, w, target, scale, loss_scale, expected, monkeypatch)
    # h's gradient: one rounding of the same fp32 values (measured: all bit-equal in bf16, 99.8% in fp16)
    assert float((got_h == ref_h).float().mean()) >= 0.99
    # (without expected_grad: 55% in bf16, 30% in fp16, where the tiny elements underflow)
    # E's: summed over chunks in fp32 and rounded once, where autograd rounds one product: at most
    # one unit in the last place apart (2^-7 of the largest element in bf16)
    assert float((got_w - ref_w).abs().max() / ref_w.abs().max()) <= 2.0**-7


def test_a_gradient_other_than_the_expected_one_still_scales_the_result(monkeypatch):
    h, w, target = _inputs(torch.float32)
    scale = torch.tensor(GAS / 5000.0)
    _, ref_h, ref_w = _autograd(h, w, target, scale, 8.0)
    _, got_h, got_w = _chunked(h, w, target, scale, 8.0, 0.5, monkeypatch)  # expected 0.5, received 8 / 3
    for a, b in ((got_h, ref_h), (got_w, ref_w)):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-5  # fp32 sums in another order

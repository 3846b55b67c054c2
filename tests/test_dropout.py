"""The hashed CPU dropout (model/dropout.py): torch's dropout statistics, reproducible masks,
exact gradients, restored by checkpointing, and the model's losses unchanged at dropout 0."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import dropout as hashed
from model import kernels as built
from model.config import ModelConfig
from model.transformer import EncoderDecoder, smoothed_loss_sum


def test_the_kernel_builds_here():
    assert built.kernels() is not None, built._failed


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_keep_fraction_and_scale_are_torchs(p):
    torch.manual_seed(0)
    y = torch.ones(1 << 22)
    out = hashed.dropout(y, p, True)
    kept = out.ne(0)
    n = y.numel()
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(out[kept].unique(), torch.tensor([1 / (1 - p)], dtype=torch.float32))
    # no structure along the tensor: neighbours and rows 64 apart are independent
    k = kept.double()
    for lag in (1, 64, 4096):
        corr = torch.corrcoef(torch.stack([k[:-lag], k[lag:]]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(n), lag
    # every call draws a fresh mask; the same seed gives the same mask
    assert not torch.equal(hashed.dropout(y, p, True), out)
    torch.manual_seed(0)
    assert torch.equal(hashed.dropout(y, p, True), out)


def test_dropout_add_gradients_equal_the_mask():
    torch.manual_seed(1)
    x = torch.randn(64, 33, dtype=torch.float64, requires_grad=True)
    y = torch.randn(64, 33, dtype=torch.float64, requires_grad=True)
    state = torch.get_rng_state()
    out = hashed.dropout_add(x, y, 2.5, 0.2, True)
    mask = (out - 2.5 * x).detach().ne(0)
    torch.testing.assert_close(out, 2.5 * x + y * mask / 0.8, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    out.backward(g)
    torch.testing.assert_close(x.grad, 2.5 * g, rtol=0, atol=0)
    torch.testing.assert_close(y.grad, g * mask / 0.8, rtol=1e-15, atol=1e-15)

    def fn(a, b):  # one mask for every evaluation
        torch.set_rng_state(state)
        return hashed.dropout_add(a, b, 0.7, 0.3, True)

    assert torch.autograd.gradcheck(fn, (x[:5, :7].detach().requires_grad_(), y[:5, :7].detach().requires_grad_()))


def test_off_in_eval_at_zero_and_torchs_elsewhere(monkeypatch):
    y, x = torch.randn(8, 16), torch.randn(8, 16)
    assert hashed.dropout(y, 0.3, False) is y and hashed.dropout(y, 0.0, True) is y
    torch.testing.assert_close(hashed.dropout_add(x, y, 3.0, 0.3, False), 3.0 * x + y)
    # bf16 (and accelerators) keep torch's dropout: its masks, drawn from the same generator
    yb = y.bfloat16()
    torch.manual_seed(5)
    ours = hashed.dropout(yb, 0.3, True)
    torch.manual_seed(5)
    assert torch.equal(ours, F.dropout(yb, 0.3, True))
    # no kernel (no compiler): torch's dropout, with one warning at the first attempt
    monkeypatch.setattr(built, "_kernels", None)
    monkeypatch.setattr(built, "_failed", "CalledProcessError: no compiler")
    torch.manual_seed(5)
    ours = hashed.dropout(y, 0.3, True)
    torch.manual_seed(5)
    assert torch.equal(ours, F.dropout(y, 0.3, True))


def test_checkpoint_recomputes_the_same_masks():
    torch.manual_seed(2)
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32, requires_grad=True)

    def block(h):
        return hashed.dropout_add(h, torch.tanh(h @ w), 0.5, 0.4, True)

    state = torch.get_rng_state()
    block(x).square().sum().backward()
    plain = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    torch.set_rng_state(state)
    checkpoint(block, x, use_reentrant=False).square().sum().backward()
    torch.testing.assert_close((x.grad, w.grad), plain, rtol=0, atol=0)


@pytest.mark.parametrize("norm", ["deepnorm", "preln", "subln", "branchnorm"])
def test_model_losses_at_dropout_0_equal_torchs_ops(norm):
    cfg = ModelConfig(encoder_layers=4, decoder_layers=4, d_model=32, heads=4, ffn_dim=64, norm=norm, dropout=0.0,
                      vocab_size=60)
    tokens = torch.randint(4, 60, (6, 21), generator=torch.Generator().manual_seed(0))
    src, tgt_in, tgt_out = tokens[:, :10], tokens[:, 10:-1], tokens[:, 11:]
    losses, grads = [], []
    for use_torch in (True, False):
        model = EncoderDecoder(cfg, seed=3).train()
        if use_torch:
            with built.torch_ops():
                loss = smoothed_loss_sum(model(src, tgt_in), tgt_out, cfg.pad_id, 0.1)
                loss.backward()
        else:
            loss = smoothed_loss_sum(model(src, tgt_in), tgt_out, cfg.pad_id, 0.1)
            loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    # float32 rounding of α·x + y and of the attention kernel's summation order: every gradient
    # within 1e-6 of the largest, the whole within 1e-6 in norm
    assert (grads[1] - grads[0]).abs().max() <= 1e-6 * grads[0].abs().max()
    assert (grads[1] - grads[0]).norm() <= 1e-6 * grads[0].norm()


def test_without_a_compiler_the_model_says_so_once_and_uses_torchs_operators(tmp_path):
    """A machine without g++: a fresh extension directory, a PATH without compilers."""
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ninja",):  # ninja present, no c++ / g++ / gcc
        found = __import__("shutil").which(tool) or os.path.join(os.path.dirname(sys.executable), tool)
        if os.path.exists(found):
            os.symlink(found, bin_dir / tool)
    env = {**os.environ, "PATH": str(bin_dir), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "c++"}
    code = ("import torch, torch.nn.functional as F\n"
            "from model import dropout as d\n"
            "y = torch.ones(1000)\n"
            "torch.manual_seed(3); a = d.dropout(y, 0.3, True); b = d.dropout(y, 0.3, True)\n"
            "torch.manual_seed(3); assert torch.equal(a, F.dropout(y, 0.3, True))\n"
            "assert d.kernels() is None\n"
            "from model.attention import attention\n"
            "q = torch.randn(2, 5, 16)\n"
            "s = q.view(2, 5, 2, 8).transpose(1, 2)\n"
            "ref = F.scaled_dot_product_attention(s, s, s).transpose(1, 2).reshape(2, 5, 16)\n"
            "assert torch.equal(attention(q, q, q, 2), ref)\n"
            "print('fallback ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert "fallback ok" in proc.stdout
    assert proc.stderr.count("fast CPU kernels unavailable") == 1, proc.stderr

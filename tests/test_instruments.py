"""The stability instruments on the single-process model (the pipeline versions are compared with
these in tests/test_strategies.py)."""
import math

import pytest
import torch

from model.config import ModelConfig
from model.instruments import GradNorms, LayerNormInputs, ProbeMonitor, model_layers, probe_masks, update_norm
from model.layers import padding_mask
from model.transformer import EncoderDecoder, smoothed_loss_sum


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models: a second intra-op thread gains nothing and, on a loaded machine, costs a lot.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(norm: str = "postln") -> EncoderDecoder:
    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=16, heads=2, ffn_dim=32, vocab_size=40,
                      norm=norm, dropout=0.1)
    return EncoderDecoder(cfg, seed=4)


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(4, 40, (3, 7), generator=g), torch.randint(4, 40, (3, 6), generator=g)
    src[0, 5:] = 0  # padding
    tgt[1, 4:] = 0
    tgt_in = torch.cat([torch.full((3, 1), 2), tgt[:, :-1]], dim=1)
    tgt_in[1, 5:] = 0
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt, "ntokens": int((tgt != 0).sum())}


def train_step(model: EncoderDecoder, opt: torch.optim.Optimizer, b: dict) -> None:
    loss = smoothed_loss_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], 0, 0.1) / b["ntokens"]
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_update_norm_is_rms_over_real_tokens_of_the_per_token_change():
    out, ref = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    per_token = (out - ref).norm(dim=-1)[mask]
    assert update_norm(out, ref, mask) == pytest.approx(math.sqrt((per_token**2).mean().item()), rel=1e-6)
    out2 = out.clone()
    out2[0, 2] += 100  # a padding position: ignored
    assert update_norm(out2, ref, mask) == pytest.approx(update_norm(out, ref, mask), rel=1e-7)


@pytest.mark.parametrize("norm", ["postln", "preln", "deepnorm", "subln", "branchnorm"])
def test_delta_f_is_zero_at_theta0_and_positive_after_a_step(norm):
    model = tiny(norm)
    probe = batch(seed=1)
    monitor = ProbeMonitor(model, probe, pad_id=0)
    assert monitor.reference.shape == (3, 6, 16)  # the decoder output, before the output projection
    assert monitor.measure()["delta_f"] == 0.0  # eval mode: dropout off, so exactly reproducible
    assert model.training  # and the model is back in training mode
    train_step(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch(seed=2))
    first = monitor.measure()["delta_f"]
    assert first > 1e-3
    train_step(model, torch.optim.Adam(model.parameters(), lr=1e-3), batch(seed=3))
    assert monitor.measure()["delta_f"] != first


def test_layer_gradient_norms_cover_the_whole_accumulated_gradient():
    model = tiny()
    layers = model_layers(model)
    with GradNorms(layers) as grads:  # two micro-batches accumulate into .grad
        for seed in (5, 6):
            b = batch(seed)
            smoothed_loss_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], 0, 0.1).backward()
    expected = {name: math.sqrt(sum(float(p.grad.pow(2).sum()) for p in layer.parameters()))
                for name, layer in layers.items()}
    assert grads.result() == pytest.approx(expected, rel=1e-6)
    assert set(expected) == {"encoder_layers.0", "encoder_layers.1", "decoder_layers.0", "decoder_layers.1"}
    # the hooks are gone: a further backward does not change what was recorded, and costs nothing
    b = batch(7)
    smoothed_loss_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], 0, 0.1).backward()
    assert grads.result() == pytest.approx(expected, rel=1e-6)
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_layernorm_input_size_of_a_pre_ln_layer():
    model = tiny("preln").eval()
    b = batch(8)
    masks = probe_masks(b["src"], b["tgt_in"], 0)
    with torch.no_grad(), LayerNormInputs(model_layers(model), masks) as ln:
        model(b["src"], b["tgt_in"])
    # Pre-LN layer 0: its LayerNorms see the embedding x, then x + SelfAttn(LN(x)).
    layer, real = model.encoder_layers[0], masks["encoder"]
    with torch.no_grad():
        x = model.embed(b["src"])
        h = layer.self_attn_res.norm(x)
        x2 = x + layer.self_attn(h, h, padding_mask(b["src"], 0))
    expected = torch.cat([x.norm(dim=-1)[real], x2.norm(dim=-1)[real]]).mean().item()
    assert ln.result()["encoder_layers.0"] == pytest.approx(expected, rel=1e-5)
    assert len(ln.result()) == 4
    assert not any(m._forward_pre_hooks for m in model.modules())

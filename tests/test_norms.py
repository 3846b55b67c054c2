"""DeepNorm constants and initialisation scales equal the paper's formulas."""
import math

import pytest
import torch

from model.config import ModelConfig
from model.norms import deepnorm_constants, resolve
from model.transformer import EncoderDecoder


@pytest.mark.parametrize("n,m", [(6, 6), (18, 18), (50, 50), (100, 100), (500, 500), (90, 6), (12, 3)])
def test_encoder_decoder_constants_follow_section_iii_c(n, m):
    c = deepnorm_constants("encoder-decoder", n, m)
    assert c["encoder_alpha"] == pytest.approx(0.81 * (n**4 * m) ** (1 / 16), rel=1e-12)
    assert c["encoder_beta"] == pytest.approx(0.87 * (n**4 * m) ** (-1 / 16), rel=1e-12)
    assert c["decoder_alpha"] == pytest.approx((3 * m) ** 0.25, rel=1e-12)
    assert c["decoder_beta"] == pytest.approx((12 * m) ** -0.25, rel=1e-12)


def test_known_values_for_100l_100l():
    # Hand-computed: (100^4·100)^(1/16) = 10^(10/16) = 4.2170; (300)^(1/4) = 4.1618; 1200^(-1/4) = 0.16990
    c = deepnorm_constants("encoder-decoder", 100, 100)
    assert c["encoder_alpha"] == pytest.approx(0.81 * 4.216965, rel=1e-5)
    assert c["encoder_beta"] == pytest.approx(0.87 / 4.216965, rel=1e-5)
    assert c["decoder_alpha"] == pytest.approx(4.161791, rel=1e-5)
    assert c["decoder_beta"] == pytest.approx(0.169904, rel=1e-4)


@pytest.mark.parametrize("layers", [1, 6, 24, 1000])
def test_encoder_only_and_decoder_only_constants(layers):
    enc = deepnorm_constants("encoder-only", encoder_layers=layers)
    dec = deepnorm_constants("decoder-only", decoder_layers=layers)
    assert enc["encoder_alpha"] == pytest.approx((2 * layers) ** 0.25)
    assert enc["encoder_beta"] == pytest.approx((8 * layers) ** -0.25)
    assert dec["decoder_alpha"] == pytest.approx((2 * layers) ** 0.25)
    assert dec["decoder_beta"] == pytest.approx((8 * layers) ** -0.25)


def test_xavier_115_variant_differs_only_in_encoder_beta():
    paper_enc, paper_dec = resolve("deepnorm", 18, 18)
    ts_enc, ts_dec = resolve("deepnorm-xavier-1.15", 18, 18)
    assert ts_enc.beta == pytest.approx(paper_enc.beta * 1.15 / 0.87)
    assert (ts_enc.alpha, ts_dec.alpha, ts_dec.beta) == (paper_enc.alpha, paper_dec.alpha, paper_dec.beta)


def test_a_name_that_is_no_strategy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"model.norm='deepnorm-torchscale' is not a strategy; choose one of "
                                         r"\['branchnorm', 'deepnorm', 'deepnorm-xavier-1.15', 'postln'"):
        resolve("deepnorm-torchscale", 6, 6)


@pytest.mark.parametrize("n,m", [(4, 2), (12, 3)])
def test_xavier_115_init_per_layer_follows_its_formula(n, m):
    # Per layer: std of V/O/fc1/fc2 = gain·sqrt(2/(fan_in+fan_out)) with gain 1.15·(N⁴M)^(−1/16)
    # in the encoder and (12M)^(−1/4) in the decoder; q/k gain 1; zero biases; mean ≈ 0.
    cfg = ModelConfig(encoder_layers=n, decoder_layers=m, d_model=256, heads=4, ffn_dim=1024, vocab_size=64,
                      norm="deepnorm-xavier-1.15")
    model = EncoderDecoder(cfg, seed=5)
    for layers, gain, attns in ((model.encoder_layers, 1.15 * (n**4 * m) ** (-1 / 16), ["self_attn"]),
                                (model.decoder_layers, (12 * m) ** (-1 / 4), ["self_attn", "cross_attn"])):
        for layer in layers:
            for attn in (getattr(layer, a) for a in attns):
                for proj, g in (("q", 1.0), ("k", 1.0), ("v", gain), ("o", gain)):
                    weight, bias = attn.projection(proj)
                    assert _std_ratio(weight, g) == pytest.approx(1.0, abs=0.02), proj
                    assert torch.count_nonzero(bias) == 0
            for lin in (layer.ffn.fc1, layer.ffn.fc2):
                assert _std_ratio(lin.weight, gain) == pytest.approx(1.0, abs=0.02)
                assert lin.weight.mean().abs() < 0.01 * gain
                assert torch.count_nonzero(lin.bias) == 0


def _std_ratio(weight: torch.Tensor, gain: float) -> float:
    fan_out, fan_in = weight.shape
    return weight.std().item() / (gain * math.sqrt(2.0 / (fan_in + fan_out)))


def test_init_std_is_beta_xavier_on_v_o_ffn_and_unscaled_on_q_k():
    # d=256, ffn=1024: 65k–262k samples per matrix, so the sample std is within ~1% of the truth.
    cfg = ModelConfig(encoder_layers=4, decoder_layers=2, d_model=256, heads=4, ffn_dim=1024, vocab_size=64)
    model = EncoderDecoder(cfg, seed=7)
    c = deepnorm_constants("encoder-decoder", 4, 2)
    stacks = [(model.encoder_layers, c["encoder_beta"], ["self_attn"]),
              (model.decoder_layers, c["decoder_beta"], ["self_attn", "cross_attn"])]
    for layers, beta, attns in stacks:
        assert beta < 0.7  # the scaling must be visible against gain 1
        for layer in layers:
            for attn_name in attns:
                attn = getattr(layer, attn_name)
                assert _std_ratio(attn.projection("q")[0], 1.0) == pytest.approx(1.0, abs=0.02)
                assert _std_ratio(attn.projection("k")[0], 1.0) == pytest.approx(1.0, abs=0.02)
                assert _std_ratio(attn.projection("v")[0], beta) == pytest.approx(1.0, abs=0.02)
                assert _std_ratio(attn.out_proj.weight, beta) == pytest.approx(1.0, abs=0.02)
                assert attn.projection("v")[0].mean().abs() < 0.01 * beta
            assert _std_ratio(layer.ffn.fc1.weight, beta) == pytest.approx(1.0, abs=0.02)
            assert _std_ratio(layer.ffn.fc2.weight, beta) == pytest.approx(1.0, abs=0.02)
            assert torch.count_nonzero(layer.ffn.fc1.bias) == 0


def test_residual_weight_alpha_is_applied_in_post_ln_block():
    cfg = ModelConfig(encoder_layers=3, decoder_layers=2, d_model=8, heads=2, ffn_dim=16, vocab_size=32, dropout=0.0)
    model = EncoderDecoder(cfg, seed=1)
    block = model.encoder_layers[0].ffn_res
    x = torch.randn(2, 3, 8)
    expected = torch.nn.functional.layer_norm(deepnorm_constants("encoder-decoder", 3, 2)["encoder_alpha"] * x
                                              + model.encoder_layers[0].ffn(x), (8,),
                                              block.norm.weight, block.norm.bias, eps=cfg.layernorm_eps)
    torch.testing.assert_close(block(x, model.encoder_layers[0].ffn), expected)


def test_pre_ln_has_final_norms_and_post_ln_does_not():
    base = dict(encoder_layers=2, decoder_layers=2, d_model=8, heads=2, ffn_dim=16, vocab_size=32)
    assert EncoderDecoder(ModelConfig(norm="preln", **base)).encoder_norm is not None
    assert EncoderDecoder(ModelConfig(norm="deepnorm", **base)).decoder_norm is None
    with pytest.raises(ValueError, match="model.norm"):
        EncoderDecoder(ModelConfig(norm="rmsnorm", **base))

"""The encoder-decoder FLOP formula equals an exact count of a real training step.

torch's FlopCounterMode counts every matmul the forward and backward run. Attention goes through
the math SDPA backend, whose matmuls the counter sees (the fused CPU kernel is invisible to it).
Source and target lengths differ on purpose: that is where the cross-attention K/V term shows.
"""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from model.config import ModelConfig
from model.flops import batch_flops, training_flops, utilization
from model.transformer import EncoderDecoder, smoothed_loss_sum

CFG = ModelConfig(encoder_layers=3, decoder_layers=2, d_model=48, heads=4, ffn_dim=80, vocab_size=97,
                  dropout=0.0)


def counted_step_flops(model: EncoderDecoder, src: torch.Tensor, tgt: torch.Tensor, ckpt: bool = False) -> int:
    def forward() -> torch.Tensor:
        if not ckpt:
            return model(src, tgt)
        # What DeepSpeed's checkpointing does: every encoder/decoder layer recomputed in backward.
        enc, mask = model.embed(src), (src != 0)[:, None, None, :]
        for layer in model.encoder_layers:
            enc = checkpoint(layer, enc, mask, use_reentrant=False)
        dec = model.embed(tgt)
        for layer in model.decoder_layers:
            dec = checkpoint(layer, dec, enc, mask, use_reentrant=False)
        return model.embed.logits(dec)

    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        smoothed_loss_sum(forward(), tgt, 0, 0.1).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("src_len,tgt_len", [(11, 7), (5, 13)])
def test_formula_equals_exact_count_of_a_training_step(src_len, tgt_len):
    torch.manual_seed(0)
    model = EncoderDecoder(CFG)
    batch = 3
    src = torch.randint(4, CFG.vocab_size, (batch, src_len))
    tgt = torch.randint(4, CFG.vocab_size, (batch, tgt_len))
    assert counted_step_flops(model, src, tgt) == pytest.approx(batch * training_flops(CFG, src_len, tgt_len),
                                                                rel=1e-12)


def test_recompute_adds_one_forward_of_the_layers():
    torch.manual_seed(0)
    model = EncoderDecoder(CFG)
    src = torch.randint(4, CFG.vocab_size, (2, 9))
    tgt = torch.randint(4, CFG.vocab_size, (2, 6))
    exact = counted_step_flops(model, src, tgt, ckpt=True)
    assert exact == pytest.approx(2 * training_flops(CFG, 9, 6, recompute=True), rel=1e-12)
    assert exact > counted_step_flops(model, src, tgt)


def test_differs_from_design_formula_only_by_cross_attention_keys_and_values():
    # The shorthand charges all decoder weights to target tokens; cross-attention K/V act on the source.
    n, m, d, f, v = CFG.encoder_layers, CFG.decoder_layers, CFG.d_model, CFG.ffn_dim, CFG.vocab_size
    for s, t in ((20, 10), (10, 20)):
        design = (6 * (n * (4 * d * d + 2 * d * f) * s + m * (8 * d * d + 2 * d * f) * t)
                  + 12 * n * d * s * s + 12 * m * d * t * t + 12 * m * d * t * s + 6 * v * d * t)
        assert training_flops(CFG, s, t) - design == pytest.approx(12 * m * d * d * (s - t))


def test_batch_flops_counts_real_lengths_and_utilization():
    pairs = [(5, 4), (9, 8)]
    assert batch_flops(CFG, pairs) == pytest.approx(training_flops(CFG, 5, 4) + training_flops(CFG, 9, 8))
    assert batch_flops(CFG, pairs) < 2 * training_flops(CFG, 9, 8)  # padding is not model work
    assert utilization(2e12, 2.0, 4e12) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        utilization(1.0, 0.0, 1.0)

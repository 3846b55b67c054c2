"""Greedy and beam search with incremental decoding (model/decoding.py), on small random models.

Scores are checked against full recomputation (the whole target through `EncoderDecoder.forward`),
and beam search against exhaustive search over every output of a tiny vocabulary and length.
"""
import itertools

import pytest
import torch

from model.config import ModelConfig
from model.decoding import (
    DecodeOptions,
    IncrementalDecoder,
    beam_search,
    generate,
    greedy_search,
    max_lengths,
    token_batches,
)
from model.transformer import EncoderDecoder

PAD, UNK, BOS, EOS = 0, 1, 2, 3


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small matrix products: one thread avoids oversubscribing a machine shared by test runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(vocab: int = 24, norm: str = "deepnorm", seed: int = 0, sharp: float = 1.0) -> EncoderDecoder:
    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, heads=4, ffn_dim=64, vocab_size=vocab,
                      norm=norm, dropout=0.0, max_positions=64)
    model = EncoderDecoder(cfg, seed=seed)
    with torch.no_grad():  # a larger embedding makes the next-token distributions less flat
        model.embed.weight.mul_(sharp)
    return model.eval()


def sources(vocab: int, lengths: list[int], seed: int = 0) -> torch.Tensor:
    """Right-padded sources: a tag-like first token, random pieces, eos."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(4, vocab, (n,), generator=g)
        src[row, n - 1] = EOS
    return src


def full_scores(model: EncoderDecoder, src: torch.Tensor, outputs: list[list[int]]) -> list[list[float]]:
    """log p of every token of each output (ending in eos), by one full forward per sentence."""
    result = []
    with torch.no_grad():
        for row, out in enumerate(outputs):
            tgt_in = torch.tensor([[BOS, *out[:-1]]])
            lp = torch.log_softmax(model(src[row:row + 1, :int((src[row] != PAD).sum())], tgt_in).float(), -1)
            result.append([float(lp[0, t, tok]) for t, tok in enumerate(out)])
    return result


@pytest.mark.parametrize("norm", ["deepnorm", "preln"])
def test_incremental_steps_equal_full_recomputation_at_every_step(norm):
    model = tiny_model(norm=norm)
    src = sources(24, [7, 4, 9, 5])
    tgt = torch.randint(4, 24, (4, 8), generator=torch.Generator().manual_seed(1))
    tgt_in = torch.cat([torch.full((4, 1), BOS), tgt[:, :-1]], dim=1)
    with torch.no_grad():
        full = torch.log_softmax(model(src, tgt_in).float(), dim=-1)
        dec = IncrementalDecoder(model, src)
        perm = torch.tensor([2, 0, 3, 1])
        rows = torch.arange(4)
        for t in range(tgt_in.size(1)):
            if t == 4:  # beams swapping histories: caches must follow the rows
                dec.reorder(perm)
                rows = rows[perm]
            step = dec.step(tgt_in[rows, t])
            torch.testing.assert_close(step, full[rows, t], rtol=0, atol=2e-5, msg=f"step {t}")


def test_beam_hypothesis_scores_equal_full_recomputation():
    model = tiny_model(sharp=4.0)
    src = sources(24, [6, 9, 3, 7, 5], seed=3)
    max_len = torch.tensor([6, 8, 4, 7, 5])
    found = beam_search(model, src, max_len, beam=5, bos=BOS, eos=EOS, banned=[PAD, BOS, UNK], lenpen=1.0)
    for row, hyps in enumerate(found):
        assert len(hyps) == 5
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        outputs = [h.tokens + [EOS] for h in hyps]
        reference = full_scores(model, src[row:row + 1].expand(len(hyps), -1), outputs)
        for h, ref in zip(hyps, reference, strict=True):
            assert len(h.tokens) <= int(max_len[row]) and EOS not in h.tokens
            assert h.token_scores == pytest.approx(ref, abs=2e-5)
            assert h.score == pytest.approx(sum(ref) / len(ref), abs=2e-5)


def exhaustive_best(model, src_row: torch.Tensor, allowed: list[int], max_len: int, lenpen: float):
    """Every output of at most `max_len` allowed tokens followed by eos, scored by full forward."""
    outputs = [list(p) + [EOS] for n in range(max_len + 1) for p in itertools.product(allowed, repeat=n)]
    scores = full_scores(model, src_row.expand(len(outputs), -1), outputs)
    normalised = [sum(s) / len(s) ** lenpen for s in scores]
    best = max(range(len(outputs)), key=normalised.__getitem__)
    return outputs[best][:-1], normalised[best], len(outputs)


@pytest.mark.parametrize("lenpen", [1.0, 0.0, 2.0])
def test_beam_search_returns_the_exhaustive_optimum(lenpen):
    # Vocabulary: pad, unk, bos, eos and three pieces; outputs of ≤ 2 pieces: 1 + 3 + 9 = 13.
    # With k = 13 the beam holds every live prefix, so beam search must find the true optimum.
    allowed, max_len, greedy_missed = [4, 5, 6], 2, 0
    for seed in range(8):
        model = tiny_model(vocab=7, seed=seed, sharp=6.0)
        src = sources(7, [5], seed=seed)
        best, best_score, count = exhaustive_best(model, src[0:1], allowed, max_len, lenpen)
        assert count == 13
        found = beam_search(model, src, torch.tensor([max_len]), beam=13, bos=BOS, eos=EOS,
                            banned=[PAD, UNK, BOS], lenpen=lenpen)[0]
        assert len(found) == 13  # every output was finished and scored
        assert found[0].tokens == best
        assert found[0].score == pytest.approx(best_score, rel=1e-6, abs=1e-5)
        greedy = greedy_search(model, src, torch.tensor([max_len]), bos=BOS, eos=EOS, banned=[PAD, UNK, BOS],
                               lenpen=lenpen)[0]
        greedy_missed += greedy.tokens != best
    assert greedy_missed > 0  # the cases are hard enough that the greedy choice is not always best


def test_beam_of_one_is_greedy_search():
    model = tiny_model(sharp=3.0)
    src = sources(24, [8, 5, 6, 3], seed=5)
    max_len = torch.tensor([9, 6, 7, 4])
    greedy = greedy_search(model, src, max_len, bos=BOS, eos=EOS, banned=[PAD, BOS])
    beam1 = beam_search(model, src, max_len, beam=1, bos=BOS, eos=EOS, banned=[PAD, BOS])
    for g, b in zip(greedy, beam1, strict=True):
        assert g.tokens == b[0].tokens
        assert g.score == pytest.approx(b[0].score, abs=1e-6)


def test_output_length_is_capped_at_a_times_source_plus_b():
    model = tiny_model()
    srcs = [list(map(int, row[row != PAD])) for row in sources(24, [3, 8, 12, 5], seed=2)]
    options = DecodeOptions(beam=3, max_len_a=0.5, max_len_b=1)
    caps = max_lengths(torch.tensor([len(s) for s in srcs]), options, 64)
    assert caps.tolist() == [int(0.5 * n + 1) for n in (3, 8, 12, 5)]
    hyps = generate(model, srcs, options, bos=BOS, eos=EOS)
    assert all(len(h.tokens) <= cap for h, cap in zip(hyps, caps.tolist(), strict=True))
    assert any(len(h.tokens) == cap for h, cap in zip(hyps, caps.tolist(), strict=True))  # a flat model runs to the cap
    assert max_lengths(torch.tensor([100]), DecodeOptions(max_len_a=2.0), 64).item() == 63  # position table


def test_generate_batches_by_tokens_and_returns_input_order():
    model = tiny_model(sharp=3.0)
    lengths = [3, 11, 6, 9, 4, 12, 7, 5]
    srcs = [list(map(int, row[row != PAD])) for row in sources(24, lengths, seed=4)]
    batches = token_batches(lengths, max_tokens=24)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) * lengths[b[0]] <= 24 and lengths[b[0]] == max(lengths[i] for i in b) for b in batches)
    seen = []
    for beam in (1, 4):
        small = generate(model, srcs, DecodeOptions(beam=beam, max_tokens=24), bos=BOS, eos=EOS,
                         progress=seen.append)
        alone = [generate(model, [s], DecodeOptions(beam=beam), bos=BOS, eos=EOS)[0] for s in srcs]
        for a, b in zip(small, alone, strict=True):  # padding and batch company do not change a translation
            assert a.tokens == b.tokens
            assert a.score == pytest.approx(b.score, abs=1e-5)
    assert sum(seen) == 2 * len(srcs) and len(seen) == 2 * len(batches)


def test_each_request_gets_the_language_of_its_own_tag():
    # Two "tags" (ids 4 and 5) ask for different outputs; mixing them in one batch must give each
    # request what it gets alone.
    model = tiny_model(sharp=4.0)
    body = [9, 10, 11, 12, EOS]
    requests = [[4, *body], [5, *body], [5, 13, EOS], [4, 13, EOS]]
    together = generate(model, requests, DecodeOptions(beam=5), bos=BOS, eos=EOS, banned=[4, 5])
    alone = [generate(model, [r], DecodeOptions(beam=5), bos=BOS, eos=EOS, banned=[4, 5])[0] for r in requests]
    assert [h.tokens for h in together] == [h.tokens for h in alone]
    assert together[0].tokens != together[1].tokens  # the tag changes the output
    assert all(t not in h.tokens for h in together for t in (4, 5, PAD, BOS))  # tags are never generated


def test_bad_requests_are_refused_with_a_clear_error():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_positions=64"):
        generate(model, [[4] * 65], DecodeOptions(), bos=BOS, eos=EOS)
    with pytest.raises(ValueError, match="beam"):
        generate(model, [[4, EOS]], DecodeOptions(beam=0), bos=BOS, eos=EOS)
    for bad in ({"lenpen": float("nan")}, {"lenpen": float("inf")}, {"max_len_a": float("inf")}):
        with pytest.raises(ValueError, match="must be finite"):
            DecodeOptions(**bad).validate()

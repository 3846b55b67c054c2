"""Greedy and beam search for the plain `EncoderDecoder`, with incremental decoding.

Incremental decoding: the encoder runs once per batch; each decoder layer keeps the keys/values
of its self-attention for the positions generated so far and the projected encoder output for
its cross-attention (the `cache` of `DecoderLayer.forward`), so step t feeds only the newest
token. Beam search reorders those caches when beams swap histories.

Beam search follows fairseq's `SequenceGenerator` (what the paper's numbers were made with):
each step scores 2k candidates per sentence; an end-of-sentence candidate ranked among the first
k finishes a hypothesis with score Σ log p / len^lenpen (len counts the eos); the first k
candidates that do not end continue; a sentence is done when k hypotheses have finished or it
reached its maximum length a·|src| + b, where only eos is allowed. `beam == 1` is greedy search.

Which language to produce is decided by the tag at the start of each source (`<2xx>`), so every
request of a batch may ask for a different target language.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from model.transformer import EncoderDecoder


@dataclass(kw_only=True)
class DecodeOptions:
    """How to search."""

    beam: int = 5
    """Beam size k (the paper: 5); 1 is greedy search."""
    lenpen: float = 1.0
    """Length penalty: a finished hypothesis scores Σ log p / len^lenpen (1.0: mean log-prob)."""
    max_len_a: float = 1.2
    """Longest output in tokens, before eos, is a·|src| + b (|src| counts the tag and eos);
    1.2 and 10 are the values fairseq's translation examples use."""
    max_len_b: int = 10
    """See max_len_a."""
    max_tokens: int = 4096
    """Source tokens per batch (sentences × longest source); beam search holds k rows each."""

    def validate(self) -> None:
        if self.beam < 1:
            raise ValueError(f"beam={self.beam} must be >= 1")
        if not math.isfinite(self.lenpen) or not math.isfinite(self.max_len_a):
            raise ValueError(f"lenpen={self.lenpen} and max_len_a={self.max_len_a} must be finite numbers")
        if self.max_tokens < 1 or self.max_len_a < 0 or self.max_len_b < 0:
            raise ValueError("max_tokens must be >= 1, max_len_a and max_len_b >= 0")


@dataclass
class Hypothesis:
    """One finished output."""

    tokens: list[int]
    """Generated ids, without the final eos."""
    score: float
    """Σ token_scores / len(token_scores)^lenpen."""
    token_scores: list[float] = field(default_factory=list)
    """log p of every generated token, the eos included."""


def _map_tensors(tree: dict, fn: Callable[[torch.Tensor], torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    """Replace every tensor in a nested dict by fn(tensor), except under the keys `skip`."""
    for key, value in tree.items():
        if key in skip:
            continue
        if isinstance(value, dict):
            _map_tensors(value, fn)
        elif isinstance(value, torch.Tensor):
            tree[key] = fn(value)


class IncrementalDecoder:
    """The decoder side of one batch, one token per step.

    Rows may be reordered (beams swapping histories, finished sentences leaving) with
    `reorder`; the encoder output and every cached tensor follow.
    """

    def __init__(self, model: EncoderDecoder, src: torch.Tensor):
        self.model = model
        self.enc, self.mask = model.encode(src)
        self.caches: list[dict] = [{} for _ in model.decoder_layers]
        self.position = 0

    def step(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [N, V] (float32) of the next token after `last_tokens` [N]."""
        model = self.model
        x = model.embed(last_tokens[:, None], offset=self.position)
        for layer, cache in zip(model.decoder_layers, self.caches, strict=True):
            x = layer(x, self.enc, self.mask, cache=cache)
        if model.decoder_norm is not None:
            x = model.decoder_norm(x)
        self.position += 1
        return F.log_softmax(model.embed.logits(x[:, -1]).float(), dim=-1)

    def reorder(self, index: torch.Tensor, memory: bool = True) -> None:
        """Row i becomes old row index[i]. `memory=False` leaves the encoder output and the
        cross-attention caches (DecoderLayer's cache['cross']) alone: right when index[i] is a
        row of the same sentence as row i, as beams of one sentence share them."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, index)

        if memory:
            self.enc = pick(self.enc)
            self.mask = None if self.mask is None else pick(self.mask)
        for cache in self.caches:
            _map_tensors(cache, pick, skip=() if memory else ("cross",))


def _banned_mask(vocab: int, banned: Sequence[int], device: torch.device) -> torch.Tensor:
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[list(banned)] = True
    return mask


def _only_eos(lprobs: torch.Tensor, rows: torch.Tensor, eos: int) -> None:
    """Rows at their maximum length may only end (in place)."""
    if rows.any():
        keep = lprobs[rows, eos]
        lprobs[rows] = float("-inf")
        lprobs[rows, eos] = keep


@torch.no_grad()
def greedy_search(model: EncoderDecoder, src: torch.Tensor, max_len: torch.Tensor, *, bos: int, eos: int,
                  banned: Sequence[int] = (), lenpen: float = 1.0) -> list[Hypothesis]:
    """Most probable next token at every step; one hypothesis per source row of `src` [B, S]."""
    batch, device = src.size(0), src.device
    dec = IncrementalDecoder(model, src)
    ban = _banned_mask(model.cfg.vocab_size, banned, device)
    alive = torch.arange(batch, device=device)
    tokens = torch.full((batch, 1), bos, dtype=torch.long, device=device)
    scores = torch.zeros(batch, 0, device=device)
    out: list[Hypothesis | None] = [None] * batch
    for t in range(int(max_len.max()) + 1):
        lprobs = dec.step(tokens[:, -1])
        lprobs[:, ban] = float("-inf")
        _only_eos(lprobs, max_len[alive] == t, eos)
        best, tok = lprobs.max(dim=1)
        tokens = torch.cat([tokens, tok[:, None]], dim=1)
        scores = torch.cat([scores, best[:, None]], dim=1)
        ended = tok == eos
        for row in ended.nonzero().flatten().tolist():
            token_scores = scores[row].tolist()
            out[int(alive[row])] = Hypothesis(tokens[row, 1:-1].tolist(), sum(token_scores) / (t + 1) ** lenpen,
                                              token_scores)
        if ended.all():
            break
        if ended.any():
            keep = (~ended).nonzero().flatten()
            tokens, scores, alive = tokens[keep], scores[keep], alive[keep]
            dec.reorder(keep)
    return out  # type: ignore[return-value]


@torch.no_grad()
def beam_search(model: EncoderDecoder, src: torch.Tensor, max_len: torch.Tensor, *, beam: int, bos: int,
                eos: int, banned: Sequence[int] = (), lenpen: float = 1.0) -> list[list[Hypothesis]]:
    """Beam search over the rows of `src` [B, S]; per row, the finished hypotheses best first."""
    batch, k, device = src.size(0), beam, src.device
    vocab = model.cfg.vocab_size
    dec = IncrementalDecoder(model, src)
    dec.reorder(torch.arange(batch, device=device).repeat_interleave(k))
    ban = _banned_mask(vocab, banned, device)
    alive = torch.arange(batch, device=device)       # sentence of each group of k rows
    tokens = torch.full((batch * k, 1), bos, dtype=torch.long, device=device)
    token_scores = torch.zeros(batch * k, 0, device=device)
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0                               # all beams start equal: keep one of them
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    for t in range(int(max_len.max()) + 1):
        n = alive.numel()
        lprobs = dec.step(tokens[:, -1])
        lprobs[:, ban] = float("-inf")
        at_limit = max_len[alive] == t
        _only_eos(lprobs, at_limit.repeat_interleave(k), eos)
        cand = (scores[:, :, None] + lprobs.view(n, k, vocab)).view(n, k * vocab)
        top_scores, top_index = cand.topk(min(2 * k, k * vocab), dim=1)
        top_beam, top_tok = top_index // vocab, top_index % vocab
        is_eos = top_tok == eos

        # An eos among the first k candidates finishes a hypothesis (in rank order).
        ends = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])
        for i, j in ends.nonzero().tolist():
            sentence = int(alive[i])
            if len(finished[sentence]) < k:
                row = i * k + int(top_beam[i, j])
                history = token_scores[row].tolist() + [float(lprobs[row, eos])]
                finished[sentence].append(Hypothesis(tokens[row, 1:].tolist(),
                                                     float(top_scores[i, j]) / (t + 1) ** lenpen, history))
        done = at_limit | torch.tensor([len(finished[s]) >= k for s in alive.tolist()], device=device)
        if done.all():
            break

        # The first k candidates that do not end continue (stable sort keeps their rank order).
        order = torch.argsort(is_eos.to(torch.int8), dim=1, stable=True)[:, :k]
        next_scores = top_scores.gather(1, order)
        next_beam = top_beam.gather(1, order)
        next_tok = top_tok.gather(1, order)
        next_scores = next_scores.masked_fill(next_tok == eos, float("-inf"))
        keep = ~done
        origin = (torch.arange(n, device=device)[:, None] * k + next_beam)[keep].flatten()
        new_tok = next_tok[keep].flatten()
        tokens = torch.cat([tokens[origin], new_tok[:, None]], dim=1)
        token_scores = torch.cat([token_scores[origin], lprobs[origin, new_tok][:, None]], dim=1)
        scores, alive = next_scores[keep], alive[keep]
        dec.reorder(origin, memory=not bool(keep.all()))
    return [sorted(hyps, key=lambda h: -h.score) for hyps in finished]


def max_lengths(src_lens: torch.Tensor, options: DecodeOptions, max_positions: int) -> torch.Tensor:
    """a·|src| + b per sentence, capped so that every decoder position has an embedding."""
    wanted = (options.max_len_a * src_lens.double() + options.max_len_b).long()
    return wanted.clamp(max=max_positions - 1)


def token_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that sentences × longest source ≤ max_tokens (a longer
    single sentence gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def generate(model: EncoderDecoder, sources: Sequence[Sequence[int]], options: DecodeOptions, *, bos: int,
             eos: int, banned: Sequence[int] = (),
             progress: Callable[[int], None] | None = None) -> list[Hypothesis]:
    """The best hypothesis for every source (ids: `<2xx>` tag, pieces, eos), in input order.

    Sources are batched by `options.max_tokens`; `banned` ids (e.g. language tags) are never
    generated, nor are padding and bos. `progress(n)` is called after each batch of n sources.
    """
    options.validate()
    pad, limit = model.cfg.pad_id, model.cfg.max_positions
    device = next(model.parameters()).device
    for i, source in enumerate(sources):
        if not 0 < len(source) <= limit:
            raise ValueError(f"source {i} has {len(source)} tokens; it must have 1 to "
                             f"model.max_positions={limit}")
    banned = sorted({pad, bos, *banned})
    results: list[Hypothesis | None] = [None] * len(sources)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in token_batches([len(s) for s in sources], options.max_tokens):
                width = len(sources[batch[0]])
                src = torch.full((len(batch), width), pad, dtype=torch.long)
                for row, i in enumerate(batch):
                    src[row, :len(sources[i])] = torch.as_tensor(sources[i], dtype=torch.long)
                src = src.to(device)
                max_len = max_lengths(torch.tensor([len(sources[i]) for i in batch]), options, limit).to(device)
                if options.beam == 1:
                    hyps = greedy_search(model, src, max_len, bos=bos, eos=eos, banned=banned,
                                         lenpen=options.lenpen)
                else:
                    hyps = [found[0] for found in beam_search(model, src, max_len, beam=options.beam, bos=bos,
                                                               eos=eos, banned=banned, lenpen=options.lenpen)]
                for i, hyp in zip(batch, hyps, strict=True):
                    results[i] = hyp
                if progress is not None:
                    progress(len(batch))
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]

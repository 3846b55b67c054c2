"""Check an export against the project's model on a fixed probe batch, and measure what the one
LayerNorm ε of the target format changes for DeepNorm (LN(α·x + G) = LN(x + G/α) needs ε/α²)."""
from __future__ import annotations

import torch

from model.transformer import EncoderDecoder
from runtime.accelerator import HOST

PROBE_SEED = 1234


def probe_batch(model: EncoderDecoder, bos: int, first_piece: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four right-padded sources and decoder inputs of ordinary pieces (ids ≥ `first_piece`,
    past the specials and tags), lengths 3 to 24, from a fixed seed."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(PROBE_SEED)
    lengths = [(24, 20), (11, 15), (3, 7), (17, 4)]
    src = torch.full((4, 24), cfg.pad_id, dtype=torch.long)
    tgt = torch.full((4, 20), cfg.pad_id, dtype=torch.long)
    for row, (s, t) in enumerate(lengths):
        src[row, :s] = torch.randint(first_piece, cfg.vocab_size, (s,), generator=g)
        tgt[row, :t] = torch.randint(first_piece, cfg.vocab_size, (t,), generator=g)
        tgt[row, 0] = bos
    return src, tgt


@torch.no_grad()
def logits_difference(model: EncoderDecoder, hf_model, src: torch.Tensor, tgt: torch.Tensor) -> float:
    """max |logit difference| over the non-padding target positions."""
    pad = model.cfg.pad_id
    ours = model.eval()(src, tgt)
    theirs = hf_model(input_ids=src, attention_mask=(src != pad).long(), decoder_input_ids=tgt,
                      decoder_attention_mask=(tgt != pad).long()).logits
    keep = tgt != pad
    return (ours[keep] - theirs[keep]).abs().max().item()


@torch.no_grad()
def verify_hf(model: EncoderDecoder, hf_dir: str, bos: int, first_piece: int, alphas: tuple[float, float]) -> dict:
    """{'max_abs_logit_diff': as exported, 'with_exact_eps': the same with every LayerNorm's ε
    set to ε/α² of its stack (the exact DeepNorm equivalent, which Marian cannot store)}."""
    from transformers import AutoModelForSeq2SeqLM

    hf = AutoModelForSeq2SeqLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    src, tgt = probe_batch(model, bos, first_piece)
    result = {"max_abs_logit_diff": logits_difference(model, hf, src, tgt),
              "max_abs_logit": model(src, tgt).abs().max().item()}
    if alphas != (1.0, 1.0):
        eps = model.cfg.layernorm_eps
        for stack, alpha in ((hf.model.encoder, alphas[0]), (hf.model.decoder, alphas[1])):
            for module in stack.modules():
                if isinstance(module, torch.nn.LayerNorm):
                    module.eps = eps / alpha**2
        result["with_exact_eps"] = logits_difference(model, hf, src, tgt)
    return result


@torch.no_grad()
def verify_ct2(model: EncoderDecoder, ct2_dir: str, pieces: list[str], bos: int, first_piece: int) -> float:
    """max |log p difference| of the probe's target tokens between CTranslate2 and the project."""
    import ctranslate2

    pad = model.cfg.pad_id
    src, tgt = probe_batch(model, bos, first_piece)
    ours = torch.log_softmax(model.eval()(src, tgt).float(), dim=-1)
    translator = ctranslate2.Translator(ct2_dir, device=HOST, intra_threads=1)
    sources = [[pieces[i] for i in row if i != pad] for row in src.tolist()]
    targets = [[pieces[i] for i in row[1:] if i != pad] for row in tgt.tolist()]
    results = translator.score_batch(sources, targets)
    worst = 0.0
    for row, result in enumerate(results):
        ids = [i for i in tgt[row, 1:].tolist() if i != pad]
        # score_batch scores the target tokens then the end token; compare the target tokens.
        for position, (token, theirs) in enumerate(zip(ids, result.log_probs, strict=False)):
            worst = max(worst, abs(ours[row, position, token].item() - theirs))
    return worst

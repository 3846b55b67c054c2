"""This project's encoder-decoder → a Hugging Face `MarianMTModel` folder, exactly.

Why Marian: it is the post-norm encoder-decoder that transformers and CTranslate2 both hold
whose pieces match this model one for one — sinusoidal positions added to √d-scaled token
embeddings, one embedding shared by encoder, decoder and output layer (`final_logits_bias` is
zero), Post-LN layers `LN(x + G(x))` with no LayerNorm on the embeddings and none at the end of a
stack, biases on every linear, relu or exact-erf gelu, the decoder started from a chosen token.

What has to be carried over explicitly:
- Positions: Marian's own table uses frequencies 10000^(−i/(d/2)); this project's (fairseq's,
  tensor2tensor's) 10000^(−i/(d/2 − 1)), both with sin in the first half and cos in the second.
  The project's table is written into `embed_positions.weight` of both stacks; transformers
  loads a table found in the file instead of computing its own (its init skips loaded tensors).
- DeepNorm: LayerNorm is scale-invariant, LN(α·x + G(x)) = LN(x + G(x)/α) with ε/α² instead of
  ε. Dividing the weight and bias of the last linear of every sub-layer (attention out_proj,
  FFN fc2) by the stack's α makes each DeepNorm layer a plain Post-LN layer. Marian's LayerNorms
  all use torch's default ε = 1e-5 and have no setting for it, so a DeepNorm export keeps
  ε = 1e-5 where ε/α² would be exact; `verify` measures what that changes.
- Decoding: the decoder starts from bos (`decoder_start_token_id`), pad/bos and the language
  tags are never generated (`suppress_tokens`), beam 5 with length penalty 1.0 and fairseq's
  stopping rule (`early_stopping=True`), as `./run.sh translate`.

Refused, because no standard class computes them: Pre-LN and Sub-LN (pre-norm layers with a
final LayerNorm per stack; Sub-LN adds LayerNorms inside the sub-layers), BranchNorm before its
maximum-norm step (the branch is still partly normalised), and LayerNorm ε other than 1e-5.
"""
from __future__ import annotations

import json
import os

import torch

from model.config import ModelConfig
from model.layers import sinusoidal_table
from model.transformer import EncoderDecoder, stack_norms

MARIAN_EPS = 1e-5  # nn.LayerNorm's default, the only ε Marian's layers have
TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json")


class ExportError(ValueError):
    """A model that cannot be exported exactly; the message says why and what to do."""


def export_alphas(model: EncoderDecoder) -> tuple[float, float]:
    """(encoder α, decoder α) of an exportable model; ExportError naming the reason otherwise."""
    cfg = model.cfg
    enc, dec = stack_norms(cfg)
    if cfg.norm == "subln":
        raise ExportError("model.norm=subln cannot be exported exactly: Sub-LN puts LayerNorms inside the "
                          "sub-layers (before the attention output projection and FFN fc2) and normalises "
                          "before each sub-layer, which no standard encoder-decoder class computes")
    if "pre" in (enc.placement, dec.placement):
        raise ExportError(f"model.norm={cfg.norm} cannot be exported exactly: Pre-LN normalises the input of each "
                          "sub-layer and ends each stack with a LayerNorm; Marian (the class transformers and "
                          "CTranslate2 share) is Post-LN, and the pre-norm classes differ elsewhere (M2M100 "
                          "shifts the positions by the padding index, MBart normalises the embeddings)")
    if "branch" in (enc.placement, dec.placement):
        steps = sorted({int(block.step) for block in _branch_blocks(model)})
        t = cfg.branchnorm_max_norm_step
        if not steps or steps[0] < t:
            raise ExportError(f"model.norm=branchnorm at step {steps[0] if steps else 0} < "
                              f"model.branchnorm_max_norm_step={t}: its branches are still partly normalised "
                              f"(λ_t = t/T < 1), which no standard class computes; it is plain Post-LN, and "
                              f"exportable, from step {t} on")
    if cfg.layernorm_eps != MARIAN_EPS:
        raise ExportError(f"model.layernorm_eps={cfg.layernorm_eps}: Marian's LayerNorms have ε = {MARIAN_EPS} "
                          "and no setting for it")
    return enc.alpha, dec.alpha


def _branch_blocks(model: EncoderDecoder) -> list:
    from model.norms import step_blocks

    return step_blocks(model)


def marian_config(cfg: ModelConfig, tags: dict[str, int], bos: int, eos: int) -> dict:
    """config.json of the exported `MarianMTModel`."""
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.encoder_layers,
        "decoder_layers": cfg.decoder_layers,
        "encoder_attention_heads": cfg.heads,
        "decoder_attention_heads": cfg.heads,
        "encoder_ffn_dim": cfg.ffn_dim,
        "decoder_ffn_dim": cfg.ffn_dim,
        "activation_function": cfg.activation,  # relu, or gelu: torch's exact (erf) gelu in both
        "max_position_embeddings": cfg.max_positions,
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout,
        "activation_dropout": cfg.activation_dropout,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "pad_token_id": cfg.pad_id,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "decoder_start_token_id": bos,
        "forced_eos_token_id": None,
        "is_encoder_decoder": True,
        "use_cache": True,
        "dtype": "float32",
    }


def generation_config(cfg: ModelConfig, tags: dict[str, int], bos: int, eos: int) -> dict:
    """generation_config.json: `./run.sh translate`'s defaults (beam 5, length penalty 1.0,
    fairseq's stopping rule) and the tokens it never generates (pad, bos, language tags)."""
    return {
        "decoder_start_token_id": bos,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_id,
        "forced_eos_token_id": None,
        "num_beams": 5,
        "length_penalty": 1.0,
        "early_stopping": True,
        "max_length": cfg.max_positions,
        "suppress_tokens": sorted({cfg.pad_id, bos, *tags.values()}),
    }


def marian_state_dict(model: EncoderDecoder) -> dict[str, torch.Tensor]:
    """The weights under Marian's names (tied copies left out: transformers ties them on load),
    DeepNorm's α folded into out_proj and fc2, the project's position table included."""
    cfg = model.cfg
    alpha_enc, alpha_dec = export_alphas(model)
    src = {k: v.detach().float() for k, v in model.state_dict().items()}
    table = sinusoidal_table(cfg.max_positions, cfg.d_model)
    out = {"model.shared.weight": src["embed.weight"],
           "model.encoder.embed_positions.weight": table.clone(),
           "model.decoder.embed_positions.weight": table.clone(),
           "final_logits_bias": torch.zeros(1, cfg.vocab_size)}

    def linear(dst: str, name: str, scale: float = 1.0) -> None:
        out[f"{dst}.weight"] = src[f"{name}.weight"] / scale
        out[f"{dst}.bias"] = src[f"{name}.bias"] / scale

    def norm(dst: str, name: str) -> None:
        out[f"{dst}.weight"] = src[f"{name}.weight"]
        out[f"{dst}.bias"] = src[f"{name}.bias"]

    def attention(dst: str, name: str, alpha: float) -> None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            linear(f"{dst}.{proj}", f"{name}.{proj}")
        linear(f"{dst}.out_proj", f"{name}.out_proj", alpha)

    for i in range(cfg.encoder_layers):
        dst, name = f"model.encoder.layers.{i}", f"encoder_layers.{i}"
        attention(f"{dst}.self_attn", f"{name}.self_attn", alpha_enc)
        norm(f"{dst}.self_attn_layer_norm", f"{name}.self_attn_res.norm")
        linear(f"{dst}.fc1", f"{name}.ffn.fc1")
        linear(f"{dst}.fc2", f"{name}.ffn.fc2", alpha_enc)
        norm(f"{dst}.final_layer_norm", f"{name}.ffn_res.norm")
    for i in range(cfg.decoder_layers):
        dst, name = f"model.decoder.layers.{i}", f"decoder_layers.{i}"
        attention(f"{dst}.self_attn", f"{name}.self_attn", alpha_dec)
        norm(f"{dst}.self_attn_layer_norm", f"{name}.self_attn_res.norm")
        attention(f"{dst}.encoder_attn", f"{name}.cross_attn", alpha_dec)
        norm(f"{dst}.encoder_attn_layer_norm", f"{name}.cross_attn_res.norm")
        linear(f"{dst}.fc1", f"{name}.ffn.fc1")
        linear(f"{dst}.fc2", f"{name}.ffn.fc2", alpha_dec)
        norm(f"{dst}.final_layer_norm", f"{name}.ffn_res.norm")
    return {k: v.contiguous() for k, v in out.items()}


def write_tokenizer(out_dir: str, spm_model: bytes, tokenizer) -> None:
    """MarianTokenizer files: the SentencePiece model byte for byte (as source.spm and
    target.spm), vocab.json (every piece → its id), and the language tags as special tokens, so
    that `tokenizer("<2de>" + text)` gives the ids of `./run.sh translate` ([tag] + pieces + eos)."""
    for name in ("source.spm", "target.spm"):
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(spm_model)
    sp = tokenizer.sp
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    _write_json(os.path.join(out_dir, "vocab.json"), vocab)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "MarianTokenizer",
        "unk_token": sp.id_to_piece(tokenizer.unk_id),
        "eos_token": sp.id_to_piece(tokenizer.eos_id),
        "pad_token": sp.id_to_piece(tokenizer.pad_id),
        "bos_token": sp.id_to_piece(tokenizer.bos_id),
        "additional_special_tokens": [sp.id_to_piece(i) for i in tokenizer.tags.values()],
        # transformers' default clean-up would rewrite " ." to "." and the like.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "separate_vocabs": False,
    })


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=2)
        f.write("\n")


def write_hf(model: EncoderDecoder, spm_model: bytes, tokenizer, out_dir: str) -> None:
    """Model, generation config, safetensors weights and tokenizer files into `out_dir`
    (which must exist and be empty)."""
    from safetensors.torch import save_file

    cfg = model.cfg
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    state = marian_state_dict(model)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), marian_config(cfg, tokenizer.tags, bos, eos))
    _write_json(os.path.join(out_dir, "generation_config.json"), generation_config(cfg, tokenizer.tags, bos, eos))
    write_tokenizer(out_dir, spm_model, tokenizer)

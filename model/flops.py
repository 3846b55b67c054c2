"""Training FLOPs of the encoder-decoder, and the utilisation figures built on them.

One function, `training_flops`, is the formula; everything that reports TFLOP/s, MFU or HFU (the
benchmark, the planner) calls it. Per sequence pair with S source and T target tokens, N encoder
and M decoder layers, width d, FFN width f, vocabulary V, a training step (forward + backward,
backward = 2 × forward) costs

    6 · (P_enc·S + P_dec,T·T + P_dec,S·S)        weight matmuls
  + 12 · N·d·S²  + 12 · M·d·T²                   self-attention scores and mixing
  + 12 · M·d·T·S                                 cross-attention
  + 6 · V·d·T                                    output projection (tied embedding)

with P_enc = N·(4d² + 2df) the encoder's matmul weights and the decoder's split by the tokens they
act on: cross-attention keys and values project the *source* (P_dec,S = M·2d²), everything else
the target (P_dec,T = M·(6d² + 2df)). The common shorthand 6·P_dec·T undercounts by
12·M·d²·(S − T) per pair whenever source and target lengths differ, which the exact count in
tests/test_flops.py exposes. Causal self-attention is counted as full S² (the kernels compute
the masked half too, and it is the usual convention). Biases, LayerNorms, softmax and the
embedding gather are left out: they are not matmuls and are < 1% at these widths.

The pipeline partitioner (parallel/partition.py `stage_bounds`, used by the trainer and by the
planner) balances `layer_costs`: the same per-layer forward FLOPs at a typical 32 + 32 tokens.

MFU counts only the model FLOPs of real (non-padding) tokens; HFU counts what the hardware did:
padded shapes plus the forward recomputed under activation checkpointing.
"""
from __future__ import annotations

from collections.abc import Iterable

from model.config import ModelConfig


def layer_matmul_params(cfg: ModelConfig) -> dict[str, int]:
    """Weight-matrix elements per layer: encoder, decoder (target side), decoder (source side)."""
    d, f = cfg.d_model, cfg.ffn_dim
    return {"encoder": 4 * d * d + 2 * d * f, "decoder_target": 6 * d * d + 2 * d * f,
            "decoder_source": 2 * d * d}


def layer_forward_flops(cfg: ModelConfig, kind: str, src_len: float, tgt_len: float) -> float:
    """Forward FLOPs of one plan layer (model/transformer.py `layer_plan` kinds) for one pair
    (multiply-add = 2 FLOPs). Embeddings and final LayerNorms count 0: no matmul."""
    d = cfg.d_model
    p = layer_matmul_params(cfg)
    s, t = float(src_len), float(tgt_len)
    if kind == "encoder":
        return 2 * p["encoder"] * s + 4 * d * s * s  # Q·Kᵀ and P·V: 2·d FLOPs per pair each
    if kind == "decoder":
        return 2 * (p["decoder_target"] * t + p["decoder_source"] * s) + 4 * d * (t * t + t * s)
    if kind == "output":
        return 2 * cfg.vocab_size * d * t
    return 0.0


LOGIT_COST = 1000.0
"""FLOP-equivalents per logit (forward + backward) of the loss beyond the output layer's matrix
products: the chunked loss (parallel/loss.py) takes the maximum, exponentials, sums and the
gradient of every logit, passes over memory that cost the same whatever d is. So the output layer
costs its products' 6·V·d per target token plus LOGIT_COST·V. `./run.sh bench ops` measures it
(`logit_cost`: (time of the layer with its loss / time of its three products − 1) · 6·d): 600–1,600
across runs on a shared 2-core CPU (d = 128–512, fp32); the GPU check measures it on GPUs."""


def layer_costs(cfg: ModelConfig, src_len: int = 32, tgt_len: int = 32) -> list[float]:
    """The forward FLOPs (`layer_forward_flops`) of every layer of the plan (model/transformer.py
    `layer_plan`), in plan order, for one pair of typical length: the weights the pipeline stages
    are balanced by. The embedding and the final LayerNorms weigh 0 (no matmul); the output layer
    its 2·V·d per target token and a third of the loss's LOGIT_COST·V, which makes the last stage
    heavy for large vocabularies."""
    from model.transformer import layer_plan  # the plan needs torch's modules; the formulas do not

    loss = LOGIT_COST * cfg.vocab_size * tgt_len / 3
    return [layer_forward_flops(cfg, layer.kind, src_len, tgt_len) + (loss if layer.kind == "output" else 0.0)
            for layer in layer_plan(cfg)]


def forward_flops(cfg: ModelConfig, src_len: float, tgt_len: float, *, layers_only: bool = False) -> float:
    """Forward FLOPs of one sequence pair: the sum of `layer_forward_flops` over the model.

    `layers_only` leaves out the output projection: what activation checkpointing recomputes
    (DeepSpeed checkpoints encoder and decoder layers, never the embedding or the output layer).
    """
    return (cfg.encoder_layers * layer_forward_flops(cfg, "encoder", src_len, tgt_len)
            + cfg.decoder_layers * layer_forward_flops(cfg, "decoder", src_len, tgt_len)
            + (0.0 if layers_only else layer_forward_flops(cfg, "output", src_len, tgt_len)))


def training_flops(cfg: ModelConfig, src_len: float, tgt_len: float, *, recompute: bool = False) -> float:
    """FLOPs of forward + backward for one sequence pair; `recompute` adds the forward that
    activation checkpointing repeats in backward (hardware FLOPs, not model FLOPs)."""
    flops = 3 * forward_flops(cfg, src_len, tgt_len)
    if recompute:
        flops += forward_flops(cfg, src_len, tgt_len, layers_only=True)
    return flops


def batch_flops(cfg: ModelConfig, pairs: Iterable[tuple[int, int]], *, recompute: bool = False) -> float:
    """Sum of `training_flops` over (source length, target length) pairs."""
    return sum(training_flops(cfg, s, t, recompute=recompute) for s, t in pairs)


def utilization(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Achieved FLOP/s as a fraction of the peak: MFU with model FLOPs, HFU with hardware FLOPs.
    `peak_flops_per_s` is the peak of all devices the step ran on together."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError("utilization needs a positive time and a positive peak")
    return flops / seconds / peak_flops_per_s

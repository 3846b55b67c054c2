"""Normalisation strategies: where the LayerNorm sits, the residual weight α and the init gain β.

Every strategy is defined here and only here. A strategy is resolved once per model into two
`StackNorm` records (encoder, decoder); layers ask their record for a residual block and for the
gain of each projection, so no layer branches on the strategy's name.

Formulas (DeepNet, Wang et al., TPAMI 2024, Section III-C and Appendix B):
  encoder-decoder, N encoder / M decoder layers
      encoder  α = 0.81·(N⁴M)^(1/16)   β = 0.87·(N⁴M)^(−1/16)
      decoder  α = (3M)^(1/4)          β = (12M)^(−1/4)
  encoder-only α = (2N)^(1/4)          β = (8N)^(−1/4)     (decoder-only: the same with M)
β is the Xavier-normal gain of the FFN linears and of the value and output projections of every
attention; query and key projections keep gain 1.

`deepnorm-torchscale` is the variant of the authors' torchscale code: encoder β divides by
(N⁴M)^(1/16)/1.15 instead of multiplying by 0.87·(N⁴M)^(−1/16), i.e. β_enc = 1.15·(N⁴M)^(−1/16);
decoder and α as the paper. (torchscale also scales PyTorch's default init rather than Xavier;
this project keeps Xavier-normal for every strategy so that only the constants differ.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


def deepnorm_constants(arch: str, encoder_layers: int = 0, decoder_layers: int = 0) -> dict[str, float]:
    """α and β of DeepNorm for `arch` in {encoder-decoder, encoder-only, decoder-only}."""
    n, m = encoder_layers, decoder_layers
    if arch == "encoder-decoder":
        return {
            "encoder_alpha": 0.81 * (n**4 * m) ** (1 / 16),
            "encoder_beta": 0.87 * (n**4 * m) ** (-1 / 16),
            "decoder_alpha": (3 * m) ** (1 / 4),
            "decoder_beta": (12 * m) ** (-1 / 4),
        }
    if arch == "encoder-only":
        return {"encoder_alpha": (2 * n) ** (1 / 4), "encoder_beta": (8 * n) ** (-1 / 4)}
    if arch == "decoder-only":
        return {"decoder_alpha": (2 * m) ** (1 / 4), "decoder_beta": (8 * m) ** (-1 / 4)}
    raise ValueError(f"unknown architecture {arch!r}: use encoder-decoder, encoder-only or decoder-only")


class PostNormResidual(nn.Module):
    """x_{l+1} = LN(α·x_l + G(x_l)): Post-LN when α = 1, DeepNorm otherwise."""

    def __init__(self, d_model: int, alpha: float, dropout: float, eps: float):
        super().__init__()
        self.alpha = alpha
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return self.norm(self.alpha * x + self.dropout(branch(x)))


class PreNormResidual(nn.Module):
    """x_{l+1} = x_l + G(LN(x_l))."""

    def __init__(self, d_model: int, dropout: float, eps: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return x + self.dropout(branch(self.norm(x)))


@dataclass(frozen=True)
class StackNorm:
    """How one stack (encoder or decoder) normalises and initialises its sub-layers."""

    placement: str
    """'post' (LN after the residual sum) or 'pre' (LN at the branch input)."""
    alpha: float = 1.0
    """Weight of the residual shortcut (post placement only)."""
    beta: float = 1.0
    """Xavier gain of the FFN linears and the attention value/output projections."""
    final_norm: bool = False
    """Whether the stack ends with a LayerNorm (Pre-LN needs one; Post-LN already ends normalised)."""

    def residual(self, d_model: int, dropout: float, eps: float) -> nn.Module:
        """The residual block wrapping one sub-layer."""
        if self.placement == "post":
            return PostNormResidual(d_model, self.alpha, dropout, eps)
        return PreNormResidual(d_model, dropout, eps)

    def gain(self, projection: str) -> float:
        """Init gain for a projection: 'q', 'k', 'v', 'o', 'fc1' or 'fc2'."""
        return 1.0 if projection in ("q", "k") else self.beta


def _postln(n: int, m: int) -> tuple[StackNorm, StackNorm]:
    return StackNorm("post"), StackNorm("post")


def _preln(n: int, m: int) -> tuple[StackNorm, StackNorm]:
    return StackNorm("pre", final_norm=True), StackNorm("pre", final_norm=True)


def _deepnorm(n: int, m: int) -> tuple[StackNorm, StackNorm]:
    c = deepnorm_constants("encoder-decoder", n, m)
    return (StackNorm("post", c["encoder_alpha"], c["encoder_beta"]),
            StackNorm("post", c["decoder_alpha"], c["decoder_beta"]))


def _deepnorm_torchscale(n: int, m: int) -> tuple[StackNorm, StackNorm]:
    c = deepnorm_constants("encoder-decoder", n, m)
    return (StackNorm("post", c["encoder_alpha"], 1.15 * (n**4 * m) ** (-1 / 16)),
            StackNorm("post", c["decoder_alpha"], c["decoder_beta"]))


STRATEGIES: dict[str, Callable[[int, int], tuple[StackNorm, StackNorm]]] = {
    "postln": _postln,
    "preln": _preln,
    "deepnorm": _deepnorm,
    "deepnorm-torchscale": _deepnorm_torchscale,
}


def resolve(norm: str, encoder_layers: int, decoder_layers: int) -> tuple[StackNorm, StackNorm]:
    """The (encoder, decoder) records of strategy `norm` for an N-layer encoder, M-layer decoder."""
    if norm not in STRATEGIES:
        raise ValueError(f"model.norm={norm!r} is not a strategy; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[norm](encoder_layers, decoder_layers)

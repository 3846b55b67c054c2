"""Normalisation strategies: where the LayerNorms sit, the residual weight α and the init gains.

Every strategy is defined here and only here. A strategy is resolved once per model into two
`StackNorm` records (encoder, decoder); layers ask their record for a residual block, for the
inner LayerNorms of a sub-layer and for the gain of each projection, so no layer branches on the
strategy's name. `StackNorm.layer(i)` specialises a record to the i-th layer of its stack (only
Post-LN-init depends on the index).

Strategies (`model.norm`), N encoder / M decoder layers, sub-layer function G:

  postln        x' = LN(x + G(x)); Xavier init.
  preln         x' = x + G(LN(x)); final LayerNorm on each stack.
  postln-init   Post-LN whose layer-l weights (l = 1..N) are down-scaled by k_l = N − l + 1 after
                Xavier init (DeepNet Section II). Scaled: the FFN linears and the attention value
                and output projections; query and key keep gain 1, because scaling them changes
                only the softmax temperature, not the magnitude of the sub-layer's output (the
                paper's Lemma 1), which is what the down-scaling is about.
  deepnorm      x' = LN(α·x + G(x)); Xavier gain β on FFN and V/O projections (paper constants):
                  encoder-decoder  encoder α = 0.81·(N⁴M)^(1/16), β = 0.87·(N⁴M)^(−1/16)
                                   decoder α = (3M)^(1/4),        β = (12M)^(−1/4)
                  encoder-only     α = (2N)^(1/4), β = (8N)^(−1/4)   (decoder-only: with M)
  deepnorm-xavier-1.15
                DeepNorm with Xavier-normal init whose encoder gain takes the constant of the
                authors' torchscale code: encoder β = 1.15·(N⁴M)^(−1/16) instead of 0.87·…;
                decoder β and both α as the paper. It is NOT the authors' initialisation, which
                keeps PyTorch's default nn.Linear init (uniform weights and biases) and divides
                fc1, fc2, v_proj and out_proj by (N⁴M)^(1/16)/1.15 (encoder) or (12M)^(1/4)
                (decoder).
  subln         Sub-LN / Pre-LN DeepNet (Section IV, eqs. 5–9): Pre-LN plus a LayerNorm before
                the attention output projection and before the FFN's second linear. As in the
                authors' torchscale code, the inner attention LayerNorm is in self-attention only
                (cross-attention has none). FFN and V/O weights are Xavier × γ:
                  encoder-only γ = sqrt(log 2N); decoder-only γ = sqrt(log 2M);
                  encoder-decoder (torchscale): encoder γ = sqrt(log(3M)·log(2N)/3),
                                                decoder γ = sqrt(log 3M).
  branchnorm    BranchNorm (Liu et al., arXiv 2305.02790) in this project's formulation (the
                paper's exact equation was not available):
                  x' = LN(x + B_t(G(x))),  B_t(y) = (1 − λ_t)·LN₀(y) + λ_t·y,  λ_t = min(t/T, 1)
                LN₀ is a LayerNorm without affine parameters, t the optimizer step, T the
                "maximum norm step" (`model.branchnorm_max_norm_step`). From t ≥ T on the block
                is exactly Post-LN. t lives in a buffer of every block (saved in checkpoints);
                the trainer sets it on every stage before each step (`set_training_step`).
Dropout is applied to the branch output before it is added to the shortcut, in every strategy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F
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


def subln_constants(arch: str, encoder_layers: int = 0, decoder_layers: int = 0) -> dict[str, float]:
    """γ (multiplier of the Xavier init of FFN and V/O) of Sub-LN for `arch`."""
    n, m = encoder_layers, decoder_layers
    if arch == "encoder-decoder":
        return {"encoder_gamma": math.sqrt(math.log(3 * m) * math.log(2 * n) / 3),
                "decoder_gamma": math.sqrt(math.log(3 * m))}
    if arch == "encoder-only":
        return {"encoder_gamma": math.sqrt(math.log(2 * n))}
    if arch == "decoder-only":
        return {"decoder_gamma": math.sqrt(math.log(2 * m))}
    raise ValueError(f"unknown architecture {arch!r}: use encoder-decoder, encoder-only or decoder-only")


def branchnorm_mix(step: int, max_norm_step: int) -> float:
    """λ_t = min(t/T, 1): the weight of the raw branch; 1 − λ_t goes to the normalised branch."""
    return min(step / max_norm_step, 1.0)


class Residual(nn.Module):
    """A residual block around one sub-layer. `norm` is the LayerNorm on the residual stream
    (after the sum in Post-LN styles, at the branch input in Pre-LN styles); the stability
    instruments record the size of its input."""

    norm: nn.LayerNorm


class PostNormResidual(Residual):
    """x_{l+1} = LN(α·x_l + G(x_l)): Post-LN when α = 1, DeepNorm otherwise."""

    def __init__(self, d_model: int, alpha: float, dropout: float, eps: float):
        super().__init__()
        self.alpha = alpha
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        shortcut = x if self.alpha == 1.0 else self.alpha * x
        return self.norm(shortcut + self.dropout(branch(x)))


class PreNormResidual(Residual):
    """x_{l+1} = x_l + G(LN(x_l))."""

    def __init__(self, d_model: int, dropout: float, eps: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return x + self.dropout(branch(self.norm(x)))


class BranchNormResidual(Residual):
    """x_{l+1} = LN(x_l + B_t(G(x_l))), B_t(y) = (1 − λ_t)·LN₀(y) + λ_t·y, λ_t = min(t/T, 1)."""

    def __init__(self, d_model: int, dropout: float, eps: float, max_norm_step: int):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.eps = eps
        self.max_norm_step = max_norm_step
        # A buffer so that the step travels with the weights (checkpoints, pipeline layer files).
        # λ_t lives in a buffer too, updated in place, and `_normalising` (λ_t < 1) is a Python
        # bool that flips once, at T: a compiled layer then reuses its graph every step (a float
        # attribute changing each step would recompile it each step).
        self.register_buffer("step", torch.zeros((), dtype=torch.long))
        self.register_buffer("mix", torch.zeros(()), persistent=False)
        self._normalising = True

    def set_step(self, step: int) -> None:
        self.step.fill_(step)
        mix = branchnorm_mix(step, self.max_norm_step)
        self.mix.fill_(mix)
        self._normalising = mix < 1.0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.set_step(int(self.step))

    def forward(self, x: torch.Tensor, branch: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        y = branch(x)
        if self._normalising:  # from T on the block is exactly Post-LN (no LN₀ term computed)
            mix = self.mix.to(y.dtype)
            y = (1.0 - mix) * F.layer_norm(y, y.shape[-1:], eps=self.eps) + mix * y
        return self.norm(x + self.dropout(y))


def step_blocks(model: nn.Module) -> list[BranchNormResidual]:
    """The blocks of `model` whose function depends on the optimizer step (BranchNorm's)."""
    return [module for module in model.modules() if isinstance(module, BranchNormResidual)]


def set_training_step(model: nn.Module | list[BranchNormResidual], step: int) -> None:
    """Tell every step-dependent block the current optimizer step. Pass `step_blocks(model)`
    instead of the model when calling every step: walking a 1000-layer model's ~20k modules
    costs milliseconds, the list nothing (it is empty for the other strategies)."""
    for block in step_blocks(model) if isinstance(model, nn.Module) else model:
        block.set_step(step)


@dataclass(frozen=True)
class StackNorm:
    """How one stack (encoder or decoder) normalises and initialises its sub-layers."""

    placement: str
    """'post' (LN after the residual sum), 'pre' (LN at the branch input) or 'branch'
    (BranchNorm: Post-LN with the branch normalised early in training)."""
    alpha: float = 1.0
    """Weight of the residual shortcut (post placement only)."""
    beta: float = 1.0
    """Xavier gain of the FFN linears and the attention value/output projections."""
    final_norm: bool = False
    """Whether the stack ends with a LayerNorm (Pre-LN needs one; Post-LN already ends normalised)."""
    inner_norms: tuple[str, ...] = ()
    """Sub-layers with an extra LayerNorm inside (Sub-LN): 'self_attn' (before the output
    projection), 'cross_attn' (likewise), 'ffn' (before the second linear)."""
    depth_scaled_layers: int = 0
    """Post-LN-init: the stack's depth N; layer i (0-based) then divides β by k = N − i.
    0 = no depth scaling."""
    max_norm_step: int = 0
    """BranchNorm's T (branch placement only)."""

    def layer(self, index: int) -> StackNorm:
        """This record specialised to layer `index` (0-based) of the stack."""
        if not self.depth_scaled_layers:
            return self
        if not 0 <= index < self.depth_scaled_layers:
            raise ValueError(f"layer index {index} outside a stack of {self.depth_scaled_layers}")
        return replace(self, beta=self.beta / (self.depth_scaled_layers - index), depth_scaled_layers=0)

    def residual(self, d_model: int, dropout: float, eps: float) -> Residual:
        """The residual block wrapping one sub-layer."""
        builders: dict[str, Callable[[], Residual]] = {
            "post": lambda: PostNormResidual(d_model, self.alpha, dropout, eps),
            "pre": lambda: PreNormResidual(d_model, dropout, eps),
            "branch": lambda: BranchNormResidual(d_model, dropout, eps, self.max_norm_step),
        }
        return builders[self.placement]()

    def inner_norm(self, where: str, dim: int, eps: float) -> nn.Module:
        """The LayerNorm inside sub-layer `where` ('self_attn', 'cross_attn', 'ffn'), or Identity
        (no parameters, so strategies without inner norms keep their state_dict keys)."""
        return nn.LayerNorm(dim, eps=eps) if where in self.inner_norms else nn.Identity()

    def gain(self, projection: str) -> float:
        """Init gain for a projection: 'q', 'k', 'v', 'o', 'fc1' or 'fc2'."""
        return 1.0 if projection in ("q", "k") else self.beta


def _postln(n: int, m: int, t: int) -> tuple[StackNorm, StackNorm]:
    return StackNorm("post"), StackNorm("post")


def _preln(n: int, m: int, t: int) -> tuple[StackNorm, StackNorm]:
    return StackNorm("pre", final_norm=True), StackNorm("pre", final_norm=True)


def _postln_init(n: int, m: int, t: int) -> tuple[StackNorm, StackNorm]:
    return StackNorm("post", depth_scaled_layers=n), StackNorm("post", depth_scaled_layers=m)


def _deepnorm(n: int, m: int, t: int) -> tuple[StackNorm, StackNorm]:
    c = deepnorm_constants("encoder-decoder", n, m)
    return (StackNorm("post", c["encoder_alpha"], c["encoder_beta"]),
            StackNorm("post", c["decoder_alpha"], c["decoder_beta"]))


def _deepnorm_xavier_115(n: int, m: int, t: int) -> tuple[StackNorm, StackNorm]:
    c = deepnorm_constants("encoder-decoder", n, m)
    return (StackNorm("post", c["encoder_alpha"], 1.15 * (n**4 * m) ** (-1 / 16)),
            StackNorm("post", c["decoder_alpha"], c["decoder_beta"]))


def _subln(n: int, m: int, t: int) -> tuple[StackNorm, StackNorm]:
    c = subln_constants("encoder-decoder", n, m)
    inner = ("self_attn", "ffn")
    return (StackNorm("pre", beta=c["encoder_gamma"], final_norm=True, inner_norms=inner),
            StackNorm("pre", beta=c["decoder_gamma"], final_norm=True, inner_norms=inner))


def _branchnorm(n: int, m: int, t: int) -> tuple[StackNorm, StackNorm]:
    return StackNorm("branch", max_norm_step=t), StackNorm("branch", max_norm_step=t)


STRATEGIES: dict[str, Callable[[int, int, int], tuple[StackNorm, StackNorm]]] = {
    "postln": _postln,
    "preln": _preln,
    "postln-init": _postln_init,
    "deepnorm": _deepnorm,
    "deepnorm-xavier-1.15": _deepnorm_xavier_115,
    "subln": _subln,
    "branchnorm": _branchnorm,
}

def resolve(norm: str, encoder_layers: int, decoder_layers: int,
            max_norm_step: int = 4000) -> tuple[StackNorm, StackNorm]:
    """The (encoder, decoder) records of strategy `norm` for an N-layer encoder, M-layer decoder
    (`max_norm_step` is BranchNorm's T, ignored by the other strategies)."""
    if norm not in STRATEGIES:
        raise ValueError(f"model.norm={norm!r} is not a strategy; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[norm](encoder_layers, decoder_layers, max_norm_step)

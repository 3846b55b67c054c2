"""Tensor parallelism inside pipeline stages, from megatron-core's layers.

`shard_(module, tp)` turns a plain layer (already initialised, full size) into its tensor-parallel
version in place: Q/K/V and FFN fc1 become column-parallel, the attention output projection and
FFN fc2 row-parallel, the shared embedding vocabulary-parallel. Each rank copies its slice of the
full matrix, so sharded init equals the unsharded model's exactly — including DeepNorm's β, whose
Xavier fans are those of the full matrix.

Dropout inside tensor-parallel regions (attention probabilities of the local heads, FFN
activations of the local columns) draws from DeepSpeed's model-parallel RNG tracker, seeded per
tensor-parallel rank and saved/restored by DeepSpeed's activation checkpointing on CPU and GPU.
Dropout on the replicated residual stream uses the default RNG, which the trainer seeds from the
stage and replica only (parallel/rng.py; DeepSpeed's per-layer seeding is off), so it is identical
across the tensor-parallel ranks of a stage, as the replicated activations require.

`SHARD_DIM` tells, per parameter name suffix, along which dimension a parameter is split (None:
replicated), for consolidating a tensor-parallel checkpoint.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.layers import FeedForward, MultiheadAttention, SharedEmbedding

SHARD_DIM = {
    "q_proj.weight": 0, "q_proj.bias": 0, "k_proj.weight": 0, "k_proj.bias": 0,
    "v_proj.weight": 0, "v_proj.bias": 0, "out_proj.weight": 1, "out_proj.bias": None,
    "fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": None, "embed.weight": 0,
    "inner_norm.weight": 0, "inner_norm.bias": 0,
}


def megatron():
    """Import megatron-core quietly (it warns about missing Transformer Engine/Apex)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.parallel_state as parallel_state
        import megatron.core.tensor_parallel as tensor_parallel
        from megatron.core.model_parallel_config import ModelParallelConfig
    return parallel_state, tensor_parallel, ModelParallelConfig


@dataclass
class TensorParallel:
    """The tensor-parallel context of this rank: group, rank, size and megatron's layer config."""

    size: int
    rank: int
    group: object
    config: object

    @classmethod
    def create(cls, layout, dtype: torch.dtype) -> "TensorParallel":
        """This rank's context on a parallel/layout.py Layout (whose groups are megatron's)."""
        _, _, ModelParallelConfig = megatron()
        config = ModelParallelConfig(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                     use_cpu_initialization=True, perform_initialization=False,
                                     params_dtype=dtype, pipeline_dtype=dtype,
                                     gradient_accumulation_fusion=False)
        return cls(layout.tp, layout.tp_rank, layout.tensor_group, config)

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        return full.chunk(self.size, dim=dim)[self.rank].clone()


def rng_fork():
    """The tracker fork for dropout in tensor-parallel regions."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    return get_cuda_rng_tracker().fork()


def seed_tensor_parallel_rng(seed: int, tp_rank: int) -> None:
    """Seed the model-parallel RNG state with `seed` + 2718 + tp_rank (DeepSpeed's convention):
    different per tensor-parallel rank. The trainer passes a seed that differs per stage and
    replica (launcher/train.py), so no two stages or replicas draw the same sharded masks."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)


def _linear_classes():
    _, tensor_parallel, _ = megatron()

    class ColumnLinear(tensor_parallel.ColumnParallelLinear):
        """Column-parallel linear returning just the (local) output, like nn.Linear."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)[0]

    class RowLinear(tensor_parallel.RowParallelLinear):
        """Row-parallel linear (input already split) returning the all-reduced output."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)[0]

    return ColumnLinear, RowLinear


def _mark_sharded(weight: torch.Tensor, dim: int) -> None:
    """Tag a sharded parameter the way megatron's own init does. With perform_initialization=False
    megatron never tags weights, and DeepSpeed's gradient norm then counts them on tensor-parallel
    rank 0 only (a silently wrong clipping norm, caught by the tests)."""
    _, tensor_parallel, _ = megatron()
    tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _column(linear: nn.Linear, tp: TensorParallel) -> nn.Module:
    column, _ = _linear_classes()
    new = column(linear.in_features, linear.out_features, config=tp.config, init_method=lambda w: None,
                 bias=linear.bias is not None, gather_output=False, tp_group=tp.group)
    with torch.no_grad():
        new.weight.copy_(tp.shard(linear.weight, 0))
        if linear.bias is not None:
            new.bias.copy_(tp.shard(linear.bias, 0))
    _mark_sharded(new.weight, 0)
    return new


def _row(linear: nn.Linear, tp: TensorParallel) -> nn.Module:
    _, row = _linear_classes()
    new = row(linear.in_features, linear.out_features, config=tp.config, init_method=lambda w: None,
              bias=linear.bias is not None, input_is_parallel=True, skip_bias_add=False, tp_group=tp.group)
    with torch.no_grad():
        new.weight.copy_(tp.shard(linear.weight, 1))
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    _mark_sharded(new.weight, 1)
    return new


class TensorParallelAttention(MultiheadAttention):
    """Attention over this rank's heads; attention dropout from the model-parallel RNG."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        with rng_fork():
            return super().forward(*args, **kwargs)


class TensorParallelFeedForward(FeedForward):
    """FFN over this rank's columns; activation dropout from the model-parallel RNG."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with rng_fork():
            return super().forward(x)


class VocabParallelSharedEmbedding(SharedEmbedding):
    """The shared embedding with its vocabulary split across tensor-parallel ranks.

    Lookup is megatron's VocabParallelEmbedding (masked local lookup + all-reduce); `logits`
    returns this rank's vocabulary slice of the logits [.., V/tp].
    """

    def forward(self, tokens: torch.Tensor, offset: int = 0) -> torch.Tensor:
        length = tokens.size(1)
        if offset + length > self.positions.size(0):
            raise ValueError(f"sequence of {offset + length} tokens exceeds model.max_positions="
                             f"{self.positions.size(0)}")
        x = self.scale * self.lookup(tokens) + self.positions[offset:offset + length]
        return self.dropout(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        _, tensor_parallel, _ = megatron()
        h = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.weight)


class TensorParallelLayerNorm(nn.Module):
    """LayerNorm over a feature dimension split across tensor-parallel ranks (Sub-LN's inner norms
    sit on the sharded attention heads and FFN columns). Mean and variance are all-reduced with
    torch.distributed.nn's differentiable all-reduce: every rank's outputs depend on every rank's
    inputs through the statistics, so their gradients must be summed too (megatron's
    reduce_from_tensor_model_parallel_region, identity in backward, would drop those terms)."""

    def __init__(self, norm: nn.LayerNorm, tp: TensorParallel):
        super().__init__()
        self.full_dim = norm.normalized_shape[-1]
        self.eps = norm.eps
        self.group = tp.group
        self.weight = nn.Parameter(tp.shard(norm.weight.detach(), 0))
        self.bias = nn.Parameter(tp.shard(norm.bias.detach(), 0))
        _mark_sharded(self.weight, 0)
        _mark_sharded(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        mean = all_reduce(x.sum(dim=-1, keepdim=True), group=self.group) / self.full_dim
        centred = x - mean
        var = all_reduce((centred * centred).sum(dim=-1, keepdim=True), group=self.group) / self.full_dim
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias


def _vocab_parallel_embedding(embed: SharedEmbedding, tp: TensorParallel) -> SharedEmbedding:
    _, tensor_parallel, _ = megatron()
    vocab, d = embed.weight.shape
    lookup = tensor_parallel.VocabParallelEmbedding(vocab, d, init_method=lambda w: None, config=tp.config,
                                                    tp_group=tp.group)
    with torch.no_grad():
        lookup.weight.copy_(tp.shard(embed.weight, 0))
    _mark_sharded(lookup.weight, 0)
    embed.__class__ = VocabParallelSharedEmbedding
    # One parameter, registered once: the embedding's weight *is* the lookup's local shard. The
    # lookup module is kept out of the module tree so the state dict keeps the plain name only.
    del embed.weight
    embed.weight = lookup.weight
    object.__setattr__(embed, "lookup", lookup)
    embed.tp_group = tp.group
    return embed


def shard_(module: nn.Module, tp: TensorParallel) -> nn.Module:
    """Make every attention, FFN and shared embedding inside `module` tensor-parallel, in place."""
    for sub in list(module.modules()):
        if isinstance(sub, MultiheadAttention):
            if sub.heads % tp.size:
                raise ValueError(f"model.heads={sub.heads} is not divisible by tensor_parallel={tp.size}")
            sub.q_proj, sub.k_proj, sub.v_proj = (_column(lin, tp) for lin in (sub.q_proj, sub.k_proj, sub.v_proj))
            sub.out_proj = _row(sub.out_proj, tp)
            if isinstance(getattr(sub, "inner_norm", None), nn.LayerNorm):
                sub.inner_norm = TensorParallelLayerNorm(sub.inner_norm, tp)
            sub.heads //= tp.size
            sub.__class__ = TensorParallelAttention
        elif isinstance(sub, FeedForward):
            sub.fc1, sub.fc2 = _column(sub.fc1, tp), _row(sub.fc2, tp)
            if isinstance(getattr(sub, "inner_norm", None), nn.LayerNorm):
                sub.inner_norm = TensorParallelLayerNorm(sub.inner_norm, tp)
            sub.__class__ = TensorParallelFeedForward
        elif isinstance(sub, SharedEmbedding):
            _vocab_parallel_embedding(sub, tp)
    return module


def vocab_parallel_smoothed_loss_sum(local_logits: torch.Tensor, target: torch.Tensor, pad_id: int, eps: float,
                                     tp: TensorParallel) -> torch.Tensor:
    """Σ over non-pad tokens of torch's label-smoothed cross-entropy, from vocabulary-split logits.

    loss = (1−ε)·(logZ − z_y) + (ε/V)·(V·logZ − Σ_v z_v), logZ = log Σ_v exp z_v. The three
    vocabulary reductions (Σ exp, z_y, Σ z) are all-reduced with megatron's
    reduce_from_tensor_model_parallel_region (all-reduce forward, identity backward), which gives
    each rank the gradient of its own slice. megatron-core's vocab_parallel_cross_entropy smooths
    with the local vocabulary size and is wrong for tp > 1 (Megatron-LM #737), hence this function.
    """
    _, tensor_parallel, _ = megatron()
    reduce = lambda t: tensor_parallel.reduce_from_tensor_model_parallel_region(t, group=tp.group)  # noqa: E731
    logits = local_logits.float().reshape(-1, local_logits.size(-1))
    target = target.reshape(-1)
    local_vocab = logits.size(-1)
    vocab = local_vocab * tp.size
    start = tp.rank * local_vocab
    # A constant shift does not change the loss; the global max keeps exp() in range.
    shift = logits.max(dim=-1).values.detach()
    torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=tp.group)
    shifted = logits - shift[:, None]
    log_z = torch.log(reduce(shifted.exp().sum(dim=-1)))
    local_target = target - start
    mine = (local_target >= 0) & (local_target < local_vocab)
    picked = shifted.gather(1, local_target.clamp(0, local_vocab - 1)[:, None]).squeeze(1) * mine
    target_logit = reduce(picked)
    sum_logits = reduce(shifted.sum(dim=-1))
    nll = log_z - target_logit
    smooth = vocab * log_z - sum_logits
    loss = (1.0 - eps) * nll + (eps / vocab) * smooth
    return (loss * (target != pad_id)).sum()


def merge_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from the plain-named state dicts of tensor-parallel ranks 0..tp-1 (in order)."""
    if len(shards) == 1:
        return dict(shards[0])
    merged = {}
    for name, first in shards[0].items():
        dim = next((d for suffix, d in SHARD_DIM.items() if name.endswith(suffix)), None)
        merged[name] = first if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return merged

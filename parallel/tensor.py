"""Tensor parallelism applied from outside: a plan of module paths → styles, applied to a built stage.

`apply_tensor_parallel(module, tp)` walks a built plain module (a pipeline stage or the whole model, already
initialised at full size) and gives each module whose path matches a pattern of `TP_PLAN` its
tensor-parallel style, with megatron-core's layers:

  embed               vocabulary-parallel (megatron's VocabParallelEmbedding for the lookup; the
                      tied output projection gives this rank's vocabulary slice of the logits)
  *attn.qkv_proj      column-parallel, each of the stacked q, k, v split by heads (each rank
  *attn.kv_proj       computes its heads' queries, keys, values in one product); q_proj likewise
  *attn.out_proj      row-parallel (input split by heads, output all-reduced)
  *ffn.fc1 / fc2      column- / row-parallel
  *.inner_norm        Sub-LN's LayerNorm over the sharded features (statistics all-reduced)
  *attn               told its local head count; its dropout draws from the model-parallel RNG
  *ffn                its dropout draws from the model-parallel RNG

Paths are the plain model's (`EncoderDecoder`): a pipeline stage passes `path_of`, which maps
its module paths to those (parallel/pipeline.py `plain_name`). The plain modules keep their class
and their forward: a style replaces a child linear or LayerNorm, sets the embedding's `lookup`
and `logits`, sets an attention's head count, or adds forward hooks. Each rank copies its slice of
the full matrix, so sharded init equals the unsharded model's exactly (including DeepNorm's β,
whose Xavier fans are those of the full matrix). The same plan says how each parameter is split
(`shard_dim`), for consolidating a tensor-parallel checkpoint.

Dropout inside tensor-parallel regions (attention probabilities of the local heads, FFN
activations of the local columns) draws from DeepSpeed's model-parallel RNG tracker, seeded per
tensor-parallel rank (`seed_tensor_parallel_rng`) and saved/restored by DeepSpeed's activation
checkpointing on CPU and GPU. Dropout on the replicated residual stream uses the default RNG,
which the trainer seeds per stage and replica but not per tensor-parallel rank
(runtime/rng.py `seed_dropout`), so it stays identical across tensor-parallel ranks, as the
replicated activations require.
"""
from __future__ import annotations

import fnmatch
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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
    """Seed the model-parallel RNG state, different per tensor-parallel rank (DeepSpeed's
    convention: seed + 2718 + tp_rank); the trainer offsets `seed` per stage and replica."""
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", seed + 2718 + tp_rank)


def _mark_sharded(weight: torch.Tensor, dim: int) -> None:
    """Tag a sharded parameter the way megatron's own init does. With perform_initialization=False
    megatron never tags weights, and DeepSpeed's gradient norm then counts them on tensor-parallel
    rank 0 only (a silently wrong clipping norm, caught by the tests)."""
    _, tensor_parallel, _ = megatron()
    tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, 1)


class Style:
    """How one module becomes tensor-parallel. `dims`: along which dimension each of its own
    parameters is split (absent: replicated)."""

    dims: dict[str, int] = {}

    def apply(self, module: nn.Module, tp: TensorParallel) -> nn.Module:
        """The module to put in its place (the same one when changed in place)."""
        raise NotImplementedError


class ColumnParallel(Style):
    """nn.Linear → megatron's ColumnParallelLinear: the output features split, not gathered.
    `parts` > 1: the linear is that many projections stacked (model/layers.py's fused q/k/v), and
    each rank holds its slice of every one, stacked the same way ([q_r; k_r; v_r])."""

    dims = {"weight": 0, "bias": 0}

    def __init__(self, parts: int = 1):
        self.parts = parts

    def apply(self, linear: nn.Linear, tp: TensorParallel) -> nn.Module:
        column, _ = _linear_classes()
        new = column(linear.in_features, linear.out_features, config=tp.config, init_method=lambda w: None,
                     bias=linear.bias is not None, gather_output=False, tp_group=tp.group)
        return _copy_shards(new, linear, self.dims, tp, self.parts)


class RowParallel(Style):
    """nn.Linear → megatron's RowParallelLinear: input features split, output all-reduced, bias whole."""

    dims = {"weight": 1}

    def apply(self, linear: nn.Linear, tp: TensorParallel) -> nn.Module:
        _, row = _linear_classes()
        new = row(linear.in_features, linear.out_features, config=tp.config, init_method=lambda w: None,
                  bias=linear.bias is not None, input_is_parallel=True, skip_bias_add=False, tp_group=tp.group)
        return _copy_shards(new, linear, self.dims, tp)


@functools.cache
def _linear_classes():
    """megatron-core's column- and row-parallel linears (their parameters, sharding attributes and
    state dicts) with forwards written as F.linear between megatron's region functions: the same
    numbers as megatron's own forwards, which compiled layers trace without a graph break (those
    go through an autograd function with an asynchronous all-reduce and warnings)."""
    _, tensor_parallel, _ = megatron()

    class ColumnLinear(tensor_parallel.ColumnParallelLinear):
        """Column-parallel linear returning just the (local) output, like nn.Linear: the input
        copied into the region (its gradient all-reduced in backward), the local output columns."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = tensor_parallel.copy_to_tensor_model_parallel_region(x, group=self.tp_group)
            return F.linear(x, self.weight, self.bias)

    class RowLinear(tensor_parallel.RowParallelLinear):
        """Row-parallel linear (input already split) returning the all-reduced output, bias added
        once after the reduction."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = tensor_parallel.reduce_from_tensor_model_parallel_region(F.linear(x, self.weight),
                                                                          group=self.tp_group)
            return out if self.bias is None else out + self.bias

    return ColumnLinear, RowLinear


def _inherit_tags(new: torch.Tensor, old: torch.Tensor) -> None:
    """Give a parameter's replacement the attributes its owner's framework set on the original
    (DeepSpeed marks the tied embedding's copy on the last stage `ds_pipe_replicated`, so that the
    gradient norm counts it once; a shard without the mark is counted twice)."""
    for key, value in vars(old).items():
        if not hasattr(new, key):
            setattr(new, key, value)


def _copy_shards(new: nn.Module, full: nn.Module, dims: dict[str, int], tp: TensorParallel,
                 parts: int = 1) -> nn.Module:
    """Fill `new`'s parameters from `full`'s (this rank's slice where `dims` splits them; of each
    of `parts` stacked projections)."""
    new.to(full.weight.device)
    with torch.no_grad():
        for name, param in new.named_parameters(recurse=False):
            source = getattr(full, name)
            if name in dims:
                param.copy_(torch.cat([tp.shard(block, dims[name]) for block in source.chunk(parts, dim=dims[name])],
                                      dim=dims[name]))
            else:
                param.copy_(source)
            _inherit_tags(param, source)
            if name in dims and not hasattr(param, "tensor_model_parallel"):  # megatron tags its biases
                _mark_sharded(param, dims[name])
    return new


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
        _inherit_tags(self.weight, norm.weight)
        _inherit_tags(self.bias, norm.bias)
        _mark_sharded(self.weight, 0)
        _mark_sharded(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_reduce

        mean = all_reduce(x.sum(dim=-1, keepdim=True), group=self.group) / self.full_dim
        centred = x - mean
        var = all_reduce((centred * centred).sum(dim=-1, keepdim=True), group=self.group) / self.full_dim
        return centred * torch.rsqrt(var + self.eps) * self.weight + self.bias


class ShardedLayerNorm(Style):
    """An inner LayerNorm over sharded features → TensorParallelLayerNorm (strategies without
    inner norms hold an nn.Identity there: nothing to shard)."""

    dims = {"weight": 0, "bias": 0}

    def apply(self, norm: nn.Module, tp: TensorParallel) -> nn.Module:
        return TensorParallelLayerNorm(norm, tp) if isinstance(norm, nn.LayerNorm) else norm


def _model_parallel_dropout(module: nn.Module) -> None:
    """Run `module`'s forward inside the model-parallel RNG fork (forward hooks: the module's own
    forward is unchanged; the closing hook runs even when the forward raises)."""

    def enter(mod: nn.Module, args) -> None:
        fork = rng_fork()
        fork.__enter__()
        mod.__dict__["_rng_fork"] = fork

    def leave(mod: nn.Module, args, output) -> None:
        mod.__dict__.pop("_rng_fork").__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


class HeadParallel(Style):
    """Attention over this rank's heads: told its local head count (its projections are split by
    the column/row styles); its dropout draws from the model-parallel RNG."""

    def apply(self, attention: nn.Module, tp: TensorParallel) -> nn.Module:
        if attention.heads % tp.size:
            raise ValueError(f"model.heads={attention.heads} is not divisible by tensor_parallel={tp.size}")
        attention.heads = attention.heads // tp.size
        if attention.dropout > 0:  # the fork saves and sets RNG states: a graph break when compiled
            _model_parallel_dropout(attention)
        return attention


class ModelParallelDropout(Style):
    """A module computing on sharded features (the FFN's local columns): its dropout draws from
    the model-parallel RNG."""

    def apply(self, module: nn.Module, tp: TensorParallel) -> nn.Module:
        if module.dropout.p > 0:  # as for attention: only where a mask is drawn
            _model_parallel_dropout(module)
        return module


@dataclass
class VocabParallelLookup:
    """The embedding's row lookup, vocabulary-parallel: megatron's VocabParallelEmbedding (masked
    local lookup + all-reduce) on this rank's rows. Held as a plain attribute, outside the module
    tree, so the state dict keeps the embedding's own parameter name."""

    module: nn.Module
    group: object

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module(tokens)


def vocab_parallel_logits(weight: nn.Parameter, group, h: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of the tied output projection: copy h into the region (its
    gradient all-reduced in backward), then h·E_localᵀ."""
    _, tensor_parallel, _ = megatron()
    return F.linear(tensor_parallel.copy_to_tensor_model_parallel_region(h, group=group), weight)


class VocabParallel(Style):
    """The shared embedding (model/layers.py SharedEmbedding) with its vocabulary split: its
    `lookup` becomes megatron's VocabParallelEmbedding over the local rows and its `logits` the
    local slice [.., V/tp]; its forward (scale, positions, dropout) is unchanged."""

    dims = {"weight": 0}

    def apply(self, embed: nn.Module, tp: TensorParallel) -> nn.Module:
        _, tensor_parallel, _ = megatron()
        vocab, d = embed.weight.shape
        lookup = tensor_parallel.VocabParallelEmbedding(vocab, d, init_method=lambda w: None, config=tp.config,
                                                        tp_group=tp.group).to(embed.weight.device)
        with torch.no_grad():
            lookup.weight.copy_(tp.shard(embed.weight, 0))
        _mark_sharded(lookup.weight, 0)
        _inherit_tags(lookup.weight, embed.weight)
        # One parameter, registered once: the embedding's weight *is* the lookup's local shard.
        del embed.weight
        embed.weight = lookup.weight
        embed.lookup = VocabParallelLookup(lookup, tp.group)
        embed.logits = functools.partial(vocab_parallel_logits, lookup.weight, tp.group)
        return embed


# Module path (fnmatch pattern over the plain model's names) → style; the first match applies.
TP_PLAN: dict[str, Style] = {
    "embed": VocabParallel(),
    "*attn.qkv_proj": ColumnParallel(parts=3),
    "*attn.kv_proj": ColumnParallel(parts=2),
    "*attn.[qkv]_proj": ColumnParallel(),  # cross-attention's q_proj; the state dict's names
    "*attn.out_proj": RowParallel(),
    "*attn.inner_norm": ShardedLayerNorm(),
    "*attn": HeadParallel(),
    "*ffn.fc1": ColumnParallel(),
    "*ffn.fc2": RowParallel(),
    "*ffn.inner_norm": ShardedLayerNorm(),
    "*ffn": ModelParallelDropout(),
}


def style_of(path: str, plan: dict[str, Style] = TP_PLAN) -> Style | None:
    """The style of the module at `path` (a plain model name), None when it stays replicated."""
    return next((style for pattern, style in plan.items() if fnmatch.fnmatchcase(path, pattern)), None)


def apply_tensor_parallel(module: nn.Module, tp: TensorParallel, path_of: Callable[[str], str | None] = lambda p: p,
                plan: dict[str, Style] = TP_PLAN) -> nn.Module:
    """Apply `plan` to the built plain `module` in place and return it. `path_of` maps a module
    path of `module` to its plain model name (None: a wrapper the plan does not address)."""
    for path, sub in list(module.named_modules()):
        name = path_of(path)
        style = style_of(name, plan) if name is not None else None
        if style is None:
            continue
        new = style.apply(sub, tp)
        if new is not sub:
            parent, _, attr = path.rpartition(".")
            setattr(module.get_submodule(parent), attr, new)
    return module


def shard_dim(name: str, plan: dict[str, Style] = TP_PLAN) -> int | None:
    """Along which dimension the parameter `name` (a plain model name) is split, None when replicated."""
    path, _, param = name.rpartition(".")
    style = style_of(path, plan)
    return None if style is None else style.dims.get(param)


def merge_shards(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from the plain-named state dicts of tensor-parallel ranks 0..tp-1 (in order)."""
    if len(shards) == 1:
        return dict(shards[0])
    merged = {}
    for name, first in shards[0].items():
        dim = shard_dim(name)
        merged[name] = first if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return merged

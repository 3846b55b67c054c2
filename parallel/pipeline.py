"""The encoder-decoder as a DeepSpeed `PipelineModule`.

Stage tuple protocol (what crosses a stage boundary):

  data → stage 0      (src [B,S] int64, tgt_in [B,T] int64)
  between stages      (h [B,S+T,d] float, src [B,S] int64, tgt_in [B,T] int64)
  last layer → loss   the decoder stream [B,T,d] (the loss projects it: parallel/loss.py)
  labels (last stage) (tgt_out [B,T] int64, scale [] float32)

`h = cat([encoder states, decoder states], dim=1)`: the first S positions are the encoder stream,
the last T the decoder stream, so the encoder output rides through every decoder stage and its
gradient accumulates back through them. One float tensor per message is deliberate: DeepSpeed
backpropagates a stage once per float tensor it sent (with retain_graph), and caches receive
buffers by tuple index regardless of dtype; a single float tensor at index 0 with int tensors
after it avoids both. Shapes change per micro-batch, so the module is built with
`dynamic_shape=True`.

Inside a stage the layers hand each other a `Flow` (enc, dec, src, tgt_in, mask): the two streams
as separate tensors and the source padding mask, computed once per stage from `src` on the device
(no value is read back to the host). Only the stage's
boundaries convert: `TranslationPipe.forward` splits a received `h` before its first layer and
concatenates after its last one (the first stage starts from the embedding, the last ends in
logits). Packing in every layer instead would copy the whole [B, S+T, d] tensor forward and
backward per layer (15% of a 100L-100L d=64 step).

`scale` turns the summed loss of a micro-batch into its share of the token-weighted mean over
the whole global batch: scale = (micro-batches per step · dp) / (target tokens in the global
batch). DeepSpeed divides by the micro-batch count and averages over dp, so the step's loss and
gradient are exactly those of Σ loss / Σ tokens over all micro-batches, as in fairseq.
"""
from __future__ import annotations


import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from torch import nn

from model.config import ModelConfig
from model.layers import padding_mask
from model.transformer import build_layer, layer_plan
from model.flops import layer_costs
from parallel.compiled import run_layer
from parallel.partition import stage_bounds
from parallel.precision import PRECISIONS, Precision
from parallel.loss import tie_output_weight, tied_output_loss_sum
from parallel.tensor import TensorParallel


def _build(cfg: ModelConfig, kind: str, index: int, init_seed: int) -> nn.Module:
    """The plain layer initialised from `init_seed` (seed + plan position, as in EncoderDecoder)."""
    torch.manual_seed(init_seed)
    return build_layer(cfg, kind, index)


def stage_flow(h: torch.Tensor, src: torch.Tensor, tgt_in: torch.Tensor, pad_id: int) -> tuple:
    """A received stage message as the in-stage flow (enc, dec, src, tgt_in, mask)."""
    enc, dec = h.split([src.size(1), tgt_in.size(1)], dim=1)
    return enc.contiguous(), dec.contiguous(), src, tgt_in, padding_mask(src, pad_id, h.dtype)


def stage_message(flow: tuple) -> tuple[torch.Tensor, ...]:
    """The in-stage flow as the message sent to the next stage: (h, src, tgt_in)."""
    enc, dec, src, tgt_in, _ = flow
    return torch.cat([enc, dec], dim=1), src, tgt_in


class EmbedPipe(nn.Module):
    """(src, tgt_in) → flow; owns the shared embedding (tied with the output layer)."""

    def __init__(self, cfg: ModelConfig, init_seed: int):
        super().__init__()
        self.embed = _build(cfg, "embed", 0, init_seed)
        self.pad_id = cfg.pad_id

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple:
        src, tgt_in = inputs
        return self.embed(src), self.embed(tgt_in), src, tgt_in, padding_mask(src, self.pad_id, self.embed.weight.dtype)


def output_states(module: EmbedPipe, inputs: tuple) -> torch.Tensor:
    """Forward of the last layer: the decoder stream tied to the embedding, which the loss projects
    it through chunk by chunk (parallel/loss.py) rather than this layer to full logits."""
    return tie_output_weight(inputs[1], module.embed.weight)


CHECKPOINTABLE = ("EncoderPipe", "DecoderPipe")
"""The layer kinds activation checkpointing recomputes (DeepSpeed's `checkpointable_layers`: a group
of `parallel.activation_checkpoint_interval` layers is recomputed when all of them are of these)."""


class EncoderPipe(nn.Module):
    def __init__(self, cfg: ModelConfig, init_seed: int, index: int = 0, kind: str = "encoder"):
        super().__init__()
        self.layer = _build(cfg, kind, index, init_seed)

    def forward(self, inputs: tuple) -> tuple:
        enc, dec, src, tgt_in, mask = inputs
        return run_layer(self.layer, enc, mask), dec, src, tgt_in, mask


class DecoderPipe(EncoderPipe):
    def __init__(self, cfg: ModelConfig, init_seed: int, index: int = 0):
        super().__init__(cfg, init_seed, index, "decoder")

    def forward(self, inputs: tuple) -> tuple:
        enc, dec, src, tgt_in, mask = inputs
        return enc, run_layer(self.layer, dec, enc, mask), src, tgt_in, mask


class FinalNormPipe(nn.Module):
    """The final LayerNorm of a Pre-LN stack; `part` is 'encoder' or 'decoder' (replicated under TP)."""

    def __init__(self, cfg: ModelConfig, init_seed: int, part: str):
        super().__init__()
        self.norm = _build(cfg, f"{part}_norm", 0, init_seed)
        self.part = part

    def forward(self, inputs: tuple) -> tuple:
        enc, dec, src, tgt_in, mask = inputs
        if self.part == "encoder":
            return self.norm(enc), dec, src, tgt_in, mask
        return enc, self.norm(dec), src, tgt_in, mask


def layer_specs(cfg: ModelConfig, seed: int) -> list[LayerSpec]:
    """One spec per plan entry; entry i is initialised from seed + i."""
    specs: list[LayerSpec] = []
    for i, layer in enumerate(layer_plan(cfg)):
        if layer.kind == "embed":
            specs.append(TiedLayerSpec("embed", EmbedPipe, cfg, seed + i, tied_weight_attr=["embed.weight"]))
        elif layer.kind == "output":
            # Built on the last stage from another seed, then overwritten by DeepSpeed's broadcast
            # of the first stage's embedding (the tied weight).
            specs.append(TiedLayerSpec("embed", EmbedPipe, cfg, seed + i, forward_fn=output_states,
                                       tied_weight_attr=["embed.weight"]))
        elif layer.kind == "encoder":
            specs.append(LayerSpec(EncoderPipe, cfg, seed + i, index=layer.index))
        elif layer.kind == "decoder":
            specs.append(LayerSpec(DecoderPipe, cfg, seed + i, index=layer.index))
        else:
            specs.append(LayerSpec(FinalNormPipe, cfg, seed + i, layer.kind.split("_")[0]))
    return specs


class TranslationPipe(PipelineModule):
    """PipelineModule whose layers are partitioned by parallel/partition.py's `stage_bounds`
    (partition_method='cost'): model/flops.py's layer costs, balanced."""

    precision: Precision = PRECISIONS["fp32"]
    """The stage's precision record: fp32 as built; parallel/parallelize.py gives it the run's, which
    the engine casts the stage to and its messages travel in."""

    def __init__(self, cfg: ModelConfig, *, topology, seed: int, partition_method: str = "cost"):
        """This rank's stage of the plain model (no parallelism inside: parallel/parallelize.py
        applies tensor parallelism, recomputation, compilation and the engine)."""
        # Set before PipelineModule.__init__, which calls _partition_layers.
        object.__setattr__(self, "_costs", layer_costs(cfg))
        object.__setattr__(self, "_plan", layer_plan(cfg))
        object.__setattr__(self, "_cfg", cfg)
        # The gradient the engine's backward gives the loss (TrainerEngine sets it each batch: 1 / the
        # micro-batches per step, times fp16's loss scale), for parallel/loss.py to scale the
        # logits' gradient before rounding it.
        object.__setattr__(self, "loss_grad", 1.0)

        def loss_fn(states: torch.Tensor, labels: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            """The output projection and the loss of the last stage, through the embedding weight
            the last layer tied to its output (this rank's vocabulary slice under tensor parallelism)."""
            target, scale = labels
            tp = self.tp
            group, size = (tp.group, tp.size) if tp is not None else (None, 1)
            return tied_output_loss_sum(states, target, cfg.pad_id, cfg.label_smoothing, group, size, scale,
                                        self.loss_grad)

        super().__init__(
            layers=layer_specs(cfg, seed),
            loss_fn=loss_fn,
            topology=topology,
            partition_method=partition_method,
            checkpointable_layers=list(CHECKPOINTABLE),
            # Not DeepSpeed's seed_layers: it reseeds every layer in forward from its index within
            # the checkpointed chunk, so with activation checkpointing all layers of a micro-batch
            # drew the same dropout masks. Init seeds are set by the specs; dropout uses each
            # rank's RNG stream (seeded and checkpointed by the trainer).
            seed_layers=False,
            dynamic_shape=True,
        )
        self.tp: TensorParallel | None = None  # set by parallel/parallelize.py under tensor parallelism
        self.pad_id = cfg.pad_id

    def forward(self, forward_input: tuple[torch.Tensor, ...]):
        """Run this stage's layers on the flow; convert from/to the stage message at its ends."""
        if self._local_start > 0:
            forward_input = stage_flow(*forward_input, self.pad_id)
        out = super().forward(forward_input)
        return stage_message(out) if self._local_stop < len(self._plan) else out

    def message_layout(self, src_shape: torch.Size, tgt_shape: torch.Size) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each tensor of the message between stages (the module docstring) for a
        micro-batch of `src_shape` source and `tgt_shape` target-input tokens."""
        (b, s), (_, t) = src_shape, tgt_shape
        return [((b, s + t, self._cfg.d_model), self.precision.dtype), ((b, s), torch.int64), ((b, t), torch.int64)]

    def train(self, mode: bool = True):
        """`nn.Module.train`, skipping the walk over every submodule when this module last set them
        all to `mode`: DeepSpeed's `train_batch` calls `train()` every step, and walking the
        thousands of modules of a deep stage costs milliseconds of host time each time. Mode
        changes must go through this module, as DeepSpeed's and the trainer's do."""
        if mode == self.training and self.__dict__.get("_all_in_mode") is mode:
            return self
        super().train(mode)
        self.__dict__["_all_in_mode"] = mode
        return self

    def _partition_layers(self, method: str = "cost") -> None:
        if method != "cost":
            return super()._partition_layers(method)
        self.parts = stage_bounds(self._cfg, self.num_stages)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

    def describe_partition(self) -> str:
        """One line per stage: its layers (by plan name) and its share of the cost model."""
        total = sum(self._costs)
        lines = []
        for stage in range(self.num_stages):
            lo, hi = self.parts[stage], self.parts[stage + 1]
            share = 100 * sum(self._costs[lo:hi]) / total
            lines.append(f"  stage {stage}: {self.stage_layers(stage)}, {share:.1f}% of cost")
        return "\n".join(lines)

    def stage_layers(self, stage: int) -> str:
        """`layers LO-HI (kinds)` of a stage, as the partition names them (and the timeline)."""
        lo, hi = self.parts[stage], self.parts[stage + 1]
        kinds = [p.kind for p in self._plan[lo:hi]]
        summary = ", ".join(f"{k}×{kinds.count(k)}" if kinds.count(k) > 1 else k for k in dict.fromkeys(kinds))
        return f"layers {lo}-{hi - 1} ({summary})"


def plain_name(plan: list, path: str) -> str | None:
    """The `EncoderDecoder` name of a stage's module or parameter path, None for the pipeline's own
    wrappers. Stage paths are '<plan index>.<wrapper attr>.<rest>' or 'tied_modules.embed.embed.<rest>';
    the wrappers hold the plain module as `.layer` (encoder/decoder), `.norm` (final LNs)."""
    tied = "tied_modules.embed.embed"
    if path == tied or path.startswith(tied + "."):
        return "embed" + path[len(tied):]
    index, _, rest = path.partition(".")
    wrapper, _, rest = rest.partition(".")
    if not index.isdigit() or wrapper not in ("layer", "norm"):
        return None
    return plan[int(index)].name + ("." + rest if rest else "")


def plain_state_dict(cfg: ModelConfig, pipe_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename one stage's `PipelineModule.state_dict()` to `EncoderDecoder` parameter names."""
    plan = layer_plan(cfg)
    out = {}
    for key, value in pipe_state.items():
        if key.endswith("._extra_state"):  # megatron's linears keep a placeholder for Transformer Engine
            continue
        name = plain_name(plan, key)
        if name is None:
            raise KeyError(f"unexpected pipeline parameter {key}")
        out[name] = value
    return out

"""The run configuration's section that parallel/ owns: how the model is laid out over processes
(`parallel`). Each field declares what it accepts in its annotation (schema/fields.py:
Range/Rule, Literal); trainer/config.py reads it from YAML and checks the rules across sections."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from parallel.precision import PRECISIONS
from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES
from schema.fields import NonNegative, Positive, Range, Rule


def _partition_method_ok(method: str) -> bool:
    if method in ("cost", "parameters", "uniform"):
        return True
    if not method.startswith("type:") or not method[len("type:"):]:
        return False
    try:
        re.compile(method[len("type:"):])
    except re.error:
        return False
    return True


class _Registered(Rule):
    """A registry name: the error lists the names registered when it is raised (the docs' text
    names none, so a schedule added to the registry changes no generated table)."""

    def problem(self, value) -> str | None:
        return None if value in SCHEDULES else f"must be one of {', '.join(SCHEDULES)} (parallel/schedules.py)"


ScheduleName = Annotated[str, _Registered(lambda v: v in SCHEDULES, "must be a schedule name of parallel/schedules.py "
                                          "(the error for any other lists them)")]

PrecisionName = Annotated[str, Rule(lambda v: v in PRECISIONS, f"must be one of {', '.join(PRECISIONS)} "
                                    "(parallel/precision.py)")]

PartitionMethod = Annotated[str, Rule(_partition_method_ok, "must be cost, parameters, uniform or type:REGEX "
                                      "(a valid regular expression)")]


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model is laid out over processes."""

    pipeline_stages: Positive = 1
    """pp: number of pipeline stages (depth partitions)."""
    tensor_parallel: Positive = 1
    """tp: megatron-core tensor parallelism inside each stage (heads, FFN columns and the
    vocabulary are split tp ways; tp must divide model.heads, model.ffn_dim and the vocabulary)."""
    data_parallel: Positive = 1
    """dp: number of model replicas. Processes launched = pipeline_stages × tensor_parallel ×
    data_parallel."""
    zero_stage: Literal[0, 1] = 1
    """ZeRO stage; DeepSpeed's pipeline engine accepts 0 or 1. 1: the fp32 master weights and Adam
    moments are partitioned over the replicas; 0: every replica keeps them whole. Both run the
    trainer's optimizer (parallel/optimizer.py) in every precision and clip by the single
    process's global gradient norm at any pp × tp × dp; only stage 1 checkpoints can be resharded."""
    activation_checkpoint_interval: NonNegative = 0
    """Recompute activations every this many layers in backward (0 = off)."""
    precision: PrecisionName = "fp32"
    """The weights', activations' and stage messages' dtype, with fp32 master weights, gradient
    accumulation and Adam moments in every precision (parallel/precision.py): bf16 on GPUs (fp16
    on V100s, with dynamic loss scaling); on CPUs fp32 (bf16 without bf16 instructions is ~3× slower)."""
    partition_method: PartitionMethod = "cost"
    """cost (FLOP model, decoder layer ≈ 4/3 encoder layer, output layer ∝ vocabulary) |
    parameters | uniform | type:REGEX (DeepSpeed's methods)."""
    schedule: ScheduleName = DEFAULT_SCHEDULE
    """Pipeline schedule: a name in parallel/schedules.py's registry, each a per-stage order of
    forwards and backwards (some split into input and weight gradients) that one engine runs;
    all compute the same numbers. `./run.sh plan` prices each from its order (memory, bubble) and
    proposes the fastest that fits; docs/pipeline.md describes them."""
    zb_max_pending_w: Annotated[int, Range(ge=-1)] = 0
    """For a schedule whose registry entry has pending bounds: at most this many weight passes (W) a
    stage keeps waiting. 0: every W right after its own B, so no stage holds more than with the
    backward unsplit; k > 0: up to k deferred W per stage; -1: no bound: the order tuned to the F, B
    and W times measured in the second step (stage s keeping s pending, or up to s + 1, the first
    stage too), which fills the most bubble. k ≠ 0 tunes within its bound too. Numbers are
    identical for every value. Memory: each pending W holds one micro-batch's inputs and output
    gradients of the stage's linears, per layer and token (8d + 2f)·e bytes on an encoder layer and
    (12d + 2f)·e (+ 3d·e per source token) on a decoder layer, e the element size: 1.1-1.3× that
    micro-batch's activations of the layer. `./run.sh plan` prices each stage with it."""

    @staticmethod
    def pending_bound(zb_max_pending_w: int) -> int | None:
        """The schedule's bound for a `zb_max_pending_w` value: None (no bound) for -1."""
        return None if zb_max_pending_w < 0 else zb_max_pending_w

"""The run configuration's sections that parallel/ owns: how the model is laid out over
processes (`parallel`) and how it is optimised (`train`). Each field declares what it accepts in
its annotation (schema/fields.py: Range/Rule, Literal); trainer/config.py reads them from YAML
and checks the rules across sections."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Literal

from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES
from schema.fields import NonNegative, Positive, Range, Rule, Seed


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


ScheduleName = Annotated[str, Rule(lambda v: v in SCHEDULES, f"must be one of {', '.join(SCHEDULES)} "
                                  "(parallel/schedules.py)")]

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
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32 | bf16 | fp16 (bf16 on GPUs; on CPUs without bf16 instructions it is ~3× slower)."""
    partition_method: PartitionMethod = "cost"
    """cost (FLOP model, decoder layer ≈ 4/3 encoder layer, output layer ∝ vocabulary) |
    parameters | uniform | type:REGEX (DeepSpeed's methods)."""
    schedule: ScheduleName = DEFAULT_SCHEDULE
    """Pipeline schedule: 1f1b (DeepSpeed's) | zb-h1 (zero-bubble ZB-H1: each backward split into
    the input gradient, run at once, and the weight gradients, run later to fill the pipeline's
    idle time; any precision, the same numbers as 1f1b; see parallel/zero_bubble.py). `./run.sh
    plan` proposes it where it shortens the step within memory."""
    zb_max_pending_w: Annotated[int, Range(ge=-1)] = 0
    """zb-h1 only: at most this many weight passes (W) a stage keeps waiting. 0: every W right after
    its own B, so no stage holds more than its 1F1B memory; k > 0: up to k deferred W per stage;
    -1: no bound: the order tuned to the F, B and W times measured in the second step (the paper's,
    stage s keeping s pending, or the filled one keeping up to s + 1, the first stage too), which
    fills the most bubble. k ≠ 0 tunes within its bound too. Numbers are identical for every value.
    Memory: each pending W holds one micro-batch's inputs and output gradients of the stage's
    linears, per layer and token (8d + 2f)·e bytes on an encoder layer and (12d + 2f)·e (+ 3d·e
    per source token) on a decoder layer, e the element size: 1.1-1.3× that micro-batch's
    activations of the layer (d = 1024, f = 4096, bf16: 32 MiB per encoder layer and 46 MiB per
    decoder layer for 1,024 + 1,024 tokens). `./run.sh plan` prices each stage with it."""

    @staticmethod
    def pending_bound(zb_max_pending_w: int) -> int | None:
        """The schedule's bound for a `zb_max_pending_w` value: None (no bound) for -1."""
        return None if zb_max_pending_w < 0 else zb_max_pending_w


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and bookkeeping."""

    max_steps: Positive = 1000
    """Optimizer steps to run."""
    micro_batches: Positive = 1
    """Micro-batches per optimizer step per replica (DeepSpeed gradient_accumulation_steps)."""
    compile: Literal["auto", True, False] = "auto"
    """Compile every encoder and decoder layer with torch.compile (parallel/compiled.py): true |
    false | auto (true with GPUs, where a step is bound by the host launching small kernels; false
    on CPUs, where compiling a layer kind takes 10-20 s and gains little of a step's CPU time).
    Checkpoints are the same either way."""
    lr: Annotated[float, Range(gt=0.0)] = 5e-4
    """Peak learning rate, reached at the end of the warm-up."""
    warmup_steps: NonNegative = 4000
    """Linear warm-up length; afterwards lr decays as 1/sqrt(step) (inverse square root)."""
    adam_betas: Annotated[tuple[float, float], Range(ge=0.0, lt=1.0)] = (0.9, 0.98)
    """Adam β₁, β₂."""
    adam_eps: Annotated[float, Range(gt=0.0)] = 1e-8
    """Adam ε."""
    weight_decay: Annotated[float, Range(ge=0.0)] = 0.0
    """Decoupled weight decay (AdamW)."""
    clip_norm: Annotated[float, Range(ge=0.0)] = 0.0
    """Clip the global gradient norm to this value (0 = no clipping; the norm is still logged)."""
    seed: Seed = 1
    """Seed of the weights (layer i uses seed + i) and of the data order."""
    init_from: str = ""
    """Start a new run from another run's weights (fine-tuning): a run directory (its newest intact
    checkpoint), a checkpoint folder, or a consolidated model file (`./run.sh convert consolidate`
    or `average`), of any pp × tp × dp layout. Weights only: the optimizer, the learning-rate
    schedule, the step and the data position start fresh. The model keys must give the source's
    parameter shapes (checked before any rank starts), and the data is encoded with the source's
    SentencePiece model (data.spm_model, unless set). A resumed run continues from its own
    checkpoints; changing the key then is refused. Empty: initialise from train.seed."""
    log_interval: Positive = 10
    """Print loss, lr, gradient norm and tokens/s every this many steps."""
    valid_interval: Positive = 100
    """Compute the validation loss every this many steps (and at the end)."""
    save_interval: Positive = 500
    """Save a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: Positive = 2
    """Checkpoints kept on disk (oldest deleted first)."""
    instrument_interval: NonNegative = 0
    """Log the stability instruments (model update ‖ΔF‖ on a probe batch, per-layer gradient
    norms, LayerNorm input sizes; see trainer/stability.py) every this many steps; 0 = off."""
    # ---- fault tolerance (launcher/procs.py, trainer/guard.py, parallel/manifest.py) ----
    collective_timeout_seconds: Annotated[float, Range(gt=0.0)] = 600.0
    """A collective (all-reduce, pipeline send/recv, barrier) that waits longer than this fails on
    every rank still alive, so a rank that dies ends the job instead of leaving the others hanging
    (torch.distributed's timeout). Must exceed the slowest checkpoint save and resume."""
    stop_grace_seconds: Annotated[float, Range(gt=0.0)] = 25.0
    """After SIGTERM (kill, scancel, SLURM's time limit) the ranks finish the step, checkpoint and
    exit; a rank still running this many seconds later exits without a checkpoint. Keep it below
    SLURM's KillWait (30 s by default)."""
    divergence_policy: Literal["stop", "skip", "rollback"] = "stop"
    """What a non-finite loss or gradient norm, or a loss spike, does (the update is never applied):
    stop (exit with a message) | skip (drop the batch, keep the weights) | rollback (reload the last
    good checkpoint and skip the data since it)."""
    divergence_spike_factor: Annotated[float, Rule(lambda v: v == 0 or v > 1, "must be > 1, or 0 to turn the spike check off")] = 4.0
    """A loss above this factor × the median of the last `divergence_window` applied steps' losses
    is a spike (0 = no spike check)."""
    divergence_window: Positive = 20
    """Applied steps whose losses form the median of the spike check (checked once it is full)."""
    divergence_max_events: Positive = 10
    """With skip or rollback: stop after this many divergence events in one run."""

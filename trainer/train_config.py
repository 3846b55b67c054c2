"""The run configuration's `train:` section: how the model is optimised and how the run keeps its
books (logging, saving, divergence, timeouts). Each field declares what it accepts in its
annotation (schema/fields.py: Range/Rule, Literal); trainer/config.py reads it from YAML and checks
the rules across sections."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from schema.fields import NonNegative, Positive, Range, Rule, Seed


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and bookkeeping."""

    max_steps: Positive = 1000
    """Optimizer steps to run."""
    micro_batches: Positive = 1
    """Micro-batches per optimizer step per replica (DeepSpeed gradient_accumulation_steps)."""
    keep_global_batch: bool = True
    """A resumed run keeps the micro-batches per step of its checkpoint (data_parallel ×
    micro_batches), at any layout: micro_batches is set to that number / data_parallel, which must
    divide it (checkpoint/elastic.py). false: this config's micro_batches, a batch changed on purpose."""
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
    trace_steps: Annotated[list[int], Range(ge=1)] = field(default_factory=list)
    """Steps whose timeline is recorded on every rank and written after the last of them as
    run_dir/timeline-A-B.json (Chrome trace events: ui.perfetto.dev or chrome://tracing opens it)
    and .png (a Gantt chart), with the bubble per stage read from the trace beside the simulator's.
    [20, 21] traces the 20th and 21st optimizer steps: every rank's forwards, backwards, weight
    passes, sends, receives, reductions, optimizer step and data loading (docs/pipeline.md). Steps
    within 1..max_steps, after the step a resumed run starts from; empty: nothing is recorded."""
    # ---- fault tolerance (launcher/procs.py, trainer/guard.py, checkpoint/manifest.py) ----
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

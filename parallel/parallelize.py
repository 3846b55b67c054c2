"""Parallelism applied in one place: `parallelize` takes the built plain stage of a rank and its
layout and applies, in this order,

1. tensor parallelism — parallel/tensor.py's plan replaces the stage's projections, FFN linears,
   vocabulary embedding and the LayerNorms inside sharded regions by megatron-core's sharded
   layers (first: everything after holds references to the final parameters);
2. activation checkpointing — the stage recomputes every `activation_checkpoint_interval` layers
   in backward (DeepSpeed's PipelineModule runs it, non-reentrant);
3. compilation — every encoder and decoder layer compiled by torch.compile, one graph per kind
   (parallel/compiled.py; `train.compile`), lazily at the first forward, so what 4 changes is
   inside the compiled layers' graphs;
4. the schedule's weight split — a schedule whose orders defer the weight gradients (W ops;
   parallel/schedules.py `splits_backward`) gives every weight-bearing module a backward that
   returns the input gradient and hands the weight gradients to a store
   (parallel/weight_split.py);
5. the engine — the client AdamW and the inverse-square-root schedule, wrapped by the engine that
   runs every schedule's orders (parallel/schedule_engine.py) with the precision's flags
   (parallel/precision.py), FlatOptimizer (parallel/optimizer.py) and ZeRO.

No other module makes a stage parallel: `build_engine` builds the plain stage and calls this; the
trainer, the engine benchmarks and the tests call `build_engine`. The benchmarks of bare layers
(bench/model.py, bench/ops.py, bench/zb_costs.py) apply steps 3 and 4 to a layer outside any stage
with the same functions (`compile_layers`, `split_weight_gradients`), to measure what the stage's
layers get; bench/startup.py, which builds one stage's layers without the other ranks, groups
them for step 2 as the stage does (parallel/pipeline.py CHECKPOINTABLE) and steps the client
optimizer of step 5 (`adamw`).
"""
from __future__ import annotations

import contextlib
import functools
import io

import torch

from model.config import ModelConfig
from parallel.config import ParallelConfig
from parallel.engine_config import Optimization, adamw, deepspeed_config, inverse_sqrt
from parallel.layout import Layout
from parallel.precision import precision_of
from parallel.schedules import schedule_of


def parallelize(stage, layout: Layout, p: ParallelConfig, t: Optimization, run_dir: str,
                load_universal: bool = False):
    """Apply 1-5 (module docstring) to `stage`, this rank's built plain TranslationPipe; the engine.
    The engine records what was applied: `precision`, `schedule` and `compiled_layers` (layers
    compiled per kind, empty when train.compile is off)."""
    from parallel.compiled import compile_enabled, compile_layers
    from parallel.engine import initialize
    from parallel.pipeline import plain_name
    from parallel.tensor import TensorParallel, apply_tensor_parallel

    precision, schedule = precision_of(p.precision), schedule_of(p.schedule)
    object.__setattr__(stage, "precision", precision)  # read by FlatOptimizer when the engine builds it
    if layout.tp > 1:  # 1
        tp = TensorParallel.create(layout, precision.dtype)
        apply_tensor_parallel(stage, tp, path_of=functools.partial(plain_name, stage._plan))
        stage.tp = tp
    # How DeepSpeed's universal checkpoint merges and splits these parameters at another tp
    # (parallel/universal.py); written into every checkpoint's model states.
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    from parallel.universal import module_info

    object.__setattr__(stage, UNIVERSAL_CHECKPOINT_INFO, module_info(stage))
    stage.activation_checkpoint_interval = p.activation_checkpoint_interval  # 2
    compiled = compile_layers(stage) if compile_enabled(t.compile) else {}  # 3
    if schedule.splits_backward:  # 4
        from parallel.weight_split import WeightGradStore, split_weight_gradients

        store = WeightGradStore()
        split = split_weight_gradients(stage, store)
        object.__setattr__(stage, "weight_split", (store, split))  # taken by the schedule's engine
    optimizer = adamw(stage.parameters(), t)  # 5
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(t.warmup_steps))
    config = deepspeed_config(p, t, run_dir, load_universal)
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its config and memory use
        engine = initialize(stage, optimizer, scheduler, config, engine_class())
    if schedule.pending_bounds:
        engine.max_pending_w = p.pending_bound(p.zb_max_pending_w)
    engine.precision, engine.schedule, engine.compiled_layers = precision, schedule, compiled
    return engine


def engine_class() -> type:
    """The engine class every schedule runs on (a function, so that a comparison can build
    DeepSpeed's own TrainerEngine, which runs its TrainSchedule, in its place)."""
    from parallel.schedule_engine import ScheduleEngine

    return ScheduleEngine


def build_engine(layout: Layout, model_cfg: ModelConfig, p: ParallelConfig, t: Optimization, run_dir: str,
                 load_universal: bool = False, init=None):
    """This rank's plain pipeline stage of the model, made parallel by `parallelize`; (engine, stage).
    `init(stage)` sets the plain stage's weights first (train.init_from: checkpoint/init_from.py)."""
    from parallel.pipeline import TranslationPipe

    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its seed and topology
        stage = TranslationPipe(model_cfg, topology=layout.topology, seed=t.seed, partition_method=p.partition_method)
    if init is not None:
        init(stage)
    return parallelize(stage, layout, p, t, run_dir, load_universal), stage

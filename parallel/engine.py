"""The trainer's DeepSpeed pipeline engine: `PipelineEngine` with the trainer's optimizer.

`TrainerEngine` builds parallel/optimizer.py's `FlatOptimizer` (a BF16_Optimizer that takes every
precision: fp32, bf16 and fp16) in place of the optimizer DeepSpeed would choose (at ZeRO stage 1
its ZeRO optimizer in fp32 and fp16, BF16_Optimizer in bf16; at stage 0 the bare client optimizer
in fp32, FP16_Optimizer in fp16, and none in bf16 with fp32 accumulation, which it refuses), by
overriding DeepSpeed's `_configure_optimizer`, and runs DeepSpeed's bf16 pipeline paths with it:
gradients folded into the flat fp32 buffer after each backward, the tied embedding's gradient
all-reduced there, the data-parallel reduction over the flat buffers. Every engine the trainer
builds gets FlatOptimizer: the run config allows ZeRO stage 0 or 1 and no offload, the model has
no MoE layers, and the client optimizer is torch's AdamW (parallel/engine_config.py). DeepSpeed's own
optimizers and paths run, unchanged, only where a caller sets `FlatOptimizer.enabled = False` (the
A/B comparisons of the tests and of bench/ops.py); `optimizer.applies` also leaves them the
engines no run config builds (MoE, offload, ZeRO ≥ 2, torch autocast, a client optimizer that is
not a torch one).

* `_bf16_reduce_grads`: DeepSpeed's reduction of the flat fp32 gradient buffers
  (`buffered_allreduce_fallback`: each buffer converted to the communication dtype, all-reduced
  over the data-parallel group, multiplied by 1/dp, copied back) without its flatten and unflatten
  copies, and without the all-reduce over a group of one at dp = 1. The conversion stays: in bf16
  DeepSpeed rounds the fp32 sums to bf16 there even at dp = 1 (its communication_data_type
  default), and the numbers equal its BF16_Optimizer's only with that rounding.
* `_configure_checkpointing`: DeepSpeed's checkpoint engine loads with `weights_only=False`; the
  engine gets runtime/safe_load.py's, whose loads are weights-only with DeepSpeed's few types.
* `clip_fp32_gradients`, `zero_grad`: the optimizer clips and clears the flat buffer (at ZeRO
  stage 0 in fp32 DeepSpeed's engine would clip the module's `.grad` by its own norm and then set
  them to None; the fold has already moved them into the buffer and freed them).

`initialize` builds an engine class of this family for a PipelineModule (deepspeed 0.19.8's
`deepspeed.initialize` hard-codes `PipelineEngine`); parallel/schedule_engine.py's engine, which
runs every schedule, derives from `TrainerEngine`.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from deepspeed import comm as ds_comm
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from parallel import optimizer as flat
from parallel.pipe_io import MessageIO
from runtime import safe_load


class TrainerEngine(MessageIO, PipelineEngine):
    """PipelineEngine with FlatOptimizer (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._observers: list[Callable] = []
        if self.flat_optimizer:
            # PipelineEngine tests `type(optimizer) == BF16_Optimizer` for its bf16 paths (the
            # per-backward fold, the tied all-reduce of `_hp_grad`, the flat reduction).
            self.using_bf16_optimizer = True

    step_loss: Callable[[], float | None] | None = None
    """Set by the trainer: the step's loss as the divergence guard read it (its one host sync of
    the step, with the loss shares of every rank summed). Then the step's aggregated loss costs no
    collective and no read of its own: DeepSpeed's all-reduces it over the replicas, broadcasts it
    over the pipeline and reads it back for its monitor, every step."""

    def train_batch(self, *args, **kwargs):
        if hasattr(self.module, "loss_grad"):
            self.module.loss_grad = self.loss_gradient()
        # DeepSpeed reads the step's loss back for its own monitor events every step; those are all
        # keyed by samples, which the trainer does not write (trainer/metrics.py drops them).
        enabled, self.monitor.enabled = self.monitor.enabled, False
        try:
            return super().train_batch(*args, **kwargs)
        finally:
            self.monitor.enabled = enabled

    def loss_gradient(self) -> float:
        """The gradient DeepSpeed's backward gives a micro-batch's loss on the last stage, as fp32
        computes it: 1 / gradient_accumulation_steps (`DeepSpeedEngine.backward` divides the loss
        by it) times the loss scale (fp16's; 1 otherwise)."""
        import numpy as np

        scaler = getattr(self.optimizer, "loss_scaler", None)
        scale = float(scaler.cur_scale) if scaler is not None else 1.0
        return float(np.float32(scale) / np.float32(self.gradient_accumulation_steps()))

    def _aggregate_total_loss(self):
        value = self.step_loss() if self.step_loss is not None else None
        if value is None:
            return super()._aggregate_total_loss()
        return torch.tensor(value)  # on the host: what DeepSpeed's monitor reads is there already

    @property
    def flat_optimizer(self) -> bool:
        return isinstance(getattr(self, "optimizer", None), flat.FlatOptimizer)

    def _get_all_zero_checkpoint_names(self, load_dir, tag, bf16_mode):
        """The optimizer shards of a checkpoint, or None when they were saved in the other precision
        family: bf16 runs name them `bf16_zero_pp_rank_*`, fp32 and fp16 runs `zero_pp_rank_*`.
        DeepSpeed's `_get_all_zero_checkpoints` then tries the other family, as it means to; its own
        version of this method never returns None, so a run resumed in another precision (fp32 →
        bf16, bf16 → fp16) failed on a missing file."""
        names = super()._get_all_zero_checkpoint_names(load_dir, tag, bf16_mode)
        return names if all(os.path.exists(name) for name in names) else None

    def _get_all_zero_checkpoints(self, load_dir, tag):
        """DeepSpeed's, less its warning on the console, which calls every checkpoint of the other
        family fp16 (an fp32 one too); the resume lists the precision change itself."""
        for bf16_mode in (self.bfloat16_enabled(), not self.bfloat16_enabled()):
            names = self._get_all_zero_checkpoint_names(load_dir, tag, bf16_mode)
            if names is not None:
                return self._get_all_zero_checkpoint_state_dicts(names)
        return None

    def _configure_checkpointing(self):
        """DeepSpeed's, with its checkpoint engine replaced by runtime/safe_load.py's, whose loads are
        weights-only: DeepSpeed's own loads with weights_only=False, so a file of a checkpoint from
        elsewhere could run code on resume. Only DeepSpeed's torch engine is built from the configs
        this trainer writes (the others come with `checkpoint.writer` or `datastates` settings)."""
        super()._configure_checkpointing()
        if type(self.checkpoint_engine) is not TorchCheckpointEngine:
            raise RuntimeError(f"DeepSpeed built a {type(self.checkpoint_engine).__name__}; the trainer loads "
                               "checkpoints only through its weights-only engine (runtime/safe_load.py)")
        self.checkpoint_engine = safe_load.SafeCheckpointEngine(self._config)

    def _configure_optimizer(self, client_optimizer, model_parameters):
        if not flat.applies(self, client_optimizer):
            return super()._configure_optimizer(client_optimizer, model_parameters)
        # DeepSpeed's preamble for a client optimizer, then FlatOptimizer whatever the precision.
        client_optimizer.param_groups[:] = [pg for pg in client_optimizer.param_groups if len(pg["params"]) != 0]
        self._check_for_duplicates(client_optimizer)
        self.basic_optimizer = client_optimizer
        self.optimizer = flat.build(self, client_optimizer)

    def observe(self, hook: Callable[[str, dict], contextlib.AbstractContextManager]) -> Callable[[], None]:
        """Run every pipeline instruction inside `hook(name, kwargs)` (a context manager: a timer, a
        profiler label) until the returned function is called. The one way to watch the schedule:
        the benchmarks' timings and memory census and the zero-bubble schedule's F/B/W costs use it.
        The engine dispatches through `self._INSTRUCTION_MAP`; an instance table of wrappers
        shadows the class's without changing what runs."""
        self._observers.append(hook)
        if "_INSTRUCTION_MAP" not in vars(self):
            def observed(name, handler):
                def run(engine, *args, **kwargs):
                    with contextlib.ExitStack() as stack:
                        for watch in list(engine._observers):
                            stack.enter_context(watch(name, kwargs))
                        return handler(engine, *args, **kwargs)
                return run

            self._INSTRUCTION_MAP = {cls: observed(cls.__name__, fn) for cls, fn in type(self)._INSTRUCTION_MAP.items()}

        def remove() -> None:
            self._observers.remove(hook)
            if not self._observers:
                del self._INSTRUCTION_MAP
        return remove

    def _bf16_reduce_grads(self):
        if not self.flat_optimizer:
            return super()._bf16_reduce_grads()
        # DeepSpeed's allreduce_bucket on each flat buffer (postscale, gradient_predivide_factor 1).
        group = self.mpu.get_data_parallel_group()
        dp = ds_comm.get_world_size(group=group)
        comm_dtype = self.communication_data_type
        for flat_grads in self.optimizer.fp32_groups_gradients_flat:
            reduced = flat_grads if flat_grads.dtype == comm_dtype else flat_grads.to(comm_dtype)
            if dp > 1:
                ds_comm.all_reduce(reduced, group=group)
                reduced.mul_(1.0 / dp)
            if reduced is not flat_grads:
                flat_grads.copy_(reduced)

    def clip_fp32_gradients(self):
        if not self.flat_optimizer:
            return super().clip_fp32_gradients()
        return None  # FlatOptimizer.step clips

    def zero_grad(self):
        if not self.flat_optimizer:
            return super().zero_grad()
        self.optimizer.zero_grad()


def initialize(module, optimizer, lr_scheduler, config: dict, engine_class: type[PipelineEngine] = TrainerEngine):
    """`deepspeed.initialize` for a PipelineModule, building `engine_class` (these are the steps of
    deepspeed 0.19.8's pipeline branch, which hard-codes PipelineEngine)."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.tensor_parallel.init_utils import merge_tp_model_init_into_config

    deepspeed.zero.partition_parameters.shutdown_init_context()
    merge_tp_model_init_into_config(config, None, None, dist)
    mpu = module.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, module)
    engine = engine_class(args=None, model=module, optimizer=optimizer, model_parameters=None,
                          training_data=None, lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=None,
                          collate_fn=None, config=config, config_class=config_class)
    deepspeed.zero.partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine

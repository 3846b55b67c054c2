"""The trainer's DeepSpeed pipeline engine: `PipelineEngine` without per-step work that does nothing.

DeepSpeed's engine is written for many replicas and many features; on the paths below it spends
Python time per parameter tensor (4,201 tensors at 100L-100L d=64, 21,000 at 500L-500L) on work
whose result is known. Each override gives DeepSpeed's numbers (tests/test_engine_lean.py) and
falls back to DeepSpeed's own code outside the case it covers:

* `allreduce_gradients` without ZeRO (parallel.zero_stage: 0) in fp32 with one replica: DeepSpeed
  flattens every gradient into buckets, all-reduces each over a group of one, divides by 1 and
  copies it back. The only effect kept: a parameter without a gradient gets a zero one (DeepSpeed
  does this so that every rank reduces the same buffers; AdamW then updates that parameter).
* `clip_fp32_gradients` (ZeRO stage 0, fp32) without tensor parallelism. DeepSpeed 0.19.8's
  `clip_grad_norm_` is wrong with pipeline stages (it counts only the first stage's gradients, and
  the tied embedding on both of its stages) and takes one norm and one multiply per tensor in
  Python. Here: each stage's sum of squares by `torch._foreach_norm`, the tied embedding's copies
  that DeepSpeed marks `ds_pipe_replicated` left out, summed over the pipeline group; then
  DeepSpeed's formula (coefficient min(1, c / (‖g‖ + 1e-6)), the norm averaged over the
  data-parallel group) applied by `torch._foreach_mul_`. The norm is also kept as the step's
  global gradient norm, which DeepSpeed leaves unset without ZeRO. With tensor parallelism,
  DeepSpeed's own (the config refuses that case at pp > 1).
* `zero_grad` without ZeRO: DeepSpeed's, over a parameter list kept at construction instead of a
  walk of the module tree (the parameters of a built stage do not change).

`initialize` builds an engine class of this family for a PipelineModule (deepspeed 0.19.8's
`deepspeed.initialize` hard-codes `PipelineEngine`); parallel/zero_bubble.py's engine derives
from `TrainerEngine`.
"""
from __future__ import annotations

import torch
from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.utils import groups


class TrainerEngine(PipelineEngine):
    """PipelineEngine with the lean paths of the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The module's parameters, fixed after construction: walking the module tree for them
        # costs 15 ms at 100L-100L, and DeepSpeed's paths below walk it several times a step.
        self._module_params = list(self.module.parameters())

    def _lean_fp32(self) -> bool:
        """fp32 without ZeRO and without DeepSpeed's optimizer wrappers: the client AdamW on .grad."""
        return not (self.zero_optimization() or self.fp16_enabled() or self.bfloat16_enabled()
                    or self.has_moe_layers or self.torch_autocast_enabled())

    def allreduce_gradients(self, bucket_size=None):
        if not (self._lean_fp32() and self.dp_world_size == 1 and self.is_gradient_accumulation_boundary()):
            return super().allreduce_gradients() if bucket_size is None else super().allreduce_gradients(bucket_size)
        for param in self._module_params:
            if param.requires_grad and param.grad is None and param.numel():
                param.grad = torch.zeros_like(param, memory_format=torch.preserve_format)

    def clip_fp32_gradients(self):
        if self.grid.get_slice_parallel_world_size() > 1:  # tensor parallelism: DeepSpeed's own
            return super().clip_fp32_gradients()
        with_grad = [p for p in self._module_params if p.grad is not None]
        if not with_grad:
            return super().clip_fp32_gradients()
        grads = [p.grad for p in with_grad]
        # Each stage's squared norm, the tied embedding counted on its first stage only (DeepSpeed
        # marks the other copies `ds_pipe_replicated`), summed over the pipeline.
        counted = [p.grad for p in with_grad if not getattr(p, "ds_pipe_replicated", False)]
        squares = (torch.stack(torch._foreach_norm(counted, 2.0)).pow(2.0).sum().float() if counted
                   else torch.zeros((), device=grads[0].device))
        if self.num_stages > 1:
            ds_comm.all_reduce(squares, group=self.grid.get_pipe_parallel_group())
        total = squares.pow(0.5)
        group = groups._get_data_parallel_group()
        if ds_comm.get_world_size(group=group) > 1:  # DeepSpeed averages the (equal) norms of the replicas
            total = total / float(ds_comm.get_world_size(group=group))
            ds_comm.all_reduce(total, group=group)
        coef = torch.clamp(self.gradient_clipping() / (total + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        self._global_grad_norm = total.item()
        return total

    def zero_grad(self):
        """DeepSpeed's (every .grad to None without ZeRO), over the kept parameter list."""
        for param in self._module_params:
            param.grad = None


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

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

* ZeRO stage 1 with one replica in fp32 (`LeanZeroOptimizer`, below): DeepSpeed's ZeRO-1
  optimizer keeps its checkpoint format and its step, without the copies that partition nothing.

`initialize` builds an engine class of this family for a PipelineModule (deepspeed 0.19.8's
`deepspeed.initialize` hard-codes `PipelineEngine`); parallel/zero_bubble.py's engine derives
from `TrainerEngine`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer, GradPartitionBufferGroup
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.utils import groups


class TrainerEngine(PipelineEngine):
    """PipelineEngine with the lean paths of the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The module's parameters, fixed after construction: walking the module tree for them
        # costs 15 ms at 100L-100L, and DeepSpeed's paths below walk it several times a step.
        self._module_params = list(self.module.parameters())
        self._observers: list[Callable] = []
        LeanZeroOptimizer.adopt(self.optimizer)

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


class LeanZeroOptimizer(DeepSpeedZeroOptimizer):
    """DeepSpeed's ZeRO-1 optimizer where it partitions nothing: one replica, fp32.

    There DeepSpeed keeps the weights twice (the module's, views of one flat buffer, and a flat
    fp32 master partition that Adam steps and that is copied back every step) and, at the end of
    each step's backward, copies every gradient into reduction buckets (reduced over a group of
    one) and then into a flat gradient partition, takes the norm one tensor at a time and re-points
    every parameter into the flat buffer after the update. Measured at 100L-100L d=64 (4,201
    tensors): 0.37 CPU s a step over the same trainer without ZeRO.

    Here, on the same object (`adopt` changes its class after DeepSpeed built it):
    * the master partition *is* the flat weight buffer (the same memory), so Adam updates the
      module's weights in place and DeepSpeed's copy-back finds source and destination the same
      (torch's copy_ returns at once); the hp-parameter links are re-made on it;
    * every parameter's `.grad` is a view of one flat gradient buffer laid out like the weights,
      so backward accumulates straight into the partition DeepSpeed steps on; `reduce_gradients`
      only hands that buffer over (a gradient found outside it is copied in), `zero_grad` zeroes
      it in one call;
    * the global norm is DeepSpeed's (same tensors, same exclusions, same all-reduces, the
      per-tensor norms in fp64 as DeepSpeed takes them) by one `torch._foreach_norm`;
    * no reduction bucket: DeepSpeed allocates one (2 GB in fp32 by default) on each backward's
      first gradient and frees it in the reduction the lean path replaces;
    * the re-pointing after the step is skipped while the parameters still are those views.
    DeepSpeed's `step`, overflow handling, clipping, `state_dict` and checkpoint loading run
    unchanged, so checkpoints are ZeRO-1's (they reshard). Whenever the buffers are found no
    longer shared (something re-bound them), the optimizer falls back to DeepSpeed's own paths
    for good. Losses, gradient norms and weights equal DeepSpeed's bit for bit
    (tests/test_pipeline_equivalence.py)."""

    enabled = True  # False: engines built from now on keep DeepSpeed's ZeRO-1 as it is (A/B runs)

    @classmethod
    def adopt(cls, opt) -> bool:
        """Make `opt` (a DeepSpeedZeroOptimizer) lean when the case applies; True if it did."""
        if not cls.enabled or type(opt) is not DeepSpeedZeroOptimizer or not cls._applies(opt):
            return False
        opt.__class__ = cls
        opt._lean_setup()
        return True

    @staticmethod
    def _applies(opt) -> bool:
        if (opt.partition_gradients or opt.cpu_offload or opt.overlap_comm or opt.has_moe_layers
                or opt.use_grad_accum_attribute or getattr(opt, "zenflow", False)
                or getattr(opt, "torch_autocast_gradscaler", None) is not None):
            return False
        if opt.dtype != torch.float32 or getattr(opt, "gradient_accumulation_dtype", torch.float32) != torch.float32:
            return False
        for i, flat in enumerate(opt.bit16_groups_flat):
            if ds_comm.get_world_size(group=opt.real_dp_process_group[i]) != 1:
                return False
            master = opt.single_partition_of_fp32_groups[i]
            if master.dtype != torch.float32 or master.numel() != flat.numel() or not flat.is_contiguous():
                return False
            if hasattr(opt, "_is_muon_group") and opt._is_muon_group(opt.bit16_groups[i]):
                return False
            for p in opt.bit16_groups[i]:
                if not p.is_contiguous() or p.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
                    return False
        return True

    def _lean_setup(self) -> None:
        self._lean = True
        self._lean_grads = []  # per parameter group: the flat gradient buffer
        self._lean_views = {}  # id(param) -> its gradient's view into that buffer
        self._lean_groups = []  # per group: the buffer as DeepSpeed's pre-flattened gradient partition
        self._lean_weights = []  # per group: (param, byte address it has as a view of the flat buffer)
        for i, flat in enumerate(self.bit16_groups_flat):
            grads = torch.zeros_like(flat)
            for p in self.bit16_groups[i]:
                offset = p.storage_offset() - flat.storage_offset()
                self._lean_views[id(p)] = grads.narrow(0, offset, p.numel()).view_as(p)
            self._lean_weights.append([(p, p.data_ptr()) for p in self.bit16_groups[i]])
            self._lean_grads.append(grads)
            self._lean_groups.append(GradPartitionBufferGroup(
                [self._lean_views[id(p)] for p in self.params_in_partition[i]], grads))
            with torch.no_grad():
                self.single_partition_of_fp32_groups[i].data = self.parallel_partitioned_bit16_groups[i][0].data
        self._link_all_hp_params()  # the links pointed into the master copy just released
        self._lean_attach()

    def _lean_intact(self) -> bool:
        """The master partitions still share memory with the weights (nothing re-bound either)."""
        return all(master.data_ptr() == flat.data_ptr() and master.numel() == flat.numel()
                   for master, flat in zip(self.single_partition_of_fp32_groups, self.bit16_groups_flat))

    def _lean_check(self) -> bool:
        if self._lean and not self._lean_intact():
            self._lean = False  # DeepSpeed's own paths from here on; they read .grad as they are
        return self._lean

    def _lean_attach(self) -> None:
        for group in self.bit16_groups:
            for p in group:
                p.grad = self._lean_views[id(p)]

    def reduce_gradients(self, pipeline_parallel=False):
        if not self._lean_check():
            return super().reduce_gradients(pipeline_parallel)
        for i, group in enumerate(self.bit16_groups):
            for p in group:  # a gradient made outside the buffer (its .grad was replaced): copy it in
                view, grad = self._lean_views[id(p)], p.grad
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                else:
                    continue
                p.grad = view
            self.averaged_gradients[i] = self._lean_groups[i]
        self.ready_for_gradients = False  # as DeepSpeed's reduction leaves it (the next backward counts a micro-step)

    def setup_buckets(self):
        """Called by DeepSpeed's gradient hooks on each backward's first gradient: DeepSpeed
        allocates its reduction bucket there (reduce_bucket_size elements, 2 GB in fp32 by
        default) and frees it in its reduction; the lean reduction uses none."""
        if not self._lean:
            return super().setup_buckets()
        if not self.ready_for_gradients:
            self.micro_step_id += 1
            self.ready_for_gradients = True

    def zero_grad(self, set_to_none=True):
        if not self._lean_check():
            return super().zero_grad(set_to_none)
        for grads in self._lean_grads:
            grads.zero_()
        self._lean_attach()

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or not self._lean:
            return super().get_grad_norm_direct(gradients, params, norm_type)
        counted = [self._lean_views[id(p)] for p in params
                   if not getattr(p, "ds_pipe_replicated", False)
                   and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)]
        if counted:  # DeepSpeed's per-tensor norms in get_norm_dtype() (fp64), summed there
            total = torch.stack(torch._foreach_norm(counted, 2.0, dtype=get_norm_dtype())).pow(2.0).sum().float()
        else:
            total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        ds_comm.all_reduce(total, op=ds_comm.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total, op=ds_comm.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=self.device)
        return total

    def _update_model_bit16_weights(self, group_index):
        if self._lean and self._lean_intact() and all(
                p.data_ptr() == address for p, address in self._lean_weights[group_index]):
            return  # the parameters are still the views of the flat buffer the step updated in place
        return super()._update_model_bit16_weights(group_index)


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

"""The trainer's optimizer for every precision: DeepSpeed's BF16_Optimizer without per-tensor work.

`FlatOptimizer` is a BF16_Optimizer (deepspeed 0.19.8, runtime/bf16_optimizer.py) built for fp32,
bf16 and fp16 alike by parallel/engine.py's `TrainerEngine._configure_optimizer`. DeepSpeed's
construction gives it its layout: the module's weights are views of one flat buffer per parameter
group, padded for the data-parallel partitions; an fp32 gradient buffer of the same layout; the
fp32 master partition the client AdamW steps; the hp links, `state_dict`, legacy and universal
checkpoint loading (so checkpoint/checkpoints.py's consolidate and reshard read its checkpoints as
DeepSpeed's bf16 ones). What it changes is the work per micro-batch and per step:

* Accumulation into the flat fp32 buffer (the fold, `update_hp_grads`): after each backward the
  gradients are added into the buffer, then *freed*, so the next backward's AccumulateGrad takes
  autograd's fresh gradient as it is (no kernel) instead of adding it into a zeroed buffer.
  fp32: one `torch._foreach_add_` into the buffer's views (one dtype: foreach's fast path).
  bf16/fp16: the gradients concatenated (one kernel) and added to the buffer (one mixed-dtype add:
  fp32 += bf16 elementwise is DeepSpeed's per-tensor `hp.add_(lp.to(fp32))`, bit for bit); CUDA's
  foreach add takes its fast path only when the lists share a dtype, across fp32 and bf16 it loops
  one kernel per tensor, hence the flat add. The `.grad` hand-over per tensor runs in C (`map`
  over attrgetter/setattr): no Python bytecode and no kernel per tensor per micro-batch.
  DeepSpeed's pipeline engine folds after every backward pass; gradients written outside one
  (zero-bubble's deferred weight passes) are folded by that engine calling `fold_lp_grads`.
* The global norm: DeepSpeed's selection (the tied embedding's pipeline copies and
  tensor-parallel duplicates left out) by one `torch._foreach_norm`, then DeepSpeed's stack, sum,
  all-reduce over the model-parallel group, root and non-finite mask (one `nan_to_num_`: DeepSpeed's
  mask copies its -1 from the host, a blocking copy on a GPU): the same fp32 value as
  `get_global_norm_of_tensors` on CPU.
* Clipping and fp16's unscaling: one `mul_` per flat group by min(1, c / (‖g‖ + 1e-6)) / scale
  (DeepSpeed's coefficient expression; × 1.0 is exact, so multiplying unconditionally equals its
  `if coef < 1`).
* fp16 (a precision with `loss_scaling`): DeepSpeed's dynamic loss scaler (`DynamicLossScaler`,
  with the config's window and hysteresis). The engine scales the loss; an overflow is one flag per step, a non-finite scaled
  norm (the norm is all-reduced over the stages and the gradients over the replicas, so every rank
  sees the same): the step is skipped, the engine counts it, the scaler lowers the scale.
* fp32: the master partition is the module's flat weight partition itself (the same memory), so
  the step updates the weights in place and no copy-back happens.
* The divergence guard (trainer/guard.py) decides through `step_gate`, called once per step after
  the norm and before any weight changes; it reads the norm with the loss and its flags in one
  host sync, the only one of a step.

Measured operation counts and the exactness against DeepSpeed's own BF16_Optimizer are in
docs/pipeline.md (engine section); tests/test_flat_optimizer.py checks both.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
import operator
from types import SimpleNamespace

import torch
from deepspeed import comm as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.constants import PIPE_REPLICATED
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.utils import all_gather_dp_groups, is_model_parallel_parameter
from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank
from torch._utils import _flatten_dense_tensors

_grad = operator.attrgetter("grad")
_is_none = functools.partial(operator.is_, None)


def _free_grads(params) -> None:
    """`p.grad = None` for every parameter, iterated in C (deque of a map of setattr)."""
    collections.deque(map(setattr, params, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0)


class FlatOptimizer(BF16_Optimizer):
    enabled = True
    """False: engines built from now on keep DeepSpeed's own optimizers (the A/B runs of the tests
    and of bench/ops.py; the trainer never sets it)."""

    step_gate = None
    """Set by the divergence guard: called as step_gate(norm, loss scale, scaled=fp16) once per step
    on every rank with the global norm as a device tensor; returns (skip the update, the unscaled
    norm as a float, inf when not finite): its one read of the device is the step's only host sync."""

    def __init__(self, init_optimizer, param_names, *, dtype: torch.dtype, mpu, clip_grad: float,
                 partition_group, allgather_bucket_size: int, loss_scaler=None):
        # BF16_Optimizer asserts bf16 is enabled in its config; it reads nothing else from it here.
        config = SimpleNamespace(enabled=True, immediate_grad_update=False)
        super().__init__(init_optimizer, param_names, bfloat16_config=config, mpu=mpu, clip_grad=clip_grad,
                         allgather_bucket_size=allgather_bucket_size, dp_process_group=partition_group,
                         grad_acc_dtype=torch.float32)
        self.fp16_groups = self.bf16_groups  # where the engine's checkpoint code looks for fp32/fp16
        self.loss_scaler = loss_scaler
        self.dynamic_loss_scale = bool(loss_scaler is not None and loss_scaler.dynamic)
        self.loss_scale_overflow = False  # the last step was skipped by fp16's loss scaling
        self._shared_master = False
        if dtype == torch.float32:
            self._share_master()
        self._views = [[g.view(p.shape) for p, g in zip(params, grads)]
                       for params, grads in zip(self.bf16_groups, self.fp32_groups_gradients)]
        for params, views in zip(self.bf16_groups, self._views):
            for p, view in zip(params, views):
                p._hp_grad = view  # the pipeline engine's tied-gradient all-reduce reads it
        tp_rank = bwc_tensor_model_parallel_rank(mpu=self.mpu)
        # get_grads_for_norm(for_clipping=False)'s selection when every parameter had a gradient
        self._norm_tensors = [g for params, grads in zip(self.bf16_groups, self.fp32_groups_gradients)
                              for p, g in zip(params, grads)
                              if not getattr(p, PIPE_REPLICATED, False)
                              and (tp_rank == 0 or is_model_parallel_parameter(p) or is_moe_param(p))]
        self._norm_group = mpu.get_model_parallel_group() if mpu is not None else None
        self._partial = False  # some parameter lacked a gradient at some fold of this step
        self._folded = False  # gradients folded since the last clear
        self._lp_clean = False  # every module parameter's .grad is None (DeepSpeed's "lp" gradients)
        self._hp_clean = True
        self.clear_lp_grads()

    def _share_master(self) -> None:
        """fp32: the master partition becomes the module's flat weight partition (same memory)."""
        for i, master in enumerate(self.fp32_groups_flat_partition):
            lp = self.bf16_partitioned_groups[i][dist.get_rank(group=self.real_dp_process_group[i])]
            master.data = lp.data
        self._link_all_hp_params()  # the links pointed into the copy just released
        self._shared_master = True

    # ---- per micro-batch -----------------------------------------------------------------
    @torch.no_grad()
    def update_hp_grads(self, clear_lp_grads=False):
        for i, params in enumerate(self.bf16_groups):
            grads = list(map(_grad, params))
            if not any(map(_is_none, grads)):
                if grads[0].dtype == torch.float32:  # one dtype: foreach's fast path, no copy
                    torch._foreach_add_(self._views[i], grads)
                else:
                    self.fp32_groups_actual_gradients_flat[i].add_(_flatten_dense_tensors(grads))
                self._folded = True
            elif not all(map(_is_none, grads)):  # a parameter without gradient: DeepSpeed skips it
                self._partial = True
                have = [j for j, g in enumerate(grads) if g is not None]
                torch._foreach_add_([self._views[i][j] for j in have], [grads[j] for j in have])
                for j in have:
                    self.fp32_groups_has_gradients[i][j] = True
            else:
                continue
            self._hp_clean = False
            _free_grads(params)
        self._lp_clean = True

    def backward_prologue(self):
        self.clear_lp_grads()
        self._lp_clean = False  # this backward makes .grad tensors until the fold frees them

    def clear_lp_grads(self, set_to_none=False):
        # DeepSpeed zeroes them; freed, the next accumulation gives the same values.
        if self._lp_clean:
            return
        for params in self.bf16_groups:
            _free_grads(params)
        self._lp_clean = True

    def fold_lp_grads(self) -> None:
        """Fold whatever gradients sit in `.grad` now into the fp32 buffer (the zero-bubble
        engine's deferred weight gradients, computed outside a backward)."""
        self.update_hp_grads()

    def clear_hp_grads(self):
        if self._hp_clean:
            return  # DeepSpeed zeroes them in step() and again in the engine's zero_grad()
        for flat in self.fp32_groups_gradients_flat:
            flat.zero_()
        if self._partial:
            for i, params in enumerate(self.bf16_groups):
                self.fp32_groups_has_gradients[i] = [False] * len(params)
        self._partial = self._folded = False
        self._hp_clean = True

    def zero_grad(self, set_to_none=True):
        self.clear_lp_grads(set_to_none)
        self.clear_hp_grads()

    def _mark_all(self) -> None:
        if self._folded:  # folds without a missing gradient: every parameter had one
            for i, params in enumerate(self.bf16_groups):
                self.fp32_groups_has_gradients[i] = [True] * len(params)
        self._folded = False

    def get_grads_for_norm(self, for_clipping=False):
        self._mark_all()
        return super().get_grads_for_norm(for_clipping)

    # ---- per step ----------------------------------------------------------------------------
    def _global_norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """get_global_norm_of_tensors (L2): per-tensor fp32 norms stacked, squared, summed,
        all-reduced over the model-parallel group (the pipeline's stages), rooted, inf/nan → -1;
        nothing read or copied from the host."""
        if tensors:
            total = torch.stack(torch._foreach_norm(tensors, 2.0)).pow(2.0).sum()
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.fp32_groups_gradients_flat[0].device)
        if self._norm_group is not None and dist.get_world_size(group=self._norm_group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._norm_group)
        total = total.pow(1. / 2.0)
        # inf/nan → -1 as DeepSpeed's mask_nan_or_inf_with_val_inplace, in one kernel and without
        # its torch.tensor(-1.0, device=…): a blocking host-to-device copy on a GPU
        return total.nan_to_num_(nan=-1.0, posinf=-1.0, neginf=-1.0)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError(f'{self.__class__} does not support closure.')
        self._mark_all()
        self.overflow = self.loss_scale_overflow = False
        tensors = self.get_grads_for_norm()[0] if self._partial else self._norm_tensors
        total = self._global_norm(tensors)  # × the loss scale in fp16
        scale = self.cur_scale
        if self.step_gate is not None:  # the divergence guard: the step's one host sync reads the norm too
            skip, value = self.step_gate(total, scale, scaled=self.loss_scaler is not None)
        else:
            value = float(total)
            value = value / scale if value != -1.0 else float("inf")
            skip = False
        invalid = not math.isfinite(value)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(invalid)
            self.loss_scale_overflow = invalid
        if invalid or skip:
            self.overflow = True
            self._global_grad_norm = float("inf")
            self.clear_hp_grads()
            self.clear_lp_grads()
            return
        self._global_grad_norm = value
        norm = total / scale if scale != 1.0 else total
        coef = torch.clamp(self.clip_grad / (norm + 1e-6), max=1.0) if self.clip_grad > 0. else None
        if scale != 1.0:
            coef = 1.0 / scale if coef is None else coef / scale
        if coef is not None:
            for flat in self.fp32_groups_gradients_flat:
                flat.mul_(coef)
        for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                                   self.fp32_groups_gradient_flat_partition):
            param_partition.grad = grad_partition
        self.optimizer.step()
        self._lazy_init_hp_params_optimizer_state()
        self.update_lp_params()
        self.clear_hp_grads()

    @torch.no_grad()
    def update_lp_params(self):
        for i, (partitions, master) in enumerate(zip(self.bf16_partitioned_groups, self.fp32_groups_flat_partition)):
            mine = partitions[dist.get_rank(group=self.real_dp_process_group[i])]
            if master.data_ptr() != mine.data_ptr():  # rounded to bf16/fp16; fp32's master is the weights
                mine.data.copy_(master.data)
        all_gather_dp_groups(groups_flat=self.bf16_groups_flat, partitioned_param_groups=self.bf16_partitioned_groups,
                             dp_process_group=self.real_dp_process_group,
                             start_alignment_factor=self.nccl_start_alignment_factor,
                             allgather_bucket_size=self.allgather_bucket_size)

    # ---- fp16's loss scale ---------------------------------------------------------------------
    @property
    def cur_scale(self) -> float:
        return float(self.loss_scaler.cur_scale) if self.loss_scaler is not None else 1.0

    loss_scale = cur_scale

    # ---- checkpoints -----------------------------------------------------------------------------
    def state_dict(self):
        state = super().state_dict()
        if self._shared_master:  # views of the weight buffer: saved alone, not with its whole storage
            state["single_partition_of_fp32_groups"] = [p.detach().clone() for p in self.fp32_groups_flat_partition]
        if self.loss_scaler is not None:
            s = self.loss_scaler
            state["loss_scaler_state"] = {k: getattr(s, k) for k in
                                          ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis") if hasattr(s, k)}
        return state

    def load_state_dict(self, state_dict_list, checkpoint_folder=None, load_optimizer_states=True,
                        load_from_fp32_weights=False, load_serial=None, param_shapes=None):
        if isinstance(state_dict_list, dict):  # zero_stage 0: the engine keeps it with the model states
            state_dict_list, load_from_fp32_weights = [state_dict_list], True
        super().load_state_dict(state_dict_list, checkpoint_folder, load_optimizer_states, load_from_fp32_weights,
                                load_serial, param_shapes)
        if state_dict_list and self.loss_scaler is not None:
            mine = state_dict_list[min(dist.get_rank(group=self.dp_process_group), len(state_dict_list) - 1)]
            for key, value in (mine.get("loss_scaler_state") or {}).items():
                setattr(self.loss_scaler, key, value)


def build(engine, client_optimizer) -> FlatOptimizer:
    """The optimizer of `engine` (a DeepSpeedEngine being constructed) over `client_optimizer`.

    The master partitions span the data-parallel group at ZeRO stage 1 (DeepSpeed's sequence
    data-parallel group, as for its BF16_Optimizer) and this rank alone at stage 0: each replica
    then steps every weight and gathers nothing."""
    precision = engine.module.precision  # the record parallel/parallelize.py gives the stage
    if precision.grad_dtype != torch.float32 or precision.master_dtype != torch.float32:
        raise ValueError(f"parallel.precision={precision.name}: FlatOptimizer accumulates gradients and keeps "
                         "master weights and Adam's moments in fp32 only")
    group = engine.seq_data_parallel_group
    if engine.zero_optimization_stage() == 0 and dist.get_world_size(group=group) > 1:
        group = torch.distributed.new_group([dist.get_rank()], use_local_synchronization=True)
    # The record's dynamic loss scaling, whatever its dtype (DeepSpeed's CreateLossScaler makes a
    # dynamic scaler for fp16 only): from 2^16 with DeepSpeed's window and hysteresis (its fp16
    # section, which parallel/precision.py fills for every precision).
    scaler = DynamicLossScaler(dtype=precision.dtype, **engine.dynamic_loss_scale_args()) \
        if precision.loss_scaling else None
    return FlatOptimizer(client_optimizer, engine.param_names, dtype=precision.dtype, mpu=engine.mpu,
                         clip_grad=engine.gradient_clipping(), partition_group=group,
                         allgather_bucket_size=engine.zero_allgather_bucket_size(), loss_scaler=scaler)


def applies(engine, client_optimizer) -> bool:
    """The cases FlatOptimizer covers; DeepSpeed's own optimizers elsewhere."""
    return (FlatOptimizer.enabled and isinstance(client_optimizer, torch.optim.Optimizer)
            and engine.zero_optimization_stage() in (0, 1) and not engine.zero_cpu_offload()
            and not engine.has_moe_layers and not engine.torch_autocast_enabled())

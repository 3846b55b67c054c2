"""The pp × tp × dp layout of a training job: the one object that knows it.

Built once per rank from `parallel:` of the run config, after torch.distributed is initialised
(`Layout.build`), and handed to everything that needs to know where this rank sits: the engine
set-up (parallel/parallelize.py), the tensor-parallel layers, the trainer, its divergence guard and
stability instruments, and the checkpoint and RNG files. No other code derives ranks or checks the
layout; the rules that can be checked before any rank starts (tp divides heads, FFN width and
vocabulary; pp at most the pipeline layers) are trainer/config.py's, on the config.

Rank order is tensor-parallel fastest, then data-parallel, then pipeline:
    rank = stage · (dp · tp) + replica · tp + tp_rank
which is both DeepSpeed's PipeModelDataParallelTopology(num_pp, num_mp, num_dp) (axes pipe, data,
model) and megatron-core's default order 'tp-cp-ep-dp-pp'. DeepSpeed's PipelineModule and engine
take their own topology object; `topology` is built from the layout's sizes, and the coordinates
here are read from it. With tp > 1, megatron-core's parallel_state is initialised here too and
every group it made is checked to hold exactly the ranks of the topology's group on that axis, so
the two libraries can never disagree silently; its groups are then the layout's groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel.config import ParallelConfig
from runtime import accelerator
from schema.text import count

AXES = {"pipe": "pipe", "data": "data", "tensor": "model"}
"""The layout's axes → DeepSpeed's names for them."""


def topology(pp: int, tp: int, dp: int):
    """DeepSpeed's topology object for a pp × tp × dp layout."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


@dataclass(frozen=True)
class Layout:
    pp: int
    """Pipeline stages."""
    tp: int
    """Tensor-parallel ranks per stage."""
    dp: int
    """Model replicas."""
    rank: int
    """This process's global rank."""
    stage: int
    """This rank's pipeline stage, 0..pp-1."""
    replica: int
    """This rank's data-parallel index, 0..dp-1."""
    tp_rank: int
    """This rank's tensor-parallel index, 0..tp-1."""
    device: torch.device
    """The device this rank trains on."""
    topology: object = field(repr=False)
    """DeepSpeed's PipeModelDataParallelTopology of the same sizes (PipelineModule takes it)."""
    groups: dict = field(repr=False, compare=False)
    """This rank's process group on each axis: 'pipe', 'data', 'tensor'."""

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def tensor_group(self):
        return self.groups["tensor"]

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @classmethod
    def build(cls, parallel: ParallelConfig) -> Layout:
        """This rank's layout; raises ValueError, naming the config keys, when the launched
        processes do not make the configured layout. A collective call: every rank calls it."""
        pp, tp, dp = parallel.pipeline_stages, parallel.tensor_parallel, parallel.data_parallel
        world = torch.distributed.get_world_size()
        if world != pp * tp * dp:
            raise ValueError(f"{count(world, 'process', 'processes')} {'was' if world == 1 else 'were'} launched but "
                             "parallel.pipeline_stages × "
                             f"tensor_parallel × data_parallel = {pp} × {tp} × {dp} = {pp * tp * dp}")
        topo = topology(pp, tp, dp)
        rank = torch.distributed.get_rank()
        coord = topo.get_coord(rank)
        return cls(pp=pp, tp=tp, dp=dp, rank=rank, stage=coord.pipe, replica=coord.data, tp_rank=coord.model,
                   device=accelerator.device(), topology=topo, groups=_groups(topo, rank, pp, tp))


def _groups(topo, rank: int, pp: int, tp: int) -> dict:
    """This rank's group on each axis. Every rank creates every group, in the same order, as
    torch.distributed.new_group requires."""
    if tp > 1:  # megatron-core's layers read its parallel_state: its groups are the layout's
        from parallel.tensor import megatron

        parallel_state, _, _ = megatron()
        if parallel_state.model_parallel_is_initialized() and (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size()) != (tp, pp):
            parallel_state.destroy_model_parallel()  # this process built another layout before (a resume at a new one)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        groups = {"tensor": parallel_state.get_tensor_model_parallel_group(),
                  "data": parallel_state.get_data_parallel_group(),
                  "pipe": parallel_state.get_pipeline_model_parallel_group()}
        for axis, group in groups.items():
            expected = next(ranks for ranks in topo.get_axis_comm_lists(AXES[axis]) if rank in ranks)
            actual = torch.distributed.get_process_group_ranks(group)
            if sorted(actual) != sorted(expected):
                raise RuntimeError(f"rank {rank}: megatron-core's {axis} group {actual} differs from "
                                   f"DeepSpeed's {expected}")
        return groups
    groups = {}
    for axis, name in AXES.items():
        for ranks in topo.get_axis_comm_lists(name):
            group = torch.distributed.new_group(ranks)
            if rank in ranks:
                groups[axis] = group
    return groups

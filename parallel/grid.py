"""The pp × tp × dp process grid: one object owns the layout for DeepSpeed and megatron-core.

Rank order is tensor-parallel fastest, then data-parallel, then pipeline:
    rank = stage · (dp · tp) + replica · tp + tp_rank
which is both DeepSpeed's PipeModelDataParallelTopology(num_pp, num_mp, num_dp) (axes pipe, data,
model) and megatron-core's default order 'tp-cp-ep-dp-pp'. `Grid.build()` initialises megatron's
parallel_state when tp > 1 and asserts that every group it made contains exactly the ranks
DeepSpeed's topology puts in that group, so the two libraries can never disagree silently.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Grid:
    pipeline_stages: int
    tensor_parallel: int
    data_parallel: int

    @property
    def world_size(self) -> int:
        return self.pipeline_stages * self.tensor_parallel * self.data_parallel

    def check(self, world_size: int, heads: int, ffn_dim: int, vocab_size: int) -> None:
        """Raise ValueError, naming the config keys, for a layout that cannot work."""
        pp, tp, dp = self.pipeline_stages, self.tensor_parallel, self.data_parallel
        if world_size != self.world_size:
            raise ValueError(f"{world_size} processes were launched but parallel.pipeline_stages × "
                             f"tensor_parallel × data_parallel = {pp} × {tp} × {dp} = {self.world_size}")
        for key, value in (("model.heads", heads), ("model.ffn_dim", ffn_dim), ("data.vocab_size", vocab_size)):
            if value % tp:
                raise ValueError(f"parallel.tensor_parallel={tp} must divide {key}={value}")

    def topology(self):
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        return PipeModelDataParallelTopology(num_pp=self.pipeline_stages, num_mp=self.tensor_parallel,
                                             num_dp=self.data_parallel)

    def build(self):
        """Initialise megatron-core's groups (tp > 1) and return DeepSpeed's topology."""
        topology = self.topology()
        if self.tensor_parallel > 1:
            from parallel.tensor import megatron

            parallel_state, _, _ = megatron()
            if not parallel_state.model_parallel_is_initialized():
                parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tensor_parallel,
                                                         pipeline_model_parallel_size=self.pipeline_stages)
            self._assert_same_groups(topology, parallel_state)
        return topology

    @staticmethod
    def _assert_same_groups(topology, parallel_state) -> None:
        rank = torch.distributed.get_rank()
        groups = {"model": parallel_state.get_tensor_model_parallel_group(),
                  "data": parallel_state.get_data_parallel_group(),
                  "pipe": parallel_state.get_pipeline_model_parallel_group()}
        for axis, group in groups.items():
            expected = next(ranks for ranks in topology.get_axis_comm_lists(axis) if rank in ranks)
            actual = torch.distributed.get_process_group_ranks(group)
            if sorted(actual) != sorted(expected):
                raise RuntimeError(f"rank {rank}: megatron-core's {axis} group {actual} differs from "
                                   f"DeepSpeed's {expected}")

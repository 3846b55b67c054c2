"""Random-number streams of a training rank: seeding for dropout and checkpointing of the state.

Weights are initialised per layer from seed + plan position (parallel/pipeline.py). Dropout draws
from each rank's own stream, seeded here once after the model is built:
  - the default generator (CPU and accelerator): same on the tensor-parallel ranks of one stage
    and replica, because they hold replicated activations whose dropout must agree; different
    across stages and replicas, so that no two layers share masks;
  - DeepSpeed's model-parallel tracker (parallel/tensor.py): different per tensor-parallel rank,
    for dropout on sharded heads and FFN columns.
DeepSpeed's activation checkpointing restores both for recomputation. The whole state of a rank
is saved next to each checkpoint (one small file per global rank) so a resumed run draws the masks
an uninterrupted run would have drawn.
"""
from __future__ import annotations

import os

import torch

from runtime import safe_load
from runtime.accelerator import HOST


def seed_dropout(seed: int, stage: int, replica: int) -> None:
    torch.manual_seed(seed * 1_000_003 + stage * 10_007 + replica * 101 + 17)


def _tracker():
    from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


def state() -> dict:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return {HOST: torch.get_rng_state(),
            "accelerator": None if accelerator.device_name() == HOST else accelerator.get_rng_state(),
            "tensor_parallel": _tracker().get_states()}


def path(checkpoint_dir: str, rank: int) -> str:
    return os.path.join(checkpoint_dir, f"rng_rank{rank:05d}.pt")


def save(checkpoint_dir: str, rank: int) -> None:
    """Write this rank's RNG state atomically into `checkpoint_dir` (before DeepSpeed's files)."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    target = path(checkpoint_dir, rank)
    torch.save(state(), target + ".tmp")
    os.replace(target + ".tmp", target)


def load(checkpoint_dir: str, rank: int) -> bool:
    """Restore this rank's RNG state; False when the checkpoint has none for this rank (it was
    written by another layout): training continues, with fresh dropout masks."""
    from deepspeed.accelerator import get_accelerator

    target = path(checkpoint_dir, rank)
    if not os.path.exists(target):
        return False
    saved = safe_load.load(target)  # tensors only: a file from elsewhere runs no code
    torch.set_rng_state(saved[HOST])
    if saved["accelerator"] is not None:
        get_accelerator().set_rng_state(saved["accelerator"])
    _tracker().set_states(saved["tensor_parallel"])
    return True

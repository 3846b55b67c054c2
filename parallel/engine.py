"""DeepSpeed set-up: distributed initialisation, the engine config, the pipeline engine."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import socket

import torch

from launcher.config import RunConfig
from model.config import ModelConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed on the accelerator's own backend.

    Without a launcher (plain `python`), a world of one process is assumed. On CPU, DeepSpeed
    would JIT-compile a shared-memory all-reduce op (60–90 s, needs g++/ninja) that only its
    inference path uses; marking no op as compatible skips the build. `__compatible_ops__` is
    read only by that one check in deepspeed.comm.torch (0.19.8).
    """
    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized():
        return
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        deepspeed.ops.__compatible_ops__ = {}
    else:
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(),
                               auto_mpi_discovery=False, verbose=False)


def deepspeed_config(cfg: RunConfig) -> dict:
    """The DeepSpeed JSON config derived from the run config.

    Batches are token-budgeted, so DeepSpeed's 'micro batch size' is nominal (1): it is used only
    for sample counters. Loss normalisation is done by the labels' scale (parallel/pipeline.py).
    """
    p, t = cfg.parallel, cfg.train
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": t.micro_batches,
        "train_batch_size": t.micro_batches * p.data_parallel,
        "gradient_clipping": t.clip_norm,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": 2**31,
        "wall_clock_breakdown": False,
        # DeepSpeed's monitors write our events on global rank 0: TensorBoard and one CSV per metric.
        "tensorboard": {"enabled": True, "output_path": os.path.join(cfg.run_dir, "tensorboard"),
                        "job_name": "train"},
        "csv_monitor": {"enabled": True, "output_path": os.path.join(cfg.run_dir, "metrics"),
                        "job_name": "train"},
        "pipeline": {
            "activation_checkpoint_interval": p.activation_checkpoint_interval,
            # Reentrant checkpointing loses gradients of int-only first-stage inputs.
            "use_reentrant": False,
            # Partitioning the activation across tensor-parallel ranks needs static shapes.
            "pipe_partitioned": False,
            "grad_partitioned": False,
        },
    }


def inverse_sqrt(warmup: int):
    """LR multiplier at optimizer step n (1-based): linear warm-up, then sqrt(warmup / n)."""
    def factor(zero_based_step: int) -> float:
        n = zero_based_step + 1
        if n <= warmup:
            return n / max(warmup, 1)
        return (warmup / n) ** 0.5
    return factor


def build_engine(cfg: RunConfig, model_cfg: ModelConfig):
    """Build the pipeline module, the optimizer, the LR schedule and DeepSpeed's engine."""
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    from parallel.pipeline import TranslationPipe

    p, t = cfg.parallel, cfg.train
    world = torch.distributed.get_world_size()
    if world != cfg.world_size:
        raise RuntimeError(f"launched {world} processes but the config asks for pipeline_stages × "
                           f"data_parallel = {p.pipeline_stages} × {p.data_parallel} = {cfg.world_size}")
    topology = PipeDataParallelTopology(num_pp=p.pipeline_stages, num_dp=p.data_parallel)
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its seed and topology
        module = TranslationPipe(model_cfg, topology=topology, seed=t.seed, partition_method=p.partition_method,
                                 activation_checkpoint_interval=p.activation_checkpoint_interval)
    optimizer = torch.optim.AdamW(module.parameters(), lr=t.lr, betas=t.adam_betas, eps=t.adam_eps,
                                  weight_decay=t.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(t.warmup_steps))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg))
    return engine, module

"""`./run.sh bench ops`' counts of the real trainer: host syncs per micro-batch and per step, and
the engine's operations per step beyond the model (bench/ops.py runs them; bench/counting.py has
the rule).

Host syncs are counted in this process at pp = 1 and in one launch of `--pp` ranks. On a GPU
both what CUDA's sync debug mode reports and the counting rule are kept; the count is the
larger. A machine with fewer GPUs than `--pp` runs that launch as CPU ranks (gloo): the same
trainer code, counted by the same rule, and the result says so.

    python -m bench.ops_syncs CONFIG --data-dir D --work W --result R.json [--set K=V ...]
        one rank of the --pp launch (started by `launch_syncs`, never by hand)
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from launcher.launch import ROOT
from schema.text import count

MICRO_BATCH_INSTRUCTIONS = ("LoadMicroBatch", "ForwardPass", "BackwardPass", "SendActivation", "RecvActivation",
                            "SendGrad", "RecvGrad", "WeightPass")
METHOD = ("reads of a value and blocking copies from host memory to the device (bench/counting.py), "
          "and on a GPU the sync debug mode's warnings")


def sync_counts(trainer, steps: int = 2) -> dict:
    """Host syncs of `steps` training steps of `trainer` on this rank: per micro-batch (inside the
    pipeline's micro-batch instructions) and per step (everything else of train_step). Counted by
    bench/counting.py's rule (reads and blocking host-to-device copies) and, on a GPU, by the sync
    debug mode too: each figure is the larger of the two."""
    import contextlib
    import warnings

    from bench.counting import KernelCounter
    from runtime import accelerator

    on_gpu = not accelerator.on_host()
    in_microbatch = [0]
    counter = KernelCounter()
    caught: list = []

    def reads() -> int:
        return max(counter.syncs, debug_syncs(caught)) if on_gpu else counter.syncs

    @contextlib.contextmanager
    def attribute(name, kwargs):
        if name not in MICRO_BATCH_INSTRUCTIONS:
            yield
            return
        start = reads()
        yield
        in_microbatch[0] += reads() - start

    remove = trainer.engine.observe(attribute)
    try:
        with warnings.catch_warnings(record=True) as caught_warnings:
            warnings.simplefilter("always")
            accelerator.warn_on_sync(True)
            caught = caught_warnings
            with counter:
                for _ in range(steps):
                    trainer.train_step()
            total, debug_mode = reads(), debug_syncs(caught)
    finally:
        accelerator.warn_on_sync(False)
        remove()
    m = trainer.cfg.train.micro_batches * steps
    return {"per_microbatch": in_microbatch[0] / m, "per_step": total / steps,
            "host_copies_per_step": counter.host_copies / steps, "reads_per_step": (counter.syncs - counter.host_copies) / steps,
            "sync_debug_mode_per_step": debug_mode / steps if on_gpu else None,
            "device": accelerator.device_type(), "method": METHOD}


def traced_step(trainer, stem: str) -> dict:
    """One more step of `trainer`, traced (trainer/timeline.py: STEM.json and .png) and counted as
    `sync_counts` counts: a traced step's syncs inside its micro-batch instructions (none: on a GPU
    the spans are device events, read after the step) and in all (the tracer's own, outside the
    pipeline: the clock exchange before the step, the one read of the events after it, the gather of
    the spans). Rank 0 adds the timeline's bubbles and files."""
    from trainer.timeline import trainer_timeline

    trainer.timeline = trainer_timeline(trainer, [trainer.step + 1], stem)
    counts = sync_counts(trainer, steps=1)
    timeline, trainer.timeline = trainer.timeline, None
    out = {"per_microbatch": counts["per_microbatch"], "per_step": counts["per_step"],
           "sync_debug_mode_per_step": counts["sync_debug_mode_per_step"], "hook_calls": timeline.tracer.calls,
           "device_clock": timeline.tracer.clock.device, "device": counts["device"]}
    if timeline.report:
        out.update(paths=timeline.paths, bubble={who: {k: v for k, v in part.items() if k.startswith(("stage_", "bubble"))}
                                                 for who, part in timeline.report.items() if who in ("trace", "simulator")})
    return out


def debug_syncs(caught: list) -> int:
    """How many of the warnings `caught` are CUDA's sync debug mode's ("called a synchronizing CUDA
    operation")."""
    return sum("synchroniz" in str(w.message) for w in caught)


def engine_ops_per_step(cfg, precision: str, data_dir: str, run_dir: str, step: int = 3,
                        flat_optimizer: bool = True) -> dict:
    """Kernel operations of training step `step` beyond the model (bench/counting.py classes; the
    earlier steps warm up: the optimizer's state is made in the first) for run config `cfg` in
    `precision`, at pp = dp = tp = 1 in this process. `flat_optimizer=False` measures DeepSpeed's
    own optimizers instead (parallel/optimizer.py's A/B switch)."""
    import copy

    from bench.counting import KernelCounter
    from parallel.optimizer import FlatOptimizer

    cfg = copy.deepcopy(cfg)
    cfg.parallel.precision = precision
    enabled, FlatOptimizer.enabled = FlatOptimizer.enabled, flat_optimizer
    try:
        trainer = new_trainer(cfg, data_dir, run_dir)
    finally:
        FlatOptimizer.enabled = enabled
    for _ in range(step - 1):
        trainer.train_step()
    with KernelCounter(classify=True) as counter:
        trainer.train_step()
    return {**counter.beyond_model(), "optimizer_class": type(trainer.engine.optimizer).__name__,
            "tensors": sum(1 for p in trainer.module.parameters() if p.requires_grad),
            "micro_batches": cfg.train.micro_batches, "host_syncs": counter.syncs}


def new_trainer(cfg, data_dir: str, run_dir: str, pp: int = 1):
    """A fresh Trainer of `cfg` at `pp` stages (this process is one of its ranks) on prepared data."""
    import copy
    import shutil

    import torch

    from trainer.trainer import Trainer

    cfg = copy.deepcopy(cfg)
    cfg.parallel.pipeline_stages, cfg.parallel.data_parallel, cfg.parallel.tensor_parallel = pp, 1, 1
    cfg.run_dir = run_dir
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        shutil.rmtree(run_dir, ignore_errors=True)
        os.makedirs(os.path.join(run_dir, "checkpoints"))
        os.symlink(os.path.abspath(data_dir), os.path.join(run_dir, "data"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return Trainer(cfg)


def syncs_worker(config: str, data_dir: str, work: str, out: str, overrides: list[str]) -> None:
    """One rank of the --pp launch: warm up, count two steps, rank 0 writes every rank's counts."""
    import torch

    from runtime.distributed import exit_rank
    from trainer.config import load_config

    cfg = load_config(config, sets=overrides)
    trainer = new_trainer(cfg, data_dir, os.path.join(work, "pp"), cfg.parallel.pipeline_stages)
    for _ in range(2):
        trainer.train_step()
    mine = sync_counts(trainer)
    mine["trace"] = traced_step(trainer, os.path.join(work, f"timeline-pp{cfg.parallel.pipeline_stages}"))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    if torch.distributed.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    exit_rank(0)


def launch_syncs(config: str, pp: int, data_dir: str, work: str, overrides: list[str]) -> tuple[list[dict], str | None]:
    """The counts of a launch of `pp` ranks (one per stage), and where its ranks ran: None on this
    process's accelerator (the host, or one GPU per rank); on a machine with fewer GPUs than `pp`
    the ranks run on the CPU (gloo) and count by the same rule: a line saying so."""
    import subprocess

    from launcher.launch import deepspeed_command, launch_env
    from runtime import accelerator

    out = os.path.join(work, f"syncs-pp{pp}.json")
    sets = [f"parallel.pipeline_stages={pp}", "parallel.data_parallel=1", "parallel.tensor_parallel=1", *overrides]
    args = [os.path.abspath(config), "--data-dir", data_dir, "--work", work, "--result", out] + \
        [a for s in sets for a in ("--set", s)]
    env = launch_env(pp)
    env["OMP_NUM_THREADS"] = "1"
    gpus = accelerator.gpu_count()
    where = None  # the ranks run on this process's accelerator
    if not accelerator.on_host() and gpus < pp:  # one GPU cannot hold two ranks' stages: CPU ranks
        env["DS_ACCELERATOR"], env["CUDA_VISIBLE_DEVICES"] = accelerator.HOST, ""
        where = f"{accelerator.HOST} ranks (this machine has {count(gpus, 'GPU')} for {count(pp, 'stage')})"
    log = os.path.join(work, f"syncs-pp{pp}.log")
    with open(log, "w") as f:
        code = subprocess.call(deepspeed_command(pp, "bench.ops_syncs", args), env=env, cwd=ROOT, stdout=f,
                               stderr=subprocess.STDOUT)
    if code != 0 or not os.path.exists(out):
        raise RuntimeError(f"the pp={pp} launch failed (exit {code}); see {log}")
    with open(out) as f:
        return json.load(f), where


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one rank of bench ops' --pp launch")
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args(argv)
    syncs_worker(args.config, args.data_dir, args.work, args.result, args.set)
    return 0


if __name__ == "__main__":
    sys.exit(main())

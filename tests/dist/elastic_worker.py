"""Runs under the deepspeed launcher (2 ranks): a run resumed in place at other layouts
(checkpoint/elastic.py) against the manual `./run.sh convert reshard` path and an uninterrupted run.

For each precision of `--precisions` (fp32: pp2·tp1·dp1 → pp1·tp1·dp2 → pp1·tp2·dp1 → pp2·tp1·dp1;
bf16 and fp16: pp2·tp1·dp1 → pp1·tp2·dp1; tp4, fp32 on 4 ranks: pp1·tp2·dp2 → pp1·tp4·dp1 →
pp2·tp1·dp2):

1. The first layout (2 micro-batches per step) trains `--steps` steps without a break, its
   checkpoint after SEG steps kept: the uninterrupted run.
2. Each transition: rank 0 prepares the run directory for the next layout as `./run.sh train`
   does before its ranks start (`prepare`: the universal copy of the newest checkpoint), and both
   ranks resume it with the real Trainer at that layout, from a config whose train.micro_batches
   is still the first layout's (the Trainer keeps the global batch); SEG steps, then a checkpoint.
   The same checkpoint resharded by `./run.sh convert reshard` into a new run directory and
   resumed there trains the same SEG steps (not for tp4).
Per step: the loss, the clipped gradient norm, the learning rate and a digest of the step's
micro-batches (their token ids); per resume: the step, the micro-batches per replica, Adam's step
count, the trainer's `resharded` record, and whether the consolidated universal copy holds
exactly the source checkpoint's weights. Rank 0 writes it all to `--out` (JSON).
"""
from __future__ import annotations

import argparse
import copy
import gc
import hashlib
import os
import shutil

import torch

from checkpoint.checkpoints import load_model, reshard
from checkpoint.elastic import copy_dir, prepare
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import write_result
from trainer.config import check_run_config, load_config
from trainer.trainer import Trainer

SEG = 3
LAYOUTS = {"fp32": [(2, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1)], "bf16": [(2, 1, 1), (1, 2, 1)],
           "fp16": [(2, 1, 1), (1, 2, 1)], "tp4": [(1, 2, 2), (1, 4, 1), (2, 1, 2)]}
"""The layouts each run goes through, by precision (tp4: fp32 on 4 ranks, tp 2 → 4 → 1)."""


def steps(trainer: Trainer, until: int, save: bool) -> dict:
    """Train to `until`, recording every step; checkpoint there when `save`."""
    out = {"loss": [], "grad_norm": [], "lr": [], "batches": []}
    original = trainer.stream.next_step

    def spy(n):
        batches = original(n)
        digest = hashlib.sha256()
        for b in batches:
            for key in ("src", "tgt_in", "tgt_out"):
                digest.update(b[key].numpy().tobytes())
        out["batches"].append(digest.hexdigest()[:16])
        return batches

    trainer.stream.next_step = spy
    while trainer.step < until:
        r = trainer.train_step()
        for key in ("loss", "grad_norm", "lr"):
            out[key].append(r[key])
    trainer.stream.next_step = original
    if save:
        trainer.save()
    return out


def resumed_state(trainer: Trainer) -> dict:
    opt = trainer.engine.optimizer.optimizer
    adam_steps = sorted({int(s["step"]) for s in opt.state.values() if "step" in s})
    return {"step": trainer.step, "micro_batches": trainer.cfg.train.micro_batches,
            "layout": [trainer.layout.pp, trainer.layout.tp, trainer.layout.dp], "adam_steps": adam_steps,
            "resharded": trainer.checkpoints.resharded}


def laid_out(cfg, layout: tuple[int, int, int]):
    out = copy.deepcopy(cfg)
    out.parallel.pipeline_stages, out.parallel.tensor_parallel, out.parallel.data_parallel = layout
    return out


def same_weights(universal: str, source: str, precision: str) -> bool:
    """The universal copy, consolidated, holds exactly the source checkpoint's weights (its fp32
    master weights, rounded to the precision the source's modules hold)."""
    a = load_model(universal).model.state_dict()
    b = load_model(source).model.state_dict()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return sorted(a) == sorted(b) and all(torch.equal(a[k].to(dtype).float(), b[k]) for k in a)


def run(cfg, precision: str, total: int) -> dict:
    rank = torch.distributed.get_rank()
    layouts = LAYOUTS[precision]
    cfg = laid_out(cfg, layouts[0])
    cfg.parallel.precision = "fp32" if precision == "tp4" else precision
    data = os.path.realpath(os.path.join(cfg.run_dir, "data"))
    cfg.run_dir = f"{cfg.run_dir}-{precision}"
    base = cfg.run_dir
    if rank == 0:
        os.makedirs(base)
        os.symlink(data, os.path.join(base, "data"))
    torch.distributed.barrier()
    first = Trainer(cfg, max_steps=total)
    out = {"uninterrupted": steps(first, SEG, save=True), "transitions": [], "first_layout": list(layouts[0])}
    rest = steps(first, SEG * len(layouts), save=False)
    for key in rest:
        out["uninterrupted"][key] += rest[key]
    del first
    gc.collect()
    for i, layout in enumerate(layouts[1:], start=1):
        tag, until = f"step{SEG * i}", SEG * (i + 1)
        made = None
        if rank == 0:
            made = prepare(cfg.run_dir, layout, log=print)
            made = made and {**made.record(), "made": made.made,
                             "same_weights": same_weights(made.path, os.path.join(base, "checkpoints", tag),
                                                          cfg.parallel.precision)}
        box = [made]
        torch.distributed.broadcast_object_list(box, src=0)
        inplace = Trainer(laid_out(cfg, layout), max_steps=total)
        step = {"layout": list(layout), "prepared": box[0], "inplace_state": resumed_state(inplace),
                "inplace": steps(inplace, until, save=True)}
        step["copy_dropped"] = not os.path.exists(copy_dir(os.path.join(base, "checkpoints"), tag))
        del inplace
        gc.collect()
        if precision == "tp4":  # (the other runs compare with convert reshard; this one saves the time)
            out["transitions"].append(step)
            continue
        manual_dir = f"{base}-manual{i}"
        if rank == 0:
            config = reshard(os.path.join(base, "checkpoints", tag), manual_dir, layout[0], layout[2],
                             tensor_parallel=layout[1], check_config=lambda c: check_run_config(c, "resharded"))
            shutil.copy(config, manual_dir + ".yaml")
        torch.distributed.barrier()
        manual = Trainer(load_config(manual_dir + ".yaml"), max_steps=total)
        step["manual_state"] = resumed_state(manual)
        step["manual"] = steps(manual, until, save=False)
        del manual
        gc.collect()
        out["transitions"].append(step)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()
    cfg = load_config(args.config)
    setup_distributed(cfg.train.collective_timeout_seconds)
    result = {}
    for precision in args.precisions.split(","):
        result[precision] = run(cfg, precision, SEG * len(LAYOUTS[precision]))
    write_result(args.out, result)
    exit_rank(0)


if __name__ == "__main__":
    main()

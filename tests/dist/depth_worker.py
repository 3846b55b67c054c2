"""Runs under the deepspeed launcher: a very deep model (e.g. 500L-500L) as a pipeline, a few steps.

Trains `--steps` steps with the real Trainer and records per step the loss and the clipped global
gradient norm; records what each stage holds (the partition bounds, the plan indices of its
layers, the DeepNorm α of every residual block of its encoder/decoder layers, the seeds' effect
through the parameters); writes each stage's parameters under the plain model's names. Rank 0
writes the numbers to `--out` (JSON); parameters go to `<out>.params.stage<k>.pt`.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from model.norms import PostNormResidual
from model.transformer import layer_plan
from runtime.distributed import exit_rank
from tests.dist.common import dump_params, record_steps
from trainer.config import load_config
from trainer.trainer import Trainer

RESIDUALS = ("self_attn_res", "cross_attn_res", "ffn_res")


def stage_contents(trainer: Trainer) -> dict:
    """Plan indices held by this stage and the α of every residual block of its layers."""
    plan = layer_plan(trainer.cfg.model)
    indices, alphas = [], {}
    for name, child in trainer.module.named_children():
        if not name.isdigit():
            continue
        index = int(name)
        indices.append(index)
        if plan[index].kind in ("encoder", "decoder"):
            blocks = [getattr(child.layer, r) for r in RESIDUALS if hasattr(child.layer, r)]
            alphas[plan[index].name] = [b.alpha for b in blocks if isinstance(b, PostNormResidual)]
    tied = [name for name, _ in trainer.module.named_modules() if name.startswith("tied_modules.")]
    return {"indices": sorted(indices), "alphas": alphas, "has_tied_embedding": bool(tied)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    cfg = load_config(args.config)
    start = time.perf_counter()
    trainer = Trainer(cfg, max_steps=args.steps)
    built = time.perf_counter() - start
    result = {"parts": [int(x) for x in trainer.module.parts], **record_steps(trainer, args.steps)}
    result["seconds"] = {"build": built, "steps": time.perf_counter() - start - built}

    dump_params(trainer, f"{args.out}.params")
    stages: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(stages, {"stage": trainer.engine.stage_id, **stage_contents(trainer)})
    result["stages"] = sorted(stages, key=lambda s: s["stage"])
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_rank()

"""Runs under the deepspeed launcher (2 ranks): checkpoint conversion checks in one launch.

1. Train the config's layout (pp=2 × dp=1) for `--steps` steps, checkpointing after `--save-at`
   steps and at the end; record the losses.
2. Run the trained pipeline on the first dev batch and keep its logits (last stage).
3. Rank 0 reshards the `--save-at` checkpoint to pp=1 × dp=2 with `./run.sh convert reshard`;
   both ranks resume it with the real Trainer in that layout and record the remaining losses.
4. Train the same model tensor-parallel (pp=1 × tp=2) for 2 steps, checkpoint it and record its
   validation loss, for the consolidation of tensor-parallel shards.
Rank 0 writes the losses to `--out` (JSON), the last stage the logits to `--out`.logits.pt.
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch

from data.batching import eval_batches
from launcher.cli import main as cli
from runtime.distributed import exit_rank
from tests.dist.common import record_steps
from trainer.config import load_config
from trainer.trainer import Trainer


def losses(trainer: Trainer, steps: int, save_at: int | None = None) -> list[float]:
    return record_steps(trainer, steps, save_at)["loss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    cfg = load_config(args.config)
    first = Trainer(cfg, max_steps=args.steps)
    result = {"uninterrupted": losses(first, args.steps, args.save_at)}
    first.save()

    batch = eval_batches(first.valid_data, cfg.data.max_tokens)[0]
    item = ((batch["src"], batch["tgt_in"]), (batch["tgt_out"], torch.tensor(1.0)))
    loss, states = first.engine.eval_batch(iter([item]), return_logits=True, num_micro_batches=1)
    if first.engine.is_last_stage():  # the last stage's output is the decoder stream; the loss projects it
        logits = first.module.tied_modules["embed"].embed.logits(states)
        torch.save({"src": batch["src"], "tgt_in": batch["tgt_in"], "tgt_out": batch["tgt_out"],
                    "logits": logits.detach(), "loss": float(loss)}, args.out + ".logits.pt")

    resharded = cfg.run_dir + "-pp1dp2"
    if torch.distributed.get_rank() == 0:
        code = cli(["convert", "reshard", os.path.join(cfg.run_dir, "checkpoints", f"step{args.save_at}"),
                    resharded, "--pipeline-stages", "1", "--data-parallel", "2"])
        assert code == 0, "convert reshard failed"
    torch.distributed.barrier()
    second = Trainer(load_config(os.path.join(resharded, "config.yaml")), max_steps=args.steps)
    result["resumed_from"] = second.step
    result["resumed_layout"] = [second.engine.num_stages, second.layout.dp, second.cfg.train.micro_batches]
    result["resumed"] = losses(second, args.steps)

    tp_cfg = copy.deepcopy(cfg)
    tp_cfg.run_dir = cfg.run_dir + "-tp2"
    tp_cfg.parallel.pipeline_stages, tp_cfg.parallel.tensor_parallel = 1, 2
    if torch.distributed.get_rank() == 0:
        os.makedirs(tp_cfg.run_dir)
        os.symlink(os.path.realpath(os.path.join(cfg.run_dir, "data")), os.path.join(tp_cfg.run_dir, "data"))
    torch.distributed.barrier()
    third = Trainer(tp_cfg, max_steps=2)
    losses(third, 2)
    third.save()
    result["tp2_valid_loss"] = third.validate()
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_rank()

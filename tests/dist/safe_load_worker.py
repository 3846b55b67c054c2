"""Runs under the deepspeed launcher (2 ranks): the ranks' own refusals of a checkpoint file that
would run code, without ./run.sh train's checks before them (tests/test_safe_load.py).

1. clean: the real Trainer resumes `--clean` (pp = 2): the step and the engine's checkpoint engine.
2. checked: `--evil` (pp = 2, a payload in both stages' ZeRO shards): the ranks' check before
   loading stops them together, rank 0 saying which file.
3. engine: the same with that check skipped: DeepSpeed's loads through the project's checkpoint
   engine refuse each rank's shard.
4. forced: `--universal` (pp = 1 × dp = 2, a payload in zero/optimizer_state.pt, which DeepSpeed
   reads with torch.load itself), the check skipped: the forced weights-only load refuses it.
Rank 0 writes per scenario every rank's exit code and the last line it printed on stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json

import torch

from runtime.distributed import exit_rank
from trainer.checkpointer import Checkpointer
from trainer.config import load_config
from trainer.trainer import Trainer


def attempt(config: str) -> dict:
    """This rank's exit code and last stderr line building a Trainer that resumes `config`."""
    said = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stderr(said):
            Trainer(load_config(config), max_steps=4)
    except SystemExit as e:
        code = e.code
    lines = said.getvalue().strip().splitlines()
    return {"code": code, "said": lines[-1] if lines else None}


def gathered(mine: dict) -> dict:
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return {"codes": [r["code"] for r in every], "said": [r["said"] for r in every]}


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--clean", "--evil", "--universal", "--out"):
        parser.add_argument(name, required=True)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    trainer = Trainer(load_config(args.clean), max_steps=4)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (trainer.step, type(trainer.engine.checkpoint_engine).__name__))
    result = {"clean": {"step": [s for s, _ in every], "engine": [e for _, e in every]}}
    del trainer

    result["checked"] = gathered(attempt(args.evil))
    Checkpointer.refuse_unsafe = lambda self, tag_dir: None  # as if a file changed after the check
    result["engine"] = gathered(attempt(args.evil))
    result["forced"] = gathered(attempt(args.universal))
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    exit_rank()

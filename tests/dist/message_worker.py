"""Runs under the deepspeed launcher, 2 ranks (pp = 2): the stage-message check of
parallel/pipe_io.py (tests/test_pipe_io.py).

    deepspeed --num_gpus 2 --module tests.dist.message_worker --config RUN.yaml --out R.json --case shape

Every case trains one step first (the engine warm). Then:
syncs  the host syncs of two more steps on each rank (bench/ops.py `sync_counts`), per micro-batch
       and per step; rank 0 writes both ranks' counts.
shape  the caller announces micro-batch 1 of the next step one target token longer than it is
       (every rank, as `Trainer.train_step`'s `engine.expect` would be told); rank 0 writes the
       micro-batch shapes of that step, then trains it: stage 0's send must raise.
dtype  stage 0's module returns its float message in bfloat16 while its parameters are float32;
       rank 0 writes the shapes of the next step, then trains it: stage 0's send must raise.
`shape` and `dtype` end the launch with the sender's error; the result is written before.
"""
from __future__ import annotations

import argparse

import torch

from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import write_result
from trainer.config import load_config
from trainer.trainer import Trainer


def next_shapes(trainer) -> list[list[list[int]]]:
    """The [src, tgt_in] shapes of this rank's micro-batches of the next step (the stream untouched)."""
    state = trainer.stream.state_dict()
    m, replica = trainer.cfg.train.micro_batches, trainer.layout.replica
    batches = trainer.stream.next_step(m * trainer.layout.dp)[replica * m:(replica + 1) * m]
    trainer.stream.load_state_dict(state)
    return [[list(b["src"].shape), list(b["tgt_in"].shape)] for b in batches]


def announce_longer(engine, micro_batch: int) -> None:
    """From now on, `engine.expect` announces `micro_batch` one target token longer than it is."""
    expect = engine.expect

    def wrong(shapes):
        shapes = list(shapes)
        src, tgt = shapes[micro_batch]
        shapes[micro_batch] = (src, torch.Size([tgt[0], tgt[1] + 1]))
        expect(shapes)

    engine.expect = wrong


def send_bfloat16(module) -> None:
    """The module's float output (the stage message's first tensor) in bfloat16 from now on."""
    forward = module.forward

    def cast(inputs):
        out = forward(inputs)
        return (out[0].to(torch.bfloat16), *out[1:])

    module.forward = cast


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--case", required=True, choices=["syncs", "shape", "dtype"])
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    setup_distributed()
    trainer = Trainer(load_config(args.config), max_steps=10)
    first = trainer.train_step()
    out = {"first_loss": first["loss"]}
    if args.case == "syncs":
        from bench.ops_syncs import sync_counts

        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, sync_counts(trainer))
        out["syncs"] = gathered
        write_result(args.out, out)
        exit_rank(0)
    out["shapes"] = next_shapes(trainer)
    out["param_dtype"] = str(next(trainer.module.parameters()).dtype)
    write_result(args.out, out)
    torch.distributed.barrier()
    if args.case == "shape":
        announce_longer(trainer.engine, 1)
    elif trainer.layout.stage == 0:
        send_bfloat16(trainer.module)
    trainer.train_step()  # stage 0 raises in its send: the launch ends here
    exit_rank(0)


if __name__ == "__main__":
    main()

"""Runs under the deepspeed launcher: several pipeline checks in one launch (start-up is costly).

Scenarios (`--scenarios`, comma-separated):
plain:    train `--steps` steps with the real Trainer, recording per step the loss, the global
          gradient norm, the learning rate and the micro-batch shapes; checkpoint after
          `--save-at` steps; write each stage's parameters under the plain model's names
          (`--out`.params.stage<s>.tp<t>.pt); resume a fresh Trainer from the checkpoint in a
          second run directory and record the remaining steps.
activation_checkpointing: the plain run again with checkpointing every 2 layers.
dropout:  dropout 0.1 everywhere and checkpointing every layer, trained (parameters written to
          `--out`.dropout.stage<s>.tp<t>.pt) and resumed as 'plain'; the same run without
          checkpointing as dropout_no_checkpointing.
zero1_deepspeed: the plain run (uninterrupted) with DeepSpeed's ZeRO-1 optimizer as DeepSpeed
          ships it, not parallel/optimizer.py's FlatOptimizer; parameters written to
          `--out`.deepspeed.stage<s>.tp<t>.pt.
zero1_fallback: the plain run (uninterrupted) where, after the second step, every fp32 master
          partition (the weights' own memory in FlatOptimizer) is re-bound to a copy of itself:
          the optimizer must notice and copy the updated master back into the weights.
partitions: the trainer's pipeline module (parallel/pipeline.py TranslationPipe) built on this
          launch's topology for several model shapes; their stage bounds.
Rank 0 writes everything to `--out` (JSON) for the test to compare with a single-process run.
"""
from __future__ import annotations

import argparse
import contextlib
import io

import torch

from model.config import ModelConfig
from parallel.pipeline import TranslationPipe
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import dump_params, record_steps, train_and_resume, variant, with_dropout, write_result
from trainer.config import load_config
from trainer.trainer import Trainer

# Shapes whose partitions differ in kind: decoder-heavy, output-heavy, Pre-LN's final norms, wide.
PARTITION_SHAPES = {
    "2-9": dict(encoder_layers=2, decoder_layers=9, d_model=32, heads=4, ffn_dim=64, vocab_size=600),
    "12-1-big-vocab": dict(encoder_layers=12, decoder_layers=1, d_model=16, heads=2, ffn_dim=32, vocab_size=5000),
    "4-4-preln": dict(encoder_layers=4, decoder_layers=4, d_model=32, heads=4, ffn_dim=128, vocab_size=300,
                      norm="preln"),
    "6-6-wide": dict(encoder_layers=6, decoder_layers=6, d_model=64, heads=4, ffn_dim=256, vocab_size=100),
}


def partitions() -> dict:
    """Stage bounds of TranslationPipe for each of PARTITION_SHAPES, one stage per rank."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=torch.distributed.get_world_size(), num_mp=1, num_dp=1)
    out = {}
    for name, shape in PARTITION_SHAPES.items():
        with contextlib.redirect_stdout(io.StringIO()):
            module = TranslationPipe(ModelConfig(**shape), topology=topology, seed=1)
        out[name] = [int(x) for x in module.parts]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--scenarios", default="plain,activation_checkpointing")
    parser.add_argument("--only-plain", action="store_true", help="--scenarios plain")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    setup_distributed()
    cfg = load_config(args.config)
    scenarios = ["plain"] if args.only_plain else args.scenarios.split(",")
    results = {}
    if "plain" in scenarios:
        results["plain"] = train_and_resume(cfg, args.steps, args.save_at, dump=f"{args.out}.params")
    if "activation_checkpointing" in scenarios:  # checkpointing every 2 layers must not change the numbers
        ckpt = variant(cfg, "ac2")
        ckpt.parallel.activation_checkpoint_interval = 2
        results["activation_checkpointing"] = record_steps(Trainer(ckpt, max_steps=args.steps), args.steps)
    if "dropout" in scenarios:
        # Checkpointing every layer: the resumed run must replay the same dropout masks, and the
        # recomputation in backward the masks of the forward.
        results["dropout"] = train_and_resume(with_dropout(cfg, "dropout"), args.steps, args.save_at,
                                              dump=f"{args.out}.dropout")
        no_ckpt = with_dropout(cfg, "dropout-no-ac", checkpoint_interval=0)
        results["dropout_no_checkpointing"] = record_steps(Trainer(no_ckpt, max_steps=args.steps), args.steps)
    if "zero1_deepspeed" in scenarios:
        from parallel.optimizer import FlatOptimizer

        FlatOptimizer.enabled = False
        try:
            shipped = Trainer(variant(cfg, "zero1-deepspeed"), max_steps=args.steps)
        finally:
            FlatOptimizer.enabled = True
        assert type(shipped.engine.optimizer).__name__ == "DeepSpeedZeroOptimizer"
        results["zero1_deepspeed"] = record_steps(shipped, args.steps)
        dump_params(shipped, f"{args.out}.deepspeed")
    if "zero1_fallback" in scenarios:
        trainer = Trainer(variant(cfg, "zero1-fallback"), max_steps=args.steps)
        opt = trainer.engine.optimizer
        first = record_steps(trainer, 2)

        def shared() -> bool:
            weights = [flat.data_ptr() for flat in opt.bf16_groups_flat]
            return any(m.data_ptr() in weights for m in opt.fp32_groups_flat_partition)

        shared_before = shared()
        for master in opt.fp32_groups_flat_partition:
            master.data = master.data.clone()
        rest = record_steps(trainer, args.steps)
        results["zero1_fallback"] = {"loss": first["loss"] + rest["loss"],
                                     "grad_norm": first["grad_norm"] + rest["grad_norm"],
                                     "shared_before": shared_before, "shared_after": shared()}
    if "partitions" in scenarios:
        results["partitions"] = partitions()
    write_result(args.out, results)


if __name__ == "__main__":
    main()
    exit_rank()

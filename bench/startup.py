"""Start-up of one pipeline stage: from launch to the end of its first training step.

    ./run.sh bench startup [--config configs/deepnet-500-500.yaml] [--pp 16] [--stage 1]

Only the named stage is built, in this one process (the other stages need not exist): the
imports a rank pays, the cost-model partition of the whole plan (every rank computes it), the
stage's layers built from their plan specs with the pipeline's init seeds, then one forward and
backward of a micro-batch of `--batch` × (`--src` + `--tgt`) tokens received as the stage
message, with activation checkpointing per layer as `parallel.activation_checkpoint_interval`
says, and one step of the engine's client AdamW (fused) over the stage's parameters. Printed per phase: wall and CPU
seconds (this process), and the peak RSS. Not included: process-group set-up and DeepSpeed's
engine initialisation, which need the other ranks (the engine's own start-up work is the
partition, timed here, and ZeRO's flattening of the stage's parameters, one copy of them).
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from schema.text import count

_T0 = time.time()  # early (after the standard library's small modules): start-up counts from the process's birth
BENCH = dict(name="startup", help="launch to first step of one pipeline stage", config="--config",
             default_config="configs/deepnet-500-500.yaml")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./run.sh bench startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/deepnet-500-500.yaml")
    parser.add_argument("--pp", type=int, default=16, help="pipeline stages of the partition")
    parser.add_argument("--stage", type=int, default=1, help="the stage to build (0-based)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src", type=int, default=32)
    parser.add_argument("--tgt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import psutil

    born = psutil.Process().create_time()
    phases: list[tuple[str, float, float]] = []
    wall, cpu = time.time(), _cpu()
    phases.append(("interpreter start-up", _T0 - born, 0.0))

    def mark(name: str) -> None:
        nonlocal wall, cpu
        now, now_cpu = time.time(), _cpu()
        phases.append((name, now - wall, now_cpu - cpu))
        wall, cpu = now, now_cpu

    import deepspeed  # noqa: F401  (every rank imports it; counted with the other imports)
    import torch

    from model.transformer import layer_plan
    from parallel.engine_config import adamw
    from parallel.partition import partition_balanced
    from parallel.pipeline import CHECKPOINTABLE, layer_costs, layer_specs, stage_flow, stage_message
    from trainer.config import load_config

    torch.set_num_threads(args.threads)
    mark("imports (torch, deepspeed, model, pipeline)")

    cfg = load_config(args.config)
    model_cfg = cfg.model
    if model_cfg.vocab_size <= 0:
        model_cfg.vocab_size = cfg.data.vocab_size
    plan = layer_plan(model_cfg)
    if not 0 <= args.stage < args.pp <= len(plan):
        raise SystemExit(f"error: --stage {args.stage} / --pp {args.pp}: need 0 ≤ stage < pp ≤ {count(len(plan), 'plan layer')}")
    mark("config")

    bounds = partition_balanced(layer_costs(model_cfg), args.pp)
    lo, hi = bounds[args.stage], bounds[args.stage + 1]
    mark(f"partition of {count(len(plan), 'plan layer')} into {count(args.pp, 'stage')}")

    specs = layer_specs(model_cfg, cfg.train.seed)[lo:hi]
    layers = torch.nn.ModuleList(spec.build() for spec in specs)
    n_params = sum(p.numel() for p in layers.parameters())
    mark(f"build stage {args.stage}: plan layers {lo}-{hi - 1}, {n_params / 1e6:.0f}M parameters")

    optimizer = adamw(layers.parameters(), cfg.train)  # the engine's client optimizer (parallelize, step 5)
    generator = torch.Generator().manual_seed(0)
    src = torch.randint(4, model_cfg.vocab_size, (args.batch, args.src), generator=generator)
    tgt_in = torch.randint(4, model_cfg.vocab_size, (args.batch, args.tgt), generator=generator)
    if lo == 0:
        flow = (src, tgt_in)
    else:
        h = torch.randn(args.batch, args.src + args.tgt, model_cfg.d_model, generator=generator, requires_grad=True)
        flow = stage_flow(h, src, tgt_in, model_cfg.pad_id)
    interval = cfg.parallel.activation_checkpoint_interval

    def run(start: int, end: int):
        def forward(x):
            for spec, layer in zip(specs[start:end], layers[start:end]):
                call = getattr(spec, "forward_fn", None)  # the tied output layer's logits
                x = call(layer, x) if call is not None else layer(x)
            return x
        return forward

    # Activation checkpointing as the stage's PipelineModule applies it (parallelize, step 2):
    # groups of `interval` layers, non-reentrant, a group recomputed only when all its layers are of
    # parallel.pipeline's CHECKPOINTABLE kinds; without it, one pass over every layer.
    for start in range(0, len(layers), interval or len(layers)):
        end = min(start + (interval or len(layers)), len(layers))
        kinds = {type(layer).__name__ for layer in layers[start:end]}
        if interval and kinds <= set(CHECKPOINTABLE):
            flow = torch.utils.checkpoint.checkpoint(run(start, end), flow, use_reentrant=False)
        else:
            flow = run(start, end)(flow)
    out = stage_message(flow)[0] if hi < len(plan) else flow  # h, or the last stage's logits
    out.backward(torch.randn(out.shape, generator=generator))
    mark(f"first forward + backward ({args.batch}×({args.src}+{args.tgt}) tokens, checkpoint interval {interval})")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark("first optimizer step (fused AdamW)")

    total_wall = sum(w for _, w, _ in phases)
    total_cpu = sum(c for _, _, c in phases)
    print(f"{model_cfg.encoder_layers}L-{model_cfg.decoder_layers}L d={model_cfg.d_model}, pp={args.pp}, "
          f"stage {args.stage} only; load average {os.getloadavg()[0]:.1f}; peak RSS {_rss_mb():.0f} MB")
    print(f"| {'phase':72s} | wall s | CPU s |")
    print(f"|{'-' * 74}|--------|-------|")
    for name, w, c in phases:
        print(f"| {name:72s} | {w:6.2f} | {c:5.2f} |")
    print(f"| {'launch to the end of the first step':72s} | {total_wall:6.2f} | {total_cpu:5.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

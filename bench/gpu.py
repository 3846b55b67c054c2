"""`./run.sh bench train` on a GPU: the shapes the paper's models put on one device, in bf16, eager
and with compiled layers, at 2k, 4k and 8k target tokens per micro-batch.

    ./run.sh bench train [--shapes a,b] [--tokens 2048,4096,8192] [--variants eager,compiled]
                         [--steps 6] [--warmup 3] [--out DIR]
    python -m bench.gpu --device cpu --shapes tiny ...        (a rehearsal on the CPU)

Each shape and variant trains in its own process (a DeepSpeed engine is never freed: bench/worker.py
says why) with the real engine of this trainer (parallel/engine.py at pp = 1: FlatOptimizer with
fp32 master weights, ZeRO-1, AdamW; the divergence guard's one read per step; micro-batch shapes
told to the engine as the trainer tells them), on synthetic token ids: 4 micro-batches per
optimizer step of 128 + 128 tokens per sentence pair, as many pairs as the micro-batch's target
tokens allow. Measured per micro-batch size, after `--warmup` steps, over `--steps` steps timed
with the device synchronised:

  target tokens/s, model TFLOP/s (model/flops.py, no recomputation), MFU against the datasheet
  dense bf16 peak (planner/devices.py), the kernel efficiency the planner uses (model FLOPs over
  the time of the forward and backward instructions alone); the GPU's busy fraction (kernel time
  over wall time, torch.profiler, one step); kernel launches per layer and host syncs per step
  (bench/counting.py, one step); the allocator's peak memory; compile time (parallel/compiled.py).

Shapes: `layers-d1024` (12 layers of 100L-100L d=1024, FFN 4096, 16 heads, a 8k vocabulary so that
the output layer does not mask the layers' efficiency), `last-stage-128k` (4 decoder layers of it
with the output layer and loss at the paper's 128k vocabulary: the last stage of a pipeline),
`6L-6L-d512` (32k vocabulary), `tiny` (CPU rehearsal). Writes OUT/results.json and OUT/report.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from parallel.accelerator import HOST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (encoder layers, decoder layers, d_model, heads, FFN, vocabulary)
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "layers-d1024": (6, 6, 1024, 16, 4096, 8192),
    "last-stage-128k": (1, 4, 1024, 16, 4096, 128000),
    "6L-6L-d512": (6, 6, 512, 8, 2048, 32000),
    "tiny": (2, 2, 32, 4, 64, 512),
}
SRC_LEN = TGT_LEN = 128
MICRO_BATCHES = 4


def model_config(shape: str, length: int):
    from model.config import ModelConfig

    enc, dec, d, heads, ffn, vocab = SHAPES[shape]
    return ModelConfig(encoder_layers=enc, decoder_layers=dec, d_model=d, heads=heads, ffn_dim=ffn, vocab_size=vocab,
                       norm="deepnorm", dropout=0.1, max_positions=length + 2)


def synthetic_batches(vocab: int, sequences: int, length: int, generator) -> list[tuple]:
    """One step's micro-batches in the pipeline's ((src, tgt_in), (tgt_out, scale)) form."""
    import torch

    out = []
    for _ in range(MICRO_BATCHES):
        src = torch.randint(4, vocab, (sequences, length), generator=generator)
        tgt = torch.randint(4, vocab, (sequences, length + 1), generator=generator)
        scale = torch.tensor(1.0 / (sequences * length * MICRO_BATCHES))
        out.append(((src, tgt[:, :-1].contiguous()), (tgt[:, 1:].contiguous(), scale)))
    return out


def _busy_fraction(engine, batches) -> float:
    """Kernel time over wall time of one step (torch.profiler's device activity); nan on a CPU."""
    from torch.profiler import ProfilerActivity, profile

    from parallel import accelerator

    if accelerator.on_host():
        return float("nan")
    accelerator.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.train_batch(iter(batches))
        accelerator.synchronize()
    wall = time.perf_counter() - start
    busy = sum(e.device_time_total for e in prof.key_averages() if e.device_time_total) / 1e6
    return busy / wall


def measure(shape: str, variant: str, token_sizes: list[int], steps: int, warmup: int, precision: str) -> dict:
    """Train `shape` in this process (a world of one) at each micro-batch size; the measurements."""
    import torch

    from bench.counting import KernelCounter
    from bench.worker import instrument, peak_memory, reset_peak_memory
    from model.flops import training_flops
    from parallel import accelerator, compiled
    from parallel.engine import setup_distributed
    from parallel.parallelize import build_engine
    from parallel.layout import Layout
    from planner import devices
    from trainer.config import RunConfig
    from trainer.guard import DivergenceGuard

    setup_distributed()
    cfg = RunConfig(run_dir=os.path.join(ROOT, "runs", "bench-gpu", f"{shape}-{variant}"))
    cfg.model = model_config(shape, TGT_LEN)
    cfg.parallel.precision = precision
    cfg.train.micro_batches, cfg.train.warmup_steps, cfg.train.clip_norm = MICRO_BATCHES, 100, 1.0
    layout = Layout.build(cfg.parallel)
    baseline = reset_peak_memory()  # the allocator's on GPUs, the resident set on the host
    cfg.train.compile = variant == "compiled"  # build_engine compiles the layers as the trainer's (parallelize)
    engine, module = build_engine(layout, cfg.model, cfg.parallel, cfg.train, cfg.run_dir)
    guard = DivergenceGuard(engine, cfg.train, layout)
    engine.step_loss = lambda: guard.step_loss
    totals, _ = instrument(engine)  # wall seconds by instruction (after a synchronize)
    key = devices.device_key(accelerator.gpu_name()) if not accelerator.on_host() else None
    peak = devices.DEVICES[key]["peak_tflops"][precision] * 1e12 if key else float("nan")
    layers = cfg.model.encoder_layers + cfg.model.decoder_layers
    generator = torch.Generator().manual_seed(0)
    rows = []
    for tokens in token_sizes:
        sequences = max(1, tokens // TGT_LEN)

        def step(batches):
            guard.step_loss = None
            engine.expect([(inputs[0].shape, inputs[1].shape) for inputs, _ in batches])
            return engine.train_batch(iter(batches))

        times = []
        for i in range(warmup + steps):
            batches = synthetic_batches(cfg.model.vocab_size, sequences, TGT_LEN, generator)
            if i == warmup:
                totals.clear()
            accelerator.synchronize()
            start = time.perf_counter()
            step(batches)
            accelerator.synchronize()
            times.append(time.perf_counter() - start)
        fwd_bwd = (totals.get("ForwardPass", 0.0) + totals.get("BackwardPass", 0.0)) / steps
        counter = KernelCounter()
        with counter:
            step(synthetic_batches(cfg.model.vocab_size, sequences, TGT_LEN, generator))
        busy = _busy_fraction(engine, synthetic_batches(cfg.model.vocab_size, sequences, TGT_LEN, generator))
        seconds = sorted(times[warmup:])[steps // 2]
        flops = sequences * MICRO_BATCHES * training_flops(cfg.model, SRC_LEN, TGT_LEN)
        rows.append({"target_tokens_per_micro_batch": sequences * TGT_LEN, "sequences": sequences,
                     "step_seconds_median": seconds, "step_seconds": times[warmup:],
                     "target_tokens_per_s": sequences * TGT_LEN * MICRO_BATCHES / seconds,
                     "model_tflops_per_s": flops / seconds / 1e12, "mfu": flops / seconds / peak,
                     "kernel_efficiency": flops / fwd_bwd / peak if fwd_bwd else float("nan"),
                     "gpu_busy_fraction": busy, "kernels_per_step": counter.kernels,
                     "kernels_per_layer_per_micro_batch": counter.kernels / (layers * MICRO_BATCHES),
                     "host_syncs_per_step": counter.syncs,
                     "instruction_seconds_per_step": {k: v / steps for k, v in sorted(totals.items())}})
        print(f"{shape} {variant} {sequences * TGT_LEN} tokens: {rows[-1]['target_tokens_per_s']:,.0f} tok/s, "
              f"MFU {rows[-1]['mfu']:.1%}, busy {busy:.0%}, {counter.kernels} kernels/step", flush=True)
    from planner import planner

    largest = max(token_sizes) // TGT_LEN
    layout_ = planner.Candidate(pp=1, tp=1, dp=1, micro_batches=MICRO_BATCHES, sequences=max(1, largest),
                                src_len=SRC_LEN, tgt_len=TGT_LEN, precision=precision)
    predicted = planner.stage_memory(cfg.model, layout_, 0, devices.device(key or "h100-80gb"))["peak"] \
        if precision != "fp32" else float("nan")
    return {"shape": shape, "variant": variant, "model": list(SHAPES[shape]), "precision": precision,
            "planner_peak_bytes": predicted,
            "parameters": sum(p.numel() for p in module.parameters()), "micro_batches": MICRO_BATCHES,
            "rows": rows, "peak_memory_bytes": peak_memory() - baseline,
            "compile": {k: dict(v) for k, v in compiled.stats.items()},
            "device": accelerator.gpu_name() if not accelerator.on_host() else accelerator.HOST, "planner_device": key,
            "datasheet_peak_tflops": peak / 1e12, "versions": accelerator.versions()}


def report(results: list[dict], command: str) -> str:
    first = results[0]
    v = first["versions"]
    lines = [f"# Training benchmark on {first['device']}", "", f"Command: `{command}`", "",
             f"Versions: python {v['python']}, torch {v['torch']}, deepspeed {v['deepspeed']}, "
             f"megatron-core {v['megatron.core']}.", "",
             f"{first['precision']}, pp = tp = dp = 1, FlatOptimizer, ZeRO-1, {MICRO_BATCHES} micro-batches of "
             f"(128 + 128)-token pairs per step; MFU against {first['datasheet_peak_tflops']:.0f} TFLOP/s "
             "(datasheet, dense); kernel efficiency = model FLOPs over forward + backward time only.", "",
             "| shape | variant | tgt tokens/µbatch | step s | target tok/s | TFLOP/s | MFU | kernel eff. | GPU busy "
             "| kernels/layer/µbatch | syncs/step | peak GiB | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        compile_s = sum(s["seconds"] for s in r["compile"].values())
        for row in r["rows"]:
            lines.append(f"| {r['shape']} | {r['variant']} | {row['target_tokens_per_micro_batch']} | "
                         f"{row['step_seconds_median']:.4f} | {row['target_tokens_per_s']:,.0f} | "
                         f"{row['model_tflops_per_s']:.1f} | {row['mfu']:.1%} | {row['kernel_efficiency']:.1%} | "
                         f"{row['gpu_busy_fraction']:.0%} | {row['kernels_per_layer_per_micro_batch']:.1f} | "
                         f"{row['host_syncs_per_step']} | {r['peak_memory_bytes'] / 2**30:.2f} | {compile_s:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="layers-d1024,last-stage-128k,6L-6L-d512",
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default="2048,4096,8192", help="target tokens per micro-batch, comma-separated")
    parser.add_argument("--variants", default="eager,compiled", help="eager, compiled or both")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per micro-batch size (6)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3; the compiled variant compiles in them)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", choices=("gpu", HOST), default="gpu",
                        help=f"{HOST}: a rehearsal on the host (fp32; with --shapes tiny)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-gpu"), help="output folder")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        tokens = [int(x) for x in args.tokens.split(",")]
    except ValueError:
        print(f"error: --tokens {args.tokens}: comma-separated integers, e.g. 2048,4096", file=sys.stderr)
        return 2
    if min(tokens) < 1 or args.steps < 1 or args.warmup < 0:
        print("error: --tokens and --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    if args.worker:
        from parallel.engine import exit_rank

        shape, variant = args.worker.split(":")
        result = measure(shape, variant, tokens, args.steps, args.warmup, args.precision)
        with open(os.path.join(args.out, f"{shape}-{variant}.json"), "w") as f:
            json.dump(result, f, indent=1)
        exit_rank(0)
    from parallel import accelerator

    if args.device == "gpu" and not accelerator.gpu_available():
        print(f"error: the GPU benchmark needs a GPU: {accelerator.why_no_gpu()} (--device cpu rehearses it)",
              file=sys.stderr)
        return 2
    shapes, variants = args.shapes.split(","), args.variants.split(",")
    bad = [s for s in shapes if s not in SHAPES] + [v for v in variants if v not in ("eager", "compiled")]
    if bad:
        print(f"error: unknown shape or variant {bad[0]}; shapes: {', '.join(SHAPES)}; variants: eager, compiled",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    if args.device == HOST:
        env["DS_ACCELERATOR"] = HOST
    precision = "fp32" if args.device == HOST else args.precision
    results = []
    for shape in shapes:
        for variant in variants:
            cmd = [sys.executable, "-m", "bench.gpu", "--worker", f"{shape}:{variant}", "--tokens", args.tokens,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", precision,
                   "--out", args.out]
            rc = subprocess.call(cmd, env=env, cwd=ROOT)
            if rc != 0:
                print(f"error: {shape} {variant} failed (exit {rc}); its output is above", file=sys.stderr)
                return rc
            with open(os.path.join(args.out, f"{shape}-{variant}.json")) as f:
                results.append(json.load(f))
    command = "./run.sh bench train" + (" " + " ".join(argv) if argv else "")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report(results, command)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


# What ./run.sh bench reads (launcher/commands/bench.py): `bench train` on a machine with a GPU.
from launcher.commands.bench import Bench  # noqa: E402

BENCH = Bench(name="train", gpu=True, help="the paper's shapes in bf16 on a GPU", paths=("--out",))


if __name__ == "__main__":
    sys.exit(main())

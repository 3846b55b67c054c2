"""`./run.sh bench train` on a GPU: the paper's shapes that fit one device, in bf16.

    ./run.sh bench train [--shapes a,b] [--steps 10] [--out DIR]

Each shape trains on one GPU with the real DeepSpeed engine of this trainer (parallel/engine.py:
the pipeline module at pp = 1, BF16_Optimizer with fp32 master weights, ZeRO-1, AdamW), on
synthetic token ids of a fixed shape: micro-batches of 32 sentence pairs × (128 + 128) tokens,
i.e. 4,096 target tokens, 4 micro-batches per optimizer step. One process per shape, because a
DeepSpeed engine is never freed (bench/worker.py says why).

Measured per shape, after `--warmup` steps, over `--steps` steps timed with the device
synchronised: target tokens/s; achieved model TFLOP/s (model/flops.py, no recomputation; the
whole step, optimizer included); MFU against the datasheet dense bf16 peak of the GPU
(planner/devices.py DEVICES); the kernel efficiency the planner assumes (model FLOPs over the
time of the forward and backward instructions alone, as planner/planner.py step_time models
compute); the allocator's peak memory next to the planner's prediction for the same layout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (encoder layers, decoder layers, d_model, heads, FFN, vocabulary). WMT shapes take a 32k joint
# vocabulary; the slice of the 3.2B model keeps its 128k one, with embedding and output layer, as
# the first and last stage of its pipeline would hold them.
SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "6L-6L-d512": (6, 6, 512, 8, 2048, 32000),
    "100L-100L-d64": (100, 100, 64, 2, 128, 32000),
    "18L-18L-d512": (18, 18, 512, 8, 2048, 32000),
    "100L-100L-d1024-slice12": (6, 6, 1024, 16, 4096, 128000),
}
SEQUENCES, SRC_LEN, TGT_LEN, MICRO_BATCHES = 32, 128, 128, 4
PLANNER_SHAPE = "18L-18L-d512"
"""The measurement the planner's default kernel efficiency for this GPU type is taken from."""


def model_config(shape: str, dropout: float = 0.1):
    from model.config import ModelConfig

    enc, dec, d, heads, ffn, vocab = SHAPES[shape]
    return ModelConfig(encoder_layers=enc, decoder_layers=dec, d_model=d, heads=heads, ffn_dim=ffn,
                       vocab_size=vocab, norm="deepnorm", dropout=dropout,
                       attention_dropout=0.0, activation_dropout=0.0,
                       max_positions=max(SRC_LEN, TGT_LEN) + 2)


def synthetic_batches(vocab: int, generator) -> list[tuple]:
    """One step's micro-batches in the pipeline's ((src, tgt_in), (tgt_out, scale)) form."""
    import torch

    out = []
    for _ in range(MICRO_BATCHES):
        src = torch.randint(4, vocab, (SEQUENCES, SRC_LEN), generator=generator)
        tgt = torch.randint(4, vocab, (SEQUENCES, TGT_LEN + 1), generator=generator)
        scale = torch.tensor(1.0 / (SEQUENCES * TGT_LEN))
        out.append(((src, tgt[:, :-1].contiguous()), (tgt[:, 1:].contiguous(), scale)))
    return out


def measure(shape: str, steps: int, warmup: int, precision: str = "bf16") -> dict:
    """Train `shape` on this process's GPU and return the measurements (a world of one)."""
    import torch

    from bench.worker import instrument
    from trainer.config import RunConfig
    from model.flops import training_flops
    from parallel import accelerator
    from planner import devices
    from planner import planner
    from parallel.engine import build_engine, setup_distributed
    from parallel.layout import Layout

    setup_distributed()
    cfg = RunConfig(run_dir=os.path.join(ROOT, "runs", "bench-gpu", shape))
    cfg.model = model_config(shape)
    cfg.parallel.precision = precision
    cfg.train.micro_batches = MICRO_BATCHES
    cfg.train.warmup_steps = 100
    cfg.train.clip_norm = 1.0
    baseline = accelerator.reset_peak_memory()
    engine, module = build_engine(Layout.build(cfg.parallel), cfg.model, cfg.parallel, cfg.train, cfg.run_dir)
    totals, _ = instrument(engine)  # wall seconds by instruction (GPU work is timed after a synchronize)
    generator = torch.Generator().manual_seed(0)
    losses, times = [], []
    for step in range(warmup + steps):
        batches = synthetic_batches(cfg.model.vocab_size, generator)
        if step == warmup:
            totals.clear()
        accelerator.synchronize()
        start = time.perf_counter()
        loss = engine.train_batch(iter(batches))
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    measured = times[warmup:]
    seconds = sorted(measured)[len(measured) // 2]
    tokens = SEQUENCES * TGT_LEN * MICRO_BATCHES
    flops = SEQUENCES * MICRO_BATCHES * training_flops(cfg.model, SRC_LEN, TGT_LEN)
    key = devices.device_key(accelerator.gpu_name())
    peak = devices.DEVICES[key]["peak_tflops"][precision] * 1e12 if key else float("nan")
    fwd_bwd = (totals.get("ForwardPass", 0.0) + totals.get("BackwardPass", 0.0)) / steps
    layout = planner.Candidate(pp=1, tp=1, dp=1, micro_batches=MICRO_BATCHES, sequences=SEQUENCES, src_len=SRC_LEN,
                               tgt_len=TGT_LEN, precision=precision)
    predicted = planner.stage_memory(cfg.model, layout, 0, devices.device(key or "h100-80gb"))["peak"]
    return {
        "shape": shape, "model": list(SHAPES[shape]), "precision": precision,
        "parameters": sum(p.numel() for p in module.parameters()),
        "micro_batch": f"{SEQUENCES}×({SRC_LEN}+{TGT_LEN})", "micro_batches": MICRO_BATCHES,
        "step_seconds_median": seconds, "step_seconds": measured,
        "target_tokens_per_s": tokens / seconds, "model_tflops_per_s": flops / seconds / 1e12,
        "mfu": flops / seconds / peak, "kernel_efficiency": flops / fwd_bwd / peak if fwd_bwd else float("nan"),
        "instruction_seconds_per_step": {k: v / steps for k, v in sorted(totals.items())},
        "peak_memory_bytes": accelerator.peak_memory() - baseline, "planner_peak_bytes": predicted,
        "gpu": accelerator.gpu_name(), "planner_device": key, "datasheet_peak_tflops": peak / 1e12,
        "losses": losses, "versions": accelerator.versions(),
    }


def plain_model_seconds(shape: str, repeats: int = 10) -> dict:
    """Forward + backward of one micro-batch through the plain bf16 model (model/transformer.py),
    without DeepSpeed: what the engine adds is the difference to its ForwardPass + BackwardPass."""
    import torch

    from model.flops import training_flops
    from model.transformer import EncoderDecoder, smoothed_loss_sum
    from parallel import accelerator

    cfg = model_config(shape)
    model = EncoderDecoder(cfg, seed=1).to(device=accelerator.device(), dtype=torch.bfloat16)
    (src, tgt_in), (tgt_out, scale) = synthetic_batches(cfg.vocab_size, torch.Generator().manual_seed(0))[0]
    src, tgt_in, tgt_out = (t.to(accelerator.device()) for t in (src, tgt_in, tgt_out))
    times = []
    for i in range(repeats + 3):
        accelerator.synchronize()
        start = time.perf_counter()
        loss = smoothed_loss_sum(model(src, tgt_in), tgt_out, cfg.pad_id, cfg.label_smoothing) * scale.item()
        loss.backward()
        accelerator.synchronize()
        times.append(time.perf_counter() - start)
    seconds = sorted(times[3:])[repeats // 2]
    flops = SEQUENCES * training_flops(cfg, SRC_LEN, TGT_LEN)
    return {"seconds": seconds, "tflops_per_s": flops / seconds / 1e12}


def profile(shape: str, out: str) -> None:
    """Two engine steps of `shape` under torch.profiler: the top operators by GPU and CPU time."""
    import torch
    from torch.profiler import ProfilerActivity

    from trainer.config import RunConfig
    from parallel.engine import build_engine, setup_distributed
    from parallel.layout import Layout

    setup_distributed()
    cfg = RunConfig(run_dir=os.path.join(ROOT, "runs", "bench-gpu", shape))
    cfg.model = model_config(shape)
    cfg.parallel.precision = "bf16"
    cfg.train.micro_batches = MICRO_BATCHES
    engine, _ = build_engine(Layout.build(cfg.parallel), cfg.model, cfg.parallel, cfg.train, cfg.run_dir)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        engine.train_batch(iter(synthetic_batches(cfg.model.vocab_size, generator)))
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            engine.train_batch(iter(synthetic_batches(cfg.model.vocab_size, generator)))
    averages = prof.key_averages()
    with open(out, "w") as f:
        f.write(f"{shape}: plain model forward+backward of one micro-batch: {plain_model_seconds(shape)}\n\n")
        f.write(averages.table(sort_by="self_cuda_time_total", row_limit=30))
        f.write("\n\n")
        f.write(averages.table(sort_by="self_cpu_time_total", row_limit=30))


def report(results: list[dict], command: str) -> str:
    first = results[0]
    v = first["versions"]
    lines = [f"# GPU training benchmark: {first['gpu']}", "",
             f"Command: `{command}`", "",
             f"Versions: python {v['python']}, torch {v['torch']} (CUDA {v.get('cuda_runtime')}), deepspeed "
             f"{v['deepspeed']}, megatron-core {v['megatron.core']}, driver {v.get('driver')}.", "",
             f"bf16 (BF16_Optimizer, fp32 master weights, ZeRO-1), pp = tp = dp = 1, micro-batches of "
             f"{first['micro_batch']} tokens ({SEQUENCES * TGT_LEN} target tokens), {MICRO_BATCHES} per step, "
             f"synthetic token ids. MFU against the datasheet dense bf16 peak "
             f"({first['datasheet_peak_tflops']:.0f} TFLOP/s, planner device {first['planner_device']}); "
             "kernel efficiency = model FLOPs over forward + backward time only (what the planner assumes).", "",
             "| shape | params | step s (median) | target tokens/s | model TFLOP/s | MFU | kernel eff. | "
             "peak GiB | planner GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['shape']} | {r['parameters'] / 1e6:.1f}M | {r['step_seconds_median']:.4f} | "
                     f"{r['target_tokens_per_s']:,.0f} | {r['model_tflops_per_s']:.1f} | {r['mfu']:.1%} | "
                     f"{r['kernel_efficiency']:.1%} | {r['peak_memory_bytes'] / 2**30:.2f} | "
                     f"{r['planner_peak_bytes'] / 2**30:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per shape (10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-gpu"),
                        help="folder for results.json and report.md (runs/bench-gpu)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--profile", metavar="SHAPE", help="profile two steps of SHAPE; tables to OUT/profile-SHAPE.txt")
    args = parser.parse_args(argv)
    from parallel.engine import exit_rank

    if args.profile:
        os.makedirs(args.out, exist_ok=True)
        profile(args.profile, os.path.join(args.out, f"profile-{args.profile}.txt"))
        exit_rank(0)
    if args.worker:
        result = measure(args.worker, args.steps, args.warmup)
        with open(os.path.join(args.out, f"{args.worker}.json"), "w") as f:
            json.dump(result, f, indent=1)
        exit_rank(0)
    from parallel import accelerator

    if not accelerator.gpu_available():
        print(f"error: the GPU benchmark needs a GPU: {accelerator.why_no_gpu()}", file=sys.stderr)
        return 2
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        print(f"error: --shapes: unknown {', '.join(unknown)}; choose from {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    results = []
    for shape in shapes:
        print(f"{shape}: measuring ({args.warmup} + {args.steps} steps)", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", shape, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--out", args.out]
        rc = subprocess.call(cmd, env=env, cwd=ROOT)
        if rc != 0:
            print(f"error: {shape} failed (exit {rc}); its output is above", file=sys.stderr)
            return rc
        with open(os.path.join(args.out, f"{shape}.json")) as f:
            results.append(json.load(f))
        r = results[-1]
        print(f"{shape}: {r['target_tokens_per_s']:,.0f} target tokens/s, {r['model_tflops_per_s']:.1f} TFLOP/s, "
              f"MFU {r['mfu']:.1%}, peak {r['peak_memory_bytes'] / 2**30:.2f} GiB", flush=True)
    command = "./run.sh bench train" + (" " + " ".join(argv) if argv else "")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = report(results, command)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

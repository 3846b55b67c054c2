"""`./run.sh bench train` on a GPU: the shapes the paper's models put on one device, in bf16, eager
and with compiled layers, at 2k, 4k and 8k target tokens per micro-batch.

    ./run.sh bench train [--shapes a,b] [--tokens 4096,8192,2048] [--variants compiled,eager]
                         [--steps 5] [--warmup 2] [--out DIR] [--trace]
    python -m bench.gpu --device cpu --shapes tiny ...        (a rehearsal on the CPU)

Each shape and variant trains in its own process (a DeepSpeed engine is never freed: bench/worker.py
says why) with the real engine of this trainer (parallel/parallelize.py `build_engine` at pp = 1:
FlatOptimizer with fp32 master weights, ZeRO-1, AdamW; the divergence guard's one read per step;
micro-batch shapes told to the engine as the trainer tells them), on synthetic token ids: 4
micro-batches per optimizer step of 128 + 128 tokens per sentence pair, as many pairs as the
micro-batch's target tokens allow, the sizes in the order given. Measured per micro-batch size,
after `--warmup` steps, over `--steps` steps timed with the device synchronised:

  target tokens/s, model TFLOP/s (model/flops.py, no recomputation), MFU against the datasheet
  dense bf16 peak (planner/devices.py), the kernel efficiency the planner uses (model FLOPs over
  the time of the forward and backward instructions alone); the GPU's busy fraction (the union of
  the kernels' intervals in one profiled step, over the median step: 1 − it is the host-bound
  fraction); kernel launches per layer and host syncs per step (bench/counting.py's rule, and on a
  GPU its sync debug mode, one step); the allocator's peak so far; the first step's seconds and the
  compile seconds and graphs per layer kind so far (parallel/compiled.py), with inductor's cache
  hits and misses.

Every size's measurement is appended, the moment it is made, as one JSON line to OUT/rows.jsonl
(`--jsonl` names another file: the GPU check's results.jsonl); OUT/results.json and OUT/report.md
are rewritten from the lines after every process (bench/gpu_results.py), so a process that fails
or is killed loses only what it had not measured, and the next shape still runs.

Shapes (the layers carry the DeepNorm α of the model they come from, whatever their number, so
that every d = 1024 shape compiles the same graph per kind and reuses the compile cache):
`layers-d1024` (12 layers of deepnet-100-100-1024, FFN 4096, 16 heads, a 8k vocabulary so that the
output layer does not mask the layers' efficiency), `last-stage-128k` (4 decoder layers of it with
the output layer and loss at the paper's 128k vocabulary: the last stage of a pipeline),
`6L-6L-d512` (32k vocabulary), `tiny` and `tiny-last` (CPU rehearsals of the first two).

`--trace`: one more step of the first size of each shape and variant, traced (trainer/timeline.py:
CUDA events, read after the step), as OUT/<shape>-<variant>.timeline.json (Perfetto) and .png.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import warnings

from bench.gpu_results import append_jsonl, read_jsonl, report, train_results, write_json
from runtime.accelerator import HOST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (encoder layers, decoder layers, d_model, heads, FFN, vocabulary, (N, M) whose α the layers carry)
SHAPES: dict[str, tuple[int, int, int, int, int, int, tuple[int, int]]] = {
    "layers-d1024": (6, 6, 1024, 16, 4096, 8192, (100, 100)),
    "last-stage-128k": (1, 4, 1024, 16, 4096, 128000, (100, 100)),
    "6L-6L-d512": (6, 6, 512, 8, 2048, 32000, (6, 6)),
    "tiny": (2, 2, 32, 4, 64, 512, (2, 2)),
    "tiny-last": (1, 2, 32, 4, 64, 4096, (2, 2)),
}
SRC_LEN = TGT_LEN = 128
MICRO_BATCHES = 4


def model_config(shape: str, length: int):
    from model.config import ModelConfig

    enc, dec, d, heads, ffn, vocab, _ = SHAPES[shape]
    return ModelConfig(encoder_layers=enc, decoder_layers=dec, d_model=d, heads=heads, ffn_dim=ffn, vocab_size=vocab,
                       norm="deepnorm", dropout=0.1, max_positions=length + 2)


def carry_alpha(module, cfg, depth: tuple[int, int]) -> dict[str, float]:
    """Give every residual of `module`'s encoder and decoder layers the α of `cfg`'s normalisation at
    `depth` (N, M) layers: a slice of a deep model computes with that model's α (one compiled graph
    per kind for every slice of it; α is a constant in the graph). Before the first forward."""
    from model.layers import DecoderLayer, EncoderLayer
    from model.norms import PostNormResidual, resolve

    encoder, decoder = resolve(cfg.norm, *depth)
    alphas = {EncoderLayer: encoder.alpha, DecoderLayer: decoder.alpha}
    for layer in module.modules():
        alpha = alphas.get(type(layer))
        for sub in layer.modules() if alpha is not None else ():
            if isinstance(sub, PostNormResidual):
                sub.alpha = alpha
    return {"encoder": encoder.alpha, "decoder": decoder.alpha}


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


def kernel_seconds(step) -> tuple[float, float]:
    """(seconds during which the device ran work, wall seconds) of one call of `step`, profiled:
    the union of the device events' intervals (kernels, copies, fills; overlaps across streams
    counted once). (nan, nan) on the host."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from runtime import accelerator

    if accelerator.on_host():
        return float("nan"), float("nan")
    accelerator.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        accelerator.synchronize()
    wall = time.perf_counter() - start
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    if not spans:  # no device event listed: the kernels' own times summed (streams overlapping counted twice)
        busy = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type == DeviceType.CUDA)
    return busy / 1e6, wall


def cache_counters() -> dict[str, int]:
    """Inductor's and AOTAutograd's compile-cache hits and misses in this process."""
    from torch._dynamo.utils import counters

    return {f"{group}_{key}": int(counters[group].get(key, 0)) for group, keys in
            (("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss")),
             ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss"))) for key in keys}


def measure(shape: str, variant: str, token_sizes: list[int], steps: int, warmup: int, precision: str,
            jsonl: str, stall_after: int = 0, trace_dir: str | None = None) -> None:
    """Train `shape` in this process (a world of one) at each micro-batch size; each size's
    measurement appended to `jsonl` as it is made. `stall_after` N > 0: after N sizes, hang,
    ignoring SIGTERM from the start (the GPU check's test of a part that must be killed: it is
    killed alike wherever its limit falls on a machine of any speed)."""
    import signal

    import torch

    from bench.counting import KernelCounter
    from bench.ops_syncs import debug_syncs
    from bench.worker import instrument, peak_memory, reset_peak_memory
    from model.flops import training_flops
    from parallel import compiled
    from parallel.layout import Layout
    from parallel.parallelize import build_engine
    from planner import devices
    from runtime import accelerator
    from runtime.distributed import setup_distributed
    from trainer.config import RunConfig
    from trainer.guard import DivergenceGuard

    if stall_after:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    started = time.perf_counter()
    setup_distributed()
    cfg = RunConfig(run_dir=os.path.join(ROOT, "runs", "bench-gpu", f"{shape}-{variant}"))
    cfg.model = model_config(shape, TGT_LEN)
    cfg.parallel.precision = precision
    cfg.train.micro_batches, cfg.train.warmup_steps, cfg.train.clip_norm = MICRO_BATCHES, 100, 1.0
    layout = Layout.build(cfg.parallel)
    baseline = reset_peak_memory()  # the allocator's on GPUs, the resident set on the host
    cfg.train.compile = variant == "compiled"  # build_engine compiles the layers as the trainer's (parallelize)
    engine, module = build_engine(layout, cfg.model, cfg.parallel, cfg.train, cfg.run_dir)
    alpha = carry_alpha(module, cfg.model, SHAPES[shape][6])
    guard = DivergenceGuard(engine, cfg.train, layout)
    engine.step_loss = lambda: guard.step_loss
    stops: list = []
    totals, _ = instrument(engine, stops)  # wall seconds by instruction (after a synchronize)
    key = devices.device_key(accelerator.gpu_name()) if not accelerator.on_host() else None
    peak = devices.DEVICES[key]["peak_tflops"][precision] * 1e12 if key else float("nan")
    layers = cfg.model.encoder_layers + cfg.model.decoder_layers
    generator = torch.Generator().manual_seed(0)
    try:
        from planner import planner

        largest = max(1, max(token_sizes) // TGT_LEN)
        candidate = planner.Candidate(pp=1, tp=1, dp=1, micro_batches=MICRO_BATCHES, sequences=largest,
                                      src_len=SRC_LEN, tgt_len=TGT_LEN, precision=precision)
        predicted = planner.stage_memory(cfg.model, candidate, 0, devices.device(key or "h100-80gb"))["peak"] \
            if precision != "fp32" else float("nan")
    except Exception as e:  # the planner's estimate is a comparison, never a reason to measure nothing
        predicted = f"not computed: {type(e).__name__}: {e}"
    meta = {"model": list(SHAPES[shape][:6]), "alpha_depth": list(SHAPES[shape][6]), "alpha": alpha,
            "precision": precision, "planner_peak_bytes": predicted, "micro_batches": MICRO_BATCHES,
            "parameters": sum(p.numel() for p in module.parameters()),
            "device": accelerator.gpu_name() if not accelerator.on_host() else HOST, "planner_device": key,
            "datasheet_peak_tflops": peak / 1e12, "versions": accelerator.versions(),
            "setup_seconds": round(time.perf_counter() - started, 2)}

    def step(batches):
        guard.step_loss = None
        engine.expect([(inputs[0].shape, inputs[1].shape) for inputs, _ in batches])
        return engine.train_batch(iter(batches))

    for done, tokens in enumerate(token_sizes):
        sequences = max(1, tokens // TGT_LEN)
        times = []
        reset_peak_memory()  # this size's high-water mark (the baseline stays the one before the engine)
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
        counter, counted = KernelCounter(), synthetic_batches(cfg.model.vocab_size, sequences, TGT_LEN, generator)
        with warnings.catch_warnings(record=True) as caught:  # on a GPU, its sync debug mode as well
            warnings.simplefilter("always")
            debug_mode = accelerator.warn_on_sync(True)
            try:
                with counter:
                    step(counted)
            finally:
                accelerator.warn_on_sync(False)
        profiled = synthetic_batches(cfg.model.vocab_size, sequences, TGT_LEN, generator)
        busy, profiled_wall = kernel_seconds(lambda: step(profiled))
        seconds = sorted(times[warmup:])[steps // 2]
        flops = sequences * MICRO_BATCHES * training_flops(cfg.model, SRC_LEN, TGT_LEN)
        row = {"target_tokens_per_micro_batch": sequences * TGT_LEN, "sequences": sequences,
               "step_seconds_median": seconds, "step_seconds": times[warmup:], "warmup_seconds": times[:warmup],
               "first_step_seconds": times[0], "target_tokens_per_s": sequences * TGT_LEN * MICRO_BATCHES / seconds,
               "model_tflops_per_s": flops / seconds / 1e12, "mfu": flops / seconds / peak,
               "kernel_efficiency": flops / fwd_bwd / peak if fwd_bwd else float("nan"),
               "gpu_busy_fraction": min(1.0, busy / seconds) if busy == busy else busy, "gpu_busy_fraction_profiled": busy / profiled_wall,
               "kernel_seconds_per_step": busy, "kernels_per_step": counter.kernels,
               "kernels_per_layer_per_micro_batch": counter.kernels / (layers * MICRO_BATCHES),
               "host_syncs_per_step": counter.syncs, "host_copies_per_step": counter.host_copies,
               "sync_debug_mode_per_step": debug_syncs(caught) if debug_mode else None,
               "instruction_seconds_per_step": {k: v / steps for k, v in sorted(totals.items())},
               "peak_memory_bytes": peak_memory() - baseline,
               "seconds_since_start": round(time.perf_counter() - started, 2)}
        meta["compile"] = {k: dict(v) for k, v in compiled.stats.items()}
        meta["compile_cache"] = cache_counters()
        append_jsonl(jsonl, {"part": "train", "shape": shape, "variant": variant, "meta": meta, "row": row})
        print(f"{shape} {variant} {sequences * TGT_LEN} tokens: {row['target_tokens_per_s']:,.0f} tok/s, "
              f"MFU {row['mfu']:.1%}, busy {row['gpu_busy_fraction']:.0%}, {counter.kernels} kernels/step, "
              f"{counter.syncs} syncs/step; {row['seconds_since_start']:.0f} s since start "
              f"({compiled.summary()})", flush=True)
        if trace_dir and done == 0:  # --trace: the instruction timer's syncs stay out of the traced step
            stops.pop()()
            trace_step(engine, layout, lambda: step(synthetic_batches(cfg.model.vocab_size, sequences, TGT_LEN, generator)),
                       os.path.join(trace_dir, f"{shape}-{variant}.timeline"), f"{shape} {variant}")
            totals, _ = instrument(engine, stops)
        if stall_after and done + 1 >= stall_after:
            print("stalling (ignoring SIGTERM), as asked", flush=True)
            while True:
                time.sleep(1)


def trace_step(engine, layout, run, stem: str, model: str) -> None:
    """`run()` (one step of `engine`) traced: STEM.json and STEM.png (trainer/timeline.py)."""
    from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES
    from trainer.timeline import Timeline

    meta = {"schedule_title": SCHEDULES[DEFAULT_SCHEDULE].title, "pp": 1, "dp": 1, "micro_batches": MICRO_BATCHES,
            "model": model}
    timeline = Timeline(engine, layout, [1], stem, meta, log=lambda line: print(line, flush=True))
    timeline.begin(1)
    run()
    timeline.end()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh bench train", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="layers-d1024,last-stage-128k,6L-6L-d512",
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--tokens", default="4096,8192,2048",
                        help="target tokens per micro-batch, comma-separated, measured in this order")
    parser.add_argument("--variants", default="compiled,eager", help="compiled, eager or both, in this order")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps per micro-batch size (5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (2; the compiled variant compiles in them)")
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", choices=("gpu", HOST), default="gpu",
                        help=f"{HOST}: a rehearsal on the host (fp32; with --shapes tiny)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-gpu"), help="output folder")
    parser.add_argument("--jsonl", help="the file each measurement is appended to (default OUT/rows.jsonl)")
    parser.add_argument("--trace", action="store_true", help="one traced step per shape and variant: "
                        "OUT/<shape>-<variant>.timeline.json (Perfetto) and .png")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--stall-after", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        tokens = [int(x) for x in args.tokens.split(",")]
    except ValueError:
        print(f"error: --tokens {args.tokens}: comma-separated integers, e.g. 2048,4096", file=sys.stderr)
        return 2
    if min(tokens) < 1 or args.steps < 1 or args.warmup < 0:
        print("error: --tokens and --steps must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    jsonl = args.jsonl or os.path.join(args.out, "rows.jsonl")
    if not args.worker and not args.jsonl and os.path.exists(jsonl):
        os.remove(jsonl)  # this run's rows only (results.json and report.md are made of them)
    if args.worker:
        from runtime.distributed import exit_rank

        shape, variant = args.worker.split(":")
        measure(shape, variant, tokens, args.steps, args.warmup, args.precision, jsonl, args.stall_after,
                args.out if args.trace else None)
        exit_rank(0)
    from runtime import accelerator

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
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONWARNINGS="ignore")
    if args.device == HOST:
        env["DS_ACCELERATOR"] = HOST
    precision = "fp32" if args.device == HOST else args.precision
    command = "./run.sh bench train" + (" " + " ".join(argv) if argv else "")
    failed = []
    for shape in shapes:
        for variant in variants:
            cmd = [sys.executable, "-m", "bench.gpu", "--worker", f"{shape}:{variant}", "--tokens", args.tokens,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--precision", precision,
                   "--out", args.out, "--jsonl", jsonl] + (["--trace"] if args.trace else [])
            rc = subprocess.call(cmd, env=env, cwd=ROOT)
            if rc != 0:
                failed.append(f"{shape} {variant} (exit {rc})")
                print(f"error: {shape} {variant} failed (exit {rc}); its output is above; going on", file=sys.stderr)
            results = train_results(read_jsonl(jsonl))
            write_json(os.path.join(args.out, "results.json"), results)
            text = report(results, command)
            with open(os.path.join(args.out, "report.md"), "w") as f:
                f.write(text)
    print(text)
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


# What ./run.sh bench reads from this source (launcher/commands/bench.py).
BENCH = dict(name="train", gpu=True, help="the paper's shapes in bf16 on a GPU", paths=("--out",), switches=("--trace",))


if __name__ == "__main__":
    sys.exit(main())

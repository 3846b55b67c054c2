"""Benchmark worker: one layout per launch.

    deepspeed --num_gpus N --module bench.worker --config RUN.yaml --layout L.json --out R.json
    python -m bench.worker ...          (world of one: no launcher needed)

The real `Trainer` is built and `train_step()` runs in two phases:

  memory   warm-up + measured steps; per rank the peak memory above the process baseline (VmHWM
           on CPU, the allocator peak on GPUs). On CPU the launcher sets a 128 KiB mmap threshold
           so that RSS follows the live tensors (bench/layouts.py); that costs every
           activation an mmap and its page faults (650k per 100L-100L d=64 step here, +80% CPU
           time), so no time of this phase is reported.
  speed    the allocator back to glibc's largest automatic threshold (as in training), one
           untimed step, then the measured steps: per step wall and CPU time, each pipeline
           instruction (forward, backward, send/recv, optimizer; the bubble is measured from
           them), and where the CPU time went (data, forward, backward, clipping, optimizer,
           engine bookkeeping). At pp = 1 in fp32 the plain `EncoderDecoder` (same seed, AdamW,
           clipping and LR schedule) is trained on the very same micro-batches right after each
           trainer step, in the same process: alternating A/B steps share the machine's load,
           and their CPU-time ratio is `trainer_over_plain`.

Per step the worker records the padded shape and real lengths of every micro-batch of the global
batch, so the launcher can count model and hardware FLOPs. Rank 0 writes everything to `--out`.

One layout per process because a DeepSpeed engine is never freed: ZeRO's gradient hooks sit on
autograd nodes (C++), which Python's garbage collector cannot see through, so a second layout in
the same process would start on top of the first one's parameters and optimizer state.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import dataclasses
import gc
import json
import os
import shutil
import time
from collections import defaultdict

import psutil
import torch

from bench.pipeline import PIPELINE_OPS
from bench.report import LAYOUT_KEYS
from runtime import accelerator
from trainer.config import RunConfig, load_config


def _on_cpu() -> bool:
    return accelerator.on_host()


def prime_process(cfg: RunConfig) -> None:
    """Pay the process's one-time costs before the baseline is taken, so that the baseline is
    'a process that can train this layout' and the peak above it is the model's own memory.

    One step of the same layout with a 1-layer, d = 4·heads model runs the same code: lazy
    imports (the first AdamW step imports torch._dynamo, +74 MB RSS; opening the first dataset
    +134 MB; model code paths imported ~600 modules, +43 MB), thread pools, kernel caches,
    process groups. What that tiny engine keeps (DeepSpeed never frees one) is a few hundred kB.
    """
    from trainer.trainer import Trainer

    tiny = copy.deepcopy(cfg)
    layers = max(1, cfg.parallel.pipeline_stages)
    width = 4 * cfg.model.heads
    tiny.model = dataclasses.replace(cfg.model, encoder_layers=layers, decoder_layers=layers, d_model=width,
                                     ffn_dim=2 * width)
    tiny.run_dir = cfg.run_dir + "-prime"
    tiny.train.max_steps = 1
    Trainer(tiny).train_step()
    torch.distributed.barrier()


def reset_peak_memory() -> int:
    """Restart the high-water mark and return the current usage (the baseline) in bytes."""
    gc.collect()
    if _on_cpu():
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS is what is live
        except OSError:
            pass
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS
        return psutil.Process().memory_info().rss
    return accelerator.reset_peak_memory()


def peak_memory() -> int:
    if _on_cpu():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("/proc/self/status has no VmHWM line")
    return accelerator.peak_memory()


def instrument(engine: object, stops: list | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Time every pipeline instruction the engine executes (`TrainerEngine.observe`): (wall
    seconds, CPU seconds) by name, and for the measured bubble's phase (bench/pipeline.py
    `step_bubbles`) the system clock (`time.time`) at the step's first instruction and at the end
    of its last forward, backward or weight pass: wall["clock_start"], wall["clock_end"]. `stops`
    gets the function that ends the timing."""
    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    synchronize = accelerator.synchronize

    @contextlib.contextmanager
    def timed(name, kwargs):
        synchronize()
        if not wall:  # the step's first instruction (the caller clears `wall` per step)
            wall["clock_start"] = time.time()
        start, start_cpu = time.perf_counter(), time.process_time()
        yield
        synchronize()
        wall[name] += time.perf_counter() - start
        cpu[name] += time.process_time() - start_cpu
        if name in PIPELINE_OPS:
            wall["clock_end"] = time.time()

    stop = engine.observe(timed)
    if stops is not None:
        stops.append(stop)
    return wall, cpu


def _time_calls(obj: object, name: str, totals: dict[str, float], part: str) -> None:
    """Add the CPU seconds of every call of `obj.name` (if it has one) to totals[part]."""
    fn = getattr(obj, name, None)
    if fn is None:
        return

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[part] += time.process_time() - start
    setattr(obj, name, timed)


def time_trainer_parts(trainer: object) -> dict[str, float]:
    """CPU seconds of the trainer's data, gradient clipping and optimizer update, by part.

    Clipping is DeepSpeed's global norm and scaling: ZeRO's `scaled_global_norm` and
    `unscale_and_clip_grads`, or the engine's `clip_fp32_gradients` without ZeRO; the optimizer
    is the torch optimizer's own `step` (on ZeRO's flat fp32 partition).
    """
    totals: dict[str, float] = defaultdict(float)
    engine = trainer.engine
    _time_calls(trainer.stream, "next_step", totals, "data")
    for name in ("scaled_global_norm", "unscale_and_clip_grads"):
        _time_calls(engine.optimizer, name, totals, "clipping")
    _time_calls(engine, "clip_fp32_gradients", totals, "clipping")
    _time_calls(getattr(engine.optimizer, "optimizer", engine.optimizer), "step", totals, "optimizer")
    return totals


def breakdown(step_cpu: float, parts: dict[str, float], cpu: dict[str, float]) -> dict[str, float]:
    """One trainer step's CPU seconds: data, forward (with the loss), backward, clipping,
    optimizer, and engine bookkeeping (the rest: gradient reduction into ZeRO's buffers and the
    copies back, schedule, send/recv, logging)."""
    out = {"data": parts.get("data", 0.0), "forward": cpu.get("ForwardPass", 0.0),
           "backward": cpu.get("BackwardPass", 0.0), "clipping": parts.get("clipping", 0.0),
           "optimizer": parts.get("optimizer", 0.0)}
    out["bookkeeping"] = step_cpu - sum(out.values())
    return out


class PlainTwin:
    """The plain `EncoderDecoder` trained with the trainer's recipe (same seed and model config,
    AdamW, global-norm clipping, inverse-sqrt schedule): the reference of `trainer_over_plain`."""

    def __init__(self, cfg: RunConfig):
        from model.transformer import EncoderDecoder
        from parallel.engine_config import adamw, inverse_sqrt

        t = cfg.train
        self.cfg = cfg
        self.model = EncoderDecoder(cfg.model, seed=t.seed).train()
        # The trainer's own AdamW (fused where torch has the kernel): the ratio then compares the
        # machinery around the model, not two optimizer implementations.
        self.optimizer = adamw(self.model.parameters(), t)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, inverse_sqrt(t.warmup_steps))

    def step(self, batches: list[dict], total_tokens: int) -> dict[str, float]:
        """One step on `batches` (this rank's micro-batches of a global batch of `total_tokens`
        target tokens); CPU seconds by part."""
        from model.step import plain_step

        clip = self.cfg.train.clip_norm
        done = plain_step(self.model, batches, self.optimizer, tokens=total_tokens, scheduler=self.schedule,
                          clip_norm=clip if clip > 0 else None, clock=time.process_time)
        return {**dict.fromkeys(("data", "forward", "backward", "clipping", "optimizer", "bookkeeping"), 0.0),
                **done.seconds}


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # where glibc's automatic threshold stops rising (64-bit)


def training_allocator() -> None:
    """Undo the memory phase's 128 KiB mmap threshold: glibc's automatic threshold rises to 32 MiB
    as large blocks are freed (and its trim threshold to twice that), so in training activations
    come from the heap; set that state directly."""
    if not _on_cpu():
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_THRESHOLD_MAX)
    except (OSError, AttributeError):
        pass


def record_batches(trainer: object) -> list[list[dict]]:
    """Per step, the global batch's micro-batches: padded shape and real (non-pad) lengths."""
    steps: list[list[dict]] = []
    original = trainer.stream.next_step
    pad = trainer.cfg.model.pad_id

    def next_step(n):
        batches = original(n)
        steps.append([{"shape": [*b["src"].shape, b["tgt_in"].size(1)],
                       "src_lens": (b["src"] != pad).sum(1).tolist(),
                       "tgt_lens": (b["tgt_out"] != pad).sum(1).tolist()} for b in batches])
        return batches

    trainer.stream.next_step = next_step
    return steps


def layout_config(base_config: str, layout: dict, run_dir: str, model_overrides: dict) -> RunConfig:
    overrides: dict = {"run_dir": run_dir, "model": dict(model_overrides),
                       "train": {"max_steps": layout["warmup"] + layout["steps"]}}
    for key, (section, name) in LAYOUT_KEYS.items():
        if key in layout:
            overrides.setdefault(section, {})[name] = layout[key]
    return load_config(base_config, overrides)


def profile_step(trainer: object, path: str) -> dict:
    """One more step under torch.profiler; writes the top operators and returns time shares."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    with open(path, "w") as f:
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    groups = {"matmul": ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear"),
              # torch's SDPA (every backend and its backward), model/csrc/attention.cpp's forward and backward
              "attention": ("aten::_scaled_dot_product", "deepnet::short_attention")}
    shares = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / total
              for name, prefixes in groups.items()}
    shares["other"] = 1.0 - sum(shares.values())
    shares["top"] = [(e.key, e.self_cpu_time_total / total) for e in
                     sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]]
    return shares


def run_layout(base_config: str, layout: dict, work_dir: str, data_dir: str, model_overrides: dict,
               profile_dir: str | None, trace_dir: str | None = None) -> dict | None:
    from trainer.trainer import Trainer

    rank = torch.distributed.get_rank()
    run_dir = os.path.join(work_dir, layout["name"])
    if rank == 0:
        for path in (run_dir, run_dir + "-prime"):
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
            os.symlink(os.path.abspath(data_dir), os.path.join(path, "data"))
    torch.distributed.barrier()
    cfg = layout_config(base_config, layout, run_dir, model_overrides)
    prime_process(cfg)
    baseline = reset_peak_memory()
    trainer = Trainer(cfg)
    memory_batches = record_batches(trainer)
    for _ in range(layout["warmup"] + layout["steps"]):
        trainer.train_step()
    peak = peak_memory()
    memory_batches = list(memory_batches)
    live = live_tensor_memory(trainer)  # one more step, after the high-water mark was read

    # Speed phase (see the module doc): the trainer, then the plain model on the same batches.
    training_allocator()
    stops: list = []
    wall, cpu = instrument(trainer.engine, stops)
    parts = time_trainer_parts(trainer)
    unrecorded = trainer.stream.next_step  # put back after the speed phase: its batches only
    batches = record_batches(trainer)
    global_batches: list[list[dict]] = []
    next_step = trainer.stream.next_step
    trainer.stream.next_step = lambda n: global_batches.append(next_step(n)) or global_batches[-1]
    m, dp_rank = cfg.train.micro_batches, trainer.layout.replica
    twin = PlainTwin(trainer.cfg) if comparable(layout) else None
    steps, plain = [], []
    for i in range(1 + layout["steps"]):  # one untimed pair first
        wall.clear(), cpu.clear(), parts.clear()
        start = time.process_time()
        out = trainer.train_step()
        step_cpu = time.process_time() - start  # this rank's CPU time, all threads
        if i:
            steps.append({"seconds": out["seconds"], "tokens": out["tokens"], "loss": out["loss"],
                          "instructions": {**wall, "train_batch": out["seconds"], "cpu_seconds": step_cpu},
                          "instructions_cpu": dict(cpu),
                          "breakdown": breakdown(step_cpu, parts, cpu)})
        if twin is not None:
            step = global_batches[-1]
            total = sum(int(b["ntokens"]) for b in step)
            twin_parts = twin.step(step[dp_rank * m:(dp_rank + 1) * m], total)
            if i:
                plain.append(twin_parts)
    trainer.stream.next_step = unrecorded  # the steps after (profiled, traced) are not the measured ones
    del batches[0]  # the untimed step's
    mine = {"rank": rank, "stage": trainer.layout.stage, "dp_rank": trainer.layout.replica,
            "baseline_bytes": baseline, "peak_bytes": peak, "live_memory": live, "params": sum(p.numel() for p in trainer.module.parameters()),
            "instructions": [s.pop("instructions") for s in steps],
            "instructions_cpu": [s.pop("instructions_cpu") for s in steps],
            "breakdown": [s.pop("breakdown") for s in steps], "plain": plain or None,
            "orders": getattr(trainer.engine, "orders", None), "share": getattr(trainer.engine, "deferred_share", None)}
    if profile_dir and torch.distributed.get_world_size() == 1:
        mine["profile"] = profile_step(trainer, os.path.join(profile_dir, f"{layout['name']}.profile.txt"))
    if trace_dir:  # bench/timeline.py: untimed by the speed phase's instruments
        from bench.timeline import trace_phase

        stops.pop()()
        trace = trace_phase(trainer, layout["steps"], os.path.join(trace_dir, f"{layout['name']}.timeline"))
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    partition = [int(x) for x in trainer.module.parts]
    if rank != 0:
        return None
    return {"layout": layout, "steps": steps, "batches": batches, "memory_batches": memory_batches,
            "ranks": ranks, "partition": partition, "vocab_size": cfg.model.vocab_size,
            "timeline": trace if trace_dir else None}


def live_tensor_memory(trainer: object) -> dict:
    """One more step with torch.profiler's allocation tracking: the bytes of live tensors over the
    step (the accelerator's allocations, CPU ones on the host), measured from the step's start.

    Unlike the RSS high-water mark this sees neither heap fragmentation nor memory the allocator
    keeps, so it tells what the schedule itself holds: `peak`, and the level at the end of every
    pipeline instruction (`after`: [instruction, buffer, bytes]), e.g. what one micro-batch's
    forward adds and what its backward leaves for a deferred weight pass. ZeRO's gradient bucket
    (`reduce_bucket_size` elements: 2 GB allocated at the first backward, of which only the
    gradients' bytes are ever written) is left out: same for every schedule, and mostly never
    touched (RSS does not count it either).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = trainer.engine

    def labelled(name, kwargs):
        return record_function(f"instruction:{name}:{kwargs.get('buffer_id', '')}")

    stop = engine.observe(labelled)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.train_step()
    finally:
        stop()
    events = prof.profiler.kineto_results.events()
    host = _on_cpu()
    bucket = int(getattr(engine.optimizer, "reduce_bucket_size", 0))
    skip = {bucket * size for size in (1, 2, 4, 8)} if bucket else set()
    allocs = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and (str(e.device_type()).endswith("CPU") == host)
                    and abs(e.nbytes()) not in skip)
    marks = sorted((e.end_ns(), e.name().split(":", 2)[1:]) for e in events if e.name().startswith("instruction:"))
    level = peak = 0
    after, i = [], 0
    for end, (name, buffer) in marks:
        while i < len(allocs) and allocs[i][0] <= end:
            level += allocs[i][1]
            peak = max(peak, level)
            i += 1
        after.append([name, buffer, level])
    for _, nbytes in allocs[i:]:
        level += nbytes
        peak = max(peak, level)
    return {"peak": peak, "after": after}


def comparable(layout: dict) -> bool:
    """Layouts whose one rank runs the whole model (pp = tp = 1) in fp32: the plain model is
    timed next to them."""
    return layout.get("pp", 1) == 1 and layout.get("tp", 1) == 1 and layout["precision"] == "fp32"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="base YAML run config (model, data, train)")
    parser.add_argument("--layout", required=True, help="JSON file: {'model': overrides, 'layout': {...}}")
    parser.add_argument("--work-dir", required=True, help="where each layout's run directory goes")
    parser.add_argument("--data-dir", required=True, help="prepared data (linked into every run dir)")
    parser.add_argument("--out", required=True, help="JSON results, written by rank 0")
    parser.add_argument("--profile-dir", help="profile one extra step of single-process layouts here")
    parser.add_argument("--trace-dir", help="trace interleaved steps (bench/timeline.py); the timelines go here")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args()

    from runtime.distributed import exit_rank, setup_distributed

    setup_distributed()
    with open(args.layout) as f:
        spec = json.load(f)
    result = run_layout(args.config, spec["layout"], args.work_dir, args.data_dir, spec.get("model", {}),
                        args.profile_dir, args.trace_dir)
    if result is not None:
        with open(args.out, "w") as f:
            json.dump(result, f)
    exit_rank()


if __name__ == "__main__":
    main()

"""Benchmark worker: one layout per launch.

    deepspeed --num_gpus N launcher/bench_worker.py --config RUN.yaml --layout L.json --out R.json
    python launcher/bench_worker.py ...          (world of one: no launcher needed)

The real `Trainer` is built and `train_step()` is timed for warm-up + measured steps. Around it
the worker records, per rank: peak memory above the process baseline (VmHWM on CPU, the
allocator peak on GPUs) and how long each pipeline instruction took (forward, backward,
send/recv, optimizer), from which the pipeline bubble is measured. Per step it records the
padded shape and real lengths of every micro-batch of the global batch, so the launcher can
count model and hardware FLOPs. Rank 0 writes everything to `--out` (JSON).

One layout per process because a DeepSpeed engine is never freed: ZeRO's gradient hooks sit on
autograd nodes (C++), which Python's garbage collector cannot see through, so a second layout in
the same process would start on top of the first one's parameters and optimizer state.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import gc
import json
import os
import shutil
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil
import torch

from launcher.config import RunConfig, load_config
from parallel import accelerator

# Layout keys → (config section, key).
LAYOUT_KEYS = {"pp": ("parallel", "pipeline_stages"), "tp": ("parallel", "tensor_parallel"),
               "dp": ("parallel", "data_parallel"), "ac": ("parallel", "activation_checkpoint_interval"),
               "precision": ("parallel", "precision"), "zero": ("parallel", "zero_stage"),
               "max_tokens": ("data", "max_tokens"), "micro_batches": ("train", "micro_batches"),
               "schedule": ("parallel", "schedule")}


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
    from launcher.train import Trainer

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


def instrument(engine: object) -> dict[str, float]:
    """Time every pipeline instruction the engine executes (seconds, accumulated by name).

    The engine looks its handlers up in `self._INSTRUCTION_MAP`; an instance attribute with
    timed wrappers shadows the class table without changing what runs.
    """
    totals: dict[str, float] = defaultdict(float)
    synchronize = accelerator.synchronize

    def timed(name, handler):
        def run(self, *args, **kwargs):
            synchronize()
            start = time.perf_counter()
            result = handler(self, *args, **kwargs)
            synchronize()
            totals[name] += time.perf_counter() - start
            return result
        return run

    engine._INSTRUCTION_MAP = {cls: timed(cls.__name__, fn) for cls, fn in type(engine)._INSTRUCTION_MAP.items()}
    return totals


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
        if key in layout and not (key == "tp" and layout[key] == 1):
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
              "attention": ("aten::_scaled_dot_product", "aten::_scaled_dot_product_flash_attention_for_cpu",
                            "aten::_scaled_dot_product_flash_attention_for_cpu_backward")}
    shares = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / total
              for name, prefixes in groups.items()}
    shares["other"] = 1.0 - sum(shares.values())
    shares["top"] = [(e.key, e.self_cpu_time_total / total) for e in
                     sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]]
    return shares


def run_layout(base_config: str, layout: dict, work_dir: str, data_dir: str, model_overrides: dict,
               profile_dir: str | None) -> dict | None:
    from launcher.train import Trainer

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
    timers = instrument(trainer.engine)
    batches = record_batches(trainer)
    steps = []
    for _ in range(layout["warmup"] + layout["steps"]):
        timers.clear()
        cpu = time.process_time()
        out = trainer.train_step()
        cpu = time.process_time() - cpu  # this rank's CPU time, all threads: robust to other load
        steps.append({"seconds": out["seconds"], "tokens": out["tokens"], "loss": out["loss"],
                      "instructions": {**timers, "train_batch": out["seconds"], "cpu_seconds": cpu}})
    peak = peak_memory()
    mine = {"rank": rank, "stage": trainer.engine.stage_id, "dp_rank": trainer.dp_rank,
            "baseline_bytes": baseline, "peak_bytes": peak, "params": sum(p.numel() for p in trainer.module.parameters()),
            "instructions": [s.pop("instructions") for s in steps]}
    if profile_dir and torch.distributed.get_world_size() == 1:
        mine["profile"] = profile_step(trainer, os.path.join(profile_dir, f"{layout['name']}.profile.txt"))
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    partition = [int(x) for x in trainer.module.parts]
    if rank != 0:
        return None
    return {"layout": layout, "steps": steps, "batches": batches, "ranks": ranks, "partition": partition,
            "vocab_size": cfg.model.vocab_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="base YAML run config (model, data, train)")
    parser.add_argument("--layout", required=True, help="JSON file: {'model': overrides, 'layout': {...}}")
    parser.add_argument("--work-dir", required=True, help="where each layout's run directory goes")
    parser.add_argument("--data-dir", required=True, help="prepared data (linked into every run dir)")
    parser.add_argument("--out", required=True, help="JSON results, written by rank 0")
    parser.add_argument("--profile-dir", help="profile one extra step of single-process layouts here")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args()

    from parallel.engine import setup_distributed

    setup_distributed()
    with open(args.layout) as f:
        spec = json.load(f)
    result = run_layout(args.config, spec["layout"], args.work_dir, args.data_dir, spec.get("model", {}),
                        args.profile_dir)
    if result is not None:
        with open(args.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()

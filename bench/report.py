"""Turns benchmark worker results into the numbers of a table row, and writes CSV/Markdown/JSON.

Definitions (docs/benchmarks.md repeats them):
  target tokens/s   non-padding target tokens of the measured steps / their summed step time
  model TFLOP/s     model/flops.py on the real lengths of every pair / step time
  MFU, HFU          model FLOP/s (resp. hardware FLOP/s: padded shapes + recomputation) / peak
                    of all devices used (GPU: datasheet × GPUs; CPU: matmul probe of the cores
                    the ranks use, ranks × OMP threads)
  bubble measured   per rank: 1 − (forward + backward (+ ZB-H1's weight-gradient) time) / (the
                    pipeline phase: from the step's first instruction to the end of the last
                    forward, backward or weight pass on any rank), averaged over ranks and
                    measured steps; theory (p−1)/(m+p−1), ZB-H1 (p−1)/(3m+p−1). A stage that
                    finishes early waits for the others inside the next collective (DeepSpeed's
                    tied-gradient all-reduce or the optimizer's norm); that wait is bubble too
  MFU by CPU time   CPU only: model FLOPs / (CPU seconds of all ranks × one-core peak); other
                    processes on a shared machine stretch wall time more than CPU time (threads
                    that spin-wait do count, so this is a lower bound on kernel efficiency)
  trainer / plain   pp = 1, fp32: CPU seconds of the trainer's steps / those of the plain model
                    trained on the same micro-batches in the same process, A/B steps alternating
  CPU breakdown     per step and rank, the trainer's CPU seconds in data, forward (with the
                    loss), backward, clipping, optimizer and engine bookkeeping (the rest), next
                    to the plain model's forward, backward, clipping and optimizer
Times and memory come from separate phases of the worker (bench/worker.py): the memory
phase's allocator settings cost deep-narrow models up to 80% more CPU time.
  memory            per stage, the largest peak above the process baseline among its replicas
"""
from __future__ import annotations

import csv
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

from bench.pipeline import MB, bubble_theory, measured_bubble, schedule_stats, schedule_table
from bench.timeline import timeline_table
from model.config import ModelConfig
from model.flops import batch_flops, training_flops, utilization
from parallel.config import ParallelConfig
from parallel.schedules import DEFAULT_SCHEDULE
from planner.planner import Candidate
from runtime import accelerator
from runtime.accelerator import HOST
from schema.text import count

# Layout keys of a benchmark grid → (config section, key).
LAYOUT_KEYS = {"pp": ("parallel", "pipeline_stages"), "tp": ("parallel", "tensor_parallel"),
               "dp": ("parallel", "data_parallel"), "ac": ("parallel", "activation_checkpoint_interval"),
               "precision": ("parallel", "precision"), "max_tokens": ("data", "max_tokens"),
               "micro_batches": ("train", "micro_batches"), "schedule": ("parallel", "schedule"),
               "partition": ("parallel", "partition_method"), "zb_max_pending_w": ("parallel", "zb_max_pending_w"),
               "zero": ("parallel", "zero_stage")}


def matmul_peak(dtype, threads: int, seconds: float = 0.4, trials: int = 5) -> float:
    """Best FLOP/s of 2048² matmuls with `threads` threads: the CPU's practical peak.

    One thread is timed by its CPU time, so another process taking the core does not lower
    the peak (wall time would: the same probe read 0.040 and 0.067 TFLOP/s minutes apart here).
    """
    import torch

    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm the kernels and thread pool
    best = 0.0
    for _ in range(trials):
        count, start = 0, clock()
        while clock() - start < seconds:
            a @ b
            count += 1
        best = max(best, 2 * n**3 * count / (clock() - start))
    torch.set_num_threads(os.cpu_count() or 1)
    return best


@dataclass
class Environment:
    device_kind: str
    device_name: str
    cores: int
    memory_bytes: int
    peaks: dict = field(default_factory=dict)
    """FLOP/s per precision: all cores on CPU, one device on GPUs (None when unknown)."""
    core_peaks: dict = field(default_factory=dict)
    """CPU: FLOP/s of one thread per precision, for layouts that use fewer cores than the machine."""
    load_average: tuple = ()

    @classmethod
    def probe(cls, precisions: set[str]) -> Environment:
        import psutil

        cores = os.cpu_count() or 1
        if accelerator.gpu_available():
            from planner.devices import DEVICES

            name = accelerator.gpu_name()
            table = next((v for k, v in DEVICES.items() if k.split("-")[0].upper() in name.upper()), None)
            peaks = {p: (table["peak_tflops"].get(p, 0) * 1e12 if table else None) for p in precisions}
            return cls("gpu", name, cores, accelerator.gpu_memory_bytes(), peaks, {}, os.getloadavg())
        from parallel.precision import PRECISIONS

        dtypes = {name: p.dtype for name, p in PRECISIONS.items()}
        load = os.getloadavg()
        core_peaks = {p: matmul_peak(dtypes[p], 1) for p in sorted(precisions)}
        # On a shared machine the all-core probe loses whatever another process takes from one
        # core (seen here: 2 cores 74 GFLOP/s, 1 core 88), so the peak is the better of the
        # all-core probe and cores × the one-thread probe.
        peaks = {p: max(matmul_peak(dtypes[p], cores), cores * core_peaks[p]) for p in sorted(precisions)}
        return cls(HOST, _cpu_name(), cores, psutil.virtual_memory().total, peaks, core_peaks, load)

    def peak_total(self, precision: str, world: int, threads_per_rank: int = 1) -> float | None:
        """Peak of what a layout runs on: `world` GPUs, or on CPU the cores its ranks use
        (all cores: the all-core probe; fewer: the one-thread probe times the cores used)."""
        peak = self.peaks.get(precision)
        if peak is None:
            return None
        if self.device_kind != HOST:
            return peak * world
        used = world * threads_per_rank
        return peak if used >= self.cores else min(peak, self.core_peaks[precision] * used)

    def describe(self) -> str:
        peaks = ", ".join(f"{p} {v / 1e12:.3f} TFLOP/s" if v else f"{p} unknown" for p, v in self.peaks.items())
        what = "datasheet, per device"
        if self.device_kind == HOST:
            one = ", ".join(f"{v / 1e12:.3f}" for v in self.core_peaks.values())
            what = f"2048² matmul probe: max(all cores, cores × one thread); one thread {one}"
        load = " ".join(f"{x:.1f}" for x in self.load_average)
        return (f"{self.device_name} ({count(self.cores, 'core')}, {self.memory_bytes / 2**30:.0f} GiB); "
                f"peak {peaks} ({what}); load average before: {load}")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def largest_microbatch(result: dict) -> tuple[int, int, int]:
    """(sequences, src_len, tgt_len) of the micro-batch with the most padded tokens among the steps
    the memory peak covers: every step of the memory phase after the first (which runs before the
    optimizer state exists) — warm-up included, since the high-water mark is."""
    memory = result["memory_batches"]
    shapes = [tuple(b["shape"]) for step in memory[1:] or memory for b in step]
    return max(shapes, key=lambda s: s[0] * (s[1] + s[2]))


def predicted_memory(model: ModelConfig, layout: dict, shape: tuple[int, int, int], env: Environment) -> list[float] | None:
    """The planner's peak bytes per stage for this layout and micro-batch (CPU fp32 only)."""
    from planner.devices import cpu_device
    from planner.planner import stage_memory

    if env.device_kind != HOST or layout["precision"] != "fp32":
        return None  # the planner's CPU model is fp32 (bf16 on CPU is not a training target)
    if layout.get("partition", "cost") != "cost":
        return None  # the planner partitions by the cost model (parallel/pipeline.py layer_costs)
    dev = cpu_device(env.peaks["fp32"], env.memory_bytes)
    plan_layout = planner_layout(layout, shape)
    return [stage_memory(model, plan_layout, s, dev)["peak"] for s in range(layout["pp"])]


def planner_layout(layout: dict, shape: tuple[int, int, int]) -> Candidate:
    """The planner's Candidate for a benchmark layout whose largest micro-batch had `shape`."""
    return Candidate(pp=layout["pp"], tp=layout.get("tp", 1), dp=layout["dp"], micro_batches=layout["micro_batches"],
                     sequences=shape[0], src_len=shape[1], tgt_len=shape[2], checkpoint=layout["ac"],
                     precision=layout["precision"], schedule=layout.get("schedule", DEFAULT_SCHEDULE),
                     zb_max_pending=ParallelConfig.pending_bound(layout.get("zb_max_pending_w", 0)),
                     zero=layout.get("zero", 1))


CPU_ASSUMED_MFU = 0.5
"""Kernel efficiency the planner assumes for its CPU step-time estimate; the estimate is meant for
ranking layouts (tests/test_planner.py), the absolute value depends on this guess."""


def predicted_step(model: ModelConfig, layout: dict, shape: tuple[int, int, int], env: Environment,
                   threads_per_rank: int) -> float | None:
    from planner.devices import cpu_device
    from planner.planner import step_time

    if env.device_kind != HOST or layout["precision"] != "fp32":
        return None
    dev = cpu_device(env.peak_total("fp32", 1, threads_per_rank), env.memory_bytes)
    return step_time(model, planner_layout(layout, shape), dev, CPU_ASSUMED_MFU)["total"]


def summarize(result: dict, env: Environment, model: ModelConfig, threads_per_rank: int = 1) -> dict:
    layout = result["layout"]
    model = ModelConfig(**{**asdict(model), "vocab_size": result["vocab_size"]})
    steps = result["steps"]
    seconds = [s["seconds"] for s in steps]
    total_time = sum(seconds)
    tokens = sum(s["tokens"] for s in steps)
    ac = layout["ac"] > 0
    model_flops = hw_flops = padded = real = 0.0
    for step in result["batches"]:
        for b in step:
            model_flops += batch_flops(model, zip(b["src_lens"], b["tgt_lens"]))
            n, s, t = b["shape"]
            hw_flops += n * training_flops(model, s, t, recompute=ac)
            padded += n * (s + t)
            real += sum(b["src_lens"]) + sum(b["tgt_lens"])
    world = len(result["ranks"])
    peak = env.peak_total(layout["precision"], world, threads_per_rank)
    # CPU seconds of all ranks: other processes on a shared machine stretch wall time, not this.
    cpu_seconds = sum(inst.get("cpu_seconds", 0.0) for r in result["ranks"] for inst in r["instructions"])
    core_peak = env.core_peaks.get(layout["precision"]) if env.device_kind == HOST else None
    pp = layout["pp"]
    m = layout["micro_batches"]
    stage_peaks = [max(r["peak_bytes"] - r["baseline_bytes"] for r in result["ranks"] if r["stage"] == s)
                   for s in range(pp)]
    shape = largest_microbatch(result)
    predicted = predicted_memory(model, layout, shape, env)
    row = {
        "layout": layout["name"], "pp": pp, "tp": layout.get("tp", 1), "dp": layout["dp"],
        "max_tokens": layout["max_tokens"], "micro_batches": m, "ac": layout["ac"], "precision": layout["precision"],
        "ranks": world, "threads_per_rank": threads_per_rank, "steps": len(steps), "target_tokens_per_s": tokens / total_time,
        "step_s_median": statistics.median(seconds), "step_s_min": min(seconds), "step_s_max": max(seconds),
        "model_tflops": model_flops / total_time / 1e12,
        "mfu": utilization(model_flops, total_time, peak) if peak else None,
        "hfu": utilization(hw_flops, total_time, peak) if peak else None,
        "mfu_cpu_time": model_flops / cpu_seconds / core_peak if core_peak and cpu_seconds else None,
        "bubble_measured": measured_bubble(result), "bubble_theory": bubble_theory(layout),
        "stage_peak_mb": [p / MB for p in stage_peaks],
        "stage_predicted_mb": [p / MB for p in predicted] if predicted else None,
        "planner_step_s": predicted_step(model, layout, shape, env, threads_per_rank),
        "largest_microbatch": list(shape), "padding": 1 - real / padded if padded else 0.0,
        "params": [r["params"] for r in result["ranks"]], "last_loss": steps[-1]["loss"],
    }
    row.update(compare_with_plain(result))
    row.update(schedule_stats(result))
    if result.get("timeline"):
        row["timeline"] = result["timeline"]
    if "profile" in result["ranks"][0]:
        row["profile"] = result["ranks"][0]["profile"]
    mfu = f"MFU {row['mfu']:.1%}" if row["mfu"] is not None else "MFU n/a"
    ratio = f" | trainer/plain {row['trainer_over_plain']:.3f}" if row["trainer_over_plain"] else ""
    row["summary"] = (f"{row['target_tokens_per_s']:.0f} tgt tok/s | step {row['step_s_median']:.2f} s | "
                      f"{row['model_tflops']:.3f} TFLOP/s | {mfu} | bubble {row['bubble_measured']:.2f} "
                      f"(theory {row['bubble_theory']:.2f}) | peak MB/stage "
                      + "/".join(f"{x:.0f}" for x in row["stage_peak_mb"]) + ratio)
    if row.get("timeline"):
        t = row["timeline"]
        row["summary"] += (f" | traced bubble {t['report']['trace']['bubble']:.3f}, simulated "
                           f"{t['report']['simulator']['bubble']:.3f}; tracing {t['overhead']['wall']:+.1%} wall")
    return row


PARTS = ("data", "forward", "backward", "clipping", "optimizer", "bookkeeping")


def compare_with_plain(result: dict) -> dict:
    """trainer_over_plain and the per-step CPU breakdowns (seconds per step, mean over ranks)."""
    ranks = result["ranks"]
    per_rank = [r["breakdown"] for r in ranks]
    trainer = {k: statistics.fmean(step[k] for steps in per_rank for step in steps) for k in PARTS}
    trainer["total"] = sum(trainer[k] for k in PARTS)
    out = {"trainer_over_plain": None, "cpu_breakdown": {"trainer": trainer, "plain": None},
           "trainer_cpu_s": trainer["total"], "plain_cpu_s": None}
    if all(r.get("plain") for r in ranks):
        plain = {k: statistics.fmean(step[k] for r in ranks for step in r["plain"]) for k in PARTS}
        plain["total"] = sum(plain[k] for k in PARTS)
        trainer_total = sum(sum(step.values()) for steps in per_rank for step in steps)
        plain_total = sum(sum(step.values()) for r in ranks for step in r["plain"])
        out.update(trainer_over_plain=trainer_total / plain_total, plain_cpu_s=plain["total"])
        out["cpu_breakdown"]["plain"] = plain
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(rows: list[dict], env: Environment, spec: dict) -> str:
    setup = (f"Config `{spec['config']}`, model overrides {spec['model'] or 'none'}; {spec['warmup']} warm-up + "
             f"{count(spec['steps'], 'measured step')} per layout (times: the worker's speed phase). Planner step time assumes kernels at "
             f"{CPU_ASSUMED_MFU:.0%} of each rank's share of the peak (for ranking layouts).")
    header = ("| layout | ranks × threads | target tok/s | step s (median, min–max) | planner step s | model TFLOP/s "
              "| MFU | MFU by CPU time | HFU | trainer / plain (CPU) | bubble measured / theory | peak MB per stage, measured (planner) "
              "| padding | load |")
    lines = [f"Device: {env.describe()}.", "", setup, "", header, "|---" * 14 + "|"]
    for r in rows:
        predicted = r["stage_predicted_mb"] or [None] * len(r["stage_peak_mb"])
        memory = " / ".join(f"{m:.0f}" + (f" ({p:.0f})" if p is not None else "")
                            for m, p in zip(r["stage_peak_mb"], predicted))
        planned = "n/a" if r["planner_step_s"] is None else f"{r['planner_step_s']:.2f}"
        lines.append(f"| {r['layout']} | {r['ranks']} × {r['threads_per_rank']} | {r['target_tokens_per_s']:.0f} | {r['step_s_median']:.2f} "
                     f"({r['step_s_min']:.2f}–{r['step_s_max']:.2f}) | {planned} | {r['model_tflops']:.4f} | {_pct(r['mfu'])} "
                     f"| {_pct(r.get('mfu_cpu_time'))} "
                     f"| {_pct(r['hfu'])} | {_ratio(r.get('trainer_over_plain'))} | {r['bubble_measured']:.2f} / {r['bubble_theory']:.2f} | {memory} "
                     f"| {_pct(r['padding'])} | {r.get('load_after', float('nan')):.1f} |")
    lines += breakdown_table(rows)
    lines += schedule_table(rows)
    lines += timeline_table(rows)
    profiled = [r for r in rows if "profile" in r]
    for r in profiled:
        p = r["profile"]
        lines += ["", f"Profile of one step of {r['layout']}: matmul {_pct(p['matmul'])}, attention "
                  f"{_pct(p['attention'])}, other {_pct(p['other'])} of operator self time; top operators: "
                  + ", ".join(f"{name} {_pct(share)}" for name, share in p["top"]) + "."]
    return "\n".join(lines) + "\n"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def breakdown_table(rows: list[dict]) -> list[str]:
    """Where one step's CPU time goes (seconds per step and rank), trainer and plain model."""
    lines = ["", "CPU seconds per step and rank (speed phase): the trainer, and the plain model on the same batches.", "",
             "| layout | run | " + " | ".join(PARTS) + " | total |", "|---" * (len(PARTS) + 3) + "|"]
    for r in rows:
        for who, parts in r["cpu_breakdown"].items():
            if parts:
                lines.append(f"| {r['layout']} | {who} | " + " | ".join(f"{parts[k]:.3f}" for k in PARTS)
                             + f" | {parts['total']:.3f} |")
    return lines


def write_outputs(rows: list[dict], env: Environment, out: str, spec: dict) -> list[str]:
    paths = [os.path.join(out, f"bench.{ext}") for ext in ("csv", "md", "json")]
    columns = [k for k in rows[0] if k not in ("summary", "profile", "cpu_breakdown", "timeline")]
    with open(paths[0], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for r in rows:
            writer.writerow(["/".join(f"{x:.1f}" if isinstance(x, float) else str(x) for x in r[c])
                             if isinstance(r[c], list) else r[c] for c in columns])
    with open(paths[1], "w") as f:
        f.write(markdown(rows, env, spec))
    with open(paths[2], "w") as f:
        json.dump({"environment": asdict(env), "spec": spec, "rows": rows}, f, indent=1)
    return paths

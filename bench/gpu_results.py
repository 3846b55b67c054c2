"""Results kept as they come, and the files made of them (the standard library and
planner/devices.py only: the GPU check's runner imports this before anything heavy).

Every measurement of the GPU check is one JSON line appended to a results file and made durable
before the process goes on (`append_jsonl`), so a process killed later has lost only what it had
not measured yet. One line per record, by "part":

  train   one micro-batch size of one shape and variant of bench/gpu.py: {"shape", "variant",
          "meta": the shape's model, device, peak, compile counts so far, ..., "row": the
          measurement}; `train_results` groups them into bench/gpu.py's results (a list of
          {"shape", "variant", ..., "rows": [...]}), the file the planner reads as
          docs/bench/gpu-<type>/train.json (planner/devices.py)
  ops     part of `./run.sh bench ops`' result (bench/ops.py): {"result": {...}}, merged in order
  costs   one layer kind of one mode of the zero-bubble cost measurement (bench/zb_costs.py):
          {"meta": the cost file's header, "mode", "kind", "costs"}; `cost_file` makes the file
          planner/zb.py reads (only with every kind of a mode: a mode half measured is left out)
  check   what the runner itself records (gpucheck/check.py): versions, each part's outcome
"""
from __future__ import annotations

import json
import math
import os

from planner.devices import BASIS_SHAPES
from schema.text import count

PLANNER_BASIS = BASIS_SHAPES
"""Shapes whose kernel efficiency the planner takes for their width (planner/devices.py prefers
them); placed last in train.json too."""


def append_jsonl(path: str, record: dict) -> None:
    """Append `record` as one JSON line and make it durable before going on: a process killed
    after this call has left it in the file."""
    line = json.dumps(record, default=_plain) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _plain(value):
    return float(value) if hasattr(value, "__float__") else str(value)


def read_jsonl(*paths: str) -> list[dict]:
    """The records of every file in `paths`, in order; a line cut off by a kill is skipped."""
    records = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return records


def write_json(path: str, value) -> None:
    """Write `value` to `path` whole or not at all (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1, default=_plain)
    os.replace(tmp, path)


def train_results(records: list[dict]) -> list[dict]:
    """bench/gpu.py's results from its lines: one per (shape, variant), its last metadata, its rows
    in the order measured (a size measured twice: the later row); planner-basis shapes last."""
    grouped: dict[tuple[str, str], dict] = {}
    for r in records:
        if r.get("part") != "train":
            continue
        result = grouped.setdefault((r["shape"], r["variant"]), {"rows": []})
        result.update({k: v for k, v in r["meta"].items() if k != "rows"}, shape=r["shape"], variant=r["variant"])
        size = r["row"]["target_tokens_per_micro_batch"]
        result["rows"] = [row for row in result["rows"] if row["target_tokens_per_micro_batch"] != size] + [r["row"]]
    return sorted(grouped.values(), key=lambda r: r["shape"] in PLANNER_BASIS)


SUMMARY_KEYS = ("config", "model", "batch", "syncs", "syncs_per_microbatch", "syncs_per_step")
"""bench ops' keys that describe its own run as a whole (the worst of its sync counts, its config):
left out of ops.json, which joins several runs; each count there says what it was counted on."""


def ops_result(records: list[dict]) -> dict:
    out: dict = {}
    for r in records:
        if r.get("part") == "ops":
            out.update({k: v for k, v in r["result"].items() if k not in SUMMARY_KEYS})
    return out


def cost_file(records: list[dict], kinds: tuple[str, ...] = ("embed", "encoder", "decoder", "output")) -> dict | None:
    """The zero-bubble cost file (bench/zb_costs.py's zb-costs.json) of the modes measured for every
    kind; None when no mode is complete."""
    meta, modes = None, {}
    for r in records:
        if r.get("part") == "costs":
            meta = r["meta"]
            modes.setdefault(r["mode"], {})[r["kind"]] = r["costs"]
    complete = {mode: costs for mode, costs in modes.items() if set(kinds) <= set(costs)}
    if meta is None or not complete:
        return None
    return {**meta, "modes": complete}


def fmt(value, spec: str = "", empty: str = "—") -> str:
    """`value` formatted by `spec`; `empty` for a missing or non-finite number (a row that lacks it)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return empty
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def train_table(results: list[dict]) -> str:
    """The training benchmark's table (bench/gpu.py), one line per measured micro-batch size."""
    if not results:
        return "No training measurement came back.\n"
    first = results[0]
    lines = [f"{first.get('precision')}, pp = tp = dp = 1, FlatOptimizer, ZeRO-1, "
             f"{count(first.get('micro_batches'), 'micro-batch', 'micro-batches')} of (128 + 128)-token pairs per step on {first.get('device')}; MFU against "
             f"{fmt(first.get('datasheet_peak_tflops'), '.0f')} TFLOP/s (datasheet, dense); kernel efficiency = model "
             "FLOPs over forward + backward time only; GPU busy = kernel time (union over streams, one profiled step) "
             "over the median step; host-bound = 1 − busy.", "",
             "| shape | variant | tgt tokens/µbatch | step s | target tok/s | TFLOP/s | MFU | kernel eff. | GPU busy "
             "| kernels/layer/µbatch | syncs/step | peak GiB | first step s | compile s (graphs) |",
             "|---" * 14 + "|"]
    for r in results:
        compiled = ", ".join(f"{k} {v['seconds']:.1f} ({int(v['graphs'])})"
                             for k, v in sorted(r.get("compile", {}).items())) or "—"
        for row in r["rows"]:
            g = row.get
            peak = g("peak_memory_bytes")
            lines.append(f"| {r['shape']} | {r['variant']} | {g('target_tokens_per_micro_batch')} | "
                         f"{fmt(g('step_seconds_median'), '.4f')} | {fmt(g('target_tokens_per_s'), ',.0f')} | "
                         f"{fmt(g('model_tflops_per_s'), '.1f')} | {fmt(g('mfu'), '.1%')} | "
                         f"{fmt(g('kernel_efficiency'), '.1%')} | {fmt(g('gpu_busy_fraction'), '.0%')} | "
                         f"{fmt(g('kernels_per_layer_per_micro_batch'), '.1f')} | {fmt(g('host_syncs_per_step'))} | "
                         f"{fmt(peak / 2**30 if peak is not None else None, '.2f')} | "
                         f"{fmt(g('first_step_seconds'), '.1f')} | {compiled} |")
    return "\n".join(lines) + "\n"


def report(results: list[dict], command: str) -> str:
    """report.md of `./run.sh bench train` on a GPU."""
    if not results:
        return f"# Training benchmark\n\nCommand: `{command}`\n\nNo measurement came back.\n"
    v = results[0].get("versions", {})
    return "\n".join([f"# Training benchmark on {results[0]['device']}", "", f"Command: `{command}`", "",
                      "Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + ".", "", train_table(results)])

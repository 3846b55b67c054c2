"""`./run.sh bench train`: time a grid of layouts of one model on the devices present.

    ./run.sh bench train [CONFIG] [--grid GRID.yaml] [--pp 1,2] [--dp 1] [--tp 1] [--ac 0,1]
                         [--max-tokens 1024] [--micro-batches 4] [--precision fp32] [--threads 1]
                         [--schedule NAME,...] [--zb-max-pending-w=0,-1] [--zero 0,1]
                         [--partition cost,parameters] [--warmup 2] [--steps 5] [--model NAME] [--out DIR]
                         [--work-dir DIR] [--profile] [--trace]

Flags with comma-separated values span a grid (their product). A grid file holds the same keys:

    config: configs/default.yaml       # run config: model, data, train (optional)
    model: {encoder_layers: 6, ...}    # overrides of its model section (optional)
    warmup: 2
    steps: 5
    layouts:                           # each entry is expanded like the flags
      - {pp: [1, 2], dp: 1, ac: [0, 1], max_tokens: 1024, micro_batches: 4, precision: fp32}
      - {pp: 1, threads: [1, 2]}       # OpenMP threads per rank (default: cores / ranks)

Each layout runs in its own launch (`bench/worker.py`), so its memory is its own. Per
layout: target tokens/s (non-padding), step time median and spread, model TFLOP/s (model/flops.py),
MFU and HFU against the peak (CPU: a matmul probe at start, all cores; GPU: datasheet table in
planner/planner.py), the measured pipeline bubble next to (p−1)/(m+p−1), and the peak memory of
each stage above the process baseline next to the planner's prediction. Written to
DIR/bench.{csv,md,json}. `--trace`: after the measured steps, as many pairs of a traced and an untraced
step (bench/timeline.py): DIR/<layout>.timeline.json (open in ui.perfetto.dev) and .png, the bubble
per stage from the trace beside the simulator's, and what tracing costs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

import yaml

from bench.report import LAYOUT_KEYS, Environment, summarize, write_outputs
from launcher.launch import DEFAULT_CONFIG, ROOT, deepspeed_command, launch_env
from runtime.accelerator import HOST
from schema.text import count
from trainer.config import ConfigError, load_config

BENCH = dict(name="train", help="layout grid on CPU", config=0, config_in=("--grid",),
             paths=("--grid", "--out", "--work-dir"), switches=("--profile", "--trace"), launches=True)

GRID_KEYS = ("pp", "tp", "dp", "ac", "max_tokens", "micro_batches", "precision", "threads", "schedule", "partition",
             "zb_max_pending_w", "zero")
FLAG_TYPES = {"pp": int, "tp": int, "dp": int, "ac": int, "max_tokens": int, "micro_batches": int, "precision": str,
              "threads": int, "schedule": str, "partition": str, "zb_max_pending_w": int, "zero": int}


def expand(entry: dict, where: str) -> list[dict]:
    unknown = sorted(set(entry) - set(GRID_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown layout {'key' if len(unknown) == 1 else 'keys'} {unknown}; use {list(GRID_KEYS)}")
    keys = list(entry)
    values = [v if isinstance(v, list) else [v] for v in entry.values()]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def layout_name(layout: dict) -> str:
    threads = f"-t{layout['threads']}" if "threads" in layout else ""
    from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES

    name = layout.get("schedule", DEFAULT_SCHEDULE)
    schedule = f"-{name}" if name != DEFAULT_SCHEDULE else ""
    partition = f"-part-{layout['partition']}" if layout.get("partition", "cost") != "cost" else ""
    if name in SCHEDULES and SCHEDULES[name].pending_bounds and "zb_max_pending_w" in layout:
        schedule += "-auto" if layout["zb_max_pending_w"] < 0 else f"-w{layout['zb_max_pending_w']}"
    zero = f"-z{layout['zero']}" if layout.get("zero", 1) != 1 else ""  # ZeRO stage (parallel.zero_stage)
    return (f"pp{layout.get('pp', 1)}-tp{layout.get('tp', 1)}-dp{layout.get('dp', 1)}-mt{layout['max_tokens']}"
            f"-m{layout['micro_batches']}-ac{layout.get('ac', 0)}-{layout['precision']}{threads}{schedule}{partition}"
            f"{zero}")


def launch_environment(layout: dict, world: int) -> dict:
    """The ranks' environment: `threads` (OpenMP threads per rank) if the layout sets it, else
    the machine's cores split over the ranks (launcher/cli.py)."""
    env = launch_env(world)
    if "threads" in layout:
        env["OMP_NUM_THREADS"] = str(layout["threads"])
    # glibc raises its mmap threshold as large blocks are freed and then keeps freed tensors in
    # its heap: RSS grew up to 1.6× above the live tensors here, by allocation order. A fixed
    # threshold returns every freed tensor ≥ 128 KiB to the OS, so peak RSS measures what the
    # training state needs, as the allocator peak does on GPUs.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    return env


def _values(key: str, text: str) -> list:
    try:
        return [FLAG_TYPES[key](v) for v in text.split(",")]
    except ValueError:
        raise ConfigError(f"--{key.replace('_', '-')} {text}: comma-separated {FLAG_TYPES[key].__name__} values") from None


def build_grid(args: argparse.Namespace) -> tuple[str, dict, list[dict], int, int]:
    """(config path, model overrides, layouts, warmup, steps) from --grid or the flags."""
    spec: dict = {}
    if args.grid:
        if not os.path.exists(args.grid):
            raise ConfigError(f"--grid {args.grid}: no such file")
        with open(args.grid) as f:
            spec = yaml.safe_load(f) or {}
        unknown = sorted(set(spec) - {"config", "model", "warmup", "steps", "layouts"})
        if unknown:
            raise ConfigError(f"{args.grid}: unknown {'key' if len(unknown) == 1 else 'keys'} {unknown}; use config, model, warmup, steps, layouts")
    config = args.config or spec.get("config") or DEFAULT_CONFIG
    base = load_config(config)
    model = dict(spec.get("model") or {})
    if args.model:
        from planner.planner import named_model

        try:
            shape = named_model(args.model)
        except ValueError as e:
            raise ConfigError(f"--model: {e}") from None
        model.update({k: getattr(shape, k) for k in ("encoder_layers", "decoder_layers", "d_model", "heads", "ffn_dim")})
    defaults = {"pp": base.parallel.pipeline_stages, "dp": base.parallel.data_parallel,
                "ac": base.parallel.activation_checkpoint_interval, "precision": base.parallel.precision,
                "max_tokens": base.data.max_tokens, "micro_batches": base.train.micro_batches,
                "tp": base.parallel.tensor_parallel, "zero": base.parallel.zero_stage}
    flags = {k: _values(k, getattr(args, k)) for k in GRID_KEYS if getattr(args, k) is not None}
    entries = spec.get("layouts") or [{}]
    layouts = []
    for i, entry in enumerate(entries):
        for layout in expand({**defaults, **entry, **flags}, f"{args.grid or 'flags'}: layouts[{i}]"):
            threads = layout.get("threads", 1)
            if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
                raise ConfigError(f"{args.grid or '--threads'}: threads={threads!r} must be an integer >= 1")
            layout["name"] = layout_name(layout)
            layouts.append(layout)
    warmup = args.warmup if args.warmup is not None else spec.get("warmup", 2)
    steps = args.steps if args.steps is not None else spec.get("steps", 5)
    if warmup < 0 or steps < 1:
        raise ConfigError("--warmup must be >= 0 and --steps >= 1")
    return config, model, layouts, warmup, steps


def check_layout(config: str, model: dict, layout: dict) -> int:
    """Validate a layout through the real config loader; returns its world size."""
    overrides: dict = {"model": dict(model)}
    for key, (section, name) in LAYOUT_KEYS.items():
        if key in layout:
            overrides.setdefault(section, {})[name] = layout[key]
    return load_config(config, overrides).world_size


def run_one(config: str, model: dict, layout: dict, world: int, work: str, data_dir: str,
            profile_dir: str | None, trace_dir: str | None = None) -> dict:
    spec_path = os.path.join(work, f"{layout['name']}.layout.json")
    out = os.path.join(work, f"{layout['name']}.result.json")
    log = os.path.join(work, f"{layout['name']}.log")
    with open(spec_path, "w") as f:
        json.dump({"model": model, "layout": layout}, f)
    args = ["--config", os.path.abspath(config), "--layout", spec_path, "--work-dir", os.path.join(work, "runs"),
            "--data-dir", data_dir, "--out", out] + (["--profile-dir", profile_dir] if profile_dir else []) + \
        (["--trace-dir", trace_dir] if trace_dir else [])
    # A world of one needs no launcher; more ranks go through the real deepspeed launcher.
    cmd = [sys.executable, "-m", "bench.worker", *args] if world == 1 else deepspeed_command(world, "bench.worker", args)
    if os.path.exists(out):
        os.remove(out)
    env = launch_environment(layout, world)
    with open(log, "w") as f:
        code = subprocess.call(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"layout {layout['name']} failed (exit {code}); log {log}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh bench train", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help=f"YAML run config (default {DEFAULT_CONFIG})")
    parser.add_argument("--grid", help="YAML grid file (see --help text above)")
    parser.add_argument("--model", help="a named model shape of the planner (e.g. base-6-6, tiny-100-100)")
    for key in GRID_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", dest=key, help=f"{key}: one value or several, comma-separated")
    parser.add_argument("--warmup", type=int, help="untimed steps per layout (default 2)")
    parser.add_argument("--steps", type=int, help="measured steps per layout (default 5)")
    parser.add_argument("--out", default="runs/bench", help="output folder (default runs/bench)")
    parser.add_argument("--work-dir", help="run directories and logs of the layouts (default OUT/work)")
    parser.add_argument("--profile", action="store_true", help="profile one extra step of single-process layouts")
    parser.add_argument("--trace", action="store_true", help="a timeline of each layout (OUT/<layout>.timeline.json, "
                        ".png) from --steps pairs of a traced and an untraced step: the bubble per stage beside the "
                        "simulator's, and the tracing overhead")
    args = parser.parse_args(argv)
    try:
        return bench(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def bench(args: argparse.Namespace) -> int:
    from data.prepare import prepare_data

    config, model, layouts, warmup, steps = build_grid(args)
    worlds = {layout["name"]: check_layout(config, model, layout) for layout in layouts}
    out = os.path.abspath(args.out)
    work = os.path.abspath(args.work_dir or os.path.join(out, "work"))
    os.makedirs(out, exist_ok=True)
    os.makedirs(work, exist_ok=True)
    base = load_config(config)
    data_dir = os.path.abspath(os.path.join(base.run_dir, "data"))  # where `./run.sh train` prepares it
    prepare_data(base.data, data_dir, log=lambda msg: print(msg, flush=True))
    env = Environment.probe({layout["precision"] for layout in layouts})
    print(env.describe(), flush=True)
    rows = []
    for layout in layouts:
        layout = {**layout, "warmup": warmup, "steps": steps}
        world = worlds[layout["name"]]
        if env.device_kind == HOST and world > (os.cpu_count() or 1):
            print(f"note: {layout['name']} runs {count(world, 'rank')} on {count(os.cpu_count() or 1, 'core')}; its times are oversubscribed")
        print(f"running {layout['name']} ({count(world, 'rank')}) ...", flush=True)
        result = run_one(config, model, layout, world, work, data_dir, out if args.profile else None,
                         out if args.trace else None)
        threads = int(launch_environment(layout, world)["OMP_NUM_THREADS"])
        row = summarize(result, env, load_config(config, {"model": model}).model, threads)
        row["load_after"] = os.getloadavg()[0]  # other processes on the machine skew times
        rows.append(row)
        print("  " + row["summary"], flush=True)
    shown = os.path.relpath(config, ROOT) if os.path.abspath(config).startswith(ROOT + os.sep) else config
    paths = write_outputs(rows, env, out, {"config": shown, "model": model, "warmup": warmup, "steps": steps})
    print(f"wrote {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

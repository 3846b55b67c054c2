"""The replay of every schedule on measured costs per layer kind: the bubble and step time each
schedule of the registry would have at every pipeline depth, and the memory of the largest stage.

    ./run.sh bench schedules --replay COSTS.json [--pp 2,4,8,16] [--micro-batches 8,16,32]
                             [--mode compiled] [--gpu h100-80gb --gpus 128] [--checkpoint] [--out DIR]

COSTS.json is `--measure-costs`' output (bench/zb_costs.py): seconds per micro-batch of F, B, W (the
split layer, as a schedule with weight passes runs it) and of F_1f1b, BW (unsplit) for each layer
kind of the model it names, at its micro-batch shape. Each stage of the model's partition (the
trainer's, parallel/partition.py) costs the sum of its layers; the final LayerNorms of Pre-LN stacks
are not measured and count 0. Every schedule of parallel/schedules.py (one with pending bounds under
each) is put on zb_timeline's dependency graph (transfers free) with the costs it runs at (F_1f1b
and BW unsplit; F, B, W split), in the order its engine would choose at these costs, as it does from
the costs it measures in its second step. Bubble = the stages' mean idle fraction of the pipeline
phase (bench/pipeline.py's replay). Memory: the planner's peak of the largest stage
(planner/planner.py `stage_memory`, with what the replayed order holds) on `--gpu` with dp =
`--gpus` / pp; micro-batch counts default to those of the paper configs (configs/deepnet-*.yaml,
their clusters included). Writes OUT/zb-replay.{md,json} (default runs/zb-replay).
"""
from __future__ import annotations

import glob
import json
import os
import statistics

import yaml

from parallel.schedules import DEFAULT_SCHEDULE
from runtime.accelerator import HOST

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def paper_micro_batches() -> list[int]:
    """train.micro_batches of the paper configs, their cluster layouts included."""
    counts = set()
    for path in glob.glob(os.path.join(ROOT, "configs", "deepnet-*.yaml")):
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        top = (raw.get("train") or {}).get("micro_batches", 1)
        counts.add(top)
        for layout in (raw.get("clusters") or {}).values():
            counts.add(((layout or {}).get("train") or {}).get("micro_batches", top))
    return sorted(counts)


def stage_costs(costs: dict, mode: str, pp: int, checkpoint: bool = False) -> list[dict[str, float]]:
    """Per stage: F, B, W (split) and F_1f1b, BW (unsplit), seconds per micro-batch; recomputation
    (activation checkpointing) adds each layer's forward to its backward."""
    from model.config import ModelConfig
    from planner.planner import stage_kinds

    cfg = ModelConfig(**costs["model"])
    kinds = costs["modes"][mode]
    out = []
    for stage in stage_kinds(cfg, pp):
        c = {k: 0.0 for k in ("F", "B", "W", "F_1f1b", "BW")}
        for kind in stage:
            if kind in kinds:
                for k in c:
                    c[k] += kinds[kind][k]
                if checkpoint and kind in ("encoder", "decoder"):
                    c["B"] += kinds[kind]["F"]
                    c["BW"] += kinds[kind]["F_1f1b"]
        out.append(c)
    return out


def _timeline_stats(pp: int, m: int, cost, orders) -> dict:
    from parallel.zb_timeline import fixed, simulate

    timeline = simulate(pp, m, cost, fixed(orders))
    span = max(ops[-1][1] for ops in timeline)
    idle = [1.0 - sum(end - start for start, end, _, _ in ops) / span for ops in timeline]
    return {"step_s": span, "bubble": statistics.fmean(idle), "stage_idle": idle}


def variants() -> list[tuple[str, str, int | None]]:
    """(label, schedule, bound) of every schedule of the registry, one with pending bounds under each
    (labelled as the planner's table does: zb-h1(w=-1))."""
    from parallel.schedules import SCHEDULES

    out = []
    for name, spec in SCHEDULES.items():
        for bound in spec.pending_bounds or (0,):
            label = f"{name}(w={-1 if bound is None else bound})" if spec.pending_bounds else name
            out.append((label, name, bound))
    return out


def replay_one(costs: dict, mode: str, pp: int, m: int, checkpoint: bool = False) -> dict:
    """Every schedule (`variants`) at `pp` stages and `m` micro-batches: its bubble, step and the
    orders' memory (planner/zb.py `order_memory`)."""
    from parallel.schedules import SCHEDULES
    from parallel.zb_timeline import with_first_stage_share
    from planner.zb import order_memory

    per_stage = stage_costs(costs, mode, pp, checkpoint)
    unsplit = [{"F": c["F_1f1b"], "BW": c["BW"]} for c in per_stage]
    split = [{"F": c["F"], "B": c["B"], "W": c["W"]} for c in per_stage]
    rows = {}
    for label, name, bound in variants():
        spec = SCHEDULES[name]
        cost = split if spec.splits_backward else unsplit
        orders, share, _ = spec.choose(pp, m, cost, bound)
        rows[label] = {**_timeline_stats(pp, m, with_first_stage_share(cost, pp, share), orders),
                       "schedule": name, "bound": bound, "memory": order_memory(orders, share)}
    return {"pp": pp, "micro_batches": m, "stage_costs": per_stage, "schedules": rows}


def largest_stage_gib(costs: dict, pp: int, m: int, row: dict, gpu: str, gpus: int, checkpoint: bool) -> float:
    """The planner's peak memory of the largest stage for this row's schedule and order."""
    from model.config import ModelConfig
    from planner.devices import device
    from planner.planner import Candidate, stage_memory

    cfg = ModelConfig(**costs["model"])
    mb = costs["micro_batch"]
    layout = Candidate(pp=pp, tp=1, dp=max(1, gpus // pp), micro_batches=m, sequences=mb["sequences"],
                       src_len=mb["src_len"], tgt_len=mb["tgt_len"], checkpoint=int(checkpoint),
                       precision=costs["precision"] if costs["precision"] != "fp32" else "bf16",
                       schedule=row["schedule"], zb_max_pending=row["bound"])
    return max(stage_memory(cfg, layout, s, device(gpu), row["memory"])["peak"] for s in range(pp)) / 2**30


def replay(costs: dict, mode: str, pps: list[int], ms: list[int], gpu: str = "h100-80gb", gpus: int = 128,
           checkpoint: bool = False) -> list[dict]:
    out = []
    for pp in pps:
        for m in ms:
            r = replay_one(costs, mode, pp, m, checkpoint)
            for row in r["schedules"].values():
                row["largest_stage_gib"] = largest_stage_gib(costs, pp, m, row, gpu, gpus, checkpoint)
                del row["memory"]
            out.append(r)
    return out


def markdown(rows: list[dict], costs: dict, mode: str, spec: dict) -> str:
    mb = costs["micro_batch"]
    lines = [f"Replay of measured F, B, W ({mode}) from `{spec['costs']}`: {costs['device']}, {costs['precision']}, "
             f"model d = {costs['model']['d_model']}, {costs['model']['encoder_layers']}L-"
             f"{costs['model']['decoder_layers']}L, micro-batch {mb['sequences']} × ({mb['src_len']} + {mb['tgt_len']}); "
             f"memory: planner, {spec['gpu']}, dp = {spec['gpus']} / pp"
             + (", activation checkpointing" if spec["checkpoint"] else "") + ".", "",
             "| pp | m | schedule | bubble (÷ default's) | step ÷ default's | largest stage GiB |", "|---" * 6 + "|"]
    for r in rows:
        s = r["schedules"]
        base = s[DEFAULT_SCHEDULE]
        for label, row in s.items():
            ratio = f" ({row['bubble'] / base['bubble']:.2f})" if base["bubble"] else ""
            lines.append(f"| {r['pp']} | {r['micro_batches']} | {label} | {row['bubble']:.3f}{ratio} | "
                         f"{row['step_s'] / base['step_s']:.3f} | {row['largest_stage_gib']:.1f} |")
    kinds = costs["modes"][mode]
    lines += ["", "Per layer kind, ms per micro-batch (F / B / W; unsplit F / BW): " + "; ".join(
        f"{k} {c['F'] * 1e3:.3f} / {c['B'] * 1e3:.3f} / {c['W'] * 1e3:.3f}; {c['F_1f1b'] * 1e3:.3f} / {c['BW'] * 1e3:.3f}"
        for k, c in kinds.items()) + "."]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    """`--replay COSTS.json`: the replay for every --pp and micro-batch count; OUT/zb-replay.{md,json}."""
    from launcher.options import user_path

    path = user_path(args.replay)
    if not os.path.isfile(path):
        print(f"error: --replay {args.replay}: no such file (bench schedules --measure-costs writes one)", flush=True)
        return 2
    with open(path) as f:
        costs = json.load(f)
    mode = args.mode or ("compiled" if "compiled" in costs["modes"] and costs["device"] != HOST else "eager")
    if mode not in costs["modes"]:
        print(f"error: --mode {mode}: {args.replay} has {', '.join(costs['modes'])}", flush=True)
        return 2
    pps = [int(x) for x in str(args.pp).split(",")]
    ms = [int(x) for x in args.micro_batches.split(",")] if args.micro_batches else paper_micro_batches()
    rows = replay(costs, mode, pps, ms, args.gpu, args.gpus, args.checkpoint)
    spec = {"costs": args.replay, "gpu": args.gpu, "gpus": args.gpus, "checkpoint": args.checkpoint, "mode": mode}
    text = markdown(rows, costs, mode, spec)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "zb-replay.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "zb-replay.json"), "w") as f:
        json.dump({"spec": spec, "rows": rows}, f, indent=1)
    print(text + f"wrote {out}/zb-replay.md, zb-replay.json", flush=True)
    return 0

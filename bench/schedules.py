"""`./run.sh bench schedules`: every schedule of the registry trained side by side in one launch,
steps interleaved; or the costs per layer kind that the schedules' orders are priced with,
measured on this device, and their replay.

    ./run.sh bench schedules [CONFIG] [--pp 2] [--micro-batches 4,8] [--schedules NAME,...] [--zb-max-pending-w=0,-1]
                             [--warmup 2] [--steps 4] [--out DIR]
    ./run.sh bench schedules --measure-costs [eager,compiled] [--d-model 1024] --out DIR   (bench/zb_costs.py)
    ./run.sh bench schedules --replay DIR/zb-costs.json --pp 2,4,8,16 --out DIR2            (bench/zb_replay.py)

`./run.sh bench train` runs each layout in its own launch, one after the other; on a shared
machine the load changes between them and with it wall and even CPU time (two ranks per core
pair slow each other's caches). Here one launch per micro-batch count builds one real `Trainer`
per schedule of parallel/schedules.py (one with pending bounds once per `--zb-max-pending-w`
bound; -1 none; `--schedules` picks some), all on the same batches, and runs their steps in turn
(A, B, C, A, B, C, ...), so every schedule sees the same load. Per schedule and stage: step wall
time, CPU seconds, the measured bubble (idle fraction of the pipeline phase, wall:
bench/pipeline.py `step_bubbles`), the CPU replay (each stage's mean CPU seconds of F, B, W per
micro-batch on the dependency graph of the orders its engine ran; bench/pipeline.py
`replayed_pipeline`) and the simulator's bubble at equal F, B, W (`bubble_theory`). Memory is
measured by `./run.sh bench train` (one layout per process; engines are never freed). Writes
OUT/schedules.{md,json} (default runs/bench-schedules).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench import zb_costs
from schema.text import count

BENCH = dict(name="schedules", help="every pipeline schedule, steps interleaved in one launch", config=0, paths=("--out",),
             launches=True)
OUT = "runs/bench-schedules"


def _variants(pending: list[int], names: list[str] | None = None) -> list[tuple[str, str, int]]:
    """(name, schedule, parallel.zb_max_pending_w) per trained schedule: every schedule of the
    registry (parallel/schedules.py; those of `names` only if given), one with pending-W bounds
    under each of `pending`."""
    from parallel.schedules import SCHEDULES

    out = []
    for name, spec in SCHEDULES.items():
        if names and name not in names:
            continue
        if not spec.pending_bounds:
            out.append((name, name, 0))
            continue
        out += [(f"{name}-auto" if p < 0 else f"{name}-w{p}", name, p) for p in pending]
    return out


def worker(args: argparse.Namespace) -> None:
    import torch

    from bench.worker import instrument, layout_config
    from parallel.schedules import SCHEDULES
    from runtime.distributed import exit_rank, setup_distributed
    from trainer.trainer import Trainer

    setup_distributed()
    rank = torch.distributed.get_rank()
    variants = _variants(args.pending, args.schedule_names)
    trainers, clocks = [], []
    for name, schedule, pending in variants:
        run_dir = os.path.join(args.work_dir, f"m{args.micro_batches}-{name}")
        if rank == 0:
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            os.symlink(args.data_dir, os.path.join(run_dir, "data"))
        torch.distributed.barrier()
        layout = {"pp": args.pp, "dp": 1, "micro_batches": args.micro_batches, "schedule": schedule,
                  "warmup": args.warmup, "steps": args.steps}
        if SCHEDULES[schedule].pending_bounds:
            layout["zb_max_pending_w"] = pending
        cfg = layout_config(args.config, layout, run_dir, {})
        trainer = Trainer(cfg)
        trainers.append(trainer)
    for _ in range(args.warmup):
        for trainer in trainers:
            trainer.train_step()
    for trainer in trainers:
        clocks.append(instrument(trainer.engine))
    steps = {name: [] for name, _, _ in variants}
    for _ in range(args.steps):
        for trainer, (name, _, _), (wall, cpu) in zip(trainers, variants, clocks):
            wall.clear(), cpu.clear()
            start = time.process_time()
            out = trainer.train_step()
            steps[name].append({"seconds": out["seconds"], "cpu_seconds": time.process_time() - start,
                                "loss": out["loss"], "wall": dict(wall), "process_time": dict(cpu)})
    mine = {"rank": rank, "stage": trainers[0].engine.stage_id, "steps": steps,
            "orders": {name: trainer.engine.orders for trainer, (name, _, _) in zip(trainers, variants)},
            "share": {name: trainer.engine.deferred_share for trainer, (name, _, _) in zip(trainers, variants)}}
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"pp": args.pp, "micro_batches": args.micro_batches, "variants": variants, "ranks": ranks,
                       "load": os.getloadavg()}, f)
    exit_rank()


def summarize(result: dict) -> list[dict]:
    """One row per schedule: wall and CPU per step, measured bubble per stage, CPU replay, and the
    simulator's bubble at equal costs."""
    from bench.pipeline import bubble_theory, replayed_pipeline, step_bubbles

    pp, m = result["pp"], result["micro_batches"]
    rows = []
    for name, schedule, pending in result["variants"]:
        per_rank = [(r["stage"], r["steps"][name]) for r in result["ranks"]]
        bubble, cpu = [[] for _ in range(pp)], [[] for _ in range(pp)]
        walls = step_bubbles([[{**step["wall"], "seconds": step["seconds"]} for step in steps] for _, steps in per_rank])
        for (stage, steps), bubbles in zip(per_rank, walls):
            for step, b in zip(steps, bubbles):
                if b is not None:
                    bubble[stage].append(b)
                cpu[stage].append(step["cpu_seconds"])
        layout = {"pp": pp, "micro_batches": m, "schedule": schedule,
                  "zb_max_pending_w": pending}
        replay = replayed_pipeline({"layout": layout, "ranks": [
            {"stage": stage, "instructions_cpu": [s["process_time"] for s in steps], "orders": r.get("orders", {}).get(name),
             "share": r.get("share", {}).get(name, 1.0)} for (stage, steps), r in zip(per_rank, result["ranks"])]})
        seconds = [s["seconds"] for s in per_rank[0][1]]
        rows.append({"schedule": name, "micro_batches": m, "step_s_median": statistics.median(seconds),
                     "step_s": seconds, "stage_bubble": [statistics.fmean(b) for b in bubble],
                     "bubble": statistics.fmean(x for b in bubble for x in b),
                     "stage_cpu_s": [statistics.fmean(c) for c in cpu], "replay_step_s": replay["replay_step_s"],
                     "replay_bubble": replay["replay_bubble"], "replay_costs": replay.get("replay_costs"),
                     "theory_bubble": bubble_theory(layout),
                     "losses": [s["loss"] for s in per_rank[0][1]], "load_after": result["load"]})
    return rows


def markdown(rows: list[dict], spec: dict) -> str:
    lines = [f"Interleaved steps of each schedule in one launch per micro-batch count; config `{spec['config']}`, "
             f"pp = {spec['pp']}, {spec['warmup']} warm-up + {count(spec['steps'], 'measured step')} per schedule; load average "
             f"before: {spec['load_before']}.", "",
             "| m | schedule | step s median (all) | bubble (wall) per stage | bubble mean | CPU s per step per stage "
             "| CPU replay: pipeline s, bubble | equal F, B, W: bubble | load after |", "|---" * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['micro_batches']} | {r['schedule']} | {r['step_s_median']:.2f} ("
                     + ", ".join(f"{s:.2f}" for s in r["step_s"]) + ") | "
                     + " / ".join(f"{b:.3f}" for b in r["stage_bubble"]) + f" | {r['bubble']:.3f} | "
                     + " / ".join(f"{c:.2f}" for c in r["stage_cpu_s"])
                     + f" | {r['replay_step_s']:.3f}, {r['replay_bubble']:.3f} | {r['theory_bubble']:.3f} | "
                     + " ".join(f"{x:.1f}" for x in r["load_after"]) + " |")
    lines += ["", "CPU seconds per micro-batch used by the replay (stage: F, B, W):", ""]
    for r in rows:
        costs = "; ".join(f"stage {i}: {c['F']:.3f}, {c['B']:.3f}, {c['W']:.3f}" for i, c in enumerate(r["replay_costs"] or []))
        lines.append(f"- m={r['micro_batches']} {r['schedule']}: {costs}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from launcher.launch import DEFAULT_CONFIG, ROOT, deepspeed_command, launch_env

    parser = argparse.ArgumentParser(prog="run.sh bench schedules", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help=f"YAML run config (default {DEFAULT_CONFIG})")
    parser.add_argument("--pp", default="2", help="pipeline stages (--replay: comma-separated)")
    parser.add_argument("--micro-batches", help="comma-separated (one launch each; default 4,8; --replay: the paper "
                                                "configs' counts)")
    costs = parser.add_argument_group("costs per layer kind (bench/zb_costs.py, bench/zb_replay.py)")
    costs.add_argument("--measure-costs", nargs="?", const="eager,compiled", metavar="MODES",
                       help="measure F, B, W per layer kind on this device (eager, compiled or both: the default)")
    zb_costs.add_arguments(costs, "--measure-costs: ")
    costs.add_argument("--replay", metavar="COSTS.json", help="replay every schedule on measured costs")
    costs.add_argument("--mode", choices=("eager", "compiled"), help="--replay: which measurement (default compiled "
                                                                    "on GPUs, eager on CPUs)")
    costs.add_argument("--gpu", default="h100-80gb", help="--replay: the GPU type the memory is priced on")
    costs.add_argument("--gpus", type=int, default=128, help="--replay: GPUs (dp = gpus / pp for the memory)")
    costs.add_argument("--checkpoint", action="store_true", help="--replay: with activation checkpointing")
    parser.add_argument("--schedules", help="comma-separated schedule names (default: every schedule of "
                                            "parallel/schedules.py)")
    parser.add_argument("--zb-max-pending-w", default="0,-1",
                        help="variants of a schedule with pending bounds: k >= 0 at most k pending weight passes per "
                             "stage (0: the default); -1 no bound (the order tuned to the measured costs)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per schedule (a tuning schedule chooses its order at the costs of its second step)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch-count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_costs or args.replay:
        if args.out == OUT:
            args.out = "runs/zb-costs" if args.measure_costs else "runs/zb-replay"
        if args.measure_costs:
            return zb_costs.run(args)
        from bench import zb_replay

        return zb_replay.run(args)
    args.micro_batches = args.micro_batches or "4,8"
    try:
        args.pp = int(args.pp)
    except ValueError:
        parser.error(f"--pp {args.pp}: one pipeline depth (a list only with --replay)")
    pending = [int(x) for x in args.zb_max_pending_w.split(",")]
    from parallel.schedules import SCHEDULES

    args.schedule_names = args.schedules.split(",") if args.schedules else None
    unknown = sorted(set(args.schedule_names or ()) - set(SCHEDULES))
    if unknown:
        parser.error(f"--schedules {args.schedules}: {', '.join(unknown)} unknown; use {', '.join(SCHEDULES)}")
    if args.worker:
        args.pending, args.micro_batches, args.out = pending, args.micro_batch_count, args.result
        worker(args)
        return 0

    from data.prepare import prepare_data
    from trainer.config import load_config

    base = load_config(args.config)
    data_dir = os.path.abspath(os.path.join(base.run_dir, "data"))
    prepare_data(base.data, data_dir, log=lambda msg: print(msg, flush=True))
    out = os.path.abspath(args.out)
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    spec = {"config": args.config, "pp": args.pp, "warmup": args.warmup, "steps": args.steps,
            "load_before": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    rows = []
    for m in (int(x) for x in args.micro_batches.split(",")):
        result = os.path.join(work, f"m{m}.json")
        log = os.path.join(work, f"m{m}.log")
        cmd = deepspeed_command(args.pp, "bench.schedules", [
            os.path.abspath(args.config), "--worker", "--pp", str(args.pp), "--micro-batch-count", str(m),
            f"--zb-max-pending-w={args.zb_max_pending_w}", "--warmup", str(args.warmup), "--steps", str(args.steps),
            *(["--schedules", args.schedules] if args.schedules else []),
            "--work-dir", work, "--data-dir", data_dir, "--result", result])
        env = launch_env(args.pp)
        env["OMP_NUM_THREADS"] = "1"
        print(f"m={m}: {', '.join(v[0] for v in _variants(pending, args.schedule_names))} interleaved ...", flush=True)
        with open(log, "w") as f:
            code = subprocess.call(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        if code != 0 or not os.path.exists(result):
            print(f"error: m={m} failed (exit {code}); see {log}", file=sys.stderr)
            return 1
        with open(result) as f:
            rows += summarize(json.load(f))
        for r in rows[-len(_variants(pending, args.schedule_names)):]:
            print(f"  {r['schedule']}: step {r['step_s_median']:.2f} s, bubble {r['bubble']:.3f} (wall), "
                  f"CPU replay {r['replay_step_s']:.3f} s, bubble {r['replay_bubble']:.3f}; equal costs "
                  f"{r['theory_bubble']:.3f}", flush=True)
    with open(os.path.join(out, "schedules.md"), "w") as f:
        f.write(markdown(rows, spec))
    with open(os.path.join(out, "schedules.json"), "w") as f:
        json.dump({"spec": spec, "rows": rows}, f, indent=1)
    print(f"wrote {out}/schedules.md, schedules.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())

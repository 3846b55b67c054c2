"""`./run.sh bench train --trace`: a timeline of each layout's steps (trainer/timeline.py) and what
tracing costs.

After the measured steps the worker runs `pairs` pairs of steps, one traced and one not, in turns
(traced first in every other pair, so that neither always follows the other): the traced steps make
the layout's timeline, OUT/<layout>.timeline.json (open in ui.perfetto.dev or chrome://tracing) and
.png, with the bubble per stage from the trace beside the simulator's at the traced costs; each
pair's ratio of the traced step's time to the untraced one's (the engine's train_batch, wall and
CPU seconds, on the same machine load) gives the overhead. Writing the files happens after the
last traced step, outside every timed step."""
from __future__ import annotations

import statistics
import time


def trace_phase(trainer, pairs: int, stem: str) -> dict:
    """The traced and untraced pairs of steps (module docstring); rank 0 gets the timeline's report,
    its files and every rank's times (other ranks: None)."""
    import torch

    from trainer.timeline import trainer_timeline

    order = []
    for i in range(pairs):
        order += [True, False] if i % 2 else [False, True]
    first = trainer.step + 1
    traced = [first + k for k, on in enumerate(order) if on]
    trainer.timeline = trainer_timeline(trainer, traced, stem)
    engine = trainer.engine
    inner = engine.train_batch
    cpu: list[float] = []

    def timed(*args, **kwargs):  # the step's CPU seconds, as its wall seconds are timed (train_batch)
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            cpu.append(time.process_time() - start)

    engine.train_batch = timed
    steps = []
    try:
        for on in order:
            out = trainer.train_step()
            steps.append({"traced": on, "seconds": out["seconds"], "cpu_seconds": cpu[-1]})
    finally:
        del engine.train_batch
    tracer = trainer.timeline.tracer
    mine = {"steps": steps, "calls": tracer.calls, "hook_seconds": hook_seconds(tracer)}
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, mine)
    if torch.distributed.get_rank() != 0:
        return None
    return {"report": trainer.timeline.report, "paths": trainer.timeline.paths, "ranks": ranks,
            "overhead": overhead(ranks)}


def hook_seconds(tracer, calls: int = 2000) -> float:
    """CPU seconds of one call of the tracer's hook around nothing (what tracing adds to each
    instruction: two clock reads, the store's count of deferred work, one append), timed here after
    the traced steps: a bound on the overhead that the machine's load does not blur."""
    tracer._raw, tracer._store = [], getattr(tracer.engine, "weight_grads", None)
    start = time.process_time()
    for _ in range(calls):
        with tracer._hook("BackwardPass", {"buffer_id": 0}):
            pass
    seconds = (time.process_time() - start) / calls
    tracer._raw, tracer.calls = None, tracer.calls - calls
    return seconds


def overhead(ranks: list[dict]) -> dict:
    """Median over pairs of the traced step's time ÷ the untraced one's, minus 1: wall seconds (rank 0's:
    every rank's step ends together) and CPU seconds (all ranks summed)."""
    def pair_ratios(values: list[tuple[bool, float]]) -> list[float]:
        out = []
        for i in range(0, len(values) - 1, 2):
            (a_on, a), (_, b) = values[i], values[i + 1]
            on, off = (a, b) if a_on else (b, a)
            out.append(on / off)
        return out

    wall = pair_ratios([(s["traced"], s["seconds"]) for s in ranks[0]["steps"]])
    cpu = pair_ratios([(s["traced"], sum(r["steps"][i]["cpu_seconds"] for r in ranks))
                       for i, s in enumerate(ranks[0]["steps"])])
    traced = [s for s in ranks[0]["steps"] if s["traced"]]
    per_step = max(r["calls"] * r["hook_seconds"] for r in ranks) / len(traced)  # the busiest rank's hooks
    untraced = statistics.median(s["cpu_seconds"] for s in ranks[0]["steps"] if not s["traced"])
    return {"pairs": len(wall), "wall": statistics.median(wall) - 1.0, "cpu_time": statistics.median(cpu) - 1.0,
            "wall_ratios": wall, "cpu_ratios": cpu, "hook_us": max(r["hook_seconds"] for r in ranks) * 1e6,
            "hooks_per_step": max(r["calls"] for r in ranks) / len(traced), "hook_share": per_step / untraced}


def timeline_table(rows: list[dict]) -> list[str]:
    """The traced layouts: bubble per stage from the trace and from the simulator at the traced
    costs, the unmodelled shares, and the tracing overhead."""
    traced = [r for r in rows if r.get("timeline")]
    if not traced:
        return []
    lines = ["", "Timelines (--trace): the pipeline bubble per stage read from the trace and simulated "
             "(parallel/zb_timeline.py) at the traced F, B, W costs and the orders the stages ran; the trace's "
             "shares of the phase the simulator does not have (sends, loads, the engine between instructions); "
             "tracing's overhead: median over interleaved pairs of a traced and an untraced step, and the hooks' own "
             "CPU time (µs per call × calls per step) over an untraced step's.", "",
             "| layout | schedule | bubble per stage, trace | simulator | all: trace / simulator | sends + loads + between, "
             "per stage | overhead wall / CPU (pairs) | hooks: µs × calls, share | files |", "|---" * 9 + "|"]
    for r in traced:
        t = r["timeline"]
        rep, cost = t["report"], t["overhead"]
        unmodelled = [a + b + c for a, b, c in zip(rep["trace"]["stage_send"], rep["trace"]["stage_load"],
                                                  rep["trace"]["stage_between"])]
        lines.append(f"| {r['layout']} | {r.get('schedule', '')} | {_row(rep['trace']['stage_bubble'])} "
                     f"| {_row(rep['simulator']['stage_bubble'])} | {rep['trace']['bubble']:.3f} / "
                     f"{rep['simulator']['bubble']:.3f} | {_row(unmodelled)} | {cost['wall']:+.1%} / {cost['cpu_time']:+.1%} "
                     f"({cost['pairs']}) | {cost['hook_us']:.1f} × {cost['hooks_per_step']:.0f}, {cost['hook_share']:.3%} "
                     f"| {', '.join(p.rsplit('/', 1)[-1] for p in t['paths'])} |")
    return lines


def _row(values) -> str:
    return " / ".join(f"{v:.3f}" for v in values)

"""Pipeline-schedule measures of `./run.sh bench train` and `./run.sh bench schedules`: the
measured bubble per rank and step (wall clock), the schedule's simulated bubble at equal costs,
and the CPU replay of a schedule's orders on the measured per-stage costs of F, B and W
(parallel/zb_timeline.py); the per-stage table that sets the schedules of a grid side by side.
Every schedule is read from the registry (parallel/schedules.py) and the orders its engine ran."""
from __future__ import annotations

import statistics

from parallel.config import ParallelConfig
from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES, UNIT

MB = 2**20


PIPELINE_OPS = ("ForwardPass", "BackwardPass", "WeightPass")
AFTER_PIPELINE = ("OptimizerStep", "ReduceGrads", "ReduceTiedGrads")


def step_bubbles(ranks_steps: list[list[dict]]) -> list[list[float | None]]:
    """The measured bubble of every rank in every step: 1 − its busy wall seconds (forward,
    backward, weight passes) / the step's pipeline phase.

    ranks_steps[r][k] is rank r's wall seconds by instruction in step k (`instrument` in
    bench/worker.py), with the system clock at the step's first instruction and at the
    end of the rank's last pipeline op ("clock_start", "clock_end"; one host's clock, or hosts
    kept in step by NTP). The phase runs from the first rank's start to the last rank's end of
    pipeline work: a stage whose work ends earlier is idle until then, although DeepSpeed puts
    that wait inside its next collective (in 1F1B the last stage's cooldown sits in the
    tied-gradient all-reduce). Results without clocks (benches before 2026-11-24) fall back to
    the step minus the reductions and the optimizer step, which counts those waits as work.
    """
    steps = min(len(s) for s in ranks_steps)
    out: list[list[float | None]] = [[] for _ in ranks_steps]
    for k in range(steps):
        starts, stops = ([s[k].get(key) for s in ranks_steps] for key in ("clock_start", "clock_end"))
        common = max(stops) - min(starts) if None not in starts + stops else None
        for r, s in enumerate(ranks_steps):
            inst = s[k]
            step = inst.get("train_batch", inst.get("seconds", 0.0))
            phase = common if common is not None else step - sum(inst.get(x, 0.0) for x in AFTER_PIPELINE)
            busy = sum(inst.get(x, 0.0) for x in PIPELINE_OPS)
            out[r].append(1.0 - busy / phase if phase > 0 else None)
    return out


def measured_bubble(result: dict) -> float:
    values = step_bubbles([rank["instructions"] for rank in result["ranks"]])
    return statistics.fmean(v for rank in values for v in rank if v is not None)


def bubble_theory(layout: dict) -> float:
    """The schedule's bubble with F, B and W of equal cost (its order simulated; an unsplit backward
    costs B + W): 1F1B (p−1)/(m+p−1), ZB-H1 (p−1)/(3m+p−1)."""
    pp, m = layout["pp"], layout["micro_batches"]
    schedule = SCHEDULES[layout.get("schedule", DEFAULT_SCHEDULE)]
    bound = ParallelConfig.pending_bound(layout.get("zb_max_pending_w", 0))
    _, _, span = schedule.choose(pp, m, UNIT, bound)
    return 1.0 - 3 * m / span


def schedule_stats(result: dict) -> dict:
    """Pipeline schedule comparison (1F1B vs ZB-H1), per stage: the measured bubble (idle
    fraction of the step's pipeline phase, `step_bubbles`; mean over steps and the stage's ranks), the busy CPU
    seconds of forward, backward and weight passes per step, and the peak bytes of live tensors
    over one step (`live_tensor_memory` in bench/worker.py)."""
    pp = result["layout"]["pp"]
    bubble, busy, live = [[] for _ in range(pp)], [[] for _ in range(pp)], [0.0] * pp
    per_rank = step_bubbles([rank["instructions"] for rank in result["ranks"]])
    for rank, bubbles in zip(result["ranks"], per_rank):
        s = rank["stage"]
        for inst, b in zip(rank["instructions"], bubbles):
            if b is not None:
                bubble[s].append(b)
                busy[s].append(sum(inst.get(k, 0.0) for k in PIPELINE_OPS))
        if rank.get("live_memory"):
            live[s] = max(live[s], rank["live_memory"]["peak"] / MB)
    return {"schedule": result["layout"].get("schedule", DEFAULT_SCHEDULE), "zero_stage": result["layout"].get("zero", 1),
            "stage_bubble": [statistics.fmean(b) if b else None for b in bubble],
            "stage_busy_s": [statistics.fmean(b) if b else None for b in busy],
            "stage_live_peak_mb": live, **replayed_pipeline(result)}


def replayed_pipeline(result: dict) -> dict:
    """The pipeline phase replayed from CPU time: each stage's mean CPU seconds per micro-batch of
    forward, backward and weight pass (its ranks' mean over the measured steps) put on the
    dependency graph of the orders the engine ran (parallel/zb_timeline.py, transfers free). Other
    processes on a shared machine stretch wall time and so the measured bubble; they barely change
    CPU time, so this is the schedule's own bubble and step time at the measured op costs.

    The orders are those a rank recorded (`orders`: the engine's, tuned to the costs it measured,
    the first stage's B + own W run as one backward), else the schedule's at equal costs; an
    unsplit backward (BW) costs what its BackwardPass took, which then includes its W."""
    layout = result["layout"]
    pp, m = layout["pp"], layout["micro_batches"]
    schedule = SCHEDULES[layout.get("schedule", DEFAULT_SCHEDULE)]
    per_stage: list[list[dict]] = [[] for _ in range(pp)]
    for rank in result["ranks"]:
        per_stage[rank["stage"]].extend(rank.get("instructions_cpu") or [])
    if not all(per_stage):
        return {"replay_step_s": None, "replay_bubble": None}
    costs = []
    for steps in per_stage:
        f, b, w = (statistics.fmean(step.get(k, 0.0) for step in steps) / m
                   for k in ("ForwardPass", "BackwardPass", "WeightPass"))
        costs.append({"F": f, "B": b, "W": w, "BW": b + w})
    ran = next((rank["orders"] for rank in result["ranks"] if rank.get("orders")), None)
    if ran:
        orders = [[tuple(op) for op in o] for o in ran]
        share = next((rank.get("share", 1.0) for rank in result["ranks"] if rank.get("orders")), 1.0)
    else:  # none recorded: the schedule's orders at equal costs within parallel.zb_max_pending_w
        orders, share, _ = schedule.choose(pp, m, UNIT, ParallelConfig.pending_bound(layout.get("zb_max_pending_w", 0)))
    from parallel.pipe_schedule import fused
    from parallel.zb_timeline import fixed, simulate

    # what ran: the first stage's B + own W as one backward, whose time its BackwardPass measured
    timeline = simulate(pp, m, costs, fixed([fused(orders[0]), *orders[1:]]))
    span = max(ops[-1][1] for ops in timeline)
    idle = [1.0 - sum(end - start for start, end, _, _ in ops) / span for ops in timeline]
    return {"replay_step_s": span, "replay_bubble": statistics.fmean(idle), "replay_costs": costs,
            "replay_share": share}


def schedule_table(rows: list[dict]) -> list[str]:
    """The grid's schedules side by side, per stage (only when it has more than one)."""
    if len({r.get("schedule", DEFAULT_SCHEDULE) for r in rows}) < 2:
        return []
    lines = ["", "Pipeline schedules per stage: measured bubble (idle fraction of the pipeline phase), busy seconds "
             "(forward + backward + weight passes, wall) per step, peak RSS above the baseline, peak of live tensors "
             "over one step (torch.profiler allocation tracking); the CPU replay puts each stage's mean CPU seconds of "
             "F, B and W on the schedule's dependency graph (load-independent).", "",
             "| layout | schedule | step s (median) | bubble per stage | busy s per stage | CPU replay: pipeline s, bubble "
             "| peak RSS MB per stage | live tensors MB per stage |", "|---" * 8 + "|"]
    for r in rows:
        def cells(values, fmt):
            return " / ".join("n/a" if v is None else format(v, fmt) for v in values)
        lines.append(f"| {r['layout']} | {r.get('schedule', DEFAULT_SCHEDULE)} | {r['step_s_median']:.2f} "
                     f"| {cells(r['stage_bubble'], '.2f')} | {cells(r['stage_busy_s'], '.2f')} "
                     f"| {cells([r['replay_step_s']], '.3f')}, {cells([r['replay_bubble']], '.3f')} "
                     f"| {cells(r['stage_peak_mb'], '.0f')} | {cells(r['stage_live_peak_mb'], '.0f')} |")
    return lines

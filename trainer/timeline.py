"""`train.trace_steps`: a measured timeline of chosen steps, as one Chrome trace-event JSON for the
whole run (one track per rank; what torch.profiler writes and Perfetto and chrome://tracing open)
and a PNG Gantt chart (trainer/gantt.py), with the pipeline bubble read from the trace beside the
timeline simulator's prediction at the same measured costs.

parallel/trace.py records the spans on every rank; here they are gathered on rank 0 once the last
traced step ended, written whole (each file to a temporary name, then renamed: never half a file),
and summed up: per stage the bubble is 1 − the stage's compute time (F, B, W, BW) / the step's
pipeline phase (from the first compute span of any rank to the last one's end), as
bench/pipeline.py measures it; the prediction puts each stage's traced order of compute spans and
its mean F, B, W and BW seconds on parallel/zb_timeline.py's dependency graph, where transfers are
free and each op starts when its input is there. What the simulator does not have — the time in
sends, in loads and in the engine between instructions — is what makes the trace's bubble larger,
and each is reported as its share of the phase."""
from __future__ import annotations

import contextlib
import json
import os
import statistics
from collections.abc import Iterable

COMPUTE = ("F", "B", "W", "BW")


def stem_name(steps: list[int]) -> str:
    """timeline-20-21 (first and last traced step; one step: timeline-20)."""
    return f"timeline-{steps[0]}" + (f"-{steps[-1]}" if steps[-1] != steps[0] else "")


def traced_steps(run_dir: str) -> set[int]:
    """The steps whose timeline a run directory already holds (its timeline-*.json files)."""
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(run_dir):
            if name.startswith("timeline-") and name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                    with open(os.path.join(run_dir, name), encoding="utf-8") as f:
                        found.update(int(s) for s in json.load(f)["otherData"]["steps"])
    return found


# ---- reading the bubble -------------------------------------------------------------------------

def _spans(record: dict, step: int, category: str | None = None) -> list[list]:
    spans = record["steps"].get(str(step), [])
    return [s for s in spans if category is None or s[1] == category]


def measured_bubbles(records: list[dict], step: int) -> dict:
    """The bubble of every stage in `step` (mean over its ranks), and the shares of the phase its
    ranks spent receiving (a wait), sending (a blocking send waits for the peer), loading, in the
    reductions and the optimizer step, and between instructions (the engine's own time)."""
    compute = {r["rank"]: _spans(r, step, "compute") for r in records}
    t0 = min(s[3] for spans in compute.values() for s in spans)
    t1 = max(s[4] for spans in compute.values() for s in spans)
    phase = t1 - t0
    stages = max(r["stage"] for r in records) + 1
    kinds = ("bubble", "recv", "send", "load", "reduce", "between")
    share: dict[str, list[list[float]]] = {k: [[] for _ in range(stages)] for k in kinds}

    def inside(spans) -> float:
        return sum(max(0, min(e, t1) - max(s, t0)) for *_, s, e in spans) / phase

    for r in records:
        s = r["stage"]
        share["bubble"][s].append(1.0 - inside(compute[r["rank"]]))
        for kind in ("recv", "send", "load"):
            share[kind][s].append(inside(_spans(r, step, kind)))
        share["reduce"][s].append(inside([x for x in _spans(r, step) if x[1] in ("reduce", "optimizer", "other")]))
        covered = _union([x for x in _spans(r, step) if x[1] not in ("step", "data")], t0, t1)
        share["between"][s].append(1.0 - covered / phase)
    out = {f"stage_{k}": [statistics.fmean(v) for v in values] for k, values in share.items()}
    out["bubble"] = statistics.fmean(out["stage_bubble"])
    out["phase_s"] = phase / 1e9
    return out


def _union(spans: list[list], t0: int, t1: int) -> int:
    """ns of [t0, t1] covered by the spans."""
    covered, reach = 0, t0
    for *_, start, end in sorted(spans, key=lambda x: x[3]):
        start, end = max(start, reach), min(end, t1)
        if end > start:
            covered += end - start
            reach = end
    return covered


def stage_costs(records: list[dict], step: int) -> list[dict[str, float]]:
    """Per stage, the mean seconds of its F, B, W and BW spans in `step` (0 for a kind it has not)."""
    stages = max(r["stage"] for r in records) + 1
    seconds: list[dict[str, list[float]]] = [{k: [] for k in COMPUTE} for _ in range(stages)]
    for r in records:
        for label, _, _, start, end in _spans(r, step, "compute"):
            seconds[r["stage"]][label].append((end - start) / 1e9)
    return [{k: statistics.fmean(v) if v else 0.0 for k, v in stage.items()} for stage in seconds]


def predicted_bubbles(records: list[dict], step: int) -> dict:
    """The simulator's bubble of every stage for the orders the stages ran in `step`, at the costs
    they were measured at (`stage_costs`)."""
    from parallel.zb_timeline import fixed, simulate

    stages = max(r["stage"] for r in records) + 1
    first = {}  # one rank per stage: its order (every replica and tensor-parallel rank runs the same)
    for r in sorted(records, key=lambda r: r["rank"]):
        first.setdefault(r["stage"], r)
    orders = [[(label, mb) for label, _, mb, _, _ in _spans(first[s], step, "compute")] for s in range(stages)]
    micro_batches = sum(1 for label, _ in orders[0] if label == "F")
    costs = stage_costs(records, step)
    timeline = simulate(stages, micro_batches, costs, fixed(orders))
    span = max(ops[-1][1] for ops in timeline)
    bubbles = [1.0 - sum(end - start for start, end, _, _ in ops) / span for ops in timeline]
    return {"stage_bubble": bubbles, "bubble": statistics.fmean(bubbles), "phase_s": span, "costs": costs,
            "orders": orders}


def bubble_report(records: list[dict]) -> dict:
    """Trace and simulator, per traced step and in the mean over them."""
    steps = sorted({int(k) for r in records for k in r["steps"]})
    per_step = {step: {"trace": measured_bubbles(records, step), "simulator": predicted_bubbles(records, step)}
                for step in steps}

    def mean(who: str, key: str) -> list[float]:
        return [statistics.fmean(v) for v in zip(*(per_step[s][who][key] for s in steps))]

    trace = {k: mean("trace", k) for k in ("stage_bubble", "stage_recv", "stage_send", "stage_load", "stage_reduce",
                                           "stage_between")}
    simulator = {"stage_bubble": mean("simulator", "stage_bubble")}
    for part in (trace, simulator):
        part["bubble"] = statistics.fmean(part["stage_bubble"])
    return {"steps": steps, "trace": trace, "simulator": simulator,
            "per_step": {str(s): v for s, v in per_step.items()}}


def report_lines(report: dict, title: str) -> list[str]:
    def row(values: Iterable[float]) -> str:
        return " / ".join(f"{v:.3f}" for v in values)

    t, s = report["trace"], report["simulator"]
    return [f"{title}: bubble per stage, trace {row(t['stage_bubble'])} (all {t['bubble']:.3f}); simulator at the "
            f"traced F, B, W costs {row(s['stage_bubble'])} (all {s['bubble']:.3f}); trace − simulator "
            f"{t['bubble'] - s['bubble']:+.3f}",
            f"  of each stage's pipeline phase in the trace: receiving (waits) {row(t['stage_recv'])}, sending "
            f"{row(t['stage_send'])}, loading {row(t['stage_load'])}, between instructions {row(t['stage_between'])}, "
            f"in reductions and the optimizer {row(t['stage_reduce'])}; the simulator's transfers and dispatch take no "
            "time"]


# ---- writing ---------------------------------------------------------------------------------------

def chrome_trace(records: list[dict], meta: dict) -> dict:
    """The Chrome trace-event JSON object (docs: "Trace Event Format"): per rank a process (its
    stage, replica and layers in the name), complete events ("X", µs) for the spans, the clocks and
    the bubble report in otherData."""
    origin = min(s[3] for r in records for spans in r["steps"].values() for s in spans)
    events: list[dict] = []
    for r in sorted(records, key=lambda r: r["rank"]):
        pid = r["rank"]
        where = f"rank {pid} · stage {r['stage']} · replica {r['replica']}" + (f" · tp {r['tp_rank']}" if r["tp_rank"] else "")
        events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": where}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
                   {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"name": "pipeline (device events)" if r["device_clock"] else "pipeline"}}]
        if r["device_clock"]:
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "host"}})
        for step, spans in r["steps"].items():
            for label, category, micro_batch, start, end in spans:
                args: dict = {"step": int(step)}
                if micro_batch is not None:
                    args["micro_batch"] = micro_batch
                if category == "compute":
                    args.update(stage=r["stage"], replica=r["replica"], layers=r["layers"])
                name = f"{label}{micro_batch}" if category == "compute" else (
                    label if micro_batch is None else f"{label} {micro_batch}")
                events.append({"name": name, "cat": category, "ph": "X", "pid": pid,
                               "tid": 1 if r["device_clock"] and category in ("data", "step") else 0,
                               "ts": (start - origin) / 1e3, "dur": (end - start) / 1e3, "args": args})
    clocks = {str(r["rank"]): {"host": r["host"], "device": r["device"], **r["clock"]} for r in records}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {**meta, "clocks": clocks, "clock_uncertainty_us": max(
                max(c["uncertainty_ns"], c["uncertainty_after_ns"]) for c in clocks.values()) / 1e3}}


def write_atomic(path: str, write) -> None:
    """`write(tmp_path)` then rename to `path`: the file is whole or absent."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def write_timeline(stem: str, records: list[dict], meta: dict) -> tuple[list[str], dict]:
    """STEM.json and STEM.png from every rank's records; (paths, bubble report)."""
    from trainer.gantt import gantt

    report = bubble_report(records)
    trace = chrome_trace(records, {**meta, "steps": report["steps"], "bubble": report})

    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(trace, f)

    write_atomic(stem + ".json", dump)
    write_atomic(stem + ".png", lambda tmp: gantt(records, report, meta, tmp))
    return [stem + ".json", stem + ".png"], report


class Timeline:
    """The trainer's side of train.trace_steps: begin and end each traced step, and write the files
    once the last one ended (`stem`: their path without the extension)."""

    def __init__(self, engine, layout, steps: Iterable[int], stem: str, meta: dict, log=print):
        from parallel.trace import StepTracer

        self.tracer = StepTracer(engine, steps, layout)
        self.stem, self.meta, self.log = stem, meta, log
        self.rank = layout.rank
        self.paths: list[str] = []
        self.report: dict | None = None

    def wants(self, step: int) -> bool:
        return self.tracer.wants(step)

    def begin(self, step: int) -> None:
        self.tracer.begin(step)

    def span(self, label: str, category: str):
        return self.tracer.span(label, category)

    def end(self) -> None:
        self.tracer.end()
        if not self.tracer.pending():
            self.write()

    def write(self) -> None:
        records = self.tracer.records()
        if records is not None:
            self.paths, self.report = publish(self.stem, records, self.meta, self.log,
                                              f"timeline of steps {', '.join(map(str, self.tracer.steps))}")


def publish(stem: str, records: list[dict], meta: dict, log, title: str) -> tuple[list[str], dict | None]:
    """`write_timeline` and its lines for the log: where the files are, how well the clocks agree, the
    bubble of the trace and the simulator's. A place that cannot be written gets one line, and
    nothing (training goes on); ([], None) then."""
    try:
        paths, report = write_timeline(stem, records, meta)
    except OSError as e:
        log(f"{title}: not written ({e.strerror or e}: {getattr(e, 'filename', None) or stem}); training goes on")
        return [], None
    clocks = [r["clock"] for r in records]
    worst = max(max(c["uncertainty_ns"], c["uncertainty_after_ns"]) for c in clocks) / 1e3
    drift = max(abs(c["offset_after_ns"] - c["offset_ns"]) for c in clocks) / 1e3
    log(f"{title}: {paths[0]} (open it in ui.perfetto.dev or chrome://tracing) and {paths[1]}; clocks aligned to "
        f"rank 0 within ±{worst:.0f} µs (drift {drift:.0f} µs over the traced steps)")
    for line in report_lines(report, f"  {meta.get('schedule_title', '')} pp={meta.get('pp')}"):
        log(line)
    return paths, report


def trainer_timeline(trainer, steps: Iterable[int] | None = None, stem: str | None = None) -> Timeline | None:
    """The Timeline of a trainer's `steps` (default: train.trace_steps) after this launch's step,
    written to `stem` (default: run_dir/timeline-A-B); None when there is none to trace. Steps at or
    before the step this launch resumed at ran before it (a requeued job): not traced, said once."""
    from parallel.schedules import SCHEDULES
    from trainer.progress import note0

    cfg = trainer.cfg
    steps = sorted(set(cfg.train.trace_steps if steps is None else steps))
    gone = [s for s in steps if s <= trainer.step]
    if gone:
        note0(cfg.run_dir, f"train.trace_steps: step{'s' * (len(gone) > 1)} {', '.join(map(str, gone))} ran before "
              f"this launch (it resumes after step {trainer.step}): not traced")
    steps = [s for s in steps if s > trainer.step]
    if not steps:
        return None
    layout, m = trainer.layout, cfg.model
    meta = {"schedule": cfg.parallel.schedule, "schedule_title": SCHEDULES[cfg.parallel.schedule].title,
            "pp": layout.pp, "tp": layout.tp, "dp": layout.dp, "micro_batches": cfg.train.micro_batches,
            "precision": cfg.parallel.precision, "model": f"{m.encoder_layers}L-{m.decoder_layers}L d={m.d_model}",
            "run_dir": cfg.run_dir}
    stem = stem or os.path.join(cfg.run_dir, stem_name(steps))
    return Timeline(trainer.engine, layout, steps, stem, meta, log=lambda line: note0(cfg.run_dir, line))

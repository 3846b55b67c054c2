"""Metrics that survive resumes and rollbacks: each step once, one header.

DeepSpeed's monitors append: its CSV monitor writes a header the first time each process writes a
metric, and TensorBoard keeps every event file. After resuming (or rolling back) at step S, rank 0
rewrites every `metrics/train/*.csv` to its header and the rows of steps ≤ S (dropping headers
repeated by older versions) and tells the CSV monitor the header exists; the TensorBoard writer is
reopened with `purge_step=S+1`, so TensorBoard discards the events of steps > S from earlier files.

DeepSpeed also logs its own `Train/Samples/lr` keyed by samples, not steps; it duplicates
`train/lr` and would be cut wrongly by a step-based purge, so it is not written.
"""
from __future__ import annotations

import csv
import io
import os

SAMPLE_KEYED = "Train/Samples/"


def _truncate_csv(path: str, step: int) -> None:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    header, kept = None, []
    for row in rows:
        if not row:
            continue
        if row[0] == "step":
            header = header or row
            continue
        try:
            if int(float(row[0])) <= step:
                kept.append(row)
        except ValueError:
            continue
    out = io.StringIO()
    writer = csv.writer(out)
    if header:
        writer.writerow(header)
    writer.writerows(kept)
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        f.write(out.getvalue())
    os.replace(tmp, path)


def install(engine) -> None:
    """Drop DeepSpeed's sample-keyed events (see the module doc); call once per engine."""
    monitor = engine.monitor
    original = monitor.write_events

    def write_events(events):
        original([e for e in events if not str(e[0]).startswith(SAMPLE_KEYED)])

    monitor.write_events = write_events


def rewind(engine, step: int) -> None:
    """Forget every logged value of a step after `step` (rank 0 holds the monitors)."""
    monitor = engine.monitor
    csv_monitor = getattr(monitor, "csv_monitor", None)
    if csv_monitor is not None and csv_monitor.enabled and csv_monitor.log_dir:
        for name in sorted(os.listdir(csv_monitor.log_dir)):
            if name.endswith(".csv") and not name.startswith("Train_Samples"):
                _truncate_csv(os.path.join(csv_monitor.log_dir, name), step)
                if name[:-4] not in csv_monitor.filenames:
                    csv_monitor.filenames.append(name[:-4])
    tb = getattr(monitor, "tb_monitor", None)
    if tb is not None and getattr(tb, "summary_writer", None) is not None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = tb.summary_writer.get_logdir()
        tb.summary_writer.close()
        tb.summary_writer = SummaryWriter(log_dir=log_dir, purge_step=step + 1)


# ---- events from a process without an engine (./run.sh train after its ranks ended) -----------

CSV_DIR = os.path.join("metrics", "train")  # where DeepSpeed's CSV monitor writes (parallel/engine_config.py)
TENSORBOARD_DIR = os.path.join("tensorboard", "train")


def _append_csv(path: str, header: str, step: int, value: float) -> None:
    """A row `step,value` in one of the monitor's CSV files (a new file gets its header; a row of
    the same step is replaced, so an evaluation repeated at a step is there once)."""
    rows: list[list[str]] = []
    if os.path.exists(path):
        with open(path, newline="", encoding="utf-8") as f:
            rows = [row for row in csv.reader(f) if row]
    if not rows or rows[0][0] != "step":
        rows.insert(0, ["step", header])
    rows = [rows[0]] + [row for row in rows[1:] if row[0] != str(step)] + [[str(step), repr(float(value))]]
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    tmp = path + ".tmp"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        f.write(out.getvalue())
    os.replace(tmp, path)


def record(run_dir: str, events: list[tuple[str, float, int]], tensorboard_only: list = ()) -> None:
    """Write (tag, value, step) events into the run's metrics as DeepSpeed's monitors name them:
    `metrics/train/<tag, / as _>.csv` with the header `step,<last part of tag>`, and scalars in
    `tensorboard/train`; `tensorboard_only` events go to TensorBoard alone."""
    from torch.utils.tensorboard import SummaryWriter

    os.makedirs(os.path.join(run_dir, CSV_DIR), exist_ok=True)
    for tag, value, step in events:
        name = tag.replace("/", "_").replace(" ", "_")
        _append_csv(os.path.join(run_dir, CSV_DIR, name + ".csv"), tag.split("/")[-1], step, value)
    writer = SummaryWriter(log_dir=os.path.join(run_dir, TENSORBOARD_DIR))
    try:
        for tag, value, step in [*events, *tensorboard_only]:
            writer.add_scalar(tag, value, step)
    finally:
        writer.close()


def score_events(rows: list[dict], step: int) -> tuple[list, list]:
    """Events of an evaluation table (translate/evaluate.py's rows: direction, sentences and a
    column per metric): (the all-direction means as `eval/<metric>`, each direction and the X→En /
    En→X means as `eval/<metric>/<direction>`)."""
    means, each = [], []
    names = {"all average": None, "X→En average": "xx-en", "En→X average": "en-xx"}
    for row in rows:
        direction = names.get(row["direction"], row["direction"])
        for metric, value in row.items():
            if metric in ("direction", "sentences") or not isinstance(value, (int, float)):
                continue
            if direction is None:
                means.append((f"eval/{metric}", float(value), step))
            else:
                each.append((f"eval/{metric}/{direction}", float(value), step))
    return means, each

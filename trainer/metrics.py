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

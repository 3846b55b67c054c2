"""Watching a run: progress lines with step/total, elapsed time, an ETA from this launch's step rate
and timestamps (a tqdm bar on a terminal, plain lines elsewhere), the same lines in
<run_dir>/train.log across launches, the step-0 validation and the end-of-training BLEU/chrF in the
CSVs and TensorBoard, summary.json's paths relative to the run directory, and a finished run
recognised before any rank starts. The last test is a real ./run.sh train, called from another
folder, launched three times."""
from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess

import pytest

from tests.conftest import ROOT, write_run_config

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
STEP_LINE = re.compile(rf"^{STAMP} \| step (\d+) \| loss [\d.]+ \| lr [\d.]+e[-+]\d+ \| grad norm [\d.]+ \| tokens/s \d+ "
                       rf"\| (\d+)/(\d+) \d+% \| elapsed (\d+:\d\d:\d\d) \| ETA (\d+:\d\d:\d\d) \(\d\d:\d\d:\d\d\)$", re.M)


class Clock:
    """A clock the test sets: the Progress reads time through it."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_eta_follows_this_launchs_step_rate_and_the_log_keeps_every_launch(tmp_path):
    from trainer.progress import Progress

    clock, console = Clock(), io.StringIO()
    progress = Progress(str(tmp_path), 100, 400, console=console, clock=clock)
    clock.now += 25.0  # start-up and the step-0 validation: in the elapsed time, not in the rate
    progress.start_steps()
    clock.now += 60.0  # 30 steps in 60 s: 2 s per step, 270 steps left
    progress.report(130, 5.79791, 9.1e-4, 1.5683, 4594.4)
    line = console.getvalue().splitlines()[-1]
    match = STEP_LINE.match(line)
    assert match, line
    assert match.groups() == ("130", "130", "400", "0:01:25", "0:09:00")
    assert f"| step 130 | loss 5.7979 | lr 9.100e-04 | grad norm 1.568 | tokens/s 4594 | 130/400 {130 / 400:.0%} |" in line
    progress.log("step 130 | valid loss 5.1000")
    progress.close()
    assert "\r" not in console.getvalue()  # no bar where the console is not a terminal

    # a resumed launch appends; each launch begins with its own line
    clock.now += 3600.0
    second = Progress(str(tmp_path), 130, 400, console=io.StringIO(), clock=clock)
    second.start_steps()
    clock.now += 10.0
    second.report(135, 5.5, 9e-4, 1.2, 4000)
    log = (tmp_path / "train.log").read_text().splitlines()
    assert [re.sub(rf"^{STAMP} \| ", "", x).split(" on ")[0] for x in log if "launch at" in x] == \
        ["launch at step 100 of 400", "launch at step 130 of 400"]
    steps = [STEP_LINE.match(x) for x in log]
    assert [(m.group(1), m.group(5)) for m in steps if m] == [("130", "0:09:00"), ("135", "0:08:50")]  # 265 steps at 2 s
    assert any(x.endswith("| step 130 | valid loss 5.1000") for x in log)
    # the console line and the file line are the same line
    assert line in log

    # a console that is train.log itself (experiments/depth_1000.py sends the ranks' output there):
    # each line once, the launch line included
    with open(tmp_path / "train.log", "a") as same:
        third = Progress(str(tmp_path), 135, 400, console=same, clock=clock)
        third.report(140, 5.4, 9e-4, 1.1, 4000)
    log = (tmp_path / "train.log").read_text().splitlines()
    assert sum("launch at step 135 of 400" in x for x in log) == 1 and sum("| step 140 |" in x for x in log) == 1

    # not rank 0: nothing anywhere
    quiet = Progress(str(tmp_path / "other"), 0, 10, enabled=False, console=console, clock=clock)
    quiet.report(5, 1.0, 1e-3, 1.0, 10.0)
    assert not (tmp_path / "other").exists()


def test_a_terminal_gets_a_bar_above_which_the_lines_scroll(tmp_path):
    from trainer.progress import Progress

    clock, terminal = Clock(), Terminal()
    progress = Progress(str(tmp_path), 0, 300, console=terminal, clock=clock)
    progress.start_steps()
    for step in range(1, 91):
        clock.now += 1.0
        progress.advance(step)
    progress.report(90, 5.0, 1e-3, 1.0, 100.0)
    progress.advance(85)  # a rollback to step 85
    progress.close()
    shown = terminal.getvalue()
    assert "\r" in shown and "90/300" in shown and "85/300" in shown
    assert re.search(rf"{STAMP} \| step 90 \| loss 5.0000 .* \| 90/300 30% \| elapsed 0:01:30 \| ETA 0:03:30", shown)


def test_a_real_pseudo_terminal_shows_the_bar(tmp_path):
    """Rank 0's stdout a pseudo-terminal that reports no size (0 × 0, as under `script` or some CI
    runners; tqdm would then hide its bar): the bar is drawn all the same, 100 columns wide."""
    import pty
    import select
    import sys

    code = f"""
from trainer.progress import Progress
p = Progress({str(tmp_path)!r}, 0, 10)
p.start_steps()
for s in range(1, 11):
    p.advance(s)
    if s == 5:
        p.report(5, 1.0, 1e-3, 1.0, 100.0)
p.close()
"""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=slave, stderr=slave, close_fds=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, cwd=str(tmp_path))
    os.close(slave)
    out = b""
    while select.select([master], [], [], 60)[0]:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    assert proc.wait(timeout=60) == 0
    text = out.decode()
    assert re.search(r"\r100%\|█+\| 10/10 \[", text), text[-2000:]
    assert re.search(rf"{STAMP} \| step 5 \| loss 1.0000 .* \| 5/10 50% \|", text), text[-2000:]


def test_metrics_from_outside_the_engine_are_written_as_the_monitors_write_them(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainer import metrics

    rows = [{"direction": "de-en", "sentences": 50, "BLEU": 20.5, "chrF": 45.25},
            {"direction": "en-de", "sentences": 50, "BLEU": 10.5, "chrF": 35.25},
            {"direction": "all average", "sentences": 100, "BLEU": 15.5, "chrF": 40.25}]
    means, each = metrics.score_events(rows, 300)
    assert means == [("eval/BLEU", 15.5, 300), ("eval/chrF", 40.25, 300)]
    assert ("eval/BLEU/de-en", 20.5, 300) in each and len(each) == 4
    metrics.record(str(tmp_path), means, tensorboard_only=each)
    metrics.record(str(tmp_path), [("eval/BLEU", 16.0, 300), ("eval/BLEU", 17.0, 400)])  # step 300 again: replaced
    with open(tmp_path / "metrics" / "train" / "eval_BLEU.csv", newline="") as f:
        assert list(csv.reader(f)) == [["step", "BLEU"], ["300", "16.0"], ["400", "17.0"]]
    events = EventAccumulator(str(tmp_path / "tensorboard" / "train"))
    events.Reload()
    assert {"eval/BLEU", "eval/chrF", "eval/BLEU/de-en", "eval/chrF/en-de"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("eval/chrF/en-de")] == [(300, 35.25)]


def _csv(path) -> dict[int, float]:
    with open(path, newline="") as f:
        return {int(float(r[0])): float(r[1]) for r in csv.reader(f) if r and r[0] != "step"}


def test_a_short_run_shows_its_progress_keeps_train_log_and_is_recognised_when_finished(tiny_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, caller = tmp_path / "run", tmp_path / "caller"
    caller.mkdir()
    write_run_config(str(caller / "short.yaml"), str(run_dir), tiny_data,
                     train={"max_steps": 4, "micro_batches": 2, "log_interval": 2, "valid_interval": 2,
                            "save_interval": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(*extra: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([os.path.join(ROOT, "run.sh"), "train", "short.yaml", *extra], cwd=caller, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return proc

    out = train("--eval-sentences", "2").stdout
    lines = [m.group(0) for m in STEP_LINE.finditer(out)]
    assert [STEP_LINE.match(x).group(1, 2, 3) for x in lines] == [("2", "2", "4"), ("4", "4", "4")], out[-3000:]
    assert STEP_LINE.match(lines[-1]).group(5) == "0:00:00"  # nothing left
    log = (run_dir / "train.log").read_text()
    for line in lines:
        assert line in log.splitlines()
    assert re.search(rf"^{STAMP} \| step 4 \| test BLEU [\d.]+ \| chrF [\d.]+ ", log, re.M), log

    # the step-0 validation and the evaluation, in the CSVs and in TensorBoard
    summary = json.loads((run_dir / "summary.json").read_text())
    valid = _csv(run_dir / "metrics" / "train" / "valid_loss.csv")
    assert sorted(valid) == [0, 2, 4] and valid[0] == pytest.approx(summary["first_valid_loss"])
    assert summary["checkpoint"] == os.path.join("checkpoints", "step4") and summary["log"] == "train.log"
    assert (run_dir / summary["checkpoint"] / "manifest.json").exists()
    bleu = _csv(run_dir / "metrics" / "train" / "eval_BLEU.csv")
    assert list(bleu) == [4] and 0 <= bleu[4] <= 100
    events = EventAccumulator(str(run_dir / "tensorboard" / "train"))
    events.Reload()
    assert [e.step for e in events.Scalars("valid/loss")] == [0, 2, 4]
    assert [e.step for e in events.Scalars("eval/chrF")] == [4]
    # ./run.sh tensorboard RUN reads them with the environment's tensorboard, from the caller's folder
    shown = subprocess.run([os.path.join(ROOT, "run.sh"), "tensorboard", os.path.relpath(run_dir, caller), "--inspect"],
                           cwd=caller, env=env, capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0 and "valid/loss" in shown.stdout and "train/loss" in shown.stdout, shown.stderr

    # finished: said in one line, before any rank starts
    again = train()
    assert "is finished: its newest checkpoint is step 4, and it was launched with train.max_steps=4" in again.stdout
    assert "launching" not in again.stdout and "--set train.max_steps=8" in again.stdout  # no rank started

    # --set continues it: the ranks train the resolved config and config.json records it
    out = train("--set", "train.max_steps=6", "--eval-sentences", "0").stdout
    assert [STEP_LINE.match(m.group(0)).group(1, 3) for m in STEP_LINE.finditer(out)] == [("6", "6")]
    assert json.loads((run_dir / "config.json").read_text())["train"]["max_steps"] == 6
    log = (run_dir / "train.log").read_text()
    assert [x.split(" | ", 1)[1].split(" on ")[0] for x in log.splitlines() if "launch at step" in x] == \
        ["launch at step 0 of 4", "launch at step 4 of 6"]
    assert sorted(_csv(run_dir / "metrics" / "train" / "valid_loss.csv")) == [0, 2, 4, 6]

"""Run states and exit codes that are true, and every start and stop on record.

A run is finished only when it reached the train.max_steps it was last launched with
(trainer/run_dir.py `relaunch`). The launches of `./run.sh train` below (2 CPU ranks, pp = 2, one
run directory) stop it in every way a user or a cluster can — SIGUSR1, SIGINT (Ctrl-C), SIGHUP, a
rank killed — and relaunch it below, at and above its step; each launch's exit code, summary.json
(state, reason, exit code) and train.log lines (launch, resume, end) are checked. A second run
directory diverges (exit 3). SIGTERM's exit 75 is tests/test_faults.py's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, write_run_config
from tests.run_cli import Run, _gone
from trainer.run_dir import BELOW, END_HERE, FINISHED, TRAIN, relaunch


@pytest.mark.parametrize("step,max_steps,launched,verdict", [
    (None, 10, None, TRAIN), (4, 10, 10, TRAIN), (4, 10, 6, TRAIN),  # a new run; resumed below max_steps
    (10, 10, 10, FINISHED), (10, 4, 10, FINISHED), (10, 4, None, FINISHED),  # reached what it was launched with
    (12, 10, 10, FINISHED),  # past it (a rollback-free finish never is, but a reshard's max_steps may be)
    (47, 47, 60, END_HERE),  # stopped at 47 of 60: a launch asking for 47 ends it there
    (47, 40, 60, BELOW),  # stopped at 47 of 60: a launch asking for 40 is refused
])
def test_relaunch_verdicts(step, max_steps, launched, verdict):
    got, line = relaunch("runs/x", step, max_steps, launched)
    assert got == verdict
    if verdict == BELOW:
        assert line == ("runs/x is not finished: it stopped at step 47 of the train.max_steps=60 it was last launched "
                        "with (its config.json), and this launch's train.max_steps=40 is below step 47. To continue "
                        "it: --set train.max_steps=60 (or more); to end it at step 47: --set train.max_steps=47")


@pytest.fixture
def runs():
    yield Run
    Run.kill_all()


def _summary(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "summary.json")) as f:
        return json.load(f)


def _log(run_dir: str) -> list[str]:
    with open(os.path.join(run_dir, "train.log")) as f:
        return [line.rstrip("\n").split(" | ", 1)[1] for line in f]


def _cli(config: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", "train", config, "--eval-sentences", "0", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def _stop(run: Run, how) -> tuple[int, float]:
    """Stop a running launch after a training step: `how` is a signal for ./run.sh train, or
    "kill rank 1". (exit code, seconds until every process of the run was gone)."""
    run.wait_for(r"\| step \d+ \| loss")
    tree = run.tree()
    sent = time.monotonic()
    if how == "kill rank 1":
        rank1 = next(p for p in tree if p.environ().get("RANK") == "1")
        rank1.kill()
    else:
        run.proc.send_signal(how)
    code = run.proc.wait(timeout=120)
    _gone(tree, timeout=10)
    return code, time.monotonic() - sent


def test_every_ending_is_recorded_and_a_stopped_run_is_not_called_finished(tiny_data, tmp_path, runs):
    run_dir = str(tmp_path / "run")
    config = write_run_config(str(tmp_path / "run.yaml"), run_dir, tiny_data,
                              train={"max_steps": 2, "micro_batches": 2, "save_interval": 1, "valid_interval": 1000,
                                     "log_interval": 1, "stop_grace_seconds": 60})
    longer = ("--set", "train.max_steps=400")

    # 1. SIGUSR1 to ./run.sh train: checkpointed, exit 75, recorded as stopped; a clean stop is no ERROR
    run = Run(config, *longer)
    code, _ = _stop(run, signal.SIGUSR1)
    assert code == 75 and "ERROR" not in run.text() and "Traceback" not in run.text(), run.text()[-3000:]
    assert "_load_legacy_checkpoint" not in run.text()
    s = _summary(run_dir)
    step = s["steps"]
    assert (s["state"], s["exit_code"]) == ("stopped", 75) and s["reason"] == f"SIGUSR1: checkpointed at step {step}, " \
        "to be resumed" and s["checkpoint"] == f"checkpoints/step{step}" and step >= 1
    assert f"end | stopped: SIGUSR1: checkpointed at step {step}, to be resumed (exit code 75); newest checkpoint " \
        f"checkpoints/step{step}" in _log(run_dir)

    # 2. Relaunched with the YAML's max_steps (2), below the step it stopped at: not "finished", exit 2,
    #    before any rank starts, saying how to continue or end it; nothing recorded
    if step > 2:
        refused = _cli(config)
        assert refused.returncode == 2 and "launching" not in refused.stdout
        assert refused.stderr == (f"error: {run_dir} is not finished: it stopped at step {step} of the "
                                  f"train.max_steps=400 it was last launched with (its config.json), and this launch's "
                                  f"train.max_steps=2 is below step {step}. To continue it: --set train.max_steps=400 "
                                  f"(or more); to end it at step {step}: --set train.max_steps={step}\n")

    # 3. Ctrl-C (SIGINT): every rank stops at once, without a checkpoint; exit 130; recorded by ./run.sh
    run = Run(config, *longer)
    code, seconds = _stop(run, signal.SIGINT)
    assert code == 130 and seconds < 5 and "Traceback" not in run.text(), (code, seconds, run.text()[-3000:])
    assert "_load_legacy_checkpoint" not in run.text()  # DeepSpeed's print on resume is not the console's
    s = _summary(run_dir)
    assert (s["state"], s["exit_code"]) == ("stopped", 130)
    assert s["reason"] == "SIGINT (Ctrl-C): every rank stopped at once, without a checkpoint"
    log = _log(run_dir)
    assert f"resumed from {run_dir}/checkpoints/step{step} at step {step} (verified)" in log  # the start, on record
    assert log[-1].startswith("end | stopped: SIGINT (Ctrl-C): every rank stopped at once, without a checkpoint "
                              "(exit code 130); newest checkpoint checkpoints/step")

    # 4. SIGHUP (the terminal closed): the same, exit 129
    code, _ = _stop(Run(config, *longer), signal.SIGHUP)
    assert code == 129 and _summary(run_dir)["reason"].startswith("SIGHUP (the terminal closed): every rank stopped")

    # 5. A rank killed: the others are ended, the launch fails with the rank's status (128 + 9)
    code, _ = _stop(Run(config, *longer), "kill rank 1")
    s = _summary(run_dir)
    assert code == 137 and (s["state"], s["exit_code"]) == ("failed", 137)
    assert re.fullmatch(r"rank 1 \(PID \d+\) died \(signal SIGKILL\)", s["reason"]), s["reason"]

    # 6. A launch asking for exactly the step it stopped at ends the run there: exit 0, finished
    newest = int(_summary(run_dir)["checkpoint"][len("checkpoints/step"):])
    ended = _cli(config, "--set", f"train.max_steps={newest}")
    assert ended.returncode == 0 and "launching" not in ended.stdout
    assert ended.stdout.strip() == (f"{run_dir} stopped at step {newest} of the train.max_steps=400 it was launched "
                                    f"with; this launch's train.max_steps={newest} ends it there (recorded as finished)")
    s = _summary(run_dir)
    assert (s["state"], s["exit_code"], s["steps"]) == ("finished", 0, newest)
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["train"]["max_steps"] == newest

    # 7. Now finished: the YAML's launch says so and exits 0
    again = _cli(config)
    assert again.returncode == 0 and again.stdout.startswith(f"{run_dir} is finished: its newest checkpoint is step "
                                                             f"{newest}, and it was launched with train.max_steps={newest}")

    # 8. Settings that differ from the recorded config are listed before any rank starts
    changed = _cli(config, "--set", f"train.max_steps={newest + 1}", "--set", "train.clip_norm=0.5")
    assert changed.returncode == 0, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert changed.stdout.splitlines()[0] == (f"resuming {run_dir} with settings changed since its last launch "
                                              f"(config.json): train.max_steps {newest} → {newest + 1}; "
                                              "train.clip_norm 0.0 → 0.5")
    assert "resumed with the config's train.clip_norm 0 → 0.5 (the checkpoint had the old values)" in _log(run_dir)
    assert _summary(run_dir)["reason"] == f"reached train.max_steps={newest + 1}"


def test_a_divergence_stop_exits_3_and_is_recorded(tiny_data, tmp_path):
    run_dir = str(tmp_path / "diverging")
    config = write_run_config(str(tmp_path / "diverge.yaml"), run_dir, tiny_data,
                              train={"max_steps": 30, "lr": 5.0, "warmup_steps": 0, "divergence_window": 1,
                                     "divergence_spike_factor": 1.05, "save_interval": 1000, "valid_interval": 1000})
    proc = _cli(config)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = _summary(run_dir)
    assert (s["state"], s["exit_code"]) == ("diverged", 3) and "train.divergence_policy=stop" in s["reason"]
    refused = int(re.match(r"step (\d+): ", s["reason"]).group(1))
    assert s["steps"] == refused - 1  # the steps applied: not the one whose update was refused
    assert _log(run_dir)[-1].startswith(f"end | diverged: step {refused}: ")


def test_a_closed_output_before_the_ranks_start_is_no_finish(tiny_data, tmp_path):
    """`./run.sh train … | head -3` whose reader is gone before the ranks start: exit 141 (a shell's
    for SIGPIPE), nothing trained or recorded, no traceback; `config` the same."""
    run_dir = str(tmp_path / "run")
    config = write_run_config(str(tmp_path / "run.yaml"), run_dir, tiny_data, train={"max_steps": 2})
    for command in (["train", config, "--eval-sentences", "0"], ["config", config]):
        read, write = os.pipe()
        os.close(read)  # the reader went away before the first line
        proc = subprocess.run([sys.executable, "-m", "launcher.cli", *command], cwd=ROOT, stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
        os.close(write)
        assert proc.returncode == 141 and "Traceback" not in proc.stderr, (command[0], proc.returncode, proc.stderr)
    left = set(os.listdir(run_dir)) & {"config.json", "summary.json", "train.log", "checkpoints"}
    assert not left, left


def test_a_run_ended_where_it_stopped_keeps_that_launchs_numbers_and_is_not_requeued(tmp_path):
    """END_HERE (stopped at 3 of 6, relaunched with max_steps=3): summary.json keeps the numbers of
    the launch that reached step 3 under its new state, and the stop's requeue marker is gone."""
    from checkpoint import manifest
    from launcher.preflight import end_run_here
    from trainer.config import RunConfig
    from trainer.run_dir import PREEMPTED_MARKER

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step3").mkdir(parents=True)
    (run_dir / "checkpoints" / "step3" / "weights.pt").write_bytes(b"w" * 64)
    manifest.commit(str(run_dir / "checkpoints"), "step3", 3)
    stopped = {"steps": 3, "max_steps": 6, "last_valid_loss": 6.8, "mean_target_tokens_per_s": 5000.0, "state": "stopped",
               "reason": "SIGTERM: checkpointed at step 3, to be resumed", "exit_code": 75,
               "checkpoint": "checkpoints/step3", "log": "train.log"}
    (run_dir / "summary.json").write_text(json.dumps(stopped))
    (run_dir / PREEMPTED_MARKER).write_text("{}")
    cfg = RunConfig()
    cfg.run_dir = str(run_dir)
    end_run_here(cfg, {"train": {"max_steps": 6}}, "")
    assert _summary(str(run_dir)) == {**stopped, "max_steps": 3, "state": "finished", "exit_code": 0,
                                      "reason": "ended at step 3 by a launch with train.max_steps=3 (it had been "
                                                "launched with 6)"}
    assert not (run_dir / PREEMPTED_MARKER).exists()
    assert json.loads((run_dir / "config.json").read_text())["train"]["max_steps"] == 3
    assert _log(str(run_dir))[-1] == ("end | finished: ended at step 3 by a launch with train.max_steps=3 (it had "
                                      "been launched with 6) (exit code 0); newest checkpoint checkpoints/step3")

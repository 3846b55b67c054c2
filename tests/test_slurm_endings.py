"""A run ended where it stopped, through `./run.sh slurm` on the real SLURM cluster of
tests/test_slurm.py (tests/conftest.py `slurm_cluster`: one per session, shared with it).

Job E (configs/slurm-tiny.yaml, 200 steps) is preempted after its first steps, the way
`sbatch --signal=B:USR1@T` does, and cancelled once it has requeued itself: a run stopped at step
S of 200, as a user finds one whose job ran out of allocation. `./run.sh slurm … --set
train.max_steps=S --submit` then ends it there. No `./run.sh train` check runs in that job, so its
ranks must leave the run as `./run.sh train` would: summary.json says finished (with every key),
config.json's max_steps is S, and the next launch at or below S finds it finished instead of
"not finished".
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from tests.conftest import ROOT
from tests.test_slurm import CONFIG, committed_steps, job_info, log_of, submit, wait_in_log, wait_until_ended
from trainer.run_dir import SUMMARY_KEYS


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _wait_for_the_run_lock(run_dir: str, timeout: float = 300) -> None:
    from launcher.runlock import RunDirBusy, RunLock

    deadline = time.monotonic() + timeout  # only keeps a hang from lasting
    while True:
        try:
            RunLock(run_dir).acquire().release()
            return
        except RunDirBusy:
            assert time.monotonic() < deadline, f"{run_dir} is still locked"
            time.sleep(0.5)


def test_a_run_ended_where_it_stopped_under_slurm_is_finished_for_the_next_launch(slurm_cluster, tiny_data,
                                                                                  tmp_path_factory):
    env = slurm_cluster
    run_dir = str(tmp_path_factory.mktemp("slurm-endings") / "ended")
    job = submit(env, run_dir, tiny_data)
    wait_in_log(run_dir, job, 0, r"\| step 1 \| loss")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=60)
    wait_in_log(run_dir, job, 0, rf"requeueing job {job}$")
    subprocess.run(["scancel", job], env=env, check=True, timeout=60)  # the allocation is gone
    info = wait_until_ended(env, job, run_dir, restarts=1)
    assert info["JobState"] == "CANCELLED", (info, log_of(run_dir, job)[-4000:])
    _wait_for_the_run_lock(run_dir)  # a rank of the start SLURM cancelled may still be leaving
    step = committed_steps(run_dir)[-1]
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["train"]["max_steps"] == 200 > step  # stopped, not finished

    ended = _cli(env, "slurm", CONFIG, "--nodes", "2", "--gpus-per-node", "0", "--partition", "test",
                 "--run-dir", run_dir, "--cpus-per-task", "1", "--set", f"train.max_steps={step}", "--submit")
    assert ended.returncode == 0, ended.stdout[-3000:] + ended.stderr[-3000:]
    assert (f"note: {run_dir} stopped at step {step} of the train.max_steps=200 it was launched with; this launch's "
            f"train.max_steps={step} ends it there (recorded as finished)") in ended.stderr
    second = re.search(r"submitted job (\d+)", ended.stdout).group(1)
    info = wait_until_ended(env, second, run_dir)
    log = log_of(run_dir, second)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "training ended with exit code 0" in log and f"step {step + 1} |" not in log

    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert list(summary) == list(SUMMARY_KEYS), summary
    assert (summary["state"], summary["exit_code"], summary["steps"], summary["max_steps"]) == ("finished", 0, step, step)
    assert summary["reason"] == (f"ended at step {step} by a launch with train.max_steps={step} (it had been launched "
                                 f"with 200)")
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["train"]["max_steps"] == step
    assert not os.path.exists(os.path.join(run_dir, "preempted.json"))

    # The next launches find it finished: at its step, and below it (which a stopped run refuses)
    for max_steps in sorted({step, max(step - 1, 1)}):
        again = _cli(env, "train", CONFIG, "--run-dir", run_dir, "--eval-sentences", "0",
                     "--set", f"train.max_steps={max_steps}")
        assert again.returncode == 0 and again.stdout.startswith(
            f"{run_dir} is finished: its newest checkpoint is step {step}, and it was launched with "
            f"train.max_steps={step}"), again.stdout[-3000:] + again.stderr[-3000:]
    assert job_info(env, second)["JobState"] == "COMPLETED"

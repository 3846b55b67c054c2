"""The generated SLURM job, run by a real SLURM cluster of two nodes on this machine.

tests/slurm/start.sh starts Debian's munged, slurmctld and two slurmd (node1, node2). Two jobs of
`./run.sh slurm configs/slurm-tiny.yaml --nodes 2 --gpus-per-node 0 --submit` run side by side,
each a 2-stage pipeline with one stage per node:
- job A trains to the end; its per-step losses must equal the single-process reference;
- job B gets SIGUSR1 the way `sbatch --signal=B:USR1@T` delivers it (to the batch shell). It must
  save a checkpoint, requeue itself, resume from that checkpoint and finish with exactly job A's
  losses at every step.
Installing and running the daemons needs root on Debian; elsewhere the test is skipped and says why.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time

import pytest

from launcher.config import load_config
from tests.reference import reference_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "slurm")
CONFIG = os.path.join(ROOT, "configs", "slurm-tiny.yaml")
REFERENCE_STEPS = 20
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


def _unavailable() -> str | None:
    """Why a SLURM cluster cannot be run here, or None after making sure it is installed."""
    if os.geteuid() != 0:
        return "needs root to install and run slurmctld/slurmd/munge"
    if not os.path.exists("/etc/debian_version"):
        return "needs Debian's slurmctld/slurmd/munge packages (not a Debian system)"
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, "install.sh")], capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        return proc.stderr.strip() or "tests/slurm/install.sh failed"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _unavailable()
    if reason:
        # pytest -q hides skip reasons; this one should be seen.
        print(f"\ntests/test_slurm.py skipped: {reason}", file=sys.__stderr__, flush=True)
        pytest.skip(reason)
    state = str(tmp_path_factory.mktemp("slurm"))
    env = dict(os.environ, SLURM_CONF=os.path.join(state, "slurm.conf"))
    try:
        proc = subprocess.run(["bash", os.path.join(SCRIPTS, "start.sh"), state], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"the SLURM cluster did not start:\n{proc.stderr}"
        yield env
    finally:
        subprocess.run(["bash", os.path.join(SCRIPTS, "stop.sh"), state], timeout=120)


def submit(env: dict, run_dir: str, data_dir: str) -> str:
    os.makedirs(run_dir)
    os.symlink(data_dir, os.path.join(run_dir, "data"))  # the session's prepared tiny corpus
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "slurm", CONFIG, "--nodes", "2",
                           "--gpus-per-node", "0", "--run-dir", run_dir, "--submit"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert proc.returncode == 0 and found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return found.group(1)


def job_info(env: dict, job: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def log_of(run_dir: str, job: str) -> str:
    path = os.path.join(run_dir, "slurm", "logs", f"slurm-tiny-{job}.out")
    return open(path, encoding="utf-8").read() if os.path.exists(path) else ""


def wait_until_ended(env: dict, job: str, run_dir: str, restarts: int = 0, timeout: float = 600) -> dict:
    """Poll scontrol until the job has ended after `restarts` requeues; generous for a busy machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = job_info(env, job)
        if info.get("JobState") in ENDED and int(info.get("Restarts", 0)) >= restarts:
            return info
        time.sleep(1)
    raise AssertionError(f"job {job} did not end within {timeout} s: {job_info(env, job)}\n"
                         f"{log_of(run_dir, job)[-4000:]}")


def losses(run_dir: str) -> list[tuple[int, float]]:
    """(step, loss) as the trainer's CSV monitor wrote them, over every launch of the run."""
    with open(os.path.join(run_dir, "metrics", "train", "train_loss.csv"), newline="") as f:
        return [(int(row[0]), float(row[1])) for row in csv.reader(f) if row[0] != "step"]


@pytest.fixture(scope="module")
def jobs(cluster, tiny_data, tmp_path_factory):
    """Submit A and B together; preempt B once its training has begun."""
    work = tmp_path_factory.mktemp("slurm-jobs")
    runs = {"A": str(work / "plain"), "B": str(work / "preempted")}
    ids = {name: submit(cluster, run_dir, tiny_data) for name, run_dir in runs.items()}
    deadline = time.monotonic() + 600
    while "step 1 |" not in log_of(runs["B"], ids["B"]):
        state = job_info(cluster, ids["B"]).get("JobState")
        assert state not in ENDED and time.monotonic() < deadline, (
            f"job B ({state}) never reached its first step:\n{log_of(runs['B'], ids['B'])[-4000:]}")
        time.sleep(0.2)
    # Exactly what SLURM does for --signal=B:USR1@T when the time limit nears.
    subprocess.run(["scancel", "--signal=USR1", "--batch", ids["B"]], env=cluster, check=True, timeout=60)
    return cluster, ids, runs


def test_generated_job_trains_pp2_across_two_nodes_with_reference_losses(jobs):
    env, ids, runs = jobs
    job, run_dir = ids["A"], runs["A"]
    info = wait_until_ended(env, job, run_dir)
    log = log_of(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert info["NodeList"] == "node[1-2]" and info["NumNodes"] == "2" and info["NumTasks"] == "2"
    assert "master node1:" in log and "2 stages" in log

    cfg = load_config(CONFIG, {"run_dir": run_dir})
    got = losses(run_dir)
    assert [step for step, _ in got] == list(range(1, cfg.train.max_steps + 1))
    ref = reference_run(load_config(CONFIG, {"run_dir": run_dir}), REFERENCE_STEPS)
    assert [loss for _, loss in got[:REFERENCE_STEPS]] == pytest.approx(ref["loss"], rel=1e-5)

    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == cfg.train.max_steps
    assert summary["last_valid_loss"] < summary["first_valid_loss"] - 0.5, summary


def test_preempted_job_checkpoints_requeues_and_resumes_with_identical_losses(jobs):
    env, ids, runs = jobs
    job, run_dir = ids["B"], runs["B"]
    info = wait_until_ended(env, job, run_dir, restarts=1)
    log = log_of(run_dir, job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-4000:]
    assert info["Restarts"] == "1", log[-4000:]

    # The first start took the signal, checkpointed after step k and requeued the job ...
    marker = os.path.join(run_dir, "slurm", "logs", f"preempted.json.{job}.0")
    assert os.path.exists(marker), log[-4000:]
    with open(marker) as f:
        k = json.load(f)["step"]
    max_steps = load_config(CONFIG).train.max_steps
    assert 1 <= k < max_steps
    first, second = log.split(f"job {job} start 1 ")
    assert "preemption signal: asking the ranks to checkpoint" in first
    assert f"step {k} | preempted by SIGUSR1: saved checkpoint {run_dir}/checkpoints/step{k}" in first
    assert f"requeueing job {job}" in first and "== summary ==" not in first
    # ... and the second start resumed from that checkpoint and finished the run.
    assert re.search(rf"resumed from {re.escape(run_dir)}/checkpoints/step{k}\S* at step {k}\n", second), second
    assert f"step {k + 1} | loss" in second and f"step {k} | loss" not in second
    assert "training ended with exit code 0" in second

    # Every step ran once, and the losses are the uninterrupted job A's.
    got = losses(run_dir)
    assert [step for step, _ in got] == list(range(1, max_steps + 1))
    wait_until_ended(env, ids["A"], runs["A"])
    plain = losses(runs["A"])
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in plain], rel=1e-6)

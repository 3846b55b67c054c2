"""What tests/test_slurm.py's jobs share: the cluster's availability, submitting a generated job,
reading its state and log, and waiting for what it logs."""
from __future__ import annotations

import csv
import glob
import json
import os
import re
import subprocess
import sys
import time

from data.config import DataConfig
from tests.conftest import TINY_DATA
from trainer.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "slurm-tiny.yaml")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
         "DEADLINE", "PREEMPTED"}


def submit(env: dict, run_dir: str, data_dir: str, config: str = CONFIG, partition: str = "test",
           script_values: dict | None = None, nodes: str = "2") -> str:
    """`./run.sh slurm CONFIG --submit`; with `script_values`, the script's variables of that name are
    set first (e.g. FAULT_GRACE) and the script is submitted with sbatch."""
    # The job's data step must find the session's corpus up to date, not rebuild it in place.
    assert load_config(config).data == DataConfig(**TINY_DATA), f"{config} data ≠ TINY_DATA"
    os.makedirs(run_dir)
    os.symlink(data_dir, os.path.join(run_dir, "data"))  # the session's prepared tiny corpus
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "slurm", config, "--nodes", nodes,
                           "--gpus-per-node", "0", "--partition", partition, "--run-dir", run_dir,
                           "--cpus-per-task", "1",  # two jobs side by side on the 2-CPU nodes
                           *([] if script_values else ["--submit"])],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if script_values:
        script = os.path.join(run_dir, "slurm", "job.sbatch")
        text = open(script).read()
        for name, value in script_values.items():
            text, n = re.subn(rf"^{name}=\S+$", f"{name}={value}", text, flags=re.M)
            assert n == 1, name
        with open(script, "w") as f:
            f.write(text)
        proc = subprocess.run(["sbatch", "--parsable", script], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]
    found = re.search(r"submitted job (\d+)", proc.stdout)
    assert found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return found.group(1)


def job_info(env: dict, job: str) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True,
                         text=True, timeout=60).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def log_of(run_dir: str, job: str) -> str:
    found = glob.glob(os.path.join(run_dir, "slurm", "logs", f"*-{job}.out"))
    return open(found[0], encoding="utf-8", errors="replace").read() if found else ""


def wait_until_ended(env: dict, job: str, run_dir: str, restarts: int = 0, timeout: float = 600) -> dict:
    """Poll scontrol until the job has ended after `restarts` requeues; generous for a busy machine."""
    deadline = time.monotonic() + timeout
    ended_at = None
    while time.monotonic() < deadline:
        info = job_info(env, job)
        if info.get("JobState") in ENDED:
            ended_at = ended_at or time.monotonic()
            # Ended without the expected requeue: give SLURM a moment, then let the caller fail.
            if int(info.get("Restarts", 0)) >= restarts or time.monotonic() - ended_at > 10:
                return info
        else:
            ended_at = None
        time.sleep(1)
    raise AssertionError(f"job {job} did not end within {timeout} s: {job_info(env, job)}\n"
                         f"{log_of(run_dir, job)[-4000:]}")


def losses(run_dir: str) -> list[tuple[int, float]]:
    """(step, loss) as the trainer's CSV monitor wrote them, over every launch of the run."""
    with open(os.path.join(run_dir, "metrics", "train", "train_loss.csv"), newline="") as f:
        return [(int(row[0]), float(row[1])) for row in csv.reader(f) if row[0] != "step"]


def attempt_log(run_dir: str, job: str, attempt: int) -> str:
    """The part of the job's log written by its start number `attempt` (to the next start)."""
    parts = re.split(rf"^\S+ job {job} start (\d+) ", log_of(run_dir, job), flags=re.M)
    found = [parts[i + 1] for i in range(1, len(parts) - 1, 2) if parts[i] == str(attempt)]
    return found[-1] if found else ""


def wait_in_log(run_dir: str, job: str, attempt: int, pattern: str, timeout: float = 600) -> float:
    """Poll (10 ms) until attempt `attempt` of the job logged `pattern`; the monotonic time seen."""
    deadline = time.monotonic() + timeout
    while not re.search(pattern, attempt_log(run_dir, job, attempt), flags=re.M):
        assert time.monotonic() < deadline, f"job {job} attempt {attempt}: no {pattern!r}:\n{log_of(run_dir, job)[-4000:]}"
        time.sleep(0.01)
    return time.monotonic()


def rank_beat(run_dir: str, rank: int, launch: str, timeout: float = 600) -> dict:
    """Rank `rank`'s heartbeat record of `launch` (its PID and node) once it exists."""
    from runtime import heartbeat

    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(heartbeat.rank_path(run_dir, rank)) as f:
                record = json.load(f)
            if record["launch"] == launch:
                return record
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, f"no heartbeat of rank {rank} in launch {launch}"
        time.sleep(0.05)


def node_processes(node: str) -> dict:
    """Every process of fake node `node`, by process: its slurmd, its job steps' slurmstepd and their
    tasks; the values are their command lines."""
    import psutil

    found = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if cmd[:4] == ["slurmd", "-D", "-N", node] or p.environ().get("SLURMD_NODENAME") == node:
                found[p] = " ".join(cmd)
                parent = p.parent()
                if parent is not None and "slurmstepd" in " ".join(parent.cmdline()):
                    found[parent] = " ".join(parent.cmdline())
        except (psutil.Error, OSError):
            continue
    return found

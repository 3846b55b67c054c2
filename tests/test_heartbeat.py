"""Naming a lost or hung rank, and a SLURM job's account of its faults, without a cluster.

- Two gloo ranks: rank 1 stops (SIGSTOP) or stays behind in a phase while alive; rank 0's
  collective times out and it names rank 1 and its node in one line, from the heartbeats
  (runtime/heartbeat.py, launcher/worker.py report_lost_contact).
- launcher/faults.py on a run directory: an attempt SLURM ended (node failure) is counted at the
  next start, the same step failing twice stops the job, and so do more than MAX_FAULT_REQUEUES
  faults. The same paths on a real cluster: tests/test_slurm.py (jobs C and D).
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lost_rank(rank: int, port: int, run_dir: str, mode: str) -> None:
    """Rank 1 stops (SIGSTOP) or stays behind in a phase (alive); rank 0 names it when its
    collective times out, as launcher/worker.py does."""
    import datetime
    import signal

    import torch
    import torch.distributed as dist

    from launcher import worker
    from runtime import heartbeat

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", SLURMD_NODENAME=f"node{rank + 1}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=4))
    heartbeat.start(run_dir)
    heartbeat.at(3, "step end")
    dist.barrier()
    if rank == 1:
        heartbeat.at(3, "validation")
        if mode == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(60)  # alive, its heartbeat going on, never reaching rank 0's collective
    heartbeat.at(3, "validation")
    heartbeat.at(3, "checkpoint save")
    try:
        dist.recv(torch.zeros(1), src=1)
    except RuntimeError as e:
        worker.report_lost_contact(e, None, "0", 4)
    os._exit(0)


@pytest.mark.parametrize("mode, words", [
    ("stop", r"lost rank 1 on node2 \(PID \d+\) after step 3 \(checkpoint save\): stopped responding: no heartbeat "
             r"for \d+ s and no answer within train.collective_timeout_seconds=4"),
    ("behind", r"rank 1 on node2 \(PID \d+\) hung: alive \(its heartbeat goes on\) but stuck after step 3 "
               r"\(validation\), never reaching the collective after step 3 \(checkpoint save\)")])
def test_a_survivor_names_the_hung_rank_and_its_node(tmp_path, mode, words):
    """Rank 0's collective times out (4 s); it names rank 1 from the heartbeats, in one line."""
    code = ("import sys; from tests.test_heartbeat import _lost_rank; import torch.multiprocessing as mp; "
            "from runtime.distributed import free_port; "
            "ctx = mp.start_processes(_lost_rank, args=(free_port(), sys.argv[1], sys.argv[2]), nprocs=2, join=False); "
            "ctx.processes[0].join(60); [p.kill() for p in ctx.processes]")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - start
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and re.fullmatch(r"error: rank 0 \(node1\): " + words + r".*; stopping, the last "
                                            r"committed checkpoint is kept", lines[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    [path] = glob.glob(os.path.join(tmp_path, "heartbeat", "fault-*.json"))  # one report for the launch
    with open(path) as f:
        report = json.load(f)
    assert (report["kind"], report["ranks"], report["nodes"], report["step"]) == (
        "unresponsive" if mode == "stop" else "stuck", [1], ["node2"], 3)
    # not before the collective timed out (4 s), whatever the machine; the subprocess' timeout
    # only keeps a hang from lasting
    assert elapsed >= 4


def test_faults_counts_an_attempt_slurm_ended_and_stops_when_the_same_step_fails_again(tmp_path):
    """`begin` finds attempt 0, which SLURM ended (no `end`), records its survivor's report; a
    second fault at the same step in attempt 1 stops the job (stopped.json, exit 1)."""
    from runtime import heartbeat

    run_dir = str(tmp_path)
    os.makedirs(os.path.join(run_dir, "heartbeat"))
    os.makedirs(os.path.join(run_dir, "slurm"))

    def faults(*words: str, job: str = "7") -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launcher.faults", *words, "--job", job], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    assert faults("begin", run_dir, "--attempt", "0").returncode == 0
    report = {"kind": "died", "ranks": [1], "nodes": ["node6"], "step": 13, "where": "after step 13 (validation)",
              "line": "lost rank 1 on node6 (PID 42) after step 13 (validation): died"}
    with open(heartbeat.fault_path(run_dir, "7.0"), "w") as f:
        json.dump(report, f)
    first = faults("begin", run_dir, "--attempt", "1")  # SLURM requeued the job: attempt 0 never ended
    assert first.returncode == 0, first.stdout + first.stderr
    assert re.search(r"attempt 0 of job 7 \(on \S*\) was ended by SLURM, which requeued the job \(a node failure\): "
                     r"lost rank 1 on node6 \(PID 42\)", first.stdout), first.stdout
    with open(heartbeat.fault_path(run_dir, "7.1"), "w") as f:
        json.dump(dict(report, line=report["line"].replace("PID 42", "PID 43")), f)
    second = faults("end", run_dir, "--attempt", "1", "--rc", "1")
    assert second.returncode == 1, second.stdout + second.stderr
    assert "error: the same step failed 2 times in job 7 (attempts 0, 1; after step 13 (validation))" in second.stdout
    with open(os.path.join(run_dir, "stopped.json")) as f:
        assert json.load(f)["code"] == 1
    state = json.load(open(os.path.join(run_dir, "slurm", "faults.json")))
    assert [(f["attempt"], f["step"]) for f in state["faults"]] == [(0, 13), (1, 13)]
    # A fault at another step is requeued, up to MAX_FAULT_REQUEUES; a new job id counts afresh.
    os.remove(os.path.join(run_dir, "stopped.json"))
    for attempt in range(4):
        assert faults("begin", run_dir, "--attempt", str(attempt), job="8").returncode == 0
        with open(heartbeat.fault_path(run_dir, f"8.{attempt}"), "w") as f:
            json.dump(dict(report, step=10 * attempt), f)
        verdict = faults("end", run_dir, "--attempt", str(attempt), "--rc", "137", job="8")
        assert verdict.returncode == (10 if attempt < 3 else 1), (attempt, verdict.stdout)
    assert "4 faults in job 8, more than MAX_FAULT_REQUEUES=3: not requeued again" in verdict.stdout

"""The generated SLURM job, run by a real SLURM cluster of fake nodes on this machine.

tests/slurm/start.sh starts Debian's munged, slurmctld and nine slurmd (node1-node9) in four
partitions. Five jobs of `./run.sh slurm CONFIG --nodes 2 --gpus-per-node 0` (job E: `--nodes 1-2`)
run side by side, each with one rank per node (A-D a 2-stage pipeline):
- job A (configs/slurm-tiny.yaml) trains to the end; its per-step losses must equal the
  single-process reference;
- job B gets SIGUSR1 the way `sbatch --signal=B:USR1@T` delivers it (to the batch shell). It must
  save a checkpoint, requeue itself, resume from that checkpoint and finish with exactly job A's
  losses at every step;
- job C (40 steps, collective timeout 20 s, partition faults) loses rank 1 to SIGKILL in a
  checkpoint save, then has it hang (SIGSTOP): each time one line names the rank, node and PID,
  the attempt ends within a bound, the job requeues itself, and it ends with job A's losses;
- job D (partition nodeloss) loses rank 1's whole node (slurmd, slurmstepd, rank), is requeued
  onto the spare node after the node is set DOWN, loses rank 1 at the same step again and stops;
- job E (`--nodes 1-2`, partition elastic) starts on two nodes; one is drained and the job requeued:
  it goes on alone at the layout its start chooses, the checkpoint resharded, the global batch
  kept; the node back and the job requeued: on two again, with the reference's losses.
The cheap checks without a cluster are tests/test_slurm_script.py (the generated script, the rank
mapping, every config's layouts, a signal reaching one rank stopping all of them), and
tests/test_heartbeat.py (naming a lost rank and the job's fault accounting).
Installing and running the daemons needs root on Debian; elsewhere the test is skipped and says why
(the cluster is tests/conftest.py's `slurm_cluster`, one per session: tests/test_slurm_endings.py
runs on it too).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from schema.text import count
from tests.reference import reference_run
from tests.slurm_jobs import (
    CONFIG,
    ENDED,
    attempt_log,
    job_info,
    log_of,
    losses,
    node_processes,
    rank_beat,
    submit,
    wait_in_log,
    wait_until_ended,
)
from trainer.config import load_config
from trainer.run_dir import SUMMARY_KEYS

REFERENCE_STEPS = 20


# ---- faults injected into running jobs (C and D), each from a thread of its own ---------------------

FAULT_CONFIG = {"max_steps": 40, "save_interval": 5, "valid_interval": 1, "collective_timeout_seconds": 20}
"""Jobs C and D: slurm-tiny's model, data and optimizer (so their losses are job A's), 40 steps,
a checkpoint every 5 and validation after every step (a fault after a step's line lands in its
validation or checkpoint save), and a collective timeout of 20 s."""
FAULT_GRACE = 15  # job D's script: srun ended this long after the fault report


def job_config(path: str, run_dir: str, train: dict) -> str:
    """slurm-tiny's config at `path`, training into `run_dir` with `train`'s settings over its own."""
    import yaml

    values = yaml.safe_load(open(CONFIG))
    values["run_dir"] = run_dir
    values["train"].update(train)
    with open(path, "w") as f:
        yaml.safe_dump(values, f)
    return path


def inject_c(env: dict, job: str, run_dir: str, out: dict) -> None:
    """Job C: attempt 0 loses rank 1 (SIGKILL) right after step 10's validation (in its checkpoint
    save); attempt 1 has rank 1 hang (SIGSTOP) after step 22's line; attempt 2 finishes."""
    for attempt, (pattern, sig) in enumerate(((r"^.*step 10 \| valid loss", signal.SIGKILL),
                                              (r"^.*step 22 \| loss", signal.SIGSTOP))):
        beat = rank_beat(run_dir, 1, f"{job}.{attempt}")
        wait_in_log(run_dir, job, attempt, pattern)
        os.kill(beat["pid"], sig)
        fault = time.monotonic()
        ended = wait_in_log(run_dir, job, attempt, rf"requeueing job {job} after a fault")
        out[attempt] = {"pid": beat["pid"], "node": beat["node"], "seconds": ended - fault}


def inject_d(env: dict, job: str, run_dir: str, out: dict) -> None:
    """Job D: attempt 0 loses rank 1's whole node (slurmd, slurmstepd, the rank: SIGKILL) after
    step 13's line; the test then sets the node DOWN. Attempt 1, on the spare node, loses rank 1 at
    the same step again: the job stops."""
    beat = rank_beat(run_dir, 1, f"{job}.0")
    victims = node_processes(beat["node"])
    wait_in_log(run_dir, job, 0, r"^.*step 13 \| loss")
    for p in victims:
        p.kill()
    fault = time.monotonic()
    ended = wait_in_log(run_dir, job, 0, rf"requeueing job {job} after a fault")
    out[0] = {"pid": beat["pid"], "node": beat["node"], "seconds": ended - fault, "killed": sorted(victims.values())}
    subprocess.run(["scontrol", "update", f"nodename={beat['node']}", "state=down", "reason=lost in a test"],
                   env=env, check=True, timeout=60)
    beat = rank_beat(run_dir, 1, f"{job}.1")
    wait_in_log(run_dir, job, 1, r"^.*step 13 \| loss")
    os.kill(beat["pid"], signal.SIGKILL)
    fault = time.monotonic()
    ended = wait_in_log(run_dir, job, 1, r"training stopped and is not requeued")
    out[1] = {"pid": beat["pid"], "node": beat["node"], "seconds": ended - fault}


ELASTIC = {"max_steps": 40, "micro_batches": 2, "save_interval": 1000, "valid_interval": 1000}
"""Job E: slurm-tiny's model and data, 2 micro-batches per step, 40 steps, no checkpoint but those
its requeues take."""


def inject_e(env: dict, job: str, run_dir: str, out: dict) -> None:
    """Job E (--nodes 1-2 on node8, node9): after its fifth step node9 is drained and the job asked
    to checkpoint and requeue (as `scancel --signal=USR1 --batch` does); its next start gets node8
    alone. Three steps later node9 is resumed and the job asked again: the third start has both."""
    for attempt, steps, state in ((0, 5, "drain reason=drained-in-a-test"), (1, 3, "resume")):
        deadline = time.monotonic() + 600
        while len(re.findall(r"\| step \d+ \| loss", attempt_log(run_dir, job, attempt))) < steps:
            assert time.monotonic() < deadline, f"job E attempt {attempt}: no {steps} steps:\n{log_of(run_dir, job)[-3000:]}"
            time.sleep(0.05)
        subprocess.run(["scontrol", "update", "nodename=node9", *f"state={state}".split()], env=env, check=True,
                       timeout=60)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=60)
        out[attempt] = state.split()[0]


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tiny_data, tmp_path_factory):
    """Submit A, B, C and D together; preempt B once its training has begun; C's and D's faults are
    injected by threads while the test waits for B."""
    cluster = slurm_cluster
    work = tmp_path_factory.mktemp("slurm-jobs")
    runs = {"A": str(work / "plain"), "B": str(work / "preempted"), "C": str(work / "faults"),
            "D": str(work / "nodeloss"), "E": str(work / "elastic")}
    ids = {name: submit(cluster, runs[name], tiny_data) for name in ("A", "B")}
    ids["C"] = submit(cluster, runs["C"], tiny_data, job_config(str(work / "c.yaml"), runs["C"], FAULT_CONFIG), "faults")
    ids["D"] = submit(cluster, runs["D"], tiny_data, job_config(str(work / "d.yaml"), runs["D"], FAULT_CONFIG), "nodeloss",
                      {"FAULT_GRACE": FAULT_GRACE})
    ids["E"] = submit(cluster, runs["E"], tiny_data, job_config(str(work / "e.yaml"), runs["E"], ELASTIC), "elastic",
                      nodes="1-2")
    injected = {"C": {}, "D": {}, "E": {}}

    def run(inject, name):
        try:
            inject(cluster, ids[name], runs[name], injected[name])
        except BaseException as e:  # the test reads it: a fault not injected is a failure, not a hang
            injected[name]["error"] = f"{type(e).__name__}: {e}"
            subprocess.run(["scancel", ids[name]], env=cluster, timeout=60)

    threads = {name: threading.Thread(target=run, args=(inject, name), daemon=True)
               for name, inject in (("C", inject_c), ("D", inject_d), ("E", inject_e))}
    for thread in threads.values():
        thread.start()
    deadline = time.monotonic() + 600
    while "step 1 |" not in log_of(runs["B"], ids["B"]):
        state = job_info(cluster, ids["B"]).get("JobState")
        assert state not in ENDED and time.monotonic() < deadline, (
            f"job B ({state}) never reached its first step:\n{log_of(runs['B'], ids['B'])[-4000:]}")
        time.sleep(0.2)
    # Exactly what SLURM does for --signal=B:USR1@T when the time limit nears.
    subprocess.run(["scancel", "--signal=USR1", "--batch", ids["B"]], env=cluster, check=True, timeout=60)
    return cluster, ids, runs, threads, injected


def test_generated_job_trains_pp2_across_two_nodes_with_reference_losses(jobs):
    env, ids, runs = jobs[:3]
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
    env, ids, runs = jobs[:3]
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
    assert re.search(rf"resumed from {re.escape(run_dir)}/checkpoints/step{k}\S* at step {k}( \(verified\))?\n", second), second
    assert f"step {k + 1} | loss" in second and f"step {k} | loss" not in second
    assert "training ended with exit code 0" in second

    # Every step ran once, and the losses are the uninterrupted job A's.
    got = losses(run_dir)
    assert [step for step, _ in got] == list(range(1, max_steps + 1))
    wait_until_ended(env, ids["A"], runs["A"])
    plain = losses(runs["A"])
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in plain], rel=1e-6)


def committed_steps(run_dir: str) -> list[int]:
    from checkpoint import manifest

    return sorted(int(tag[4:]) for tag in manifest.committed_tags(os.path.join(run_dir, "checkpoints")))


def fault_job_ended(jobs, name: str, restarts: int, state: str, exit_code: str) -> tuple[str, str, str, dict]:
    """Wait for fault job `name` to end in `state` / `exit_code` after `restarts` requeues, with both
    of its faults injected and no traceback: (job id, run_dir, log, faults)."""
    env, ids, runs, threads, injected = jobs
    job, run_dir = ids[name], runs[name]
    info = wait_until_ended(env, job, run_dir, restarts=restarts)
    threads[name].join(60)
    log = log_of(run_dir, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == (state, exit_code, str(restarts)), log[-4000:]
    faults = injected[name]
    assert set(faults) == {0, 1}, (faults, log[-4000:])
    assert "Traceback" not in log
    return job, run_dir, log, faults


def test_lost_and_hung_ranks_are_named_the_job_requeues_and_resumes_with_identical_losses(jobs):
    """Job C: rank 1 SIGKILLed in step 10's checkpoint save, then SIGSTOPped after step 22. Each
    time one line names it (rank, node, PID; died / stopped responding), the attempt ends within a
    bound, the job requeues itself, and the run ends with job A's loss at every step."""
    env, ids, runs, _, _ = jobs
    job, run_dir, log, faults = fault_job_ended(jobs, "C", restarts=2, state="COMPLETED", exit_code="0:0")
    for attempt, how in ((0, r"died: its connection closed and its heartbeat stopped \d+ s ago"),
                         (1, r"stopped responding: no heartbeat for \d+ s and no answer within "
                             r"train.collective_timeout_seconds=20 \(a hung or stopped process, or its node or network "
                             r"is gone\)")):
        part, lost = attempt_log(run_dir, job, attempt), faults[attempt]
        named = [line for line in part.splitlines() if line.startswith("error: rank ")]
        assert len(named) == 1, part[-3000:]  # one line for the job, by the first survivor
        assert re.fullmatch(rf"error: rank 0 \(node\d\): lost rank 1 on {lost['node']} \(PID {lost['pid']}\) "
                            rf"(in|after) step \d+ \(\w[\w ]*\): {how}; stopping, the last committed checkpoint is kept",
                            named[0]), named[0]
        assert f"fault {attempt + 1} of job {job} (at most 3 requeued): requeueing" in part
    # fault → end of the attempt (its requeue line): SIGKILL: the survivor's connection closes at
    # once (the line above says "died: its connection closed", not "stopped responding", which only
    # the collective timeout gives); SIGSTOP: not before the collective timed out (20 s). How much
    # longer each takes is the machine's (2 cores shared by four jobs here): printed, not judged.
    print(f"\njob C: fault → attempt end: SIGKILL {faults[0]['seconds']:.1f} s, SIGSTOP {faults[1]['seconds']:.1f} s",
          file=sys.__stderr__)
    assert faults[1]["seconds"] >= FAULT_CONFIG["collective_timeout_seconds"]
    # No checkpoint committed from a step rank 1 did not finish: each attempt resumed from one it
    # had completed (verified against its manifest), and the last start found all of them intact.
    for attempt, last_done in ((1, 10), (2, 22)):  # the steps the faults of attempts 0 and 1 came after
        resumed = re.search(rf"resumed from {re.escape(run_dir)}/checkpoints/step(\d+) at step \d+ \(verified\)",
                            attempt_log(run_dir, job, attempt))
        assert resumed and int(resumed.group(1)) <= last_done, attempt_log(run_dir, job, attempt)[-3000:]
    assert "damaged" not in log and committed_steps(run_dir)[-1] == FAULT_CONFIG["max_steps"]
    # Every step once, with the uninterrupted job A's losses.
    got = losses(run_dir)
    assert [step for step, _ in got] == list(range(1, FAULT_CONFIG["max_steps"] + 1))
    wait_until_ended(env, ids["A"], runs["A"])
    plain = losses(runs["A"])[:FAULT_CONFIG["max_steps"]]
    assert [loss for _, loss in got] == pytest.approx([loss for _, loss in plain], rel=1e-6)
    state = json.load(open(os.path.join(run_dir, "slurm", "faults.json")))
    assert [(f["kind"], f["ranks"], f["nodes"]) for f in state["faults"]] == [
        ("died", [1], [faults[0]["node"]]), ("unresponsive", [1], [faults[1]["node"]])]


def test_a_lost_node_is_replaced_and_a_fault_recurring_at_one_step_stops_the_job(jobs):
    """Job D: rank 1's node is lost whole (its slurmd, slurmstepd and rank SIGKILLed) after step 13:
    the survivor names it, srun (waiting for that node) is ended FAULT_GRACE s later, the job
    requeues itself, the node is set DOWN and the job resumes on the spare node; there rank 1 is
    lost again at step 13: the job stops with a message instead of requeueing."""
    env = jobs[0]
    job, run_dir, log, faults = fault_job_ended(jobs, "D", restarts=1, state="FAILED", exit_code="1:0")
    lost = faults[0]["node"]
    assert any(k.startswith(f"slurmd -D -N {lost}") for k in faults[0]["killed"]), faults[0]
    first, second = attempt_log(run_dir, job, 0), attempt_log(run_dir, job, 1)
    named = [line for line in first.splitlines() if line.startswith("error: rank ")]
    assert len(named) == 1 and re.match(rf"error: rank 0 \(node\d\): lost rank 1 on {lost} \(PID {faults[0]['pid']}\) "
                                        r"after step 13 \(\w[\w ]*\): died", named[0]), first[-3000:]
    assert f"srun still running {FAULT_GRACE} s after the ranks stopped" in first
    # The replacement: the second start runs on the surviving node and the spare, not the lost one.
    start = re.search(rf"job {job} start 1 on (\S+),", log).group(1)
    hosts = subprocess.run(["scontrol", "show", "hostnames", start], env=env, capture_output=True, text=True,
                           timeout=60, check=True).stdout.split()
    assert len(hosts) == 2 and lost not in hosts, hosts
    assert faults[1]["node"] != lost
    assert re.search(r"resumed from \S+/checkpoints/step(5|10) at step (5|10) \(verified\)", second), second[-3000:]
    stop = [line for line in second.splitlines()
            if re.match(r"\S+ error: the same step failed 2 times", line)]  # (stopped.json's copy follows)
    assert len(stop) == 1 and f"in job {job} (attempts 0, 1; after step 13 (" in stop[0], second[-3000:]
    assert "requeueing" not in second
    with open(os.path.join(run_dir, "stopped.json")) as f:
        assert json.load(f)["code"] == 1
    with open(os.path.join(run_dir, "summary.json")) as f:  # the job script's record: every key of the ranks' own
        summary = json.load(f)
    assert list(summary) == list(SUMMARY_KEYS) and (summary["state"], summary["max_steps"], summary["steps"]) == (
        "failed", FAULT_CONFIG["max_steps"], committed_steps(run_dir)[-1]), summary
    print(f"\njob D: node lost → attempt end {faults[0]['seconds']:.1f} s; recurring fault → job end "
          f"{faults[1]['seconds']:.1f} s", file=sys.__stderr__)
    # The node: the survivor's line, then FAULT_GRACE before the script ends srun (said above); not
    # sooner, whatever the machine. How much longer is the machine's: printed, not judged.
    assert faults[0]["seconds"] >= FAULT_GRACE


def test_an_elastic_job_continues_on_the_nodes_it_gets_with_the_same_batch_and_losses(jobs):
    """Job E (--nodes 1-2): started on node8 and node9; node9 drained and the job requeued: it goes
    on alone on node8 at pp1·tp1·dp1 (its checkpoint resharded before the ranks start, the 2
    micro-batches per step kept); node9 back and the job requeued: on both again. Every step once,
    the single-process reference's losses."""
    env, ids, runs, threads, injected = jobs
    job, run_dir = ids["E"], runs["E"]
    info = wait_until_ended(env, job, run_dir, restarts=2)
    threads["E"].join(60)
    log = log_of(run_dir, job)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), log[-4000:]
    assert injected["E"] == {0: "drain", 1: "resume"} and "Traceback" not in log
    starts = re.findall(rf"job {job} start (\d) on (\S+),", log)
    assert [(a, nodes) for a, nodes in starts] == [("0", "node[8-9]"), ("1", "node8"), ("2", "node[8-9]")], starts
    chosen = []
    for attempt, nodes in ((0, 2), (1, 1), (2, 2)):
        part = attempt_log(run_dir, job, attempt)
        line = re.search(rf"^layout for {count(nodes, 'node')} × 1 rank: (pp\d·tp1·dp\d), train.micro_batches (\d) "
                         r"\(2 micro-batches per step", part, flags=re.M)
        assert line, part[-3000:]
        chosen.append(line.group(1))
        assert int(line.group(2)) * int(line.group(1)[-1]) == 2  # dp × micro-batches: the global batch kept
        if attempt:
            k = json.load(open(os.path.join(run_dir, "slurm", "logs", f"preempted.json.{job}.{attempt - 1}")))["step"]
            said = rf"^resharded step {k} from {chosen[-2]} to {chosen[-1]} in [\d.]+ s"
            assert re.search(said, part, flags=re.M) and "resharded through" in part, part[-3000:]
            assert part.index("resharded step") < part.index(f"step {k + 1} | loss")
    assert chosen[1] == "pp1·tp1·dp1" and chosen[0] == chosen[2]
    got = losses(run_dir)
    assert [step for step, _ in got] == list(range(1, ELASTIC["max_steps"] + 1))
    ref = reference_run(load_config(os.path.join(run_dir, "slurm", "config.yaml")), ELASTIC["max_steps"])
    assert [loss for _, loss in got] == pytest.approx(ref["loss"], rel=1e-4)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["resharded"]["from"] == chosen[1] and summary["resharded"]["to"] == chosen[2]

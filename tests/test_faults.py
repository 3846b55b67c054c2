"""Faults a weeks-long run meets, on the real launcher and trainer (2 CPU ranks, pp=2).

Two groups, each in as few launches as possible:
- `./run.sh train` itself (launches of the CLI on one run directory): SIGTERM to it
  checkpoints and leaves no process, within seconds; a second trainer on the same run directory is
  refused with the holder's host and PID; `kill -9` of every process in the middle of a save, then
  a rerun resumes from the last committed checkpoint with the losses the killed run computed; the
  metrics CSVs then hold every step once under one header; a checkpoint write failing on every
  rank (`ulimit -f`), and a checkpoint that cannot fit (exit 4, nothing written); a deleted
  config.json restored from a manifest; a SIGTERM right after the launch line still checkpoints.
- one launch of tests/dist/fault_worker.py: every kind of checkpoint damage falls back to the
  newest intact checkpoint and continues with the uninterrupted run's losses; the divergence
  guard under each policy.
"""
from __future__ import annotations

import csv
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import ROOT, launch, write_run_config
from tests.run_cli import Run, _gone, _losses

# ---- checkpoint damage and divergence (one launch) -------------------------------------------

@pytest.fixture(scope="module")
def worker(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    config = write_run_config(str(work / "pp2.yaml"), str(work / "run"), tiny_data,
                              model={"dropout": 0.1},
                              train={"micro_batches": 2, "save_interval": 1000, "keep_checkpoints": 5,
                                     "lr": 0.002, "clip_norm": 1.0})
    out = str(work / "result.json")
    proc = launch(2, "tests.dist.fault_worker", ["--config", config, "--out", out])
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, "fault worker failed (its output is above)"
    with open(out) as f:
        return {"result": json.load(f), "log": proc.stdout + proc.stderr, "work": work}


@pytest.mark.parametrize("case, resumed, expect", [
    ("nonfinite_weights", 4, r"checkpoint step5 is damaged: .*step5 holds non-finite weights"),
    ("latest_garbage", 4, r"checkpoints/latest holds b'\\x00\\xffst\\x00ep', not a checkpoint name"),
    ("latest_missing_step", 4, r"checkpoints/latest names 'step9', which does not exist"),
    ("deleted_mp_rank_01", 2, r"checkpoint step4 is damaged: .*step4/mp_rank_01_model_states\.pt is missing"),
    ("truncated_zero_file", 2, r"step4/zero_pp_rank_0_mp_rank_01_optim_states\.pt has \d+ bytes, the manifest "
                               r"says \d+ \(truncated\)"),
    ("random_bytes_in_layer", 2, r"step4/layer_02-model_00-model_states\.pt has changed since it was written"),
    ("deleted_rng_rank1", 2, r"step4/rng_rank00001\.pt is missing"),
])
def test_damaged_checkpoint_falls_back_to_the_newest_intact_one(worker, case, resumed, expect):
    r = worker["result"]["damage"]
    got = r["cases"][case]
    assert got["resumed"] == resumed
    # continuing from there computes exactly what the uninterrupted run computed
    assert got["losses"] == pytest.approx(r["uninterrupted"][resumed:resumed + 2], rel=1e-6)
    assert re.search(expect, worker["log"]), f"no message matching {expect!r}"
    assert "Traceback" not in worker["log"]
    if case.startswith("latest_"):  # the bad hint is replaced by the checkpoint resumed
        assert got["latest_after_resume"] == f"step{resumed}"


def test_no_intact_checkpoint_stops_with_a_message(worker):
    # every rank refuses the launch together (exit 2, recorded as refused: tests/test_run_states.py)
    assert worker["result"]["damage"]["cases"]["none_intact"]["code"] == 2
    lines = [line for line in worker["log"].splitlines() if "no intact checkpoint" in line]
    assert len(lines) == 1 and lines[0].startswith("error: no intact checkpoint in ") and "(checked: step4, step2)" in \
        lines[0], lines


def test_divergence_stop_applies_nothing_and_saves_nothing(worker):
    r = worker["result"]["divergence"]["stop"]
    assert r["stopped"].startswith("step 3: loss is nan") and "train.divergence_policy=stop" in r["stopped"]
    assert r["unchanged_by_bad_step"]  # the NaN step's update was never applied
    assert r["latest"] == "step2" and r["tags"] == ["step2"]
    assert len(r["events"]) == 1
    assert "rerunning resumes from step2 with the new settings" in r["stopped"]
    summary = r["summary"]  # written on the way out, with the event and the reason
    assert (summary["state"], summary["reason"], summary["exit_code"]) == ("diverged", r["stopped"], 3)
    assert summary["divergence_events"] == 1
    assert summary["steps"] == 2 and summary["checkpoint"].endswith("step2")  # 2 applied (3 refused), saved at 2


def test_divergence_skip_drops_the_spike_and_keeps_training(worker):
    r = worker["result"]["divergence"]["skip"]
    assert r["stopped"] is None and r["step"] == 5
    assert [e["step"] for e in r["events"]] == [4] and "median" in r["events"][0]["reason"]
    assert r["unchanged_by_bad_step"]
    rows = r["loss_csv"]
    assert rows[0] == ["step", "loss"] and [int(x[0]) for x in rows[1:]] == [1, 2, 3, 4, 5]
    assert all(float(x[1]) < 20 for i, x in enumerate(rows[1:]) if i != 3)


def test_divergence_rollback_reloads_and_skips_the_window(worker):
    d = worker["result"]["divergence"]
    r = d["rollback"]
    assert r["stopped"] is None and r["step"] == 5
    assert len(r["events"]) == 1 and r["events"][0]["rolled_back_to"] == 2 and r["events"][0]["step"] == 4
    assert "rolled back to step 2 and skipped the data of steps 3..4" in worker["log"]
    rows = r["loss_csv"]
    assert rows[0] == ["step", "loss"] and [int(x[0]) for x in rows[1:]] == [1, 2, 3, 4, 5]  # each step once
    # steps 3..5 after the rollback = a fresh resume of step2 that skips the two batches of steps 3..4
    assert [float(x[1]) for x in rows[3:]] == pytest.approx(d["rollback_reference"], rel=1e-6)


# ---- ./run.sh train: signals, the run lock, kill -9 mid-save (three launches) -----------------

@pytest.fixture
def runs():
    yield Run
    Run.kill_all()


def test_run_owns_its_processes_refuses_a_second_trainer_and_survives_kill_9(tiny_data, tmp_path, runs):
    run_dir = str(tmp_path / "run")

    def config(name: str, max_steps: int) -> str:  # the same model and layout; only the length differs
        # (a grace after SIGTERM that no machine's step and checkpoint outlast: the stop is told by
        # its exit code and checkpoint, not by a clock)
        return write_run_config(str(tmp_path / f"{name}.yaml"), run_dir, tiny_data, model={"dropout": 0.1},
                                train={"micro_batches": 2, "save_interval": 2, "max_steps": max_steps,
                                       "valid_interval": 1000, "stop_grace_seconds": 300})

    ckpt = os.path.join(run_dir, "checkpoints")

    # 1. SIGTERM to ./run.sh train: the step finishes, a checkpoint is committed, nothing is left.
    first = Run(config("long", 2000))
    first.wait_for(r"step 3 \| loss")
    tree = first.tree()
    assert len([p for p in tree if "--local_rank=" in " ".join(p.cmdline())]) == 2

    # ... meanwhile a second trainer on the same run directory is refused, naming the first
    second = subprocess.run([sys.executable, "-m", "launcher.cli", "train", config("long", 2000),
                             "--eval-sentences", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2
    assert re.fullmatch(rf"error: {re.escape(run_dir)} is in use by another trainer \(host \S+, PID "
                        rf"{first.proc.pid}, since [\d\- :]+\); stop it first, or train into another run_dir\n",
                        second.stderr), second.stderr

    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=600) == 75, first.text()[-3000:]  # 75: checkpointed, not killed at the grace
    _gone(tree, timeout=120)
    stopped_at = int(first.wait_for(r"step (\d+) \| preempted by SIGTERM").group(1))
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == f"step{stopped_at}"
    assert os.path.exists(os.path.join(ckpt, f"step{stopped_at}", "manifest.json"))

    # 2. kill -9 of every process of the run while a checkpoint is being written
    killed = Run(config("long", 2000))
    killed.wait_for(rf"resumed from .*step{stopped_at} at step {stopped_at} \(verified\)")
    mid_save = None
    end = time.monotonic() + 240
    while mid_save is None and time.monotonic() < end and killed.proc.poll() is None:
        for tag in os.listdir(ckpt) if os.path.isdir(ckpt) else []:
            if (tag.startswith("step") and int(tag[4:]) > stopped_at
                    and not os.path.exists(os.path.join(ckpt, tag, "manifest.json"))):
                mid_save = tag
                break
        else:
            time.sleep(0.002)
    procs = [psutil.Process(killed.proc.pid), *killed.tree()]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _gone(procs, timeout=120)
    assert mid_save is not None, "no save was seen in progress"
    killed_losses = _losses(killed.text())

    # 3. the rerun resumes from the newest committed checkpoint; its losses are the killed run's
    end_step = int(mid_save[4:]) + 2
    last = Run(config("end", end_step))
    assert last.proc.wait(timeout=600) == 0, last.text()[-3000:]
    resumed = int(last.wait_for(r"resumed from .*step(\d+) at step \d+ \(verified\)").group(1))
    assert resumed < int(mid_save[4:])
    again = _losses(last.text())
    overlap = [s for s in killed_losses if s in again]
    assert overlap, "the killed run computed no step that the rerun recomputed"
    assert [again[s] for s in overlap] == [killed_losses[s] for s in overlap]
    with open(os.path.join(run_dir, "metrics", "train", "train_loss.csv"), newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "loss"] and [int(r[0]) for r in rows[1:]] == list(range(1, end_step + 1))
    assert not [p for p in psutil.process_iter(["cmdline"]) if run_dir in " ".join(p.info["cmdline"] or [])]

    # 4. a checkpoint write that fails (files limited to 64 KB, as `ulimit -f` does: layer and
    # optimizer files are larger): the failing rank's one line names the checkpoint and the cause,
    # exit 1 (the other rank may fail the same way or be ended first), `latest` still names the
    # newest intact checkpoint, a SLURM job would not requeue (stopped.json), no process is left
    newest = f"step{end_step}"
    limited = Run(config("more", end_step + 2), file_size_limit=64 * 1024)
    assert limited.proc.wait(timeout=600) == 1, limited.text()[-3000:]
    limited.wait_for(rf"^error: rank [01]: could not write checkpoint step{end_step + 2} to {re.escape(ckpt)} "
                     rf"\(torch could not write a file: .*; this process may write files of at most 0\.1 MB "
                     rf"\(ulimit -f\); \d+ MB free on that filesystem\); the incomplete step{end_step + 2} is "
                     rf"ignored\. The newest intact checkpoint, {newest}, is kept: make room")
    assert "Traceback" not in limited.text(), limited.text()[-3000:]
    # the supervisor names it (or, reaped before it looked, the rank that ended first); rc above: its code
    limited.wait_for(r"^rank [01] \(PID \d+\) (failed \(exit code 1\); stopping the other ranks|ended first)")
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == newest
    assert manifest_of(ckpt, f"step{end_step + 2}") is None
    with open(os.path.join(run_dir, "stopped.json")) as f:
        stopped = json.load(f)
        assert stopped["code"] == 1 and f"could not write checkpoint step{end_step + 2}" in stopped["reason"]
    _gone([p for p in psutil.process_iter(["cmdline"]) if run_dir in " ".join(p.info["cmdline"] or [])], timeout=120)
    with open(os.path.join(run_dir, "summary.json")) as f:  # the failing rank's own line, whichever rank it was
        ending = json.load(f)
        assert ending["state"] == "failed" and f"could not write checkpoint step{end_step + 2}" in ending["reason"]

    # 5. not enough room for the next checkpoint (the newest one made to look larger than four
    # times the free space, a sparse file the manifest does not list): every rank stops before
    # writing anything, exit 4, and the older checkpoint is not deleted for nothing
    padding = os.path.join(ckpt, newest, "padding.bin")
    size = max(2**40, 4 * shutil.disk_usage(ckpt).free)
    fd = os.open(padding, os.O_CREAT | os.O_WRONLY)
    os.truncate(fd, size)
    os.close(fd)
    need_mb = round(sum(os.path.getsize(os.path.join(ckpt, newest, n)) for n in os.listdir(os.path.join(ckpt, newest)))
                    / 2**20)
    full = Run(config("more", end_step + 2))
    assert full.proc.wait(timeout=600) == 4, full.text()[-3000:]
    full.wait_for(rf"resumed from .*{newest} at step {end_step} \(verified\)")
    full.wait_for(rf"^error: not enough room for checkpoint step{end_step + 2} in {re.escape(ckpt)}: about "
                  rf"{need_mb} MB needed \(the size of {newest}\), \d+ MB free; nothing was written\. The newest "
                  rf"intact checkpoint, {newest}, is kept")
    assert not os.path.exists(os.path.join(ckpt, f"step{end_step + 2}"))
    assert manifest_of(ckpt, f"step{end_step - 2}") is not None  # removing it would not have made the room
    assert "died" not in full.text() and "Traceback" not in full.text(), full.text()[-3000:]
    with open(os.path.join(run_dir, "stopped.json")) as f:
        stopped = json.load(f)
        assert stopped["code"] == 4 and "not enough room" in stopped["reason"]
    os.unlink(padding)

    # 6. config.json deleted: the check before launch uses the config of the newest checkpoint's
    # manifest, so a changed model is still refused before any rank starts (and, holding no run
    # lock, writes nothing)
    os.unlink(os.path.join(run_dir, "config.json"))
    changed = write_run_config(str(tmp_path / "changed.yaml"), run_dir, tiny_data, model={"dropout": 0.1, "ffn_dim": 48})
    refused = subprocess.run([sys.executable, "-m", "launcher.cli", "train", changed], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (f"{run_dir}/config.json is missing: using the config recorded in the manifest of checkpoint {newest}"
            in refused.stdout), refused.stdout
    assert refused.stderr.endswith("was trained with another model or layout (model.ffn_dim: 64 → 48); use a new "
                                   f"run_dir (train.init_from={run_dir} starts it from this run's weights where the "
                                   "model's shapes allow)\n"), refused.stderr
    assert not os.path.exists(os.path.join(run_dir, "config.json"))

    # 7. SIGTERM right after the launch line, before the ranks could handle it: the supervisor
    # holds it back until they do, and they checkpoint at their first step and exit 75; the ranks
    # restored config.json from the manifest, and the stop marker of step 5 is gone
    early = Run(write_run_config(str(tmp_path / "early.yaml"), run_dir, tiny_data, model={"dropout": 0.1},
                                 train={"micro_batches": 2, "save_interval": 2, "max_steps": 2000,
                                        "valid_interval": 1000, "stop_grace_seconds": 300}))
    early.wait_for(r"^launching 2 ranks")
    early.proc.send_signal(signal.SIGTERM)
    assert early.proc.wait(timeout=600) == 75, early.text()[-3000:]
    step = int(early.wait_for(r"step (\d+) \| preempted by SIGTERM: saved checkpoint").group(1))
    assert manifest_of(ckpt, f"step{step}") is not None
    early.wait_for(rf"config.json is missing: restored from the manifest of checkpoint {newest}")
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["model"]["ffn_dim"] == 64
    assert not os.path.exists(os.path.join(run_dir, "stopped.json"))


def manifest_of(ckpt: str, tag: str):
    from checkpoint import manifest

    return manifest.read(os.path.join(ckpt, tag))


# ---- the pieces, in one process ------------------------------------------------------------------

def test_lock_of_a_killed_trainer_is_refused_then_taken_over(tmp_path):
    from launcher.runlock import RunDirBusy, RunLock

    run_dir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; "
                               "from launcher.runlock import RunLock; lock = RunLock(sys.argv[1]).acquire();"
                               "print('held', flush=True); time.sleep(600)", run_dir], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RunDirBusy, match=rf"is in use by another trainer \(host \S+, PID {holder.pid}, since "):
            RunLock(run_dir).acquire()
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(run_dir).acquire()  # the dead holder's lock is simply taken
    with open(os.path.join(run_dir, ".trainer.lock.json")) as f:
        assert json.load(f)["pid"] == os.getpid()
    lock.release()


def test_manifest_names_every_kind_of_damage(tmp_path):
    from checkpoint import manifest

    ckpt = tmp_path / "checkpoints"
    (ckpt / "step3").mkdir(parents=True)
    for name, size in (("a.pt", 5000), ("b.pt", 300), ("c.pt", 70)):
        (ckpt / "step3" / name).write_bytes(os.urandom(size))
    manifest.commit(str(ckpt), "step3", 3)
    assert (ckpt / "latest").read_text() == "step3" and manifest.committed_tags(str(ckpt)) == ["step3"]
    assert manifest.verify(str(ckpt / "step3")) == []
    with open(ckpt / "step3" / "a.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0" * 8 if f.read(8) != b"\0" * 8 else b"\1" * 8)
    (ckpt / "step3" / "b.pt").write_bytes((ckpt / "step3" / "b.pt").read_bytes()[:10])
    (ckpt / "step3" / "c.pt").unlink()
    problems = manifest.verify(str(ckpt / "step3"))
    assert [p.split("/")[-1] for p in problems] == [
        "a.pt has changed since it was written (SHA-256 differs from the manifest)",
        "b.pt has 10 bytes, the manifest says 300 (truncated)",
        "c.pt is missing"]
    assert manifest._deal({"x": 10, "y": 9, "z": 2}, 2) == [["x"], ["y", "z"]]


def test_room_is_made_only_from_what_rotation_would_delete():
    from trainer.checkpointer import room_to_make

    newest_first = ["step40", "step30", "step20", "step10"]
    assert room_to_make(newest_first, keep=3) == ["step20", "step10"]  # kept after the save: 40, 30, new
    assert room_to_make(newest_first, keep=1) == ["step30", "step20", "step10"]  # never the newest
    assert room_to_make(newest_first, keep=5) == []
    assert room_to_make([], keep=2) == []


def test_write_failures_are_named_and_others_are_not(tmp_path):
    """torch's own error for a write over the file-size limit (SIGXFSZ ignored, as the ranks do),
    an OSError with its errno, and errors that are no failed write (None: handled elsewhere)."""
    import errno

    import torch

    from trainer.checkpointer import write_failure

    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 * 1024, old_limit[1]))
    try:
        with pytest.raises(RuntimeError) as caught:
            torch.save(torch.zeros(100_000), str(tmp_path / "big.pt"))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    why = write_failure(caught.value, str(tmp_path))
    assert re.fullmatch(r"torch could not write a file: [^\n\[]+; \d+ MB free on that filesystem", why), why
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/step9/rng_rank00000.pt")
    assert re.fullmatch(r"No space left on device: /ckpt/step9/rng_rank00000\.pt; \d+ MB free on that filesystem",
                        write_failure(full, str(tmp_path)))
    assert write_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer"), "/") is None
    assert write_failure(ValueError("file write failed"), "/") is None


def test_rendezvous_port_is_outside_the_ephemeral_range_and_free():
    """Two trainers started together: a master port from bind(0) is an ephemeral port, which the
    other job's outgoing gloo connections can take before the rendezvous binds it (EADDRINUSE).
    free_port draws below the kernel's ephemeral range and checks the port binds."""
    import socket

    from runtime.distributed import ephemeral_port_range, free_port

    low, high = ephemeral_port_range()
    assert 1024 < low <= high
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < low for p in ports), (ports, low)
    assert len(set(ports)) > 1  # drawn, not a fixed port every launch would share
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_the_supervisor_names_the_killed_rank_not_the_peer_that_failed_with_it(tmp_path):
    """A rank killed by a signal and a peer that exited with an error in the same interval between
    two checks (gloo closes the peer's connections at once): the killed rank is named, the other
    said to have failed with it, whatever their rank order."""
    from launcher.procs import Supervisor
    from runtime import heartbeat

    for killed_rank in (0, 1):
        peer = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
        victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        victim.send_signal(signal.SIGKILL)
        # zombies, not reaped (no wait) until the check has read their status
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(
                psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE for p in (peer, victim)):
            time.sleep(0.01)
        lines = []
        sup = Supervisor(["true"], {}, ROOT, 1.0, log=lines.append)
        sup._signal_ranks = lambda signum: None
        sup.ranks = {peer.pid: 1 - killed_rank, victim.pid: killed_rank}
        sup._check_ranks()
        assert sup.dead_rank == (killed_rank, victim.pid) and sup.dead_code == -signal.SIGKILL
        assert lines == [f"rank {killed_rank} (PID {victim.pid}) died (signal SIGKILL); stopping the other ranks "
                         f"(rank {1 - killed_rank} failed with it)"]
        peer.wait(), victim.wait()
        assert sup.ending(137) == ("failed", f"rank {killed_rank} (PID {victim.pid}) died (signal SIGKILL)")

    # a rank that exited with an error alone: it failed (it was not killed); the message it left in
    # its heartbeat (launcher/worker.py) is the reason; the end line adds the exit code
    for message in (None, "error: rank 0: could not write checkpoint step6 to /x (disk full)"):
        run_dir = tmp_path / f"run-{message is None}"
        peer = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(1)"])
        if message is not None:
            beat = heartbeat.Heartbeat(str(run_dir), 0, 2)
            beat.record["pid"] = peer.pid
            os.makedirs(os.path.dirname(beat.path))
            beat.mark(f"failed: {message}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and psutil.Process(peer.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)
        lines = []
        sup = Supervisor(["true"], {}, ROOT, 1.0, log=lines.append, run_dir=str(run_dir))
        sup._signal_ranks = lambda signum: None
        sup.ranks = {peer.pid: 0}
        sup._check_ranks()
        assert lines == [f"rank 0 (PID {peer.pid}) failed (exit code 1); stopping the other ranks"]
        said = ": could not write checkpoint step6 to /x (disk full)" if message else ""
        assert sup.ending(1) == ("failed", f"rank 0 (PID {peer.pid}) failed{said}")
        peer.wait()

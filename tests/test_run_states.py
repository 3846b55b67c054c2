"""Run states and exit codes that are true, and every start and stop on record.

A run is finished only when it reached the train.max_steps it was last launched with
(trainer/run_dir.py `relaunch`). The launches of `./run.sh train` below (2 CPU ranks, pp = 2, one
run directory) stop it in every way a user or a cluster can — SIGUSR1, SIGINT (Ctrl-C), SIGHUP, a
rank killed — relaunch it below, at and above its step (at its step also as srun starts the ranks,
without ./run.sh's checks), and have the ranks refuse it (no intact checkpoint); each launch's exit
code, summary.json (state, reason, exit code, and the same keys for every ending) and train.log
lines (launch, resume, end) are checked. A second run directory diverges (exit 3). SIGTERM's exit
75 is tests/test_faults.py's. Nothing here depends on the machine's speed: a stop "at once" is
told by the ranks' heartbeats (killed while running, not left on their own), not by a clock.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from tests.conftest import ROOT, launch, write_run_config
from tests.run_cli import Run, _gone
from trainer.run_dir import BELOW, END_HERE, FINISHED, SUMMARY_KEYS, TRAIN, relaunch


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


def _stop(run: Run, how) -> tuple[int, dict[int, int]]:
    """Stop a running launch after a training step: `how` is a signal for ./run.sh train, or
    "kill rank 1". (exit code, PID of every rank). The timeouts only keep a hang from lasting."""
    run.wait_for(r"\| step \d+ \| loss")
    tree = run.tree()
    ranks = {int(p.environ()["RANK"]): p.pid for p in tree if p.environ().get("RANK") is not None
             and "launcher.worker" in " ".join(p.cmdline())}
    if how == "kill rank 1":
        psutil.Process(ranks[1]).kill()
    else:
        run.proc.send_signal(how)
    code = run.proc.wait(timeout=600)
    _gone(tree, timeout=120)
    return code, ranks


def _left_as(run_dir: str, ranks: dict[int, int]) -> list[str]:
    """How each rank of the launch left, as its heartbeat says: `running` if it was killed (it
    never got to say), else what it marked (`exited 75`, …)."""
    from runtime import heartbeat

    records = [heartbeat.read_rank(run_dir, rank) for rank in sorted(ranks)]
    assert [r["pid"] for r in records] == [ranks[rank] for rank in sorted(ranks)], records
    return [r["state"] for r in records]


def _damage_every_checkpoint(run_dir: str) -> list[str]:
    """Flip the first bytes of one file of every committed checkpoint (its size unchanged, so only
    the ranks' hash check finds it); the tags, newest first."""
    from checkpoint import manifest

    ckpt = os.path.join(run_dir, "checkpoints")
    tags = manifest.committed_tags(ckpt)
    for tag in tags:
        name = sorted(manifest.read(os.path.join(ckpt, tag))["files"])[0]
        with open(os.path.join(ckpt, tag, name), "r+b") as f:
            head = f.read(16)
            f.seek(0)
            f.write(bytes(b ^ 0xFF for b in head))
    return tags


def test_every_ending_is_recorded_and_a_stopped_run_is_not_called_finished(tiny_data, tmp_path, runs):
    run_dir = str(tmp_path / "run")
    train = {"max_steps": 2, "micro_batches": 2, "save_interval": 1, "valid_interval": 1000, "log_interval": 1,
             "stop_grace_seconds": 60}
    config = write_run_config(str(tmp_path / "run.yaml"), run_dir, tiny_data, train=train)
    longer = ("--set", "train.max_steps=400")
    layout = {"pipeline_stages": 2, "tensor_parallel": 1, "data_parallel": 1, "micro_batches": 2}

    def summary(state: str, code: int, max_steps: int = 400) -> dict:
        """summary.json of the launch that just ended: its state, exit code and every key."""
        s = _summary(run_dir)
        assert (s["state"], s["exit_code"]) == (state, code) and list(s) == list(SUMMARY_KEYS), s
        assert (s["max_steps"], s["layout"], s["log"]) == (max_steps, layout, "train.log"), s
        return s

    # 1. SIGUSR1 to ./run.sh train: checkpointed, exit 75, recorded as preempted; a clean stop is no ERROR
    run = Run(config, *longer)
    code, ranks = _stop(run, signal.SIGUSR1)
    assert code == 75 and "ERROR" not in run.text() and "Traceback" not in run.text(), run.text()[-3000:]
    assert "_load_legacy_checkpoint" not in run.text()
    assert _left_as(run_dir, ranks) == ["exited 75", "exited 75"]  # every rank left on its own, after the checkpoint
    s = summary("preempted", 75)
    step = s["steps"]
    assert s["reason"] == f"SIGUSR1: checkpointed at step {step}, to be resumed" and \
        s["checkpoint"] == f"checkpoints/step{step}" and step >= 1 and s["last_valid_loss"] is not None
    assert f"end | preempted: SIGUSR1: checkpointed at step {step}, to be resumed (exit code 75); newest checkpoint " \
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

    # 3. Ctrl-C (SIGINT): every rank stops at once, without a checkpoint: killed while running (none
    #    left on its own; the supervisor's SIGKILL, whatever the machine's speed); exit 130; recorded by ./run.sh
    run = Run(config, *longer)
    code, ranks = _stop(run, signal.SIGINT)
    assert code == 130 and "Traceback" not in run.text(), (code, run.text()[-3000:])
    assert "SIGINT: stopping every rank now (the last checkpoint is kept)" in run.text()
    assert _left_as(run_dir, ranks) == ["running", "running"]
    assert "_load_legacy_checkpoint" not in run.text()  # DeepSpeed's print on resume is not the console's
    s = summary("stopped", 130)
    assert s["reason"] == "SIGINT (Ctrl-C): every rank stopped at once, without a checkpoint"
    assert s["first_valid_loss"] is None and s["wall_seconds_this_launch"] is None  # the ranks' numbers: unknown
    log = _log(run_dir)
    assert f"resumed from {run_dir}/checkpoints/step{step} at step {step} (verified)" in log  # the start, on record
    assert log[-1].startswith("end | stopped: SIGINT (Ctrl-C): every rank stopped at once, without a checkpoint "
                              "(exit code 130); newest checkpoint checkpoints/step")

    # 4. SIGHUP (the terminal closed): the same, exit 129
    code, ranks = _stop(Run(config, *longer), signal.SIGHUP)
    assert code == 129 and summary("stopped", 129)["reason"].startswith("SIGHUP (the terminal closed): every rank stopped")
    assert _left_as(run_dir, ranks) == ["running", "running"]

    # 5. A rank killed: the others are ended, the launch fails with the rank's status (128 + 9)
    code, _ = _stop(Run(config, *longer), "kill rank 1")
    s = summary("failed", 137)
    assert code == 137
    assert re.fullmatch(r"rank 1 \(PID \d+\) died \(signal SIGKILL\)", s["reason"]), s["reason"]

    # 6. The ranks started as srun starts them (no ./run.sh, so none of its checks before) with
    #    exactly the step it stopped at: they end the run there, and config.json says so too
    newest = int(_summary(run_dir)["checkpoint"][len("checkpoints/step"):])
    at_newest = write_run_config(str(tmp_path / "at-newest.yaml"), run_dir, tiny_data, train={**train, "max_steps": newest})
    ended = launch(2, "launcher.worker", ["--config", at_newest, "--run-dir", run_dir])
    assert ended.returncode == 0, ended.stdout[-3000:] + ended.stderr[-3000:]
    s = summary("finished", 0, max_steps=newest)
    assert s["steps"] == newest and s["reason"] == (f"ended at step {newest} by a launch with "
                                                    f"train.max_steps={newest} (it had been launched with 400)")
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["train"]["max_steps"] == newest

    # 7. Now finished: a launch at that step, and the YAML's below it, say so and exit 0
    for extra in (("--set", f"train.max_steps={newest}"), ()):
        again = _cli(config, *extra)
        assert again.returncode == 0 and again.stdout.startswith(
            f"{run_dir} is finished: its newest checkpoint is step {newest}, and it was launched with "
            f"train.max_steps={newest}"), again.stdout + again.stderr

    # 8. Settings that differ from the recorded config are listed before any rank starts
    changed = _cli(config, "--set", f"train.max_steps={newest + 1}", "--set", "train.clip_norm=0.5")
    assert changed.returncode == 0, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert changed.stdout.splitlines()[0] == (f"resuming {run_dir} with settings changed since its last launch "
                                              f"(config.json): train.max_steps {newest} → {newest + 1}; "
                                              "train.clip_norm 0.0 → 0.5")
    assert "resumed with the config's train.clip_norm 0 → 0.5 (the checkpoint had the old values)" in _log(run_dir)
    assert summary("finished", 0, max_steps=newest + 1)["reason"] == f"reached train.max_steps={newest + 1}"

    # 9. Every checkpoint damaged (sizes unchanged: only the ranks' hash check sees it): the ranks
    #    refuse the launch together, exit 2, one line; recorded as refused with that line, not as a
    #    rank that died; a SLURM job would not be requeued to meet it again (stopped.json)
    tags = _damage_every_checkpoint(run_dir)
    refused = _cli(config, "--set", f"train.max_steps={newest + 3}")
    said = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and len(said) == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert said[0] == (f"error: no intact checkpoint in {run_dir}/checkpoints (checked: {', '.join(tags)}); restore "
                       "one, or train afresh in another run_dir (or after removing checkpoints/)")
    assert "died" not in refused.stdout + refused.stderr and "Traceback" not in refused.stderr
    s = summary("refused", 2, max_steps=newest + 3)
    assert s["reason"] == said[0].removeprefix("error: ") and s["checkpoint"] == f"checkpoints/{tags[0]}"
    assert _log(run_dir)[-1] == f"end | refused: {s['reason']} (exit code 2); newest checkpoint checkpoints/{tags[0]}"
    with open(os.path.join(run_dir, "stopped.json")) as f:
        assert json.load(f) == {"code": 2, "reason": said[0]}


def test_a_divergence_stop_exits_3_and_is_recorded(tiny_data, tmp_path):
    run_dir = str(tmp_path / "diverging")
    config = write_run_config(str(tmp_path / "diverge.yaml"), run_dir, tiny_data,
                              train={"max_steps": 30, "lr": 5.0, "warmup_steps": 0, "divergence_window": 1,
                                     "divergence_spike_factor": 1.05, "save_interval": 1000, "valid_interval": 1000})
    proc = _cli(config)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = _summary(run_dir)
    assert (s["state"], s["exit_code"]) == ("diverged", 3) and "train.divergence_policy=stop" in s["reason"]
    assert list(s) == list(SUMMARY_KEYS) and s["divergence_events"] == 1
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
    assert _summary(str(run_dir)) == {**dict.fromkeys(SUMMARY_KEYS), **stopped, "max_steps": 3, "state": "finished",
                                      "exit_code": 0, "reason": "ended at step 3 by a launch with train.max_steps=3 "
                                                                "(it had been launched with 6)"}
    assert list(_summary(str(run_dir))) == list(SUMMARY_KEYS)
    assert not (run_dir / PREEMPTED_MARKER).exists()
    assert json.loads((run_dir / "config.json").read_text())["train"]["max_steps"] == 3
    assert _log(str(run_dir))[-1] == ("end | finished: ended at step 3 by a launch with train.max_steps=3 (it had "
                                      "been launched with 6) (exit code 0); newest checkpoint checkpoints/step3")


def test_an_ending_the_ranks_could_not_record_has_every_key(tmp_path):
    """./run.sh train (a signal, a dead rank) and the SLURM job script (launcher/faults.py: a failed
    attempt) record endings without the trainer's numbers: the same keys as the ranks' summary,
    null where not known; the launch's max_steps and layout as the caller knows them, else as
    config.json (the last launch that trained) has them."""
    from checkpoint import manifest
    from trainer.config import RunConfig
    from trainer.run_dir import launch_facts, record_ending

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step4").mkdir(parents=True)
    (run_dir / "checkpoints" / "step4" / "weights.pt").write_bytes(b"w" * 64)
    manifest.commit(str(run_dir / "checkpoints"), "step4", 4)
    (run_dir / "config.json").write_text(json.dumps({"train": {"max_steps": 40, "micro_batches": 6}, "parallel": {
        "pipeline_stages": 2, "tensor_parallel": 1, "data_parallel": 3, "precision": "fp32"}}))
    unknown = {"first_valid_loss": None, "last_valid_loss": None, "mean_target_tokens_per_s": None,
               "wall_seconds_this_launch": None, "divergence_events": None, "divergence": None, "resharded": None, "init_from": None}
    record_ending(str(run_dir), "failed", "lost rank 1 on node4 (PID 42) after step 4 (validation): died", 1)
    s = _summary(str(run_dir))
    assert list(s) == list(SUMMARY_KEYS) and s == {
        "state": "failed", "reason": "lost rank 1 on node4 (PID 42) after step 4 (validation): died", "exit_code": 1,
        "steps": 4, "max_steps": 40, "checkpoint": "checkpoints/step4", "log": "train.log",
        "layout": {"pipeline_stages": 2, "tensor_parallel": 1, "data_parallel": 3, "micro_batches": 6}, **unknown}
    cfg = RunConfig()
    cfg.train.max_steps, cfg.parallel.pipeline_stages = 60, 2
    record_ending(str(run_dir), "stopped", "SIGINT (Ctrl-C): every rank stopped at once, without a checkpoint", 130,
                  known=launch_facts(cfg))
    s = _summary(str(run_dir))
    assert list(s) == list(SUMMARY_KEYS) and (s["max_steps"], s["layout"], s["steps"]) == (
        60, {"pipeline_stages": 2, "tensor_parallel": 1, "data_parallel": 1,
             "micro_batches": cfg.train.micro_batches}, 4)

"""The GPU check (gpucheck/gpu_check.sh, gpucheck/check.py) rehearsed on this machine's CPU.

One rehearsal runs every part at tiny shapes, one of them (eager) made to hang after its first
result while ignoring SIGTERM: it is killed at its limit, keeps that result, and every other part's
results, the files the planner reads, the pipelined part's timeline and the summary (with the
command that reruns just the missing part) still come back, in at most the 8 files a device run
hands back. The rest checks
the runner's pieces without torch: the kill of a part that ignores SIGTERM and of what it started
in a session of its own, the budget that cuts parts, the merge of a run and its rerun, and the
train.json the planner reads."""
import json
import math
import re
import os
import subprocess
import sys
import time

import pytest

from bench import gpu_results
from gpucheck import check as gpu_check
from tests.conftest import ROOT

HANDED_BACK = {"summary.md", "versions.txt", "results.jsonl", "train.json", "ops.json", "costs.json", "trace.json",
               "logs.txt"}
STALL_LIMIT = 20
"""The stalled part's limit on an idle 2-core machine, scaled by the load as the check scales every
rehearsal limit (1 + the load per core): it must have its first result by then."""


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """(OUT, the stalled part's limit). No part's status depends on the machine's speed: the budget
    cuts none, every limit (the stalled part's too) is scaled by the load, and the stalled part
    ignores SIGTERM from its start, so it is killed the same way wherever its limit falls; the
    timeout only keeps a hang from lasting."""
    out = tmp_path_factory.mktemp("check") / "out"
    limit = math.ceil(STALL_LIMIT * (1.0 + os.getloadavg()[0] / (os.cpu_count() or 1)))
    proc = subprocess.run(["bash", os.path.join(ROOT, "gpucheck", "gpu_check.sh"), str(out), "--rehearse",
                           "--budget", "7200", "--stall", "eager", "--limit", f"eager={limit}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, limit


def test_every_part_comes_back_and_the_killed_one_keeps_its_first_result(rehearsal):
    out, _ = rehearsal
    summary = (out / "summary.md").read_text()
    outcomes = {r["name"]: r for r in gpu_results.read_jsonl(str(out / "results.jsonl")) if r["part"] == "check"}
    assert list(outcomes) == gpu_check.NAMES
    for name, outcome in outcomes.items():
        if name != "eager":
            assert outcome["status"] == "ok", (name, outcome, summary)
            assert f"| {name} | ok |" in summary
    eager, limit = outcomes["eager"], rehearsal[1]
    assert eager["status"] == f"killed at its {limit} s limit (SIGKILL: SIGTERM was ignored for 5 s)"
    # killed by `timeout -k` at its limit and the grace (the status says so: the runner's own kill,
    # should timeout not end it, says otherwise), and never before (a bound no machine beats)
    assert eager["seconds"] >= limit + gpu_check.GRACE
    assert "gpucheck/gpu_check.sh OUT2 --only eager --rehearse" in summary
    handed_back = {p.name for p in out.iterdir()}
    assert handed_back == HANDED_BACK  # files only, at most 8: what a device run hands back
    train = json.loads((out / "train.json").read_text())
    assert [(r["shape"], r["variant"], len(r["rows"])) for r in train] == [
        ("tiny-last", "compiled", 1), ("tiny", "compiled", 1), ("tiny", "eager", 1)]  # planner basis last
    rows = {(r["shape"], r["variant"]): r["rows"][0] for r in train}
    for row in rows.values():
        assert row["target_tokens_per_s"] > 0 and row["host_syncs_per_step"] == 1 and row["host_copies_per_step"] == 0
    assert rows[("tiny", "compiled")]["kernels_per_step"] < rows[("tiny", "eager")]["kernels_per_step"]
    last = next(r for r in train if r["shape"] == "tiny-last")
    assert last["alpha_depth"] == [2, 2] and {k: v["graphs"] for k, v in last["compile"].items()} == \
        {"encoder": 1, "decoder": 1}
    cache = last["compile_cache"]  # the α of the model they come from: tiny's graphs, from the cache
    assert cache["inductor_fxgraph_cache_hit"] >= 2 and cache["inductor_fxgraph_cache_miss"] == 0, cache
    assert "tiny compiled, 256 target tokens per micro-batch" in summary.split("## First number")[1]


def test_the_counts_and_costs_come_back(rehearsal):
    out, _ = rehearsal
    ops = json.loads((out / "ops.json").read_text())
    for kind in ("embedding", "encoder", "decoder", "output"):
        assert ops["kernel_ops_per_layer"][kind]["eager"] > 0
    assert 0 < ops["engine_ops_per_step"]["fp32"] <= ops["engine_ops_per_step"]["bf16"]
    one = ops["syncs_pp1"]["ranks"]
    assert [(r["per_microbatch"], r["per_step"], r["host_copies_per_step"]) for r in one] == [(0.0, 1.0, 0.0)]
    two = ops["syncs_pp2"]["ranks"]
    assert [(r["per_microbatch"], r["per_step"]) for r in two] == [(0.0, 1.0), (0.0, 1.0)]
    costs = json.loads((out / "costs.json").read_text())
    assert set(costs["modes"]) == {"eager"} and set(costs["modes"]["eager"]) == {"embed", "encoder", "decoder", "output"}
    summary = (out / "summary.md").read_text()
    assert "| 2 |" in summary.split("## Zero-bubble replay")[1]  # the replay's table, folded into the summary
    assert re.search(r"\b\d+ skipped", summary) and not re.search(r"\b\d+ failed", summary)  # the GPU suite ran


def test_the_pipelined_part_comes_back_as_a_timeline(rehearsal):
    """The pp2 part's traced step is OUT/trace.json (Chrome trace events, one process per rank); a traced
    step has no host sync inside its micro-batch instructions, at pp = 1 and pp = 2."""
    out, _ = rehearsal
    trace = json.loads((out / "trace.json").read_text())
    assert trace["otherData"]["pp"] == 2 and trace["otherData"]["steps"] == [5]  # 2 + 2 counted steps, then it
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1} and {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"} >= {"compute", "recv", "send"}
    ops = json.loads((out / "ops.json").read_text())
    assert ops["trace_pp1"]["per_microbatch"] == 0 and ops["trace_pp1"]["hook_calls"] > 0
    assert ops["trace_pp2"]["per_microbatch_by_rank"] == [0, 0] and ops["trace_pp2"]["hook_calls"] > 0
    assert "Pipeline bubble per stage at pp = 2" in (out / "summary.md").read_text()


def test_one_package_list_for_the_wheels_and_the_versions(rehearsal):
    """gpucheck/packages.txt is the one list: what wheels.sh builds or fetches (at the
    pins of requirements.txt, which this environment has) and what versions.txt reports."""
    import importlib.util
    from importlib import metadata

    listed = gpu_check.packages()
    assert len({dist.lower() for dist, _, _ in listed}) == len(listed)
    assert {where for _, _, where in listed} == {"image", "built", "wheel"} and ("torch", "torch", "image") in listed
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pins = dict(line.strip().lower().split("==") for line in f if "==" in line)
    for dist, module, where in listed:
        if where != "image":  # carried: this environment has it, at its pin
            assert pins.get(dist.lower(), metadata.version(dist)) == metadata.version(dist), dist
            assert importlib.util.find_spec(module) is not None, (dist, module)
    reported = [line.split()[0] for line in (rehearsal[0] / "versions.txt").read_text().splitlines()[1:]]
    assert reported[:len(listed)] == [dist for dist, _, _ in listed]


def test_nothing_of_the_check_is_left_running(rehearsal):
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"DEEPNET_CHECK_PART=" in f.read():
                    left.append(pid)
        except OSError:
            continue
    assert left == []


IGNORES_TERM = 'trap "" TERM; setsid sleep 60 & echo $! > "$1"; exec sleep 60'
"""A part (sh: milliseconds from exec to each step, where Python's start-up takes seconds on a loaded
machine) that ignores SIGTERM and starts a process in a session of its own, escaping the part's
process group; an ignored signal stays ignored across exec, so both sleeps ignore it too."""


def test_a_part_that_ignores_sigterm_is_killed_with_what_it_started(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "GRACE", 1)
    pid_file = tmp_path / "child.pid"
    part = gpu_check.Part("stubborn", (), (), 1, 1)
    outcome = gpu_check.run_part(part, ["sh", "-c", IGNORES_TERM, "sh", str(pid_file)], 1, str(tmp_path / "log"),
                                 dict(os.environ))
    assert outcome["status"] == "killed at its 1 s limit (SIGKILL: SIGTERM was ignored for 1 s)"
    assert outcome["seconds"] >= 1 + 1 and outcome["stragglers_killed"] == 1
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 60  # only keeps a hang from lasting
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def test_a_process_of_the_parts_own_group_is_no_straggler_however_slowly_it_dies():
    """After the part's process group got SIGKILL, its processes may still be on their way out when
    the sweep looks (the longer the busier the machine): killed again, but counted as stragglers only
    when they escaped the group (a session of their own)."""
    env = dict(os.environ, DEEPNET_CHECK_PART="sweep-test")
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    grouped = subprocess.Popen(sleep, env=env, start_new_session=True)
    escaped = subprocess.Popen(sleep, env=env, start_new_session=True)
    # (Popen returns once each has exec'd: its environment is the marked one.) The first stands for
    # the part's group, still alive as the sweep looks.
    assert gpu_check._sweep("sweep-test", group=grouped.pid) == [escaped.pid]
    assert grouped.wait(timeout=60) == escaped.wait(timeout=60) == -9


def test_a_part_that_timeout_does_not_end_is_killed_by_the_check_and_said_so(tmp_path, monkeypatch):
    """Should `timeout` itself not end a part (here a stand-in that ignores its limit), the check
    kills it GRACE + 10 s after its limit and says that, not "killed at its limit"."""
    monkeypatch.setattr(gpu_check, "GRACE", 1)
    fake = tmp_path / "bin" / "timeout"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 600\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PATH", env["PATH"])
    outcome = gpu_check.run_part(gpu_check.Part("deaf", (), (), 1, 1), [sys.executable, "-c", "pass"], 1,
                                 str(tmp_path / "log"), env)
    assert outcome["status"] == "killed by the check 12 s after it started (timeout did not end it)"
    assert outcome["seconds"] >= 12


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"  # killed, not yet reaped by init
    except FileNotFoundError:
        return True


def test_the_budget_cuts_the_parts_it_has_no_time_for(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.jsonl", *gpu_check.MADE):  # an earlier check's files in the same OUT
        (out / name).write_text("{}\n")
    assert gpu_check.main([str(out), "--rehearse", "--budget", "20", "--only", "layers,replay"]) == 0
    summary = (out / "summary.md").read_text()
    assert "| layers | cut: 10 s of the budget left |" in summary and "| replay | cut:" in summary
    assert "gpucheck/gpu_check.sh OUT2 --only layers,costs,replay --rehearse" in summary  # replay reads its folder's costs
    assert "No first number" in summary
    assert sorted(p.name for p in out.iterdir()) == ["logs.txt", "results.jsonl", "summary.md"]  # none stale


def _row(tokens: int, efficiency: float) -> dict:
    return {"target_tokens_per_micro_batch": tokens, "kernel_efficiency": efficiency}


def _line(shape: str, variant: str, d: int, tokens: int, efficiency: float) -> dict:
    return {"part": "train", "shape": shape, "variant": variant, "meta": {"model": [6, 6, d, 16, 4 * d, 8192]},
            "row": _row(tokens, efficiency)}


def test_a_run_and_its_rerun_merge_into_the_file_the_planner_reads(tmp_path):
    from planner.devices import measured_efficiency

    first, rerun, merged = tmp_path / "a", tmp_path / "b", tmp_path / "docs" / "bench" / "gpu-h100"
    for folder, lines in ((first, [_line("layers-d1024", "compiled", 1024, 4096, 0.33),
                                   {"part": "check", "name": "layers", "status": "ok"},
                                   {"part": "check", "name": "shapes", "status": "killed at its 150 s limit (SIGTERM)"}]),
                          (rerun, [_line("last-stage-128k", "compiled", 1024, 4096, 0.21),
                                   _line("layers-d1024", "compiled", 1024, 8192, 0.42),
                                   {"part": "check", "name": "shapes", "status": "ok"}])):
        folder.mkdir()
        for line in lines:
            gpu_results.append_jsonl(str(folder / "results.jsonl"), line)
    from gpucheck.summary import summary

    assert gpu_check.merge(str(merged), [str(first), str(rerun)], summary) == 0
    train = json.loads((merged / "train.json").read_text())
    assert [(r["shape"], [row["target_tokens_per_micro_batch"] for row in r["rows"]]) for r in train] == [
        ("last-stage-128k", [4096]), ("layers-d1024", [4096, 8192])]
    # the planner takes the layers' efficiency (the basis), not the last stage's
    assert measured_efficiency("h100-80gb", root=str(tmp_path)) == [(1024, 4096, 0.33), (1024, 8192, 0.42)]
    text = (merged / "summary.md").read_text()
    assert "| shapes | ok |" in text and "Every part completed." in text

"""The timeline of traced steps (train.trace_steps; parallel/trace.py, trainer/timeline.py).

One launch of 4 ranks (tests/dist/timeline_worker.py) trains every schedule of the registry at
pp = 4 and at pp = 2 × dp = 2 with steps 3 and 4 traced, resumes one run with new trace steps and
measures the clock offsets with skewed clocks; the tests read its numbers and the files it wrote.
The rest needs no launch: the micro-batch of every instruction of DeepSpeed's own 1F1B schedule
(whose buffers are reused), the bubble read from a trace that is a simulated timeline, the files'
format, and the bad inputs."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from parallel.schedules import SCHEDULES
from tests.bad_inputs import assert_one_line_error, base_config, run_cli
from tests.conftest import run_worker, write_run_config
from tests.dist.timeline_worker import SKEW_NS

M = 4  # micro-batches per step of the launch
MODEL = {"encoder_layers": 4, "decoder_layers": 4, "d_model": 128, "heads": 4, "ffn_dim": 256}
"""Wide enough that an op lasts tens of ms: four ranks share two cores, and a rank woken by a message
may wait for one, which the simulator does not know (small ops made that most of the bubble)."""
TOLERANCE = 0.25
"""|trace − simulator| of the mean bubble with 4 ranks on a shared 2-core CPU (gloo); the trace's is
larger by what the simulator does not model: blocking transfers in the engine's order, the engine's
own time, and costs that vary from op to op under load (docs/pipeline.md, "A timeline of real steps")."""


@pytest.fixture(scope="module")
def launched(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("timeline")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data, model=MODEL,
                              data={"max_tokens": 512},
                              train={"micro_batches": M, "valid_interval": 100, "save_interval": 100})
    result = run_worker(4, "tests.dist.timeline_worker", str(work / "result.json"),
                        ["--config", config, "--layouts", "4x1,2x2"])
    return result, config


def _runs(launched):
    return launched[0]["runs"].items()


def _trace(ranks: list[dict]) -> dict:
    with open(ranks[0]["paths"][0]) as f:
        return json.load(f)


def test_nothing_is_recorded_outside_the_traced_steps(launched):
    """Hook calls after steps 1..5 (3 and 4 traced): none before step 3, none in step 5; no observer
    is left on the engine after any step."""
    for name, ranks in _runs(launched):
        for rank in ranks:
            calls = rank["calls"]
            assert calls[0] == calls[1] == 0 and calls[2] > 0, (name, calls)
            assert calls[3] == 2 * calls[2] and calls[4] == calls[3], (name, calls)
            assert rank["observers"] == [0] * 5, (name, rank["observers"])


def test_every_instruction_is_a_span_with_its_micro_batch(launched):
    for name, ranks in _runs(launched):
        trace = _trace(ranks)
        pp = trace["otherData"]["pp"]
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
        assert len(names) == len(ranks) and trace["otherData"]["steps"] == [3, 4], name
        for pid, rank in enumerate(ranks):
            for step in (3, 4):
                mine = [e for e in events if e["pid"] == pid and e["args"]["step"] == step]
                stage = next(e["args"]["stage"] for e in mine if e["cat"] == "compute")
                forwards = [e["args"]["micro_batch"] for e in mine if e["cat"] == "compute" and e["name"][0] == "F"]
                backwards = [e["args"]["micro_batch"] for e in mine if e["cat"] == "compute" and e["name"][0] == "B"]
                assert forwards == list(range(M)) and sorted(backwards) == list(range(M)), (name, pid, mine)
                sent = sorted(e["args"]["micro_batch"] for e in mine if e["name"].startswith("send activation"))
                got = sorted(e["args"]["micro_batch"] for e in mine if e["name"].startswith("receive gradient"))
                assert sent == got == (list(range(M)) if stage < pp - 1 else []), (name, pid)
                assert sum(e["name"] == "optimizer step" for e in mine) == 1
                assert sum(e["name"] == "data loader" for e in mine) == 1
                assert sum(e["name"] == "data-parallel all-reduce" for e in mine) == 1
                assert all(e["args"]["layers"].startswith("layers ") for e in mine if e["cat"] == "compute")


def test_clocks_are_aligned_and_messages_arrive_after_they_were_sent(launched):
    """Ranks of one host share the clock: each measured offset lies within its uncertainty of 0.
    On the aligned clocks the forward of micro-batch k on stage s + 1 starts after it ended on stage s."""
    for name, ranks in _runs(launched):
        for rank in ranks:
            for offset, uncertainty in rank["offsets"]:
                assert abs(offset) <= uncertainty, (name, offset, uncertainty)
        trace = _trace(ranks)
        slack = trace["otherData"]["clock_uncertainty_us"] * 2
        forward = {(e["args"]["stage"], e["args"]["replica"], e["args"]["step"], e["args"]["micro_batch"]): e
                   for e in trace["traceEvents"] if e.get("cat") == "compute" and e["name"][0] == "F"}
        for (stage, replica, step, k), after in forward.items():
            before = forward.get((stage - 1, replica, step, k))
            if before is not None:
                assert after["ts"] >= before["ts"] + before["dur"] - slack, (name, stage, replica, step, k)


def test_a_skewed_clock_is_measured_within_its_uncertainty(launched):
    for rank, (offset, uncertainty) in enumerate(launched[0]["skewed"]):
        assert abs(offset - rank * SKEW_NS) <= uncertainty, (rank, offset, uncertainty)


def test_the_traced_bubble_is_the_simulators_within_the_tolerance(launched):
    """Every schedule of the registry at pp = 4 and pp = 2 × dp = 2: the mean bubble from the trace
    and the simulator's at the traced costs agree within TOLERANCE; the simulator, whose transfers
    are free, is not above the trace (within noise)."""
    seen = set()
    for name, ranks in _runs(launched):
        report = ranks[0]["report"]
        trace, simulator = report["trace"]["bubble"], report["simulator"]["bubble"]
        assert abs(trace - simulator) <= TOLERANCE, (name, trace, simulator, report["trace"])
        assert simulator <= trace + 0.05, (name, trace, simulator)
        assert len(report["trace"]["stage_bubble"]) == _trace(ranks)["otherData"]["pp"]
        seen.add(name.split("-pp")[0])
    assert seen == set(SCHEDULES)


def test_the_files_are_written_whole(launched):
    for name, ranks in _runs(launched):
        json_path, png_path = ranks[0]["paths"]
        assert os.path.basename(json_path) == "timeline-3-4.json"
        with open(png_path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert not [n for n in os.listdir(os.path.dirname(json_path)) if ".tmp-" in n]


def test_a_resumed_run_traces_its_new_steps_and_notes_the_old_ones(launched):
    resumed = launched[0]["resumed"]
    assert resumed["from"] == 5 and resumed["steps"] == [6]  # step 3 ran before the launch
    assert [os.path.basename(p) for p in resumed["paths"]] == ["timeline-6.json", "timeline-6.png"]
    run_dir = os.path.dirname(resumed["paths"][0])
    with open(os.path.join(run_dir, "train.log")) as f:
        assert "train.trace_steps: step 3 ran before this launch (it resumes after step 5): not traced" in f.read()


def test_steps_before_the_resumed_one_are_refused_before_launch(launched, capsys):
    """The run (its newest checkpoint: step 5) traced 3, 4 and 6: those are passed over; step 5 was not."""
    from launcher.preflight import check_trace_steps
    from trainer.config import ConfigError, load_config

    run_dir = os.path.dirname(launched[0]["resumed"]["paths"][0])
    config = launched[1]
    again = load_config(config, {"run_dir": run_dir, "train": {"trace_steps": [3, 4, 6, 8], "max_steps": 9}})
    check_trace_steps(again, config)  # the same steps again, and a new one: fine
    refused = load_config(config, {"run_dir": run_dir, "train": {"trace_steps": [5, 8], "max_steps": 9}})
    with pytest.raises(ConfigError) as error:
        check_trace_steps(refused, config)
    assert "train.trace_steps=[5, 8] names step 5, which ran before the step this run resumes from (5)" in str(error.value)
    assert "within 6..9" in str(error.value)


# ---- no launch -------------------------------------------------------------------------------------

def test_micro_batches_of_deepspeeds_1f1b_instructions(one_thread):
    """DeepSpeed's TrainSchedule names buffers (min(p − s, m) of them, reused), not micro-batches."""
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    from parallel.trace import label_micro_batches

    p, m = 4, 7
    for stage in range(p):
        raw, t = [], 0
        for step in TrainSchedule(micro_batches=m, stages=p, stage_id=stage).steps():
            for cmd in step:
                raw.append((type(cmd).__name__, cmd.kwargs.get("buffer_id"), t, t + 1, 0))
                t += 1
        spans = label_micro_batches(raw)
        by_label: dict = {}
        for label, category, micro_batch, *_ in spans:
            by_label.setdefault(label, []).append(micro_batch)
        assert by_label["F"] == by_label["BW"] == list(range(m))  # 1F1B: forwards and backwards in order
        for label in ("load", "receive activation", "send activation", "receive gradient", "send gradient"):
            assert by_label.get(label, list(range(m))) == list(range(m)), (stage, label, by_label.get(label))
        assert ("load" in by_label) == (stage in (0, p - 1))


def _records_of_simulation(p: int, m: int, cost: dict, order, send: int = 0) -> list[dict]:
    """A trace whose compute spans are a simulated timeline (ns), `send` ns of send after each F."""
    from parallel.zb_timeline import simulate

    records = []
    for stage, ops in enumerate(simulate(p, m, cost, order)):
        spans = []
        for start, end, kind, j in ops:
            spans.append([kind, "compute", j, int(start * 1e9), int(end * 1e9)])
            if send and kind == "F":
                spans.append(["send activation", "send", j, int(end * 1e9), int(end * 1e9) + send])
        records.append({"rank": stage, "stage": stage, "replica": 0, "tp_rank": 0, "layers": f"layers {stage}",
                        "host": "h", "device": "d", "device_clock": False, "steps": {"1": spans},
                        "clock": {"offset_ns": 0, "uncertainty_ns": 5, "offset_after_ns": 0, "uncertainty_after_ns": 7}})
    return records


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_bubble_of_a_simulated_timeline_is_the_simulators(name):
    """Read as a trace, the simulator's own timeline gives the simulator's bubble, for every
    schedule of the registry (uneven F, B, W costs)."""
    from trainer.timeline import bubble_report

    cost = {"F": 1.0, "B": 1.3, "W": 0.6}
    report = bubble_report(_records_of_simulation(4, 6, cost, SCHEDULES[name].order))
    assert report["trace"]["stage_bubble"] == pytest.approx(report["simulator"]["stage_bubble"], abs=1e-6)
    assert report["trace"]["stage_send"] == [0, 0, 0, 0] and report["trace"]["bubble"] > 0


def test_the_chrome_trace_and_the_gantt_chart(tmp_path):
    from trainer.timeline import write_timeline

    records = _records_of_simulation(2, 4, {"F": 0.01, "B": 0.01, "W": 0.01}, SCHEDULES["1f1b"].order, send=1000)
    paths, report = write_timeline(str(tmp_path / "timeline-1"), records, {"schedule_title": "x", "pp": 2})
    with open(paths[0]) as f:
        trace = json.load(f)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "M"} == {"process_name", "process_sort_index",
                                                                             "thread_name"}
    assert len(complete) == 2 * (2 * 4 + 4) and min(e["ts"] for e in complete) == 0
    assert {e["name"] for e in complete if e["cat"] == "compute"} >= {"F0", "BW3"}
    assert trace["otherData"]["clock_uncertainty_us"] == 0.007 and trace["otherData"]["steps"] == [1]
    assert report["trace"]["stage_send"][0] > 0 and report["trace"]["bubble"] == pytest.approx(report["simulator"]["bubble"])
    assert os.path.getsize(paths[1]) < 200_000


def test_an_unwritable_place_writes_nothing_and_says_so_once(tmp_path):
    from trainer.timeline import publish

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    lines: list[str] = []
    records = _records_of_simulation(2, 2, None, SCHEDULES["1f1b"].order)
    assert publish(str(blocker / "timeline-1"), records, {"pp": 2}, lines.append, "timeline of steps 1") == ([], None)
    assert lines == [f"timeline of steps 1: not written (Not a directory: {blocker / 'timeline-1.json'}.tmp-{os.getpid()}); "
                     "training goes on"]
    assert os.listdir(tmp_path) == ["a-file"]


def test_trace_steps_beyond_max_steps_stop_before_any_rank(tmp_path, capsys, no_launch):
    for steps, words in (([1, 3], ["train.trace_steps=[1, 3]", "beyond train.max_steps=2", "1..2"]),
                         ([0], ["train.trace_steps=[0]", "must be >= 1"])):
        cfg = base_config(tmp_path)
        cfg["train"]["trace_steps"] = steps
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert_one_line_error(*run_cli(["train", str(path)], capsys), words)
        assert not (tmp_path / "run").exists()


def test_one_rank_gets_a_note(tmp_path, capsys):
    from launcher.preflight import check_trace_steps
    from trainer.config import load_config

    cfg = base_config(tmp_path)
    cfg["parallel"]["pipeline_stages"], cfg["train"]["trace_steps"] = 1, [2]
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    check_trace_steps(load_config(str(path)), str(path))
    assert capsys.readouterr().out.splitlines() == [
        "note: train.trace_steps on a layout of one rank: its timeline has one track and no pipeline bubble "
        "(nothing waits for another stage)"]


def test_bench_overhead_pairs_each_traced_step_with_its_neighbour():
    """bench train --trace's pairs run traced-first in every other pair; each ratio is traced ÷ untraced."""
    from bench.timeline import overhead, timeline_table

    def rank(calls: int, seconds: list[float], cpu: list[float]) -> dict:
        order = [False, True, True, False]
        return {"calls": calls, "hook_seconds": 2e-6,
                "steps": [{"traced": t, "seconds": s, "cpu_seconds": c} for t, s, c in zip(order, seconds, cpu)]}

    ranks = [rank(40, [1.0, 1.1, 2.2, 2.0], [1.0, 1.02, 2.04, 2.0]), rank(60, [1.0, 1.1, 2.2, 2.0], [0.5, 0.5, 0.5, 0.5])]
    cost = overhead(ranks)
    assert cost["wall_ratios"] == pytest.approx([1.1, 1.1]) and cost["wall"] == pytest.approx(0.1)
    assert cost["cpu_ratios"] == pytest.approx([1.52 / 1.5, 2.54 / 2.5])
    assert cost["hooks_per_step"] == 30 and cost["hook_share"] == pytest.approx(30 * 2e-6 / 1.5)
    report = {"trace": {k: [0.1, 0.2] for k in ("stage_bubble", "stage_send", "stage_load", "stage_between")},
              "simulator": {"stage_bubble": [0.1, 0.1], "bubble": 0.1}}
    report["trace"]["bubble"] = 0.15
    lines = timeline_table([{"layout": "pp2", "schedule": "1f1b"},
                            {"layout": "pp2-t", "schedule": "1f1b", "timeline": {"report": report, "overhead": cost,
                                                                                  "paths": ["/x/a.json", "/x/a.png"]}}])
    assert len(lines) == 6 and lines[-1].startswith("| pp2-t | 1f1b | 0.100 / 0.200 | 0.100 / 0.100 | 0.150 / 0.100 |")
    assert "+10.0% / +1.5% (2) | 2.0 × 30, 0.004%" in lines[-1] and "a.json, a.png" in lines[-1]

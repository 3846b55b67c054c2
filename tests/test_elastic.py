"""A run resumed in place at another pp × tp × dp layout (checkpoint/elastic.py).

1. tests/dist/elastic_worker.py (a launch of 2 ranks, one of 4): fp32 pp2·tp1·dp1 → pp1·tp1·dp2 →
   pp1·tp2·dp1 → pp2·tp1·dp1, bf16 pp2 → tp2 (fp16 too where the CPU takes it), and on 4 ranks
   pp1·tp2·dp2 → pp1·tp4·dp1 → pp2·tp1·dp2, each resumed in place and (but on 4 ranks)
   through `./run.sh convert reshard`: the same losses bit for bit; the uninterrupted run's
   batches, learning rates and (fp32) losses within rounding; the global batch, Adam's step and
   the weights kept.
2. `./run.sh train` itself: a run of pp = 2 relaunched at pp1·dp2 is killed while its checkpoint is
   converted; the next launch converts it again, says so before any rank starts, records it in
   train.log and summary.json, and trains on, every step once.
3. Refusals before any rank starts, one line each, and a damaged checkpoint passed over.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest

from tests.conftest import run_worker, write_run_config
from tests.run_cli import Run, _gone
from tests.test_flat_optimizer import fp16_unsupported

CONFIG = {"parallel": {"pipeline_stages": 2},
          "train": {"micro_batches": 2, "lr": 0.002, "clip_norm": 0.5, "save_interval": 1000, "valid_interval": 1000}}


@pytest.fixture(scope="module")
def resumed(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data, **CONFIG)
    precisions = "fp32,bf16" + ("" if fp16_unsupported() else ",fp16")
    return run_worker(2, "tests.dist.elastic_worker", str(work / "result.json"),
                      ["--config", config, "--precisions", precisions])


@pytest.fixture(scope="module")
def resumed4(tiny_data, tmp_path_factory):
    """4 ranks: pp1·tp2·dp2 → pp1·tp4·dp1 → pp2·tp1·dp2 (fp32)."""
    work = tmp_path_factory.mktemp("elastic4")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data, **CONFIG)
    return run_worker(4, "tests.dist.elastic_worker", str(work / "result.json"),
                      ["--config", config, "--precisions", "tp4"])


RUNS = ["fp32", "bf16", "fp16", "tp4"]


def _run(request, name: str) -> dict:
    if name == "tp4":
        return request.getfixturevalue("resumed4")["tp4"]
    resumed = request.getfixturevalue("resumed")
    if name not in resumed:
        pytest.skip(fp16_unsupported())
    return resumed[name]


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_in_place_equals_convert_reshard_bit_for_bit(request, name):
    for t in _run(request, name)["transitions"]:
        assert t["inplace"] == t["manual"], t["layout"]  # losses, clipped norms, lrs, batches
        assert t["inplace_state"] == {**t["manual_state"], "resharded": t["inplace_state"]["resharded"]}


@pytest.mark.parametrize("name", RUNS)
def test_in_place_continues_the_uninterrupted_run(request, name):
    """The same micro-batches at every step (the data stream continues exactly: no example skipped
    or seen twice), the same learning rates, and in fp32 the same losses within rounding."""
    run = _run(request, name)
    whole, seg = run["uninterrupted"], 3
    got = {key: whole[key][:seg] for key in whole}
    for t in run["transitions"]:
        for key in got:
            got[key] += t["inplace"][key]
    assert got["batches"] == whole["batches"] and len(set(got["batches"])) == len(got["batches"])
    assert got["lr"] == whole["lr"]
    if name in ("fp32", "tp4"):
        assert got["loss"] == pytest.approx(whole["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)
    assert got["loss"][-1] < got["loss"][0]


@pytest.mark.parametrize("name", RUNS)
def test_each_resume_keeps_step_batch_optimizer_and_weights(request, name):
    run = _run(request, name)
    layouts = [run["first_layout"]] + [t["layout"] for t in run["transitions"]]
    per_step = 2 * layouts[0][2]  # the config's 2 micro-batches per replica at the first layout
    for i, t in enumerate(run["transitions"], start=1):
        state, prepared = t["inplace_state"], t["prepared"]
        shown = "pp{}·tp{}·dp{}".format
        assert state["step"] == 3 * i and state["adam_steps"] == [3 * i]
        assert state["layout"] == t["layout"] and state["micro_batches"] * t["layout"][2] == per_step  # kept
        assert prepared["made"] and prepared["same_weights"] and prepared["step"] == 3 * i
        assert (prepared["from"], prepared["to"]) == (shown(*layouts[i - 1]), shown(*layouts[i]))
        assert state["resharded"] == {"step": 3 * i, "from": prepared["from"], "to": prepared["to"],
                                      "seconds": pytest.approx(prepared["seconds"], abs=0.01),
                                      "copy": f"universal-step{3 * i}"}
        assert t["copy_dropped"]  # the copy went once the resumed run committed a checkpoint of its own


# ---- ./run.sh train --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """A run of pp = 2 trained 4 steps by ./run.sh train, checkpoints at 2 and 4."""
    work = tmp_path_factory.mktemp("elastic-cli")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data,
                              parallel={"pipeline_stages": 2},
                              train={"micro_batches": 2, "max_steps": 4, "save_interval": 2, "valid_interval": 1000})
    run = Run(config)
    assert run.proc.wait(300) == 0, run.text()[-3000:]
    return config, str(work / "run")


def test_train_reshards_before_the_ranks_redoes_a_killed_conversion_and_records_it(trained):
    from checkpoint import manifest
    from checkpoint.checkpoints import load_model

    config, run_dir = trained
    ckpt = os.path.join(run_dir, "checkpoints")
    layout = ["--set", "parallel.pipeline_stages=1", "--set", "parallel.data_parallel=2", "--set", "train.max_steps=6"]
    killed = Run(config, *layout)
    deadline = time.monotonic() + 240
    while not [n for n in os.listdir(ckpt) if n.endswith(".tmp")]:  # the conversion has begun
        assert time.monotonic() < deadline and killed.proc.poll() is None, killed.text()[-3000:]
        time.sleep(0.05)
    tree = killed.tree()
    killed.proc.kill()
    _gone(tree, 30)  # the converter and its workers die with it
    assert killed.proc.wait(30) == -9 and "launching" not in killed.text()
    assert not os.path.exists(os.path.join(ckpt, "universal-step4"))

    run = Run(config, *layout)
    assert run.proc.wait(300) == 0, run.text()[-3000:]
    out = run.text()
    said = re.search(r"^resharded step 4 from pp2·tp1·dp1 to pp1·tp1·dp2 in ([\d.]+) s \(\S+universal-step4\)$",
                     out, flags=re.M)
    assert said and out.index(said.group(0)) < out.index("launching 2 ranks"), out[-3000:]
    assert re.search(r"^train.micro_batches 2 → 1: data_parallel 2 × 1 = 2 micro-batches per step, the run's "
                     r"\(data_parallel 1 × train.micro_batches 2 at step 4; train.keep_global_batch\)$", out, flags=re.M)
    assert f"resumed from {ckpt}/step4 at step 4 (verified), resharded through {ckpt}/universal-step4" in out
    assert not [n for n in os.listdir(ckpt) if n.startswith("universal-")]  # the killed one's remains, the copy
    with open(os.path.join(run_dir, "train.log")) as f:
        log = f.read()
    assert said.group(0) in log and "resharded through" in log
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["resharded"] == {"step": 4, "from": "pp2·tp1·dp1", "to": "pp1·tp1·dp2",
                                    "seconds": pytest.approx(float(said.group(1)), abs=0.06), "copy": "universal-step4"}
    assert summary["layout"] == {"pipeline_stages": 1, "tensor_parallel": 1, "data_parallel": 2, "micro_batches": 1}
    with open(os.path.join(run_dir, "metrics", "train", "train_loss.csv")) as f:
        assert [int(row.split(",")[0]) for row in f.read().split()[1:]] == [1, 2, 3, 4, 5, 6]
    # the checkpoint of the earlier layout stays intact and readable
    assert manifest.committed_tags(ckpt) == ["step6", "step4"] and not manifest.verify_local(os.path.join(ckpt, "step4"))
    assert load_model(run_dir, tag="step4").meta["source"]["pipeline_stages"] == 2


def _refused(run_dir_config: str, capsys, *sets: str) -> str:
    from launcher.cli import main as cli

    assert cli(["train", run_dir_config, "--eval-sentences", "0", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_layout_the_model_or_the_batch_cannot_take_is_refused_in_one_line(trained, capsys, no_launch):
    config, run_dir = trained
    err = _refused(config, capsys, "parallel.pipeline_stages=1", "parallel.data_parallel=4", "train.max_steps=9")
    assert ("parallel.data_parallel=4 cannot keep the run's 2 micro-batches per step (data_parallel " in err
            and "data_parallel 1 or 2 can; to change the batch on purpose set train.keep_global_batch=false "
                "(4 × train.micro_batches" in err), err
    err = _refused(config, capsys, "parallel.pipeline_stages=1", "parallel.tensor_parallel=3")
    assert "parallel.tensor_parallel=3 must divide model.heads=4" in err
    err = _refused(config, capsys, "parallel.pipeline_stages=7")
    assert "parallel.pipeline_stages=7 exceeds the model's 6 encoder and decoder layers" in err
    assert not [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith("universal-")]


def test_a_damaged_checkpoint_is_passed_over_and_zero_stage_0_refused(trained, tmp_path):
    from checkpoint import elastic, manifest
    from trainer.config import ConfigError

    run_dir = str(tmp_path / "run")
    shutil.copytree(trained[1], run_dir, symlinks=True)
    ckpt = os.path.join(run_dir, "checkpoints")
    newest = manifest.committed_tags(ckpt)[0]
    shard = sorted(n for n in os.listdir(os.path.join(ckpt, newest)) if n.endswith("optim_states.pt"))[0]
    with open(os.path.join(ckpt, newest, shard), "r+b") as f:
        f.seek(200)
        f.write(b"\x00" * 8)
    said: list[str] = []
    done = elastic.prepare(run_dir, (1, 2, 1), log=said.append)
    assert said[0].startswith(f"checkpoint {newest} is damaged: ") and "SHA-256" in said[0]
    assert said[-1] == f"the damaged checkpoints {newest} are moved to {ckpt}/damaged/"
    older = manifest.committed_tags(ckpt)[0]
    assert done.tag == older != newest and done.made and os.path.isdir(os.path.join(ckpt, "damaged", newest))
    assert not manifest.verify_local(done.path)

    # a checkpoint without ZeRO shards (parallel.zero_stage: 0) cannot be converted: one line, nothing made
    shutil.rmtree(done.path)
    for name in os.listdir(os.path.join(ckpt, older)):
        if name.endswith("optim_states.pt") or name == manifest.MANIFEST:
            os.remove(os.path.join(ckpt, older, name))
    manifest.commit_local(os.path.join(ckpt, older), older, int(older[4:]),
                          extra={"config": elastic.recorded(trained[1] + "/checkpoints", older)})
    with pytest.raises(ConfigError, match=r"has no ZeRO optimizer shards; resharding needs a checkpoint trained "
                                          r"with parallel.zero_stage: 1"):
        elastic.prepare(run_dir, (1, 2, 1))
    assert not [n for n in os.listdir(ckpt) if n.startswith("universal-")]

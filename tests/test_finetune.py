"""From pretraining to use: a run started from another run's weights (train.init_from), checkpoint
averaging (./run.sh convert average) and an existing SentencePiece model (data.spm_model).

One launch of 2 ranks (tests/dist/finetune_worker.py) trains a source at pp = 1 × dp = 2 and starts
runs from it at pp = 2 (from the run directory), pp = 1 × tp = 2 (from a checkpoint folder) and
pp = 2 again (from a model file averaging two checkpoints). Here: each started run holds exactly the
source's weights, with a fresh optimizer, schedule, step and data position; a fine-tuning run
resumes exactly; the average is the element-wise mean. The refusals run in this process through
the real command line, before any rank would start.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil

import pytest
import torch

from checkpoint.checkpoints import CONSOLIDATED_FORMAT, load_model
from parallel.tensor import merge_shards
from tests.bad_inputs import assert_one_line_error, run_cli
from tests.conftest import TINY_DATA, TINY_MODEL, run_worker, write_run_config


@pytest.fixture(scope="module")
def finetuned(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("finetune")
    run_dir = str(work / "source")
    config = write_run_config(str(work / "run.yaml"), run_dir, tiny_data,
                              train={"micro_batches": 2, "lr": 2e-3, "save_interval": 1000, "max_steps": 4})
    out = str(work / "result.json")
    result = run_worker(2, "tests.dist.finetune_worker", out, ["--config", config])
    return {"run_dir": run_dir, "result": result, "out": out, "average": str(work / "average.pt")}


def started_weights(finetuned, name: str) -> dict[str, torch.Tensor]:
    """The plain model a started run held, from its stages' and tensor-parallel ranks' dumps."""
    by_stage: dict[int, list] = {}
    for path in sorted(glob.glob(f"{finetuned['out']}.{name}.stage*.tp*.pt")):
        stage = int(path.split(".stage")[1].split(".")[0])
        by_stage.setdefault(stage, []).append(torch.load(path, weights_only=True))
    weights: dict[str, torch.Tensor] = {}
    for shards in by_stage.values():
        weights.update(merge_shards(shards))
    return weights


def assert_same_weights(started: dict, expected: dict) -> None:
    assert sorted(started) == sorted(expected)
    differ = [name for name, value in expected.items() if not torch.equal(started[name], value)]
    assert not differ, f"{len(differ)} tensors differ from the source, e.g. {differ[:3]}"


def test_a_run_started_from_a_run_directory_at_pp2_holds_its_newest_weights_exactly(finetuned):
    source = load_model(finetuned["run_dir"])  # newest: step 3
    assert source.meta["source"]["step"] == 3
    assert_same_weights(started_weights(finetuned, "b"), source.model.state_dict())
    record = finetuned["result"]["b"]["record"]
    assert record["init_from"] == finetuned["run_dir"] and record["step"] == 3
    assert record["checkpoint"] == os.path.join(finetuned["run_dir"], "checkpoints", "step3")


def test_a_run_started_from_a_checkpoint_folder_at_tp2_holds_its_weights_exactly(finetuned):
    assert_same_weights(started_weights(finetuned, "c"), load_model(finetuned["run_dir"], "step2").model.state_dict())
    assert finetuned["result"]["c"]["record"]["step"] == 2


def test_every_source_folder_passes_the_check_before_launch(finetuned, tiny_data, tmp_path):
    """A run directory, its checkpoints/ folder and one checkpoint folder (whose manifest.json is
    the checkpoint's, not a data manifest) all name the run's SentencePiece model and pass the
    check ./run.sh train makes before any rank starts."""
    from data.spm_source import read_spm
    from launcher.preflight import check_init_from
    from trainer.config import load_config

    with open(os.path.join(tiny_data, "spm.model"), "rb") as f:
        spm = f.read()
    run_dir = finetuned["run_dir"]
    for i, source in enumerate((run_dir, os.path.join(run_dir, "checkpoints"),
                                os.path.join(run_dir, "checkpoints", "step2"))):
        assert read_spm(source) == spm, source
        path = write_run_config(str(tmp_path / f"cfg{i}.yaml"), str(tmp_path / f"run{i}"), tiny_data,
                                train={"init_from": source})
        cfg = load_config(path)
        assert cfg.data.spm_model == source  # implied by train.init_from
        check_init_from(cfg, path)


def test_a_run_started_from_an_averaged_model_file_holds_the_average(finetuned):
    assert_same_weights(started_weights(finetuned, "d"), load_model(finetuned["average"]).model.state_dict())


@pytest.mark.parametrize("run", ["b", "c", "d"])
def test_optimizer_schedule_step_and_data_start_fresh(finetuned, run):
    r = finetuned["result"]
    assert r["a"]["step"] == 3 and r["a"]["adam_states"] > 0  # the source's optimizer had moved
    fresh = r[run]
    assert fresh["step"] == 0 and fresh["adam_states"] == 0 and fresh["scheduler_epoch"] == 0
    assert fresh["lr"] == pytest.approx(2e-3 / 2)  # warm-up step 1 of 2, as a run from scratch
    assert [fresh["stream"][k] for k in ("epoch", "window", "position")] == [0, 0, 0]
    assert fresh["history"] == {"valid": [], "tokens_per_s": []}


def test_a_fine_tuning_run_resumes_exactly_without_reading_its_source_again(finetuned):
    r = finetuned["result"]
    again = r["b_resumed"]
    assert again["step"] == 2 and not again["read_source"]
    assert again["record"] == r["b"]["record"]  # from the checkpoint
    assert len(r["b"]["loss"]) == 4 and again["loss"] == r["b"]["loss"][2:]


def test_averaging_two_checkpoints_is_their_element_wise_mean(finetuned, tmp_path, capsys):
    averaged = load_model(finetuned["average"])  # of the two checkpoint folders, named
    two = [load_model(finetuned["run_dir"], tag).model.state_dict() for tag in ("step2", "step3")]
    state = averaged.model.state_dict()
    for name, value in state.items():
        assert torch.equal(value, (two[0][name] + two[1][name]) / 2), name
    assert not torch.equal(two[0]["embed.weight"], two[1]["embed.weight"])  # the weights moved
    assert [a["step"] for a in averaged.meta["source"]["averaged"]] == [2, 3]
    assert averaged.meta["source"]["step"] == 3
    chosen = str(tmp_path / "steps.pt")  # the same two chosen by step from the run directory
    assert run_cli(["convert", "average", finetuned["run_dir"], "--steps", "2", "3", "--out", chosen], capsys)[0] == 0
    again = load_model(chosen).model.state_dict()
    assert all(torch.equal(value, again[name]) for name, value in state.items())


def test_the_model_card_says_where_a_model_started_and_what_it_averages(finetuned):
    from export.card import model_card, run_facts

    fine = load_model(finetuned["run_dir"] + "-b")  # its step-4 checkpoint records the start
    card = model_card(fine.meta, run_facts(fine.meta), "note", "hf")
    assert f"fine-tuned from `{finetuned['run_dir']}/checkpoints/step3` (step 3" in card
    averaged = load_model(finetuned["average"])
    assert "the element-wise mean of 2 checkpoints (steps 2, 3" in model_card(averaged.meta, {}, "note", "hf")


def test_a_card_shows_the_evaluation_and_validation_of_its_own_model_only(finetuned):
    """The run's eval/ scored its step-3 checkpoint (eval.json names it): that checkpoint's card
    shows the table; the average of steps 2 and 3 gets neither the table nor a validation loss."""
    from export.card import run_facts

    newest, averaged = load_model(finetuned["run_dir"]), load_model(finetuned["average"])
    eval_dir, metrics_dir = (os.path.join(finetuned["run_dir"], name) for name in ("eval", "metrics"))
    os.makedirs(eval_dir)
    os.makedirs(os.path.join(metrics_dir, "train"), exist_ok=True)
    csv_path = os.path.join(metrics_dir, "train", "valid_loss.csv")
    try:
        with open(csv_path, "w") as f:
            f.write("step,valid_loss\n0,6.9\n3,6.5\n")
        with open(os.path.join(eval_dir, "test.md"), "w") as f:
            f.write("| direction | BLEU |\n|---|---|\n| en-de | 12.3 |\n")
        with open(os.path.join(eval_dir, "eval.json"), "w") as f:
            json.dump({"test": {"rows": []}, "model": newest.meta["source"]}, f)
        facts = run_facts(newest.meta)
        assert "| en-de | 12.3 |" in facts["eval_table"] and facts["valid_loss"] == (3, 6.5)
        facts = run_facts(averaged.meta)
        assert facts["eval_table"] is None and facts["valid_loss"] is None
    finally:
        shutil.rmtree(eval_dir)
        os.remove(csv_path)


def test_average_refuses_what_it_cannot_average(finetuned, tmp_path, capsys):
    run = finetuned["run_dir"]
    out = str(tmp_path / "avg.pt")
    code, out_text, err = run_cli(["convert", "average", run, "--last", "3", "--out", out], capsys)
    assert_one_line_error(code, out_text, err, ["keeps 2 checkpoints (step2, step3)", "--last 3 needs 3"])
    code, out_text, err = run_cli(["convert", "average", run, "--steps", "1", "3", "--out", out], capsys)
    assert_one_line_error(code, out_text, err, ["no checkpoint of step 1"])
    step2 = os.path.join(run, "checkpoints", "step2")
    for argv, words in ((["--steps", "2", "2"], ["step 2 is named twice"]),
                        ([], [f"{run}: give --last N or --steps"])):
        assert_one_line_error(*run_cli(["convert", "average", run, *argv, "--out", out], capsys), words)
    for sources, words in (([step2], [f"{step2}: an average needs two or more"]),
                           ([step2, os.path.join(run, "checkpoints", ".", "step2")], [f"{step2} is named twice"])):
        assert_one_line_error(*run_cli(["convert", "average", *sources, "--out", out], capsys), words)
    assert not os.path.exists(out)


# ---- refusals before any rank starts, and data.spm_model ------------------------------------------

@pytest.fixture(scope="module")
def model_file(tiny_data, tmp_path_factory):
    """A consolidated model file of the tiny model, with the tiny data's SentencePiece model."""
    from model.config import ModelConfig
    from model.transformer import EncoderDecoder

    cfg = ModelConfig(**{**TINY_MODEL, "vocab_size": TINY_DATA["vocab_size"]})
    with open(os.path.join(tiny_data, "spm.model"), "rb") as f:
        spm = f.read()
    package = {"format": CONSOLIDATED_FORMAT, "model_config": dataclasses.asdict(cfg),
               "state_dict": EncoderDecoder(cfg).state_dict(), "spm_model": spm, "languages": ["en", "de", "fr"],
               "directions": [], "tags": {}, "source": {"checkpoint": "made here", "step": 7}}
    path = str(tmp_path_factory.mktemp("model") / "model.pt")
    torch.save(package, path)
    return path


def other_spm(tiny_data: str, path: str) -> str:
    """The tiny data's SentencePiece model with piece 599 renamed: same size, another vocabulary."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(os.path.join(tiny_data, "spm.model"), "rb") as f:
        proto.ParseFromString(f.read())
    proto.pieces[599].piece = "▁zzzq"
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    return path


@pytest.mark.parametrize("case", ["shape", "function", "vocabulary", "languages", "missing", "direction"])
def test_a_start_that_cannot_work_is_refused_before_any_rank_starts(case, tiny_data, model_file, tmp_path,
                                                                   capsys, no_launch):
    train = {"init_from": model_file}
    model, data, words = {}, {}, []
    if case == "shape":
        model, words = {"ffn_dim": 128}, ["encoder_layers.0.ffn.fc1.weight is [64, 32] there and [128, 32] here",
                                          "model.ffn_dim: 64 there, 128 here"]
    elif case == "function":
        model, words = {"norm": "postln"}, ["model.norm is 'deepnorm' there and 'postln' here"]
    elif case == "vocabulary":
        data = {"spm_model": other_spm(tiny_data, str(tmp_path / "other.model"))}
        words = ["id 599 is", "'▁zzzq' here", "leave data.spm_model empty"]
    elif case == "languages":
        data, words = {"languages": ["de", "es"]}, ["has no tag for es (<2es>)", "has tags for de, en, fr"]
    elif case == "missing":
        train, words = {"init_from": str(tmp_path / "nowhere")}, ["nowhere: no such run directory"]
    else:
        train, data, words = {}, {"directions": ["de-fr"]}, ["data.directions lists de-fr", "en-de"]
    config = write_run_config(str(tmp_path / "cfg.yaml"), str(tmp_path / "run"), tiny_data,
                              model=model, data=data, train=train)
    code, out, err = run_cli(["train", config], capsys)
    assert_one_line_error(code, out, err, words)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_prepare_encodes_with_an_existing_sentencepiece_model(tiny_data, model_file, tmp_path):
    from data.config import DataConfig
    from data.prepare import corpus_fingerprint, prepare_data

    lines = []
    cfg = DataConfig(**{**TINY_DATA, "languages": ["de"], "vocab_size": 100, "spm_model": model_file})
    manifest = prepare_data(cfg, str(tmp_path / "data"), log=lines.append)
    with open(tmp_path / "data" / "spm.model", "rb") as f, open(os.path.join(tiny_data, "spm.model"), "rb") as g:
        assert f.read() == g.read()
    with open(os.path.join(tiny_data, "manifest.json")) as f:
        tiny = json.load(f)
    assert manifest["vocab_size"] == 600 and manifest["spm_sample"] == {}
    assert manifest["tags"] == {k: tiny["tags"][k] for k in ("en", "de")}
    assert any("using the SentencePiece model of" in line for line in lines)
    assert not any("training SentencePiece" in line for line in lines)
    other = dataclasses.replace(cfg, spm_model=other_spm(tiny_data, str(tmp_path / "other.model")))
    assert corpus_fingerprint(other) != corpus_fingerprint(cfg)  # another model: prepared again


def test_prepared_data_needs_its_sentencepiece_source_no_more(tiny_data, model_file, tmp_path):
    """Once prepared, data/spm.model is the run's model: with the source moved away, the data is
    up to date and the resume check passes (a fine-tuning run resumes without its source)."""
    import shutil

    from data.config import DataConfig
    from data.prepare import prepare_data
    from launcher.preflight import check_resume_data
    from trainer.config import RunConfig

    source = str(tmp_path / "source.pt")
    shutil.copy(model_file, source)
    cfg = DataConfig(**{**TINY_DATA, "languages": ["de"], "vocab_size": 100, "spm_model": source})
    data = str(tmp_path / "run" / "data")
    prepare_data(cfg, data, log=lambda _: None)
    os.remove(source)
    lines = []
    prepare_data(cfg, data, log=lines.append)
    assert lines == [f"data: {data} is up to date (2 directions, " + lines[0].split("(2 directions, ")[1]], lines
    run = RunConfig(run_dir=str(tmp_path / "run"), data=cfg)
    check_resume_data(run, {"data": cfg.preparation_key()}, "run.yaml")


def test_directions_select_what_the_stream_draws(tiny_data):
    from data.batching import BatchStream
    from data.dataset import PairDataset

    every = PairDataset(os.path.join(tiny_data, "train"))
    chosen = PairDataset(os.path.join(tiny_data, "train"), ["en-de"])
    index = every.directions.index("en-de")
    assert chosen.direction_sizes.tolist() == [every.direction_sizes[index] if d == index else 0
                                               for d in range(len(every.directions))]
    drawn = torch.cat([b["dirs"] for b in BatchStream(chosen, 256, 1, 1.5).next_step(len(chosen) // 8)])
    assert set(drawn.tolist()) == {index} and len(drawn) > 100


def test_average_refuses_checkpoints_of_another_model_or_vocabulary(model_file, tiny_data, tmp_path, capsys):
    from model.config import ModelConfig
    from model.transformer import EncoderDecoder

    package = torch.load(model_file, weights_only=True)
    wider = ModelConfig(**{**package["model_config"], "ffn_dim": 128})
    with open(other_spm(tiny_data, str(tmp_path / "other.model")), "rb") as f:
        other = f.read()
    cases = {"model": (dict(package, model_config=dataclasses.asdict(wider), state_dict=EncoderDecoder(wider).state_dict()),
                       ["is another model than", "model.ffn_dim: 128 there, 64 in the first"]),
             "vocabulary": (dict(package, spm_model=other), ["has another SentencePiece model (vocabulary)"])}
    out = str(tmp_path / "avg.pt")
    for name, (changed, words) in cases.items():
        path = str(tmp_path / f"{name}.pt")
        torch.save(changed, path)
        code, out_text, err = run_cli(["convert", "average", model_file, path, "--out", out], capsys)
        assert_one_line_error(code, out_text, err, [path, *words])
        assert not os.path.exists(out)

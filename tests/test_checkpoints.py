"""Checkpoint conversion and evaluation on a real pipeline checkpoint.

One launch of 2 ranks (tests/dist/checkpoint_worker.py) trains pp=2, reshards a checkpoint to
pp=1 × dp=2 through DeepSpeed's universal checkpoint and resumes it there. Here: the resumed
losses equal the uninterrupted run's; the consolidated single file reproduces the pipeline's
logits; translate and eval run on the trained model and eval's scores are sacreBLEU's.
"""
import json
import os
import shutil

import pytest
import sacrebleu
import torch

from checkpoint.checkpoints import CheckpointError, load_model
from launcher.cli import main as cli
from tests.conftest import TINY_DATA, launch, write_run_config

STEPS, SAVE_AT = 4, 2


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    """translate/eval --threads 1 set torch's thread count for the whole process: put it back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt")
    run_dir = str(work / "run")
    config = write_run_config(str(work / "pp2.yaml"), run_dir, tiny_data,
                              train={"micro_batches": 2, "clip_norm": 0.05, "lr": 0.002, "save_interval": 1000})
    out = str(work / "result.json")
    proc = launch(2, "tests.dist.checkpoint_worker",
                  ["--config", config, "--out", out, "--steps", str(STEPS), "--save-at", str(SAVE_AT)])
    assert proc.returncode == 0, "checkpoint worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)
    return {"run_dir": run_dir, "work": work, "result": result,
            "logits": torch.load(out + ".logits.pt", weights_only=True)}


def test_resharded_pp2_to_pp1_dp2_resumes_with_identical_losses(trained):
    r = trained["result"]
    assert r["resumed_from"] == SAVE_AT
    assert r["resumed_layout"] == [1, 2, 1]  # 1 stage, 2 replicas, global batch kept (2 × 1 micro-batches)
    assert len(r["resumed"]) == STEPS - SAVE_AT
    assert r["resumed"] == pytest.approx(r["uninterrupted"][SAVE_AT:], rel=1e-5)
    assert r["uninterrupted"][-1] < r["uninterrupted"][0]  # the weights and Adam state really moved


def test_consolidated_file_reproduces_the_pipeline_logits(trained, tmp_path):
    out = str(tmp_path / "model.pt")
    assert cli(["convert", "consolidate", trained["run_dir"], "--out", out]) == 0
    package = torch.load(out, weights_only=True)  # plain tensors and values only
    assert package["source"]["step"] == STEPS and package["source"]["pipeline_stages"] == 2
    loaded = load_model(out)
    ref = trained["logits"]
    with torch.no_grad():
        logits = loaded.model(ref["src"], ref["tgt_in"])
    assert logits.shape == ref["logits"].shape
    diff = (logits - ref["logits"]).abs().max().item()
    assert diff <= 1e-5, f"consolidated model's logits differ from the pipeline's by {diff}"
    # the same model straight from the run directory's checkpoint, without a file
    direct = load_model(trained["run_dir"]).model.state_dict()
    for name, value in loaded.model.state_dict().items():
        assert torch.equal(direct[name], value), name


def test_consolidate_never_overwrites_unasked_nor_leaves_a_partial_file(trained, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    folder = tmp_path / "folder"
    folder.mkdir()
    for out, words in ((notes, "exists"), (folder, "is a folder")):
        assert cli(["convert", "consolidate", trained["run_dir"], "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert notes.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["folder", "notes.txt"]
    assert not os.listdir(folder)
    assert cli(["convert", "consolidate", trained["run_dir"], "--out", str(notes), "--force"]) == 0
    assert load_model(str(notes)).meta["source"]["step"] == STEPS and sorted(os.listdir(tmp_path)) == ["folder", "notes.txt"]


def test_universal_checkpoint_consolidates_to_the_same_weights(trained):
    # The resharded run directory holds only the universal checkpoint made from step 2.
    universal = load_model(trained["run_dir"] + "-pp1dp2")
    assert universal.meta["source"]["tag"] == f"universal-step{SAVE_AT}"
    original = load_model(trained["run_dir"], tag=f"step{SAVE_AT}").model.state_dict()
    for name, value in universal.model.state_dict().items():
        assert torch.equal(original[name], value), name


def test_average_finds_the_universal_checkpoint_of_a_resharded_run(trained, tmp_path, capsys):
    """A resharded run keeps `universal-stepN` beside the checkpoints it trains itself; `convert
    average --last/--steps` counts it as consolidate, translate and train do."""
    run = tmp_path / "resharded"
    shutil.copytree(trained["run_dir"] + "-pp1dp2", run, symlinks=True)
    shutil.copytree(os.path.join(trained["run_dir"], "checkpoints", f"step{STEPS}"), run / "checkpoints" / f"step{STEPS}")
    assert cli(["convert", "average", str(run), "--last", "2"]) == 0, capsys.readouterr().err
    averaged = load_model(str(run / f"model-average-universal-step{SAVE_AT}-step{STEPS}.pt"))
    assert [a["step"] for a in averaged.meta["source"]["averaged"]] == [SAVE_AT, STEPS]
    first = load_model(trained["run_dir"], tag=f"step{SAVE_AT}").model.state_dict()
    last = load_model(trained["run_dir"], tag=f"step{STEPS}").model.state_dict()
    for name, value in averaged.model.state_dict().items():
        assert torch.equal(value, (first[name].float() + last[name].float()) / 2), name
    capsys.readouterr()
    assert cli(["convert", "average", str(run), "--steps", str(SAVE_AT), "--out", str(tmp_path / "one.pt")]) == 0
    assert load_model(str(tmp_path / "one.pt")).meta["source"]["averaged"][0]["checkpoint"].endswith(
        f"universal-step{SAVE_AT}")
    assert cli(["convert", "average", str(run), "--steps", "3", "--out", str(tmp_path / "none.pt")]) == 2
    assert capsys.readouterr().err == f"error: {run} has no checkpoint of step 3 (it has: universal-step{SAVE_AT}, step{STEPS})\n"


def test_tensor_parallel_shards_consolidate_to_the_pipelines_model(trained):
    from data.batching import PairDataset, eval_batches
    from model.transformer import smoothed_loss_sum

    run_dir = trained["run_dir"] + "-tp2"
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "step2", "layer_01-model_01-model_states.pt"))
    loaded = load_model(run_dir)
    cfg = loaded.model.cfg
    total = tokens = 0.0
    with torch.no_grad():
        for batch in eval_batches(PairDataset(os.path.join(run_dir, "data", "dev")), TINY_DATA["max_tokens"]):
            logits = loaded.model(batch["src"], batch["tgt_in"])
            total += smoothed_loss_sum(logits, batch["tgt_out"], cfg.pad_id, cfg.label_smoothing).item()
            tokens += batch["ntokens"]
    assert total / tokens == pytest.approx(trained["result"]["tp2_valid_loss"], rel=1e-5)


def test_files_that_need_code_to_load_are_refused(tmp_path):
    path = str(tmp_path / "evil.pt")
    torch.save({"format": "deepnet-consolidated-1", "payload": shutil.rmtree}, path)
    with pytest.raises(CheckpointError) as refused:
        load_model(path)
    assert str(refused.value) == (f"{path}: holds shutil.rmtree, which is not loaded: only tensors and plain values "
                                  "are (anything else could run code)")
    with pytest.raises(CheckpointError, match="no such model file"):
        load_model(str(tmp_path / "missing.pt"))


def test_reshard_refuses_an_impossible_layout(trained, tmp_path):
    assert cli(["convert", "reshard", trained["run_dir"], str(tmp_path / "x"), "--pipeline-stages", "1",
                "--data-parallel", "3"]) == 2  # 3 does not divide the global batch of 2 micro-batches
    assert not os.path.exists(tmp_path / "x" / "checkpoints")


def test_translate_keeps_lines_and_refuses_unknown_languages(trained, tmp_path, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("Save and continue editing\n\nDelete\n", encoding="utf-8")
    assert cli(["translate", trained["run_dir"], "--to", "de", "-i", str(src), "-o", str(out), "--beam", "2",
                "--threads", "1"]) == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""
    assert "sentences/s" in capsys.readouterr().err
    assert cli(["translate", trained["run_dir"], "--to", "xx", "-i", str(src)]) == 2
    assert "xx" in capsys.readouterr().err


def test_translate_refuses_bad_text_and_paths_with_one_line_and_writes_nothing(trained, tmp_path, capsys,
                                                                               monkeypatch):
    import io

    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_bytes("Delete\n".encode() + b"caf\xe9 ok\n")
    src_bytes = src.read_bytes()
    folder = tmp_path / "folder"
    folder.mkdir()
    cases = [(["-i", str(src), "-o", str(out)], "in.txt line 2 is not UTF-8 (byte 0xe9 at column 4)"),
             (["-i", str(src), "-o", str(folder)], "is a folder"),
             (["-i", str(folder)], "is a folder"),
             (["-i", str(src), "-o", str(tmp_path / "nowhere" / "x.txt")], "does not exist"),
             (["-i", str(src), "-o", str(src)], "is the --input file"),
             (["-i", str(src), "-o", str(out), "--beam", "100000"], "--beam 100000 is wider than the model's "
                                                                   "vocabulary of 600 pieces")]
    for extra, words in cases:
        assert cli(["translate", trained["run_dir"], "--to", "de", "--threads", "1", *extra]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["folder", "in.txt"] and not os.listdir(folder)
    assert src.read_bytes() == src_bytes
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    assert cli(["translate", trained["run_dir"], "--to", "de", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert "standard input line 2 is not UTF-8 (byte 0xff at column 1)" in err and "Traceback" not in err
    assert cli(["eval", trained["run_dir"], "--beam", "601", "--threads", "1"]) == 2
    assert "--beam 601 is wider than the model's vocabulary of 600 pieces" in capsys.readouterr().err
    assert cli(["eval", trained["run_dir"], "--out-dir", str(src), "--threads", "1"]) == 2  # before loading
    err = capsys.readouterr().err
    assert err.startswith("error: --out-dir") and "is a file" in err and src.read_bytes() == src_bytes


def test_eval_scores_come_from_sacrebleu_on_raw_references(trained, tmp_path, monkeypatch, capsys):
    from sacrebleu.tokenizers import tokenizer_spm

    from data.corpus import list_pairs, read_direction
    from data.prepare import corpus_path, load_manifest

    # spBLEU: absent FLORES model → a message naming the path; present → a column (a stand-in file).
    monkeypatch.setattr(tokenizer_spm, "SACREBLEU_DIR", str(tmp_path / "sacrebleu"))
    out_dir = tmp_path / "eval"
    args = ["eval", trained["run_dir"], "--splits", "test", "--max-sentences", "6", "--greedy", "--threads", "1",
            "--out-dir", str(out_dir), "--spbleu", "flores200"]
    assert cli(args) == 0
    printed = capsys.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and os.path.join(str(tmp_path / "sacrebleu"), "models", "flores200sacrebleuspm") in notes[0]
    assert "| direction | sentences | BLEU | tokenizer | chrF |" in printed and "| de-en | 6 |" in printed

    report = json.loads((out_dir / "eval.json").read_text())["test"]
    data_dir = os.path.join(trained["run_dir"], "data")
    pairs = {d: p for p in list_pairs(corpus_path(data_dir, load_manifest(data_dir))) for d in p.directions()}
    rows = {r["direction"]: r for r in report["rows"]}
    directions = [d for d in rows if "average" not in d]
    assert sorted(directions) == ["de-en", "en-de", "en-fr", "fr-en"]
    for direction in directions:
        refs = [t for _, t in read_direction(pairs[direction], "test", direction)][:6]
        hyps = (out_dir / "test" / f"{direction}.hyp").read_text(encoding="utf-8").split("\n")[:-1]
        assert len(hyps) == rows[direction]["sentences"] == 6
        assert rows[direction]["BLEU"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], tokenize="13a").score)
        assert rows[direction]["chrF"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score)
    assert rows["X→En average"]["chrF"] == pytest.approx((rows["de-en"]["chrF"] + rows["fr-en"]["chrF"]) / 2)
    assert rows["En→X average"]["BLEU"] == pytest.approx((rows["en-de"]["BLEU"] + rows["en-fr"]["BLEU"]) / 2)
    assert rows["all average"]["sentences"] == 24
    table = (out_dir / "test.md").read_text()
    assert "| X→En average |" in table and "nrefs:1|case:mixed|eff:no|tok:13a" in table
    assert "| en-de | 6 | " in table and " | 13a | " in table
    assert (out_dir / "test.csv").read_text().startswith("direction,sentences,BLEU,tokenizer,chrF")

    models = tmp_path / "sacrebleu" / "models"
    models.mkdir(parents=True)
    shutil.copy(os.path.join(data_dir, "spm.model"), models / "flores200sacrebleuspm")
    assert cli([*args, "--directions", "de-en"]) == 0
    row = json.loads((out_dir / "eval.json").read_text())["test"]["rows"][0]
    hyps = (out_dir / "test" / "de-en.hyp").read_text(encoding="utf-8").split("\n")[:-1]
    refs = [t for _, t in read_direction(pairs["de-en"], "test", "de-en")][:6]
    expected = sacrebleu.metrics.BLEU(tokenize="flores200").corpus_score(hyps, [refs]).score
    assert row["spBLEU"] == pytest.approx(expected)


def test_bleu_takes_the_tokenizer_the_target_language_needs():
    from translate.evaluate import Scores

    scores = Scores("none")
    hyp, ref = ["我们 今天 去 公园 玩"], ["我们今天去公园玩了"]
    chinese = scores.score(hyp, ref, "zh_CN")
    assert chinese["tokenizer"] == "zh"
    assert chinese["BLEU"] == pytest.approx(sacrebleu.metrics.BLEU(tokenize="zh").corpus_score(hyp, [ref]).score)
    assert chinese["BLEU"] != pytest.approx(sacrebleu.metrics.BLEU(tokenize="13a").corpus_score(hyp, [ref]).score)
    hyp, ref = ["The cat sat on the mat today ."], ["The cat sat on the mat ."]
    english = scores.score(hyp, ref, "en")
    assert english["tokenizer"] == "13a" and english["BLEU"] == pytest.approx(sacrebleu.corpus_bleu(hyp, [ref]).score)
    assert english["BLEU"] > 50

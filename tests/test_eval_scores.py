"""Scores per target language and clean errors.

- BLEU takes the tokenizer its target language needs (zh: 'zh'; ja/ko: 'ja-mecab'/'ko-mecab' where
  installed, else chrF only; th and other scripts without spaces: chrF only), each direction's in
  the table, the signatures per tokenizer in the tables' file, the reasons said in one line;
- hypotheses that are all empty get one warning line;
- `./run.sh eval` (a subprocess, on a tiny model trained here for seconds: tests/test_export.py's
  helpers) prints its table and at most one line of notes;
- a file that is not a model, given to translate, eval or export, gets one line naming it and what
  was expected, nothing of torch's advice to load it unsafely.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import sacrebleu
import torch

from tests.conftest import ROOT

EXPECTED = "expected a consolidated model file (./run.sh convert consolidate RUN_DIR) or a run directory"


def run_sh(*args: str, stdin: str = "", env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(ROOT, "run.sh"), *args], cwd=ROOT, input=stdin, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


class Echo:
    """A translator that answers each source with a fixed text per target language."""

    def __init__(self, answers: dict[str, str]):
        self.answers = answers

    def translate(self, texts, targets, options, progress=None):
        out = [self.answers[t] for t in targets]
        return out, sum(len(o.split()) for o in out)


SETS = {split: {"en-zh": (["a", "b"], ["我们今天去公园玩了", "他们明天来"]),
                "en-th": (["a", "b"], ["สวัสดีครับ", "ขอบคุณมาก"]),
                "en-ja": (["a", "b"], ["今日は公園に行きました", "ありがとう"]),
                "en-de": (["a", "b"], ["Wir gehen heute in den Park .", "Danke schön ."])}
        for split in ("dev", "test")}
ANSWERS = {"zh": "我们 今天 去 公园 玩", "th": "สวัสดี", "ja": "今日は公園", "de": "Wir gehen heute in den Park ."}


def mecab(language: str) -> bool:
    try:
        sacrebleu.metrics.BLEU(tokenize=f"{language}-mecab")
        return True
    except Exception:
        return False


def test_bleu_per_target_language_and_one_line_of_notes(tmp_path, capsys, monkeypatch):
    from model.decoding import DecodeOptions
    from translate.evaluate import evaluate

    monkeypatch.setattr("sacrebleu.tokenizers.tokenizer_spm.SACREBLEU_DIR", str(tmp_path / "sacrebleu"))
    printed: list[str] = []
    report = evaluate(Echo(ANSWERS), SETS, DecodeOptions(beam=1), "auto", str(tmp_path / "eval"), log=printed.append)
    rows = {r["direction"]: r for r in report["test"]["rows"]}
    refs = {d: refs for d, (_, refs) in SETS["test"].items()}
    hyps = {d: [ANSWERS[d.split("-")[1]]] * 2 for d in refs}
    assert rows["en-zh"]["tokenizer"] == "zh"
    assert rows["en-zh"]["BLEU"] == pytest.approx(
        sacrebleu.metrics.BLEU(tokenize="zh").corpus_score(hyps["en-zh"], [refs["en-zh"]]).score)
    assert rows["en-de"]["tokenizer"] == "13a"
    assert rows["en-de"]["BLEU"] == pytest.approx(sacrebleu.corpus_bleu(hyps["en-de"], [refs["en-de"]]).score)
    assert rows["en-th"]["BLEU"] is None and rows["en-th"]["tokenizer"] == "–"
    assert rows["en-th"]["chrF"] == pytest.approx(sacrebleu.corpus_chrf(hyps["en-th"], [refs["en-th"]]).score)
    scored = ["en-zh", "en-de"] + (["en-ja"] if mecab("ja") else [])
    assert (rows["en-ja"]["tokenizer"], rows["en-ja"]["BLEU"] is None) == (
        ("ja-mecab", False) if mecab("ja") else ("–", True))
    average = rows["En→X average"]
    assert average["BLEU"] == pytest.approx(sum(rows[d]["BLEU"] for d in scored) / len(scored))
    assert average["tokenizer"] == "+".join(sorted(rows[d]["tokenizer"] for d in scored))

    # printed: per split the table and its speed; one line of notes for the whole evaluation
    notes = [line for line in printed if line.startswith("note: ")]
    assert len(notes) == 1 and "\n" not in notes[0], printed
    assert "th: chrF only, no BLEU (Thai is written without spaces between words" in notes[0]
    assert ("ja: chrF only, no BLEU (sacreBLEU's ja-mecab tokenizer is not installed (pip install 'sacrebleu[ja]'))"
            in notes[0]) != mecab("ja")
    assert "spBLEU" not in notes[0]  # auto: said in the tables only
    assert not any("signature:" in line for line in printed)
    assert "| direction | sentences | BLEU | tokenizer | chrF |" in printed[0] and "| en-th | 2 | – | – |" in printed[0]
    table = (tmp_path / "eval" / "test.md").read_text(encoding="utf-8")
    assert "- BLEU (zh): `nrefs:1|case:mixed|eff:no|tok:zh|" in table and "- BLEU (13a): `" in table
    assert "- spBLEU skipped: sacreBLEU needs the flores200 SentencePiece model" in table
    assert "- th: chrF only, no BLEU" in table
    csv_rows = (tmp_path / "eval" / "test.csv").read_text(encoding="utf-8").splitlines()
    assert csv_rows[0] == "direction,sentences,BLEU,tokenizer,chrF" and csv_rows[2].startswith("en-th,2,,–,")
    assert capsys.readouterr().err == ""  # nothing to warn about


def test_empty_hypotheses_get_one_warning_line(tmp_path, capsys):
    from model.decoding import DecodeOptions
    from translate.evaluate import evaluate

    sets = {split: {d: SETS[split][d] for d in ("en-de", "en-zh")} for split in ("dev", "test")}
    evaluate(Echo({"de": "", "zh": ""}), sets, DecodeOptions(beam=1), "none", str(tmp_path / "a"), log=lambda *_: None)
    err = capsys.readouterr().err
    assert err == ("warning: every hypothesis is empty (8 sentences of dev, test): the model generated no tokens, so "
                   "its scores are 0 and its tokens/s say nothing\n")
    evaluate(Echo({"de": "Danke", "zh": ""}), sets, DecodeOptions(beam=1), "none", str(tmp_path / "b"),
             log=lambda *_: None)
    assert capsys.readouterr().err == ("warning: every hypothesis of these directions is empty (dev: en-zh; test: "
                                       "en-zh): the model generated no tokens for them\n")


@pytest.fixture(scope="module")
def tiny_run(tiny_data, tmp_path_factory):
    """A run directory on the session's tiny corpus and a model file trained 12 steps on it."""
    from tests.test_export import save_consolidated, train_tiny

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = train_tiny(tiny_data, "deepnorm", 12)
    finally:
        torch.set_num_threads(threads)
    work = tmp_path_factory.mktemp("eval")
    os.makedirs(work / "run")
    os.symlink(tiny_data, work / "run" / "data")
    return str(work / "run"), save_consolidated(net, tiny_data, str(work / "model.pt"))


def test_eval_prints_its_tables_and_at_most_one_line_of_notes(tiny_run, tmp_path):
    run_dir, model = tiny_run
    flags = ["eval", run_dir, "--model", model, "--max-sentences", "2", "--greedy", "--max-len-a", "0",
             "--max-len-b", "4", "--threads", "1", "--out-dir", str(tmp_path / "eval")]
    env = {"SACREBLEU": str(tmp_path / "sacrebleu")}  # no FLORES model there
    proc = run_sh(*flags, env=env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("| direction | sentences | BLEU | tokenizer | chrF |") == 2  # dev and test
    assert "| de-en | 2 | " in out and " | 13a | " in out
    assert not [line for line in out.splitlines() if line.startswith("note")] and "signature:" not in out
    # a model this small, trained for seconds, may end every output at once: then one warning says so
    hyps = [line for path in (tmp_path / "eval").glob("*/*.hyp") for line in path.read_text().splitlines()]
    assert len(hyps) == 16
    warned = ("warning: every hypothesis is empty (16 sentences of dev, test): the model generated no tokens, so its "
              "scores are 0 and its tokens/s say nothing\n")
    assert proc.stderr == (warned if not any(hyps) else ""), proc.stderr
    proc = run_sh(*flags, "--spbleu", "flores200", env=env)  # asked for by name and missing: said, once
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stdout.splitlines() if line.startswith("note")]
    assert len(notes) == 1 and notes[0].startswith("note: spBLEU skipped: sacreBLEU needs the flores200 "), notes
    # without --out-dir a model file's scores go beside the run's own eval/, naming the model scored
    proc = run_sh(*flags[:-2], "--splits", "test", env=env)
    assert proc.returncode == 0, proc.stderr
    scored = json.loads((Path(run_dir) / "eval-model" / "eval.json").read_text())["model"]
    from checkpoint.checkpoints import load_model

    assert scored == load_model(model).meta["source"] and not (Path(run_dir) / "eval").exists()


def test_a_file_that_is_not_a_model_gets_one_line(tiny_run, tmp_path, capsys):
    from launcher.cli import main

    run_dir, _ = tiny_run
    text = tmp_path / "hosts.txt"
    text.write_text("127.0.0.1 localhost\n")
    said = f"error: {text}: not a PyTorch file; {EXPECTED}\n"
    for args in (["translate", str(text), "--to", "de"], ["eval", run_dir, "--model", str(text)],
                 ["export", str(text), "--to", "hf", str(tmp_path / "hf")]):
        proc = run_sh(*args, stdin="Save\n")
        assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", said), args
    assert not (tmp_path / "hf").exists()
    # in-process: a file that needs code to load, a folder that is not a run directory
    evil = tmp_path / "evil.pt"
    torch.save({"format": "deepnet-consolidated-1", "payload": shutil.rmtree}, evil)
    folder = tmp_path / "folder"
    folder.mkdir()
    threads = torch.get_num_threads()
    for path, said in ((evil, "holds shutil.rmtree, which is not loaded: only tensors and plain values are (anything "
                              "else could run code)"), (folder, f"a folder without checkpoints/; {EXPECTED}")):
        assert main(["translate", str(path), "--to", "de", "--threads", str(threads)]) == 2
        assert capsys.readouterr().err == f"error: {path}: {said}\n"

"""Bad corpora: each stops before any rank starts with exit code 2 and one line on stderr that
names the file or line, without a traceback, leaving no run directory; the good corpus passes and
reaches the launch. A representative subset of configs and corpora through the real `./run.sh
train` / `./run.sh prepare` as separate processes.
"""
from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from tests.bad_inputs import (LANGS, RankLaunched, assert_one_line_error, base_config, good_corpus, run_cli,
                              with_key, write_case, write_lines, written_files)
from tests.conftest import ROOT


def f(corpus, split="dev", side="fr", lang="fr"):
    return os.path.join(corpus, f"en-{lang}", f"opus.en-{lang}-{split}.{side}")


def remove_dev(c):
    os.remove(f(c, side="en"))
    os.remove(f(c))


def empty_dev(c):
    open(f(c, side="en"), "w").close()
    open(f(c), "w").close()


def relink(path, target):
    os.remove(path)
    os.symlink(target, path)


def dangling(c):
    relink(f(c), f(c) + ".gone")


def file_loop(c):
    os.remove(f(c))
    os.symlink(f(c) + ".b", f(c))
    os.symlink(f(c), f(c) + ".b")


def folder_loop(c):
    os.symlink(os.path.join(c, "en-fr"), os.path.join(c, "en-fr", "again"))


def sibling_loop(c):
    os.symlink(os.path.join(c, "en-fr"), os.path.join(c, "en-de", "x"))
    os.symlink(os.path.join(c, "en-de"), os.path.join(c, "en-fr", "y"))


def same_file_both_sides(c):
    relink(f(c), f(c, side="en"))


def dev_is_train(c):
    relink(f(c), f(c, split="train"))
    relink(f(c, side="en"), f(c, split="train", side="en"))


def encoded(encoding, bom=b""):
    def make(c):
        lines = [f"Satz {k} (fr)." for k in range(8)]
        with open(f(c), "wb") as handle:
            handle.write(bom + "".join(x + "\n" for x in lines).encode(encoding))
    return make


def nul_in_line_3(c):
    with open(f(c), "rb") as handle:
        lines = handle.read().split(b"\n")
    lines[2] = lines[2] + b"\0"
    with open(f(c), "wb") as handle:
        handle.write(b"\n".join(lines))


def cr_line_endings(c):
    with open(f(c, split="train"), "rb") as handle:
        text = handle.read()
    with open(f(c, split="train"), "wb") as handle:
        handle.write(text.replace(b"\n", b"\r"))


def latin1_train(c):
    write_lines(f(c, split="train"), [f"Phrase numéro {k}, déjà vu." for k in range(30)], encoding="latin-1")


def dev_all_too_long(c):
    write_lines(f(c), ["mot " * 600] * 8)


def unknown_code(c):
    os.rename(os.path.join(c, "en-fr"), os.path.join(c, "en-zz"))
    for name in os.listdir(os.path.join(c, "en-zz")):
        os.rename(os.path.join(c, "en-zz", name), os.path.join(c, "en-zz", name.replace("fr", "zz")))


def upper_code(c):
    os.rename(f(c), f(c).replace("-dev.fr", "-dev.FR"))


def counts_differ(c):
    write_lines(f(c), [f"Satz {k}" for k in range(7)])


def empty_train_side(c):
    open(f(c, split="train"), "w").close()


def folder_named_like_file(c):
    os.remove(f(c, split="test"))
    os.mkdir(f(c, split="test"))


def fifo_named_like_file(c):
    os.remove(f(c, split="test"))
    os.mkfifo(f(c, split="test"))


def tsv_without_tab(c):
    for side in ("en", "de"):
        os.remove(f(c, split="train", side=side, lang="de"))
    write_lines(os.path.join(c, "en-de", "opus.en-de-train.tsv"), ["Hello\tHallo"] * 3 + ["no tab"] + ["Yes\tJa"])


def split_given_twice(c):
    write_lines(os.path.join(c, "en-fr", "dev.en-fr.fr"), ["x"] * 8)


def opus_typo(c):
    path = f(c, split="test")
    os.rename(path, os.path.join(os.path.dirname(path), "opus.en-fr.test.fr"))


def only_test(c):
    for lang in LANGS:
        for split in ("train", "dev"):
            for side in ("en", lang):
                os.remove(f(c, split=split, side=side, lang=lang))


def corpus_missing(c):
    import shutil

    shutil.rmtree(c)


def corpus_is_file(c):
    import shutil

    shutil.rmtree(c)
    open(c, "w").close()


# (id, mutation of the good corpus, data overrides, words of the message)
CORPUS_CASES = [
    ("no-dev-split", remove_dev, {}, ["en-fr", "no dev split"]),
    ("empty-dev-files", empty_dev, {}, ["opus.en-fr-dev", "empty file"]),
    ("dev-all-dropped", dev_all_too_long, {}, ["opus.en-fr-dev", "none of the 8", "too_long_chars"]),
    ("dangling-symlink", dangling, {}, ["opus.en-fr-dev.fr", "dangling"]),
    ("file-symlink-loop", file_loop, {}, ["opus.en-fr-dev.fr", "loop"]),
    ("folder-symlink-loop", folder_loop, {}, ["again", "already read"]),
    ("sibling-symlink-loop", sibling_loop, {}, ["symbolic link", "already read"]),
    ("same-file-both-sides", same_file_both_sides, {}, ["opus.en-fr-dev.fr", "same file"]),
    ("dev-is-train", dev_is_train, {}, ["opus.en-fr-dev", "same file"]),
    ("utf16-bom", encoded("utf-16"), {}, ["opus.en-fr-dev.fr", "UTF-16"]),
    ("utf16-no-bom", encoded("utf-16-le"), {}, ["opus.en-fr-dev.fr", "line 1", "NUL", "UTF-16"]),
    ("utf32-bom", encoded("utf-32"), {}, ["opus.en-fr-dev.fr", "UTF-32"]),
    ("utf8-bom", encoded("utf-8", b"\xef\xbb\xbf"), {}, ["opus.en-fr-dev.fr", "byte-order mark"]),
    ("nul-byte", nul_in_line_3, {}, ["opus.en-fr-dev.fr line 3", "NUL"]),
    ("cr-line-endings", cr_line_endings, {}, ["opus.en-fr-train.fr", "CR only"]),
    ("latin1-file", latin1_train, {}, ["opus.en-fr-train.fr", "not UTF-8"]),
    ("unknown-language", unknown_code, {}, ["opus.en-zz", "'zz'"]),
    ("language-not-lower-case", upper_code, {}, ["opus.en-fr-dev.FR"]),
    ("line-counts-differ", counts_differ, {}, ["opus.en-fr-dev.en has 8 lines", "opus.en-fr-dev.fr has 7"]),
    ("empty-train-side", empty_train_side, {}, ["opus.en-fr-train.fr", "empty file"]),
    ("folder-named-like-file", folder_named_like_file, {}, ["opus.en-fr-test.fr", "folder"]),
    ("fifo-named-like-file", fifo_named_like_file, {}, ["opus.en-fr-test.fr", "regular file"]),
    ("tsv-line-without-tab", tsv_without_tab, {}, ["opus.en-de-train.tsv line 4", "tabs"]),
    ("split-given-twice", split_given_twice, {}, ["dev.en-fr.fr", "split dev"]),
    ("opus-name-typo", opus_typo, {}, ["opus.en-fr.test.fr", "OPUS-100"]),
    ("only-test-splits", only_test, {}, ["train split"]),
    ("language-not-in-corpus", lambda c: None, {"languages": ["it"]}, ["['it']", "available"]),
    ("one-language-twice", lambda c: os.makedirs(os.path.join(c, "x")) or write_lines(
        os.path.join(c, "x", "train.en-en.en"), ["a"]), {}, ["train.en-en.en", "two different languages"]),
    ("pair-in-both-orders", lambda c: write_lines(os.path.join(c, "dev.fr-en.tsv"), ["a\tb"]), {},
     ["dev.fr-en.tsv", "keep one order"]),
    ("extension-of-a-third-language", lambda c: write_lines(os.path.join(c, "en-fr", "opus.en-fr-dev.it"), ["x"]), {},
     ["opus.en-fr-dev.it", "extension"]),
    ("corpus-missing", corpus_missing, {}, ["data.corpus", "does not exist"]),
    ("corpus-is-a-file", corpus_is_file, {}, ["data.corpus", "not a folder"]),
]


@pytest.mark.parametrize("mutate, data, words", [c[1:] for c in CORPUS_CASES], ids=[c[0] for c in CORPUS_CASES])
def test_bad_corpus_stops_before_any_rank_with_one_line(tmp_path, capsys, no_launch, mutate, data, words):
    corpus = good_corpus(tmp_path)
    mutate(corpus)
    cfg = base_config(tmp_path, corpus)
    cfg["data"].update(data)
    path = write_case(tmp_path, yaml.safe_dump(cfg))
    code, out, err = run_cli(["train", path], capsys)
    assert_one_line_error(code, out, err, words)
    assert written_files(tmp_path / "run") == [], "the failed preparation left files behind"


def test_the_good_corpus_passes_the_checks(tmp_path):
    from data.config import DataConfig
    from data.corpus import list_pairs
    from data.prepare import check_corpus

    corpus = good_corpus(tmp_path)
    check_corpus(DataConfig(corpus=corpus, languages=[]))
    assert [p.name for p in list_pairs(corpus)] == ["en-de", "en-fr"]
    # A pair folder that is a symbolic link to text kept elsewhere is read, not skipped.
    os.rename(os.path.join(corpus, "en-fr"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(corpus, "en-fr"))
    assert [p.name for p in list_pairs(corpus)] == ["en-de", "en-fr"]


# ---- the real command line, a representative subset -------------------------------------------

def test_real_cli_refuses_bad_inputs_without_starting_ranks(tmp_path):
    """`./run.sh train` and `./run.sh prepare` as a user runs them, two at a time. fp16 follows the
    answer of the accelerator the command will ask (DeepSpeed's, as in conftest; its CPU accelerator
    supports fp16 on some processors only): refused where it lacks fp16, else the config passes the
    device check and stops at the next one, its missing corpus (tests/test_bad_inputs.py also
    covers the other answer with a test double)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    corpus = good_corpus(tmp_path)
    remove_dev(corpus)
    utf16 = good_corpus(tmp_path / "u")
    encoded("utf-16")(utf16)
    fp16 = base_config(tmp_path / "fp16", str(tmp_path / "no-corpus"))
    fp16["parallel"]["precision"] = "fp16"
    fp16_words = (["data.corpus", "no-corpus"] if torch.float16 in get_accelerator().supported_dtypes()
                  else ["parallel.precision=fp16", "not supported"])
    cases = []
    for name, content, command, words in [
        ("empty", "", "train", ["empty"]),
        ("heads", with_key("model.heads", 0), "train", ["model.heads"]),
        ("fp16", yaml.safe_dump(fp16), "train", fp16_words),
        ("proc", with_key("run_dir", "/proc/deepnet-run"), "prepare", ["run_dir", "/proc"]),
        ("nodev", yaml.safe_dump(base_config(tmp_path / "nodev", corpus)), "prepare", ["no dev split"]),
        ("utf16", yaml.safe_dump(base_config(tmp_path / "utf16", utf16)), "train", ["UTF-16"]),
    ]:
        folder_ = tmp_path / name
        folder_.mkdir(exist_ok=True)
        cases.append((write_case(folder_, content), command, words, folder_))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # conftest chose the accelerator (DS_ACCELERATOR)
    for batch in (cases[i:i + 2] for i in range(0, len(cases), 2)):
        procs = [(subprocess.Popen([os.path.join(ROOT, "run.sh"), command, path], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), words, folder_)
                 for path, command, words, folder_ in batch]
        for proc, words, folder_ in procs:
            out, err = proc.communicate(timeout=300)
            assert_one_line_error(proc.returncode, out, err, words)
            assert "launching" not in out and written_files(folder_ / "run") == []



def test_the_good_corpus_reaches_the_launch(tmp_path, capsys, no_launch):
    """Positive control of the corpus table: unchanged, the same corpus and config are prepared
    and get as far as the launch guard, so the table's refusals come from the checks."""
    cfg = base_config(tmp_path, good_corpus(tmp_path))
    cfg["data"].update(vocab_size=300, spm_sample_sentences=1000)
    path = write_case(tmp_path, yaml.safe_dump(cfg))
    with pytest.raises(RankLaunched):
        run_cli(["train", path], capsys)
    assert os.path.exists(tmp_path / "run" / "data" / "manifest.json")

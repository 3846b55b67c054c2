"""Data pipeline: bundled corpus, SentencePiece, binarisation, sampling, batching, resume."""

import json
import os

import numpy as np
import polib
import pytest

from data.batching import (
    BatchStream,
    PairDataset,
    collate,
    epoch_order,
    eval_batches,
    make_batches,
)
from data.config import DataConfig
from data.corpus import list_pairs, read_direction, read_pair
from data.errors import DataError
from data.gettext_corpus import build_django_corpus, catalog_files, catalog_pairs
from data.prepare import corpus_path, load_manifest, prepare_data, split_prefix, spm_model_path
from data.sampling import temperature_probs
from data.spm import load_tokenizer

# Latin and Cyrillic script; small limits so that some pairs are dropped as too long.
CONFIG = DataConfig(
    languages=["de", "ru"],
    vocab_size=800,
    dev_size=30,
    test_size=30,
    max_source_len=40,
    max_target_len=40,
    max_tokens=300,
)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("prepared") / "data")
    return out, prepare_data(CONFIG, out, log=lambda _: None)


@pytest.fixture(scope="module")
def train_set(prepared) -> PairDataset:
    return PairDataset(split_prefix(prepared[0], "train"))


def _write(path, lines) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("".join(line + "\n" for line in lines))


def test_round_trip_text_ids_text_for_every_language(prepared):
    out, manifest = prepared
    tokenizer = load_tokenizer(spm_model_path(out))
    sp = tokenizer.sp
    seen = set()
    for pair in list_pairs(corpus_path(out, manifest)):
        for direction in pair.directions():
            src_lang, tgt_lang = direction.split("-")
            for source, target in read_direction(pair, "dev", direction):
                ids = tokenizer.encode_source(source, tgt_lang)
                assert ids[0] == manifest["tags"][tgt_lang] and ids[-1] == tokenizer.eos_id
                assert tokenizer.decode(ids) == sp.decode(sp.encode(source))
                ids = tokenizer.encode_target(target)
                # Decoding stops at eos and ignores what follows (padding, a second sentence).
                assert tokenizer.decode([*ids, 17, 18]) == sp.decode(sp.encode(target))
                seen.add(src_lang)
    assert seen == {"en", "de", "ru"}


def test_binarised_examples_decode_to_the_corpus_lines(prepared):
    out, manifest = prepared
    tokenizer = load_tokenizer(spm_model_path(out))
    dev = PairDataset(split_prefix(out, "dev"))
    directions = manifest["directions"]
    src, tgt = dev[0]
    direction = directions[dev.dir_ids[0]]
    pair = next(p for p in list_pairs(corpus_path(out, manifest)) if direction in p.directions())
    first = next(read_direction(pair, "dev", direction))
    sp = tokenizer.sp
    assert tokenizer.decode(src) == sp.decode(sp.encode(first[0]))
    assert tokenizer.decode(tgt) == sp.decode(sp.encode(first[1]))
    assert src[0] == manifest["tags"][direction.split("-")[1]]


def test_mismatched_line_counts_raise_data_error_naming_both_files(tmp_path):
    left = tmp_path / "en-xx" / "opus.en-xx-train.en"
    right = tmp_path / "en-xx" / "opus.en-xx-train.xx"
    _write(str(left), ["one", "two", "three"])
    _write(str(right), ["eins", "zwei"])
    (pair,) = list_pairs(str(tmp_path))
    with pytest.raises(DataError) as error:
        list(read_pair(pair, "train"))
    message = str(error.value)
    assert str(left) in message and str(right) in message and "3" in message and "2" in message
    folder_cfg = DataConfig(corpus=str(tmp_path), languages=[], vocab_size=50)
    with pytest.raises(DataError, match="line counts differ"):
        prepare_data(folder_cfg, str(tmp_path / "out"), log=lambda _: None)


def test_tsv_pairs_are_read_and_bad_lines_named(tmp_path):
    _write(str(tmp_path / "de-en" / "opus.de-en-dev.tsv"), ["Hallo\tHello", "Ja\tYes"])
    (pair,) = list_pairs(str(tmp_path))
    assert pair.langs == ("de", "en")
    assert list(read_direction(pair, "dev", "en-de")) == [("Hello", "Hallo"), ("Yes", "Ja")]
    _write(str(tmp_path / "de-en" / "opus.de-en-dev.tsv"), ["Hallo\tHello", "kaputt"])
    with pytest.raises(DataError, match="line 2"):
        list(read_pair(list_pairs(str(tmp_path))[0], "dev"))


def test_catalog_pairs_skip_fuzzy_and_include_both_plural_forms():
    pairs = set(catalog_pairs("de"))
    entries = [e for path in catalog_files("de") for e in polib.pofile(path)]
    plural = next(e for e in entries if e.msgid_plural and e.translated() and not e.fuzzy)
    assert (" ".join(plural.msgid.split()), " ".join(plural.msgstr_plural[0].split())) in pairs
    assert (
        " ".join(plural.msgid_plural.split()),
        " ".join(plural.msgstr_plural[1].split()),
    ) in pairs
    assert len(pairs) > 700 and all(en and de and "\n" not in en + de for en, de in pairs)


def test_bundled_split_keeps_each_english_sentence_in_one_split(prepared):
    out, manifest = prepared
    english = {split: set() for split in ("train", "dev", "test")}
    for pair in list_pairs(corpus_path(out, manifest)):
        for split in english:
            english[split] |= {en for en, _ in read_pair(pair, split)}
        assert manifest["pairs"][pair.name]["test"] >= CONFIG.test_size
    assert not english["train"] & english["test"] and not english["train"] & english["dev"]
    assert not english["dev"] & english["test"]


def test_interrupted_corpus_build_leaves_nothing_behind(tmp_path, monkeypatch):
    import data.gettext_corpus as module

    calls = []

    def failing_write(path, lines):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        _write(path, lines)

    monkeypatch.setattr(module, "_write_lines", failing_write)
    with pytest.raises(KeyboardInterrupt):
        build_django_corpus(str(tmp_path / "corpus"), ["de"], 10, 10, seed=1)
    assert os.listdir(tmp_path) == []


def test_prepare_data_is_idempotent_and_manifest_has_counts(prepared):
    out, manifest = prepared
    before = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    lines = []
    # Batching-only settings do not invalidate the prepared files.
    again = prepare_data(
        DataConfig(**{**CONFIG.to_dict(), "max_tokens": 999}), out, log=lines.append
    )
    after = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    assert before == after and again == manifest and "up to date" in lines[0]
    assert again == load_manifest(out)
    assert manifest["directions"] == ["en-de", "de-en", "en-ru", "ru-en"]
    for split in ("train", "dev", "test"):
        dataset = PairDataset(split_prefix(out, split))
        assert len(dataset) == sum(manifest["counts"][split].values())
        for direction, kept in manifest["counts"][split].items():
            pair = "en-" + direction.replace("en", "").strip("-")
            dropped = sum(manifest["dropped"][split][direction].values())
            assert kept + dropped == manifest["pairs"][pair][split]
    assert sum(manifest["dropped"]["train"]["en-de"].values()) > 0  # limits of 40 tokens bite
    assert max(PairDataset(split_prefix(out, "train")).src_lens) <= CONFIG.max_source_len
    with open(os.path.join(out, "manifest.json")) as handle:
        assert json.load(handle)["spm_sha256"] == manifest["spm_sha256"]


def test_every_index_appears_exactly_once_per_epoch_at_temperature_one(train_set):
    for epoch in range(2):
        order = epoch_order(train_set.dir_ids, 1.0, seed=3, epoch=epoch)
        batches = make_batches(train_set.src_lens, train_set.tgt_lens, 300, 3, epoch, order)
        ids = np.concatenate(batches)
        assert np.array_equal(np.sort(ids), np.arange(len(train_set)))
    stream = BatchStream(train_set, max_tokens=300, seed=3, temperature=1.0)
    per_epoch = len(stream.epoch_batches(0))
    ids = np.concatenate([b["ids"].numpy() for b in stream.next_step(per_epoch)])
    assert np.array_equal(np.sort(ids), np.arange(len(train_set))) and stream.epoch == 0


def test_batches_respect_max_tokens_and_collate_shifts_targets(train_set):
    stream = BatchStream(train_set, max_tokens=300, seed=1, temperature=1.5)
    for batch in stream.next_step(len(stream.epoch_batches(0)) + 5):
        b, s = batch["src"].shape
        t = batch["tgt_out"].shape[1]
        assert b * max(s, t) <= 300
        assert (batch["tgt_in"][:, 0] == 2).all()
        real = batch["tgt_out"] != 0
        assert ((batch["tgt_in"] != 0) == real).all()
        shifted = batch["tgt_in"][:, 1:] == batch["tgt_out"][:, :-1]
        assert shifted[real[:, 1:]].all()
        assert batch["ntokens"] == int((batch["tgt_out"] != 0).sum())
    for batch in eval_batches(train_set, 300):
        assert batch["src"].shape[0] * max(batch["src"].shape[1], batch["tgt_out"].shape[1]) <= 300


def test_collate_pads_right_and_builds_decoder_input():
    batch = collate(
        [(np.array([5, 9, 3]), np.array([7, 3])), (np.array([5, 3]), np.array([8, 6, 3]))]
    )
    assert batch["src"].tolist() == [[5, 9, 3], [5, 3, 0]]
    assert batch["tgt_out"].tolist() == [[7, 3, 0], [8, 6, 3]]
    assert batch["tgt_in"].tolist() == [[2, 7, 0], [2, 8, 6]]
    assert batch["ntokens"] == 5 and batch["src"].dtype.is_floating_point is False


def test_resumed_stream_yields_exactly_the_uninterrupted_batches(train_set):
    def run(steps, state=None):
        stream = BatchStream(train_set, 300, seed=5, temperature=2.0, start_state=state)
        return [b for _ in range(steps) for b in stream.next_step(4)], stream

    per_epoch = len(BatchStream(train_set, 300, 5, 2.0).epoch_batches(0))
    steps = per_epoch // 4 + 3  # crosses into the second epoch
    reference, _ = run(2 * steps)
    first, stream = run(steps)
    state = json.loads(json.dumps(stream.state_dict()))  # as saved in a checkpoint
    assert state["epoch"] == 1 and state["position"] > 0
    rest, _ = run(steps, state)
    for expected, got in zip(reference, first + rest, strict=True):
        for key in ("src", "tgt_in", "tgt_out", "ids"):
            assert (expected[key] == got[key]).all()


def test_data_parallel_ranks_split_the_global_batches(train_set):
    whole = BatchStream(train_set, 300, seed=2, temperature=1.0).next_step(6)
    ranks = [BatchStream(train_set, 300, 2, 1.0, dp_rank=r, dp_size=2).next_step(3) for r in (0, 1)]
    assert [b["ids"].tolist() for b in whole[0::2]] == [b["ids"].tolist() for b in ranks[0]]
    assert [b["ids"].tolist() for b in whole[1::2]] == [b["ids"].tolist() for b in ranks[1]]


def test_temperature_sampling_matches_the_formula():
    sizes = np.array([5000, 500, 50])
    dir_ids = np.repeat(np.arange(3), sizes).astype(np.int16)
    for temperature in (1.0, 1.5, 5.0):
        expected = (sizes / sizes.sum()) ** (1 / temperature)
        expected = sizes.sum() * expected / expected.sum()
        assert np.allclose(temperature_probs(sizes, temperature) * sizes.sum(), expected)
        order = epoch_order(dir_ids, temperature, seed=1, epoch=0)
        counts = np.bincount(dir_ids[order], minlength=3)
        assert np.all(np.abs(counts - expected) <= 1), (temperature, counts, expected)
    # Up-sampled direction: every example shows up; down-sampled: no repeats.
    order = epoch_order(dir_ids, 5.0, seed=1, epoch=0)
    small = np.bincount(order[dir_ids[order] == 2], minlength=len(dir_ids))[-50:]
    big = np.bincount(order[dir_ids[order] == 0], minlength=len(dir_ids))[:5000]
    assert small.min() >= 1 and big.max() == 1
    # Over many epochs the average share of each direction is the formula's.
    shares = np.mean(
        [np.bincount(dir_ids[epoch_order(dir_ids, 5.0, 1, e)], minlength=3) for e in range(20)], 0
    )
    assert np.allclose(shares / shares.sum(), temperature_probs(sizes, 5.0), atol=1e-3)

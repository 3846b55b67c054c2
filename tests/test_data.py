"""Data pipeline on the bundled corpus: round trip, shards, manifest, batching, resume."""

import hashlib
import json
import os
import warnings

import numpy as np
import polib
import pytest

from data.batching import BatchStream, collate, epoch_stats, eval_batches
from data.config import DataConfig
from data.corpus import SPLITS, list_pairs, read_direction, read_pair
from data.dataset import PairDataset
from data.gettext_corpus import (
    build_django_corpus,
    catalog_pairs,
    django_locale_root,
    find_catalogs,
)
from data.prepare import (
    corpus_path,
    load_manifest,
    prepare_data,
    split_prefix,
    spm_model_path,
)
from data.sampling import temperature_probs
from data.spm import load_tokenizer

# The default config's languages; small shards so that every split spans several of them.
CONFIG = DataConfig(
    languages=["de", "es", "fr", "ru", "it"],
    vocab_size=1500,
    dev_size=30,
    test_size=30,
    max_source_len=48,
    max_target_len=48,
    max_tokens=400,
    shard_size=250,
    workers=2,
)


def epoch_batches(stream: BatchStream, epoch: int) -> list:
    """Every batch of `epoch`, window by window (small corpora only)."""
    return [b for k in range(stream.windows) for b in stream.window_batches(epoch, k)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("prepared") / "data")
    return out, prepare_data(CONFIG, out, log=lambda _: None)


@pytest.fixture(scope="module")
def train_set(prepared) -> PairDataset:
    return PairDataset(split_prefix(prepared[0], "train"))


def test_round_trip_text_ids_text_is_exact_for_every_language(prepared):
    out, manifest = prepared
    tokenizer = load_tokenizer(spm_model_path(out))
    seen = set()
    for pair in list_pairs(corpus_path(out, manifest)):
        for split in SPLITS:
            for line_a, line_b in read_pair(pair, split):
                for text, language, other in ((line_a, *pair.langs), (line_b, *pair.langs[::-1])):
                    source = tokenizer.encode_source(text, other)
                    assert source[0] == manifest["tags"][other] and source[-1] == tokenizer.eos_id
                    assert tokenizer.decode(source) == text
                    assert tokenizer.decode([*tokenizer.encode(text), tokenizer.eos_id, 17, 18]) == text  # a target: stops at eos
                    seen.add(language)
    assert seen == {"en", "de", "es", "fr", "ru", "it"}
    # Byte fallback: characters the model never saw still come back exactly.
    assert tokenizer.decode(tokenizer.encode("Ｗｉｄｅ 漢字 ☃ \u200b")) == "Ｗｉｄｅ 漢字 ☃ \u200b"


def test_binarised_examples_are_the_kept_corpus_lines_in_order(prepared):
    out, manifest = prepared
    tokenizer = load_tokenizer(spm_model_path(out))
    dev = PairDataset(split_prefix(out, "dev"))
    assert dev.directions == manifest["directions"]
    for pair in list_pairs(corpus_path(out, manifest)):
        forward = manifest["directions"].index(pair.directions()[0])
        lines = list(read_pair(pair, "dev"))
        decoded = []
        for row in range(dev.direction_sizes[forward]):
            src, tgt = dev.example(forward, row)
            back_src, back_tgt = dev.example(forward + 1, row)  # the b→a example of the same pair
            assert src[0] == manifest["tags"][pair.langs[1]]
            assert back_src[0] == manifest["tags"][pair.langs[0]]
            assert np.array_equal(back_src[1:], tgt) and np.array_equal(back_tgt[:-1], src[1:-1])
            decoded.append((tokenizer.decode(src), tokenizer.decode(tgt)))
        assert len(decoded) == manifest["counts"]["dev"][pair.directions()[0]] > 0
        it = iter(lines)  # kept lines keep their order: a subsequence of the corpus
        assert all(any(entry == line for line in it) for entry in decoded)


def test_shards_manifest_and_report_agree(prepared):
    out, manifest = prepared
    assert manifest["languages"] == ["en", "de", "es", "fr", "it", "ru"]
    with open(spm_model_path(out), "rb") as handle:
        assert manifest["spm_sha256"] == hashlib.sha256(handle.read()).hexdigest()
    assert len(manifest["shards"]["train"]) > 2 * len(CONFIG.languages)  # several per pair
    with open(os.path.join(out, "validation_report.json")) as handle:
        report = json.load(handle)
    for split in SPLITS:
        for name, lines in manifest["pairs"].items():
            entry = report["pairs"][name][split]
            dropped = sum(entry[reason] for reason in report["reasons"])
            assert entry["lines"] == lines[split] == entry["kept"] + dropped
            assert manifest["counts"][split][name] == entry["kept"]
            assert manifest["dropped"][split][name]["too_long_tokens"] == entry["too_long_tokens"]
        dataset = PairDataset(split_prefix(out, split))
        assert len(dataset) == sum(manifest["counts"][split].values())
        assert dataset.src_lens.max() <= CONFIG.max_source_len
    assert report["total"]["too_long_tokens"] > 0  # the 48-token limit bites on long help texts
    # The SentencePiece sample: every kept train line once (T=5 over languages, capped at all).
    sample = manifest["spm_sample"]
    assert set(sample) == set(manifest["languages"]) and sample["en"] > sample["de"]


def test_prepare_is_idempotent_and_batching_settings_do_not_redo_it(prepared):
    out, manifest = prepared
    before = {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in os.listdir(out)}
    lines = []
    changed = DataConfig(**{**CONFIG.to_dict(), "max_tokens": 999, "workers": 1})
    assert prepare_data(changed, out, log=lines.append) == manifest == load_manifest(out)
    assert before == {p: os.stat(os.path.join(out, p)).st_mtime_ns for p in os.listdir(out)}
    assert "up to date" in lines[0] and not os.path.exists(os.path.join(out, ".work"))


def test_every_token_appears_in_exactly_one_batch_per_epoch(prepared, train_set):
    _, manifest = prepared
    stream = BatchStream(train_set, max_tokens=400, seed=3, temperature=1.0, window=1000)
    assert stream.windows == -(-len(train_set) // 1000) > 1
    for epoch in range(2):
        batches = [b for k in range(stream.windows) for b in stream.window_batches(epoch, k)]
        ids = np.concatenate(batches)
        assert np.array_equal(np.sort(ids), np.arange(len(train_set)))
    # The same through next_step and collate, counting tokens: every stored piece of every
    # kept pair is a target once per direction, plus one eos per example.
    collated = stream.next_step(len(epoch_batches(stream, 0)))
    assert (stream.epoch, stream.window_index) == (0, stream.windows - 1)
    assert sum(b["ntokens"] for b in collated) == manifest["tokens"]["train"] + len(train_set)
    sources = sum(int((b["src"] != 0).sum()) for b in collated)
    assert sources == manifest["tokens"]["train"] + 2 * len(train_set)  # tag and eos


def test_batches_respect_max_tokens_and_collate_shifts_targets(train_set):
    stream = BatchStream(train_set, max_tokens=400, seed=1, temperature=1.5, window=1500)
    for batch in stream.next_step(len(epoch_batches(stream, 0)) + 5):
        b, s = batch["src"].shape
        t = batch["tgt_out"].shape[1]
        assert b * max(s, t) <= 400
        assert (batch["tgt_in"][:, 0] == 2).all()
        real = batch["tgt_out"] != 0
        assert ((batch["tgt_in"] != 0) == real).all()
        shifted = batch["tgt_in"][:, 1:] == batch["tgt_out"][:, :-1]
        assert shifted[real[:, 1:]].all()
        assert batch["ntokens"] == int(real.sum())
    batches = eval_batches(train_set, 400)
    assert sorted(np.concatenate([b["ids"].numpy() for b in batches])) == list(range(len(train_set)))
    assert all(b["src"].shape[0] * max(b["src"].shape[1], b["tgt_out"].shape[1]) <= 400
               for b in batches)


def test_epoch_statistics_match_the_collated_batches(train_set):
    stream = BatchStream(train_set, max_tokens=400, seed=4, temperature=1.5, window=1500)
    stats = epoch_stats(stream, epoch=0)
    batches = stream.next_step(len(epoch_batches(stream, 0)))
    slots = sum(b["src"].numel() + b["tgt_out"].numel() for b in batches)
    pads = sum(int((b["src"] == 0).sum() + (b["tgt_out"] == 0).sum()) for b in batches)
    assert stats["batches"] == len(batches)
    assert stats["examples"] == sum(b["nsentences"] for b in batches) == stream.wants.sum()
    assert stats["padding_fraction"] == pytest.approx(pads / slots)
    assert stats["tgt_tokens"] == sum(b["ntokens"] for b in batches)
    assert 0 < stats["padding_fraction"] < 0.2  # length bucketing keeps padding low
    assert stats["max_width"] * 1 <= 400 and stats["max_batch_size"] * 2 <= 400
    per_direction = np.bincount(np.concatenate([b["dirs"].numpy() for b in batches]))
    assert list(stats["examples_per_direction"].values()) == per_direction.tolist()


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
        stream = BatchStream(train_set, 400, seed=5, temperature=2.0, start_state=state, window=1500)
        return [b for _ in range(steps) for b in stream.next_step(4)], stream

    per_epoch = len(epoch_batches(BatchStream(train_set, 400, 5, 2.0, window=1500), 0))
    steps = per_epoch // 4 + 3  # crosses windows and into the second epoch
    reference, _ = run(2 * steps)
    first, stream = run(steps)
    state = json.loads(json.dumps(stream.state_dict()))  # as saved in a checkpoint
    assert state["epoch"] == 1 and state["position"] > 0
    rest, _ = run(steps, state)
    for expected, got in zip(reference, first + rest, strict=True):
        for key in ("src", "tgt_in", "tgt_out", "ids"):
            assert (expected[key] == got[key]).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every rank would warn: the trainer's rank 0 says it, in train.log too
        changed = BatchStream(train_set, 300, 5, 2.0, start_state=state, window=1500)
    assert (changed.epoch, changed.window_index, changed.position) == (2, 0, 0)
    assert changed.order_changed == ("the batch order changed since the checkpoint (data.max_tokens): the data "
                                     "stream continues at the start of epoch 2, not where the checkpoint left it")
    assert BatchStream(train_set, 400, 5, 2.0, start_state=state, window=1500).order_changed == ""


def test_temperature_counts_of_an_epoch_follow_the_formula(train_set):
    sizes = train_set.direction_sizes
    for temperature in (1.0, 1.5, 5.0):
        stream = BatchStream(train_set, 400, seed=1, temperature=temperature, window=1000)
        expected = sizes.sum() * temperature_probs(sizes, temperature)
        ids = np.concatenate(epoch_batches(stream, 0))
        counts = np.bincount(train_set.locate(ids)[0], minlength=len(sizes))
        assert np.all(np.abs(counts - expected) <= 0.5 + 1e-9), (temperature, counts, expected)


def test_catalog_pairs_skip_fuzzy_and_include_both_plural_forms():
    files = find_catalogs(django_locale_root())["de"]
    pairs = set(catalog_pairs(files))
    entries = [e for path in files for e in polib.pofile(path)]
    plural = next(e for e in entries if e.msgid_plural and e.translated() and not e.fuzzy)
    assert (" ".join(plural.msgid.split()), " ".join(plural.msgstr_plural[0].split())) in pairs
    assert (
        " ".join(plural.msgid_plural.split()),
        " ".join(plural.msgstr_plural[1].split()),
    ) in pairs
    fuzzy = [e for e in entries if e.fuzzy and e.msgstr]
    assert all((e.msgid, e.msgstr) not in pairs for e in fuzzy)
    assert len(pairs) > 700 and all(en and de and "\n" not in en + de for en, de in pairs)


def test_bundled_split_keeps_each_english_sentence_in_one_split(prepared):
    out, manifest = prepared
    english = {split: set() for split in SPLITS}
    for pair in list_pairs(corpus_path(out, manifest)):
        for split in english:
            english[split] |= {en for en, _ in read_direction(pair, split, pair.name)}
        assert manifest["pairs"][pair.name]["test"] >= CONFIG.test_size
    assert not english["train"] & english["test"] and not english["train"] & english["dev"]
    assert not english["dev"] & english["test"]


def test_interrupted_corpus_build_leaves_nothing_behind(tmp_path, monkeypatch):
    import data.gettext_corpus as module

    calls = []
    original = module._write_lines

    def failing_write(path, lines):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(path, lines)

    monkeypatch.setattr(module, "_write_lines", failing_write)
    with pytest.raises(KeyboardInterrupt):
        build_django_corpus(str(tmp_path / "corpus"), ["de"], 10, 10, seed=1)
    assert os.listdir(tmp_path) == []


def test_corpus_path_resolves_when_prepared_into_a_relative_folder(tmp_path, monkeypatch):
    # `./run.sh train --run-dir runs/x` prepares into a relative folder; evaluation later reads
    # the raw references through the manifest from there.
    monkeypatch.chdir(tmp_path)
    manifest = prepare_data(CONFIG, os.path.join("runs", "x", "data"), log=lambda *_: None)
    assert manifest["corpus_dir"] == "corpus"
    assert os.path.isdir(corpus_path(os.path.join("runs", "x", "data"), manifest))

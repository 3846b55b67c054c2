"""Validation: every rule on a small bad file, counted per pair and reason; malformed input stops
with the file and line; every reader layout (OPUS-100, TSV, plain file pairs, gettext .po/.mo)."""

import json
import os
import shutil

import numpy as np
import polib
import pytest

from data.config import DataConfig
from data.corpus import list_pairs, read_pair
from data.dataset import PairDataset
from data.errors import DataError
from data.gettext_corpus import catalog_pairs, django_locale_root, find_catalogs
from data.prepare import prepare_data, split_prefix, spm_model_path
from data.spm import load_tokenizer

CONFIG = {"vocab_size": 700, "max_chars": 400, "max_source_len": 128, "max_target_len": 128,
          "max_length_ratio": 4.0, "shard_size": 150, "workers": 2, "spm_sample_sentences": 100_000}
# Per pair, what the bad lines below must add to the report.
EXPECTED = {"invalid_utf8": 1, "empty": 2, "too_long_chars": 1, "duplicate": 3,
            "too_long_tokens": 1, "length_ratio": 1}


def _base(language: str, count: int) -> list[tuple[bytes, bytes]]:
    """Short real catalog pairs: no token limit or length ratio can touch them."""
    pairs = catalog_pairs(find_catalogs(django_locale_root())[language])
    short = [(a, b) for a, b in pairs if len(a) <= 40 and len(b) <= 40 and "\t" not in a + b]
    return [(a.encode(), b.encode()) for a, b in short[:count]]


def _bad_rows(base: list[tuple[bytes, bytes]], long_b: bytes) -> list[tuple[bytes, bytes]]:
    """``base`` with one line pair per rule (two empty ones) spread through it."""
    rows = list(base)
    bad = [
        (b"Cafe", b"Caf\xe9 au lait"),  # Latin-1, not UTF-8
        (b"Hello there", b""),
        (b"   ", b"Hallo"),  # whitespace only
        (b"word " * 100, b"Wort"),  # 500 characters
        base[0], base[0], base[1],  # three repeats of earlier pairs
        (" ".join("abcdefghijklmnopqrstuvwxyz"[i % 26] + "7" for i in range(120)).encode(), b"x y"),
        (b"Yes", long_b),  # 1 piece against dozens
    ]
    for k, row in enumerate(bad):
        rows.insert(20 + 37 * k, row)
    return rows


def _write(path: str, lines: list[bytes], newline: bytes = b"\n") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(b"".join(line + newline for line in lines))


@pytest.fixture(scope="module")
def bad_corpus(tmp_path_factory) -> tuple[str, str, dict, list[str]]:
    """One pair per layout: OPUS-100 files (CRLF endings), a TSV, plain fairseq-style files."""
    root = tmp_path_factory.mktemp("bad")
    corpus = str(root / "corpus")
    long_b = " ".join(b.decode() for _, b in _base("de", 60)[30:45])[:150].encode()
    layouts = {}
    for language in ("de", "fr", "ru"):
        base = _base(language, 260)
        layouts[language] = {"train": _bad_rows(base[:200], long_b), "dev": base[200:230],
                             "test": base[230:]}
    for split, rows in layouts["de"].items():
        prefix = os.path.join(corpus, "en-de", f"opus.en-de-{split}")
        _write(prefix + ".en", [a for a, _ in rows], b"\r\n")
        _write(prefix + ".de", [b for _, b in rows], b"\r\n")
    for split, rows in layouts["fr"].items():
        _write(os.path.join(corpus, f"{split}.en-fr.tsv"), [a + b"\t" + b for a, b in rows])
    for split, rows in layouts["ru"].items():
        name = "valid" if split == "dev" else split  # fairseq's name for dev
        _write(os.path.join(corpus, f"{name}.en-ru.en"), [a for a, _ in rows])
        _write(os.path.join(corpus, f"{name}.en-ru.ru"), [b for _, b in rows])
    out = str(root / "out")
    lines: list[str] = []
    manifest = prepare_data(DataConfig(corpus=corpus, languages=[], **CONFIG), out, log=lines.append)
    return corpus, out, manifest, lines


def test_readers_find_every_layout_with_its_splits(bad_corpus):
    corpus, *_ = bad_corpus
    pairs = {pair.name: pair for pair in list_pairs(corpus)}
    assert sorted(pairs) == ["en-de", "en-fr", "en-ru"]
    assert all(sorted(pair.files) == ["dev", "test", "train"] for pair in pairs.values())
    assert len(pairs["en-fr"].files["train"]) == 1 and len(pairs["en-ru"].files["dev"]) == 2
    dev = list(read_pair(pairs["en-de"], "dev"))  # CRLF endings are not part of the text
    assert len(dev) == 30 and not any("\r" in a + b for a, b in dev)


def test_each_rule_drops_and_counts_its_lines_per_pair(bad_corpus):
    _, out, _, lines = bad_corpus
    with open(os.path.join(out, "validation_report.json")) as handle:
        report = json.load(handle)
    for pair in ("en-de", "en-fr", "en-ru"):
        train = report["pairs"][pair]["train"]
        assert {reason: train[reason] for reason in EXPECTED} == EXPECTED, pair
        assert train["lines"] == 209 and train["kept"] == 200  # the 200 base pairs
        for split in ("dev", "test"):
            entry = report["pairs"][pair][split]
            assert entry["kept"] == entry["lines"] == 30
    with open(os.path.join(out, "validation_report.tsv")) as handle:
        rows = [line.rstrip("\n").split("\t") for line in handle]
    assert rows[0][:4] == ["pair", "split", "lines", "kept"] and len(rows) == 1 + 3 * 3
    assert ["en-fr", "train", "209", "200", "1", "2", "1", "3", "1", "1"] in rows
    summary = next(line for line in lines if line.startswith("data: validation kept"))
    assert "kept 780 of 807 line pairs, dropped 27" in summary
    assert all(f"{reason} {3 * n}" in summary for reason, n in EXPECTED.items())


def test_the_first_of_duplicates_is_kept_and_bad_lines_never_reach_the_shards(bad_corpus):
    _, out, manifest, _ = bad_corpus
    tokenizer = load_tokenizer(spm_model_path(out))
    train = PairDataset(split_prefix(out, "train"))
    direction = train.directions.index("en-fr")
    kept = [tuple(tokenizer.decode(side) for side in train.example(direction, row))
            for row in range(train.direction_sizes[direction])]
    base = [(a.decode(), b.decode()) for a, b in _base("fr", 200)]
    assert kept == base  # in order, each once, nothing else
    assert manifest["counts"]["train"]["en-fr"] == manifest["counts"]["train"]["fr-en"] == 200


def test_mismatched_line_counts_stop_naming_both_files_and_counts(tmp_path):
    left, right = tmp_path / "c" / "en-de" / "opus.en-de-train.en", tmp_path / "c" / "en-de" / "opus.en-de-train.de"
    _write(str(left), [b"one", b"two", b"three"])
    _write(str(right), [b"eins", b"zwei"])
    for side in ("en", "de"):
        _write(str(tmp_path / "c" / "en-de" / f"opus.en-de-dev.{side}"), [b"ok"])
    out = tmp_path / "out"
    with pytest.raises(DataError) as error:
        prepare_data(DataConfig(corpus=str(tmp_path / "c"), languages=[]), str(out), log=print)
    message = str(error.value)
    assert f"{left} has 3 lines but {right} has 2" in message
    assert not (out / "manifest.json").exists() and not (out / "shards").exists()


def test_malformed_tsv_line_stops_naming_file_and_line(tmp_path):
    rows = [b"Hello\tHallo"] * 5 + [b"no tab here"] + [b"Yes\tJa"] * 5
    _write(str(tmp_path / "c" / "train.de-en.tsv"), rows)
    _write(str(tmp_path / "c" / "dev.de-en.tsv"), [b"Good\tGut"])
    with pytest.raises(DataError, match=r"train\.de-en\.tsv line 6 has 0 tabs"):
        prepare_data(DataConfig(corpus=str(tmp_path / "c"), languages=[], workers=1),
                     str(tmp_path / "out"), log=lambda _: None)


@pytest.mark.parametrize("name, message", [
    ("opus.en-DE-train.de", "'DE' is not a language code"),
    ("opus.en-de-trian.de", "not an OPUS-100 file name"),
    ("train.en-de.fr", "extension must be en, de or tsv"),
    ("train.en-en.en", "two different languages"),
])
def test_bad_file_names_and_language_codes_are_rejected(tmp_path, name, message):
    _write(str(tmp_path / "en-de" / name), [b"x"])
    with pytest.raises(DataError, match=message) as error:
        list_pairs(str(tmp_path))
    assert name in str(error.value)


def test_config_rejects_invalid_language_codes():
    for bad in (["pt-BR"], ["EN_us"], ["d"], ["de/x"]):
        with pytest.raises(ValueError, match="not a language code"):
            DataConfig(languages=bad)
    assert DataConfig(languages=["pt_BR", "zh_Hans", "ast", "sr_Latn"]).languages[0] == "pt_BR"


def test_gettext_importer_reads_po_and_mo_catalogs(tmp_path):
    django = find_catalogs(django_locale_root())
    root = tmp_path / "catalogs"
    (root / "de" / "LC_MESSAGES").mkdir(parents=True)
    shutil.copy(django["de"][0], root / "de" / "LC_MESSAGES" / "app.po")
    (root / "po").mkdir()
    polib.pofile(django["fr"][0]).save_as_mofile(str(root / "po" / "fr.mo"))  # GNOME-style name
    polib.pofile(django["sr_Latn"][0]).save(str(root / "po" / "sr@latin.po"))
    catalogs = find_catalogs(str(root))
    assert sorted(catalogs) == ["de", "fr", "sr_Latn"]
    from_mo = catalog_pairs(catalogs["fr"])
    assert from_mo and set(from_mo) == set(catalog_pairs(django["fr"][:1]))
    cfg = DataConfig(corpus=f"gettext:{root}", languages=["de", "fr"], vocab_size=1200,
                     dev_size=20, test_size=20, workers=1)
    manifest = prepare_data(cfg, str(tmp_path / "out"), log=lambda _: None)
    assert manifest["directions"] == ["en-de", "de-en", "en-fr", "fr-en"]
    assert np.sum(list(manifest["counts"]["train"].values())) > 1000


def test_line_index_matches_a_plain_reading_across_block_boundaries(tmp_path, monkeypatch):
    from data import corpus

    rng = np.random.default_rng(0)
    lines = [b"x" * int(n) for n in rng.integers(0, 9, size=200)]
    for name, ending, last in (("lf", b"\n", b"\n"), ("crlf", b"\r\n", b"\r\n"), ("open", b"\n", b"")):
        path = tmp_path / name
        path.write_bytes(ending.join(lines) + last)
        starts = np.cumsum([0] + [len(x) + len(ending) for x in lines])[:-1]
        for block in (5, 7, 1 << 24):
            monkeypatch.setattr(corpus, "BLOCK_BYTES", block)
            for every in (1, 3, 50, 200, 1000):
                count, offsets = corpus.line_offsets(str(path), every)
                assert count == 200 and offsets == starts[::every].tolist(), (name, block, every)
        assert corpus.read_lines(str(path), int(starts[17]), 3) == lines[17:20]


def test_bucketed_deduplication_equals_a_plain_first_occurrence_pass(tmp_path, monkeypatch):
    from data import validate
    from data.shards import Shard

    rng = np.random.default_rng(1)
    shards = [Shard(pair=0, name="en-de", split="train", number=k, first_line=1000 * k,
                    lines=1000, files=("unused",), offsets=(0,)) for k in range(3)]
    values = (rng.integers(1, 900, size=3000).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    reasons = np.where(rng.random(3000) < 0.1, validate.CODE["empty"], 0).astype(np.uint8)
    for work in ("one", "bucketed"):
        for k, shard in enumerate(shards):
            prefix = validate.work_prefix(str(tmp_path / work), "check", shard)
            validate.save_atomic(prefix + ".reasons.npy", reasons[1000 * k:1000 * (k + 1)])
            validate.save_atomic(prefix + ".hash.npy", values[1000 * k:1000 * (k + 1)])
    validate.deduplicate(shards, str(tmp_path / "one"))
    monkeypatch.setattr(validate, "DEDUP_BUCKET", 300)  # → 16 hash-range buckets
    validate.deduplicate(shards, str(tmp_path / "bucketed"))
    seen, expected = set(), reasons.copy()
    for i, value in enumerate(values.tolist()):
        if reasons[i] == 0:
            if value in seen:
                expected[i] = validate.CODE["duplicate"]
            seen.add(value)
    for work in ("one", "bucketed"):
        got = np.concatenate([np.load(validate.final_path(str(tmp_path / work), s)) for s in shards])
        assert np.array_equal(got, expected), work
    assert (expected == validate.CODE["duplicate"]).sum() > 1500

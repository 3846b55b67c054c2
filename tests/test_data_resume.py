"""A second corpus (OPUS-100 layout, not part of the repo): interrupted and killed preparations
resume to byte-identical output; temperature sampling over unequal directions."""

import glob
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest

import data.prepare as prepare_module
from data.batching import BatchStream
from data.config import DataConfig
from data.dataset import PairDataset
from data.gettext_corpus import catalog_pairs, django_locale_root, find_catalogs
from data.prepare import prepare_data, split_prefix
from data.sampling import permute, temperature_probs
from tests.test_data import epoch_batches

# Languages of other scripts than the bundled default's; en-uk is cut to a tenth so that
# temperature sampling has something to do.
SIZES = {"ja": None, "uk": 80, "el": None}
CONFIG = {"languages": [], "vocab_size": 1500, "shard_size": 120, "max_source_len": 64,
          "max_target_len": 64, "spm_sample_sentences": 100_000}


def _opus_corpus(folder: str) -> None:
    """en-xx pairs from Django catalogs in OPUS-100 layout: 60 dev, 60 test, the rest train."""
    catalogs = find_catalogs(django_locale_root())
    for language, train_size in SIZES.items():
        pairs = catalog_pairs(catalogs[language])
        splits = {"dev": pairs[:60], "test": pairs[60:120], "train": pairs[120:][:train_size]}
        os.makedirs(os.path.join(folder, f"en-{language}"))
        for split, rows in splits.items():
            prefix = os.path.join(folder, f"en-{language}", f"opus.en-{language}-{split}")
            for side, suffix in ((0, "en"), (1, language)):
                with open(f"{prefix}.{suffix}", "w", encoding="utf-8") as handle:
                    handle.writelines(row[side] + "\n" for row in rows)


def _files(out: str) -> dict[str, bytes]:
    """Every output file that must not depend on interruptions (the manifest holds timings)."""
    paths = glob.glob(os.path.join(out, "shards", "*", "*")) + glob.glob(os.path.join(out, "*.*"))
    return {os.path.relpath(p, out): open(p, "rb").read() for p in paths
            if not p.endswith(("manifest.json", ".lock"))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("opus") / "corpus")
    _opus_corpus(folder)
    return folder


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("reference") / "data")
    cfg = DataConfig(corpus=corpus, workers=2, **CONFIG)
    return out, prepare_data(cfg, out, log=lambda _: None)


def test_second_corpus_in_opus_layout_is_prepared(reference):
    _, manifest = reference
    assert manifest["languages"] == ["en", "el", "ja", "uk"]
    assert manifest["directions"] == ["en-el", "el-en", "en-ja", "ja-en", "en-uk", "uk-en"]
    assert manifest["pairs"]["en-uk"]["train"] == 80
    for split, shards in manifest["shards"].items():
        lines = [pair[split] for pair in manifest["pairs"].values()]
        assert len(shards) == sum(-(-n // CONFIG["shard_size"]) for n in lines)
    assert len(manifest["shards"]["train"]) >= 5


def test_interrupted_binarisation_resumes_to_identical_shards_without_redoing_any(
    corpus, reference, tmp_path, monkeypatch
):
    out = str(tmp_path / "data")
    cfg = DataConfig(corpus=corpus, workers=1, **CONFIG)  # in-process, so the patch applies
    original = prepare_module.binarize_shard
    done: list[str] = []

    def interrupted(task):
        if len(done) == 4:
            raise KeyboardInterrupt  # Ctrl-C between two shards
        done.append(task[0].id)
        return original(task)

    monkeypatch.setattr(prepare_module, "binarize_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg, out, log=lambda _: None)
    assert not os.path.exists(os.path.join(out, "manifest.json"))
    finished = {os.path.basename(p)[: -len(".json")] for p in glob.glob(f"{out}/shards/*/*.json")}
    assert len(finished) == 4

    redone: list[str] = []

    def counted(task):
        redone.append(task[0].id)
        return original(task)

    monkeypatch.setattr(prepare_module, "binarize_shard", counted)
    lines: list[str] = []
    manifest = prepare_data(cfg, out, log=lines.append)
    assert "data: resuming an interrupted preparation" in lines
    total = len(glob.glob(f"{reference[0]}/shards/*/*.json"))
    assert not set(redone) & set(done) and len(redone) == total - 4
    assert _files(out) == _files(reference[0])
    assert manifest["spm_sha256"] == reference[1]["spm_sha256"]


def _prepare_in_child(corpus: str, out: str) -> None:
    prepare_data(DataConfig(corpus=corpus, workers=2, **CONFIG), out, log=lambda _: None)


def test_killed_preparation_reruns_to_identical_output(corpus, reference, tmp_path):
    out = str(tmp_path / "data")
    child = multiprocessing.get_context("fork").Process(target=_prepare_in_child, args=(corpus, out))
    child.start()
    deadline = time.monotonic() + 300
    # Kill it as soon as binarisation has finished a first shard (or whenever it ends).
    while child.is_alive() and not glob.glob(f"{out}/shards/*/*.json"):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    lines: list[str] = []
    prepare_data(DataConfig(corpus=corpus, workers=2, **CONFIG), out, log=lines.append)
    assert _files(out) == _files(reference[0])
    assert glob.glob(f"{out}/shards/*/*.tmp-*") == []


def test_sampling_frequencies_follow_the_temperature_formula(reference):
    train = PairDataset(split_prefix(reference[0], "train"))
    sizes = train.direction_sizes
    assert sizes.max() > 5 * sizes.min()
    for temperature in (1.0, 2.0, 5.0):
        stream = BatchStream(train, 300, seed=1, temperature=temperature, window=400)
        expected = sizes.sum() * temperature_probs(sizes, temperature)
        directions, rows = train.locate(np.concatenate(epoch_batches(stream, 0)))
        counts = np.bincount(directions, minlength=len(sizes))
        assert np.all(np.abs(counts - expected) <= 0.5 + 1e-9), (temperature, counts, expected)
        for d in range(len(sizes)):
            seen = np.bincount(rows[directions == d], minlength=sizes[d])
            if counts[d] >= sizes[d]:  # up-sampled: every example, as evenly as possible
                assert seen.min() == counts[d] // sizes[d] and seen.max() <= seen.min() + 1
            else:  # down-sampled: no example twice
                assert seen.max() == 1
    # Windows are stratified: each holds every direction in its sampled proportion.
    stream = BatchStream(train, 300, seed=1, temperature=5.0, window=400)
    shares = temperature_probs(sizes, 5.0)
    for k in range(stream.windows):
        ids, _, _ = stream.window_examples(0, k)
        share = np.bincount(train.locate(ids)[0], minlength=len(sizes)) / len(ids)
        assert np.allclose(share, shares, atol=0.01)


def test_permutation_is_a_bijection_and_depends_on_the_seed():
    for n in (1, 2, 3, 7, 1000, 4097):
        assert np.array_equal(np.sort(permute(np.arange(n), n, (1, 2))), np.arange(n))
    a, b = permute(np.arange(1000), 1000, (1,)), permute(np.arange(1000), 1000, (2,))
    assert (a != b).mean() > 0.9 and abs(np.corrcoef(np.arange(1000), a)[0, 1]) < 0.1
    huge = permute(np.arange(10_000), 12_000_000_000, (3,))  # no array of 12B is built
    assert huge.max() < 12_000_000_000 and len(np.unique(huge)) == 10_000

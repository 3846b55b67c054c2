"""The one entry point from raw parallel text to training-ready files.

``out_dir`` after :func:`prepare_data`::

    corpus/                    bundled corpus only (OPUS-100 layout, see gettext_corpus.py)
    spm.model, spm.vocab       joint SentencePiece model with <2xx> tags
    {train,dev,test}.src.{bin,idx}, .tgt.{bin,idx}, .dir.npy
    manifest.json              written last: its presence means everything above is complete

The manifest records the preparation config and a fingerprint of the corpus; a later call with
the same config and corpus returns it without redoing anything, so repeated training launches
cost nothing here. Concurrent callers (several ranks) are serialised by a lock file; the second
one finds the manifest and returns.
"""

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Callable
from contextlib import contextmanager

from data.binarize import binarize_split, token_dtype
from data.config import BUNDLED_DJANGO, DataConfig
from data.corpus import (
    SPLITS,
    corpus_languages,
    list_pairs,
    select_pairs,
    validate_pairs,
)
from data.errors import DataError
from data.gettext_corpus import build_django_corpus
from data.spm import load_tokenizer, train_spm

MANIFEST = "manifest.json"
SPM_MODEL = "spm.model"
# Bump when the files written here change meaning, so old preparations are redone.
FORMAT_VERSION = 1


def split_prefix(out_dir: str, split: str) -> str:
    """Prefix of one binarised split, as :class:`data.batching.PairDataset` expects it."""
    return os.path.join(out_dir, split)


def spm_model_path(out_dir: str) -> str:
    """Path of the joint SentencePiece model."""
    return os.path.join(out_dir, SPM_MODEL)


def corpus_path(out_dir: str, manifest: dict) -> str:
    """Absolute path of the raw corpus a manifest was prepared from (evaluation references)."""
    return os.path.normpath(os.path.join(out_dir, manifest["corpus_dir"]))


def load_manifest(out_dir: str) -> dict:
    """The manifest of a prepared data folder; an error tells how to create it."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        raise DataError(f"{out_dir} holds no prepared data ({MANIFEST} missing); prepare it first")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _corpus_fingerprint(cfg: DataConfig) -> str:
    """What identifies the input text. A folder corpus is identified by its files' names, sizes
    and modification times (hashing gigabytes on every launch would be too slow); the bundled
    corpus by the Django version whose catalogs it is built from."""
    if cfg.corpus == BUNDLED_DJANGO:
        import django

        return f"django-{django.__version__}"
    digest = hashlib.sha256()
    for pair in list_pairs(cfg.corpus):
        for split in sorted(pair.files):
            for path in pair.files[split]:
                stat = os.stat(path)
                digest.update(f"{os.path.relpath(path, cfg.corpus)}:{stat.st_size}:".encode())
                digest.update(f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _is_current(out_dir: str, key: dict, fingerprint: str) -> dict | None:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    manifest = load_manifest(out_dir)
    if (
        manifest.get("format") != FORMAT_VERSION
        or manifest.get("config_key") != key
        or manifest.get("corpus_fingerprint") != fingerprint
    ):
        return None
    needed = [spm_model_path(out_dir)] + [
        split_prefix(out_dir, split) + suffix
        for split in manifest["splits"]
        for suffix in (".src.bin", ".src.idx", ".tgt.bin", ".tgt.idx", ".dir.npy")
    ]
    return manifest if all(os.path.exists(p) for p in needed) else None


@contextmanager
def _locked(out_dir: str):
    # Append mode: taking the lock must not touch the file (or anything else in out_dir).
    with open(os.path.join(out_dir, ".prepare.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_data(cfg: DataConfig, out_dir: str, log: Callable[[str], None] = print) -> dict:
    """Build (if needed) the corpus, the SentencePiece model and the binarised splits under
    ``out_dir``; write and return the manifest. Returns the existing manifest untouched when it
    was made from the same config and corpus."""
    os.makedirs(out_dir, exist_ok=True)
    key = cfg.preparation_key()
    with _locked(out_dir):
        fingerprint = _corpus_fingerprint(cfg)
        manifest = _is_current(out_dir, key, fingerprint)
        if manifest is not None:
            log(f"data: {out_dir} is up to date ({_summary(manifest)})")
            return manifest
        old = os.path.join(out_dir, MANIFEST)
        if os.path.exists(old):
            os.remove(old)  # from here on the folder is incomplete until the new one is written
        return _prepare(cfg, out_dir, key, fingerprint, log)


def _prepare(cfg: DataConfig, out_dir: str, key: dict, fingerprint: str, log) -> dict:
    start = time.perf_counter()
    if cfg.corpus == BUNDLED_DJANGO:
        corpus_dir = os.path.join(out_dir, "corpus")
        names = ", ".join(cfg.languages)
        log(f"data: building the bundled corpus from Django's catalogs ({names})")
        build_django_corpus(corpus_dir, cfg.languages, cfg.dev_size, cfg.test_size, cfg.seed)
    else:
        corpus_dir = os.path.abspath(cfg.corpus)
    available = list_pairs(corpus_dir)
    pairs = select_pairs(available, cfg.languages)
    lines = validate_pairs(pairs)
    languages = corpus_languages(pairs)
    directions = [direction for pair in pairs for direction in pair.directions()]
    totals = {split: sum(c.get(split, 0) for c in lines.values()) for split in SPLITS}
    log(
        f"data: {len(pairs)} of {len(available)} pairs, {len(directions)} directions, "
        + ", ".join(f"{split} {totals[split]} lines" for split in SPLITS)
    )

    model_path = spm_model_path(out_dir)
    log(f"data: training SentencePiece ({cfg.spm_model_type}, vocab {cfg.vocab_size})")
    train_spm(
        pairs,
        model_path,
        languages,
        vocab_size=cfg.vocab_size,
        model_type=cfg.spm_model_type,
        character_coverage=cfg.character_coverage,
        sample_sentences=cfg.spm_sample_sentences,
        temperature=cfg.spm_temperature,
        seed=cfg.seed,
    )
    tokenizer = load_tokenizer(model_path)

    counts, dropped = {}, {}
    for split in SPLITS:
        result = binarize_split(
            pairs,
            split,
            tokenizer,
            split_prefix(out_dir, split),
            directions,
            cfg.max_source_len,
            cfg.max_target_len,
        )
        counts[split], dropped[split] = result["counts"], result["dropped"]
        lost = sum(n for reasons in result["dropped"].values() for n in reasons.values())
        log(f"data: {split}: {sum(result['counts'].values())} examples ({lost} dropped)")

    manifest = {
        "format": FORMAT_VERSION,
        "languages": languages,
        "directions": directions,
        "pairs": lines,
        "splits": list(SPLITS),
        "counts": counts,
        "dropped": dropped,
        "vocab_size": tokenizer.vocab_size,
        "special_ids": {"pad": 0, "unk": 1, "bos": 2, "eos": 3},
        "tags": {language: tokenizer.tag_id(language) for language in languages},
        "token_dtype": token_dtype(tokenizer.vocab_size).__name__,
        "spm_model": SPM_MODEL,
        "spm_sha256": _sha256(model_path),
        # The raw text stays where it is: evaluation reads references from it, undropped.
        "corpus_dir": os.path.relpath(corpus_dir, out_dir)
        if cfg.corpus == BUNDLED_DJANGO
        else corpus_dir,
        "corpus_fingerprint": fingerprint,
        "config": cfg.to_dict(),
        "config_key": key,
        "seconds": round(time.perf_counter() - start, 2),
    }
    tmp = os.path.join(out_dir, f".{MANIFEST}.tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2, ensure_ascii=False)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    log(f"data: prepared {out_dir} in {manifest['seconds']:.1f} s ({_summary(manifest)})")
    return manifest


def _summary(manifest: dict) -> str:
    train = sum(manifest["counts"]["train"].values())
    return (
        f"{len(manifest['directions'])} directions, {train} training examples, "
        f"vocab {manifest['vocab_size']}"
    )

"""The one entry point from raw parallel text to training-ready files.

``out_dir`` after :func:`prepare_data`::

    corpus/                       gettext corpora only (OPUS-100 layout, see gettext_corpus.py)
    spm.model, spm.vocab          joint SentencePiece model with <2xx> tags
    shards/<split>/<pair>.<k>.{a,b}.{bin,idx}   megatron-core indexed datasets, one per side
    shards/<split>/<pair>.<k>.json              the shard's counts (written last: shard done)
    <split>.shards.json           the split's pairs, tag ids and shards (PairDataset reads it)
    validation_report.{json,tsv}  kept and dropped line pairs per pair, split and reason
    manifest.json                 written last: its presence means everything above is complete

Steps: index the input (line counts, shard boundaries), validate every shard in worker
processes, deduplicate per pair and split, train SentencePiece on a temperature-sampled subset,
binarise every shard in worker processes, write the indexes, report and manifest. Intermediate
results live in ``out_dir/.work`` until the end, so an interrupted preparation resumes where it
stopped (finished shards are not redone) and produces byte-identical shards. A later call with
the same config and corpus returns the manifest without redoing anything.
"""

import fcntl
import glob
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from itertools import groupby

import numpy as np

from data.binarize import binarize_shard, load_stats, shard_done, token_dtype
from data.config import BUNDLED_DJANGO, GETTEXT_PREFIX, DataConfig
from data.corpus import SPLITS, CorpusPair, corpus_languages, list_pairs, select_pairs
from data.errors import DataError
from data.gettext_corpus import build_django_corpus, build_gettext_corpus, django_locale_root, find_catalogs
from data.shards import Shard, output_prefix, plan_shards, shard_from_dict
from data.spm import load_tokenizer
from data.spm_source import check_spm_languages, make_spm, spm_sha256
from data.validate import (
    build_report,
    check_done,
    check_layout,
    check_shard,
    check_splits,
    count_reasons,
    deduplicate,
    final_path,
    write_report,
)
from data.workers import run_tasks, worker_count
from schema.fields import PATH_RULE
from schema.text import count

MANIFEST = "manifest.json"
SPM_MODEL = "spm.model"
WORK = ".work"
# Bump when the files written here change meaning, so old preparations are redone.
FORMAT_VERSION = 2


def split_prefix(out_dir: str, split: str) -> str:
    """Prefix of one binarised split, as :class:`data.dataset.PairDataset` expects it."""
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
    try:
        with open(path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (ValueError, OSError) as error:
        raise DataError(f"{path} is damaged ({error}); delete it and run ./run.sh prepare again") from None
    if not isinstance(manifest, dict):
        raise DataError(f"{path} is damaged (not a JSON object); delete it and run ./run.sh prepare again")
    return manifest


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: str, value) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=1, ensure_ascii=False)
    os.replace(tmp, path)


SPM_MARK = "+spm-"


def corpus_fingerprint(cfg: DataConfig) -> str:
    """What identifies the input: the text's (`text_fingerprint`) and, with `data.spm_model`, the
    sha256 of that SentencePiece model (another model gives other ids)."""
    text = text_fingerprint(cfg)
    return f"{text}{SPM_MARK}{spm_sha256(cfg.spm_model)}" if cfg.spm_model else text


def same_input(fingerprint: str, cfg: DataConfig) -> bool:
    """Whether a preparation with this `fingerprint` (its manifest's) was made from `cfg`'s corpus
    text, with an existing SentencePiece model exactly when `cfg` names one. The model named by
    data.spm_model is not read again: once prepared, the data's own copy (data/spm.model, its
    sha256 in the manifest) is the run's model, so a fine-tuning run resumes without its source."""
    text, mark, _ = fingerprint.partition(SPM_MARK)
    return text == text_fingerprint(cfg) and bool(mark) == bool(cfg.spm_model)


def text_fingerprint(cfg: DataConfig) -> str:
    """What identifies the input text: the names, sizes and modification times of its files
    (hashing terabytes on every launch would be too slow); for the bundled corpus the version of
    Django whose catalogs it is built from."""
    if cfg.corpus == BUNDLED_DJANGO:
        import django

        return f"django-{django.__version__}"
    if cfg.corpus.startswith(GETTEXT_PREFIX):
        root = cfg.corpus[len(GETTEXT_PREFIX):]
        paths = [p for files in find_catalogs(root).values() for p in files]
    else:
        root = cfg.corpus
        paths = [p for pair in list_pairs(root) for files in pair.files.values() for p in files]
    digest = hashlib.sha256()
    for path in sorted(paths):
        stat = os.stat(path)
        digest.update(f"{os.path.relpath(path, root)}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _is_current(out_dir: str, key: dict, cfg: DataConfig) -> dict | None:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        manifest = load_manifest(out_dir)
    except DataError:
        return None  # damaged: prepared again
    if (
        manifest.get("format") != FORMAT_VERSION
        or manifest.get("config_key") != key
        or not same_input(manifest.get("corpus_fingerprint", ""), cfg)
    ):
        return None
    needed = [spm_model_path(out_dir)] + [split_prefix(out_dir, s) + ".shards.json" for s in SPLITS]
    needed += [
        os.path.join(out_dir, "shards", f"{shard}.{side}.{ext}")
        for shards in manifest["shards"].values()
        for shard in shards
        for side in ("a", "b")
        for ext in ("bin", "idx")
    ]
    return manifest if all(os.path.exists(p) for p in needed) else None


@contextmanager
def _locked(out_dir: str):
    # POSIX record locks belong to the process, unlike flock locks, which forked workers would
    # inherit: a killed preparation's orphaned workers could then block every rerun.
    with open(os.path.join(out_dir, ".prepare.lock"), "a") as handle:
        fcntl.lockf(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(handle, fcntl.LOCK_UN)


def prepare_data(
    cfg: DataConfig,
    out_dir: str,
    log: Callable[[str], None] = print,
    progress: bool | None = None,
) -> dict:
    """Build (if needed) the corpus, the SentencePiece model and the binarised shards under
    ``out_dir``; write and return the manifest. Returns the existing manifest untouched when it
    was made from the same config and corpus. ``progress``: show progress bars (default: when
    stderr is a terminal)."""
    check_corpus(cfg)
    created = os.path.abspath(out_dir)
    while not os.path.lexists(os.path.dirname(created)):
        created = os.path.dirname(created)
    created = None if os.path.lexists(created) else created
    os.makedirs(out_dir, exist_ok=True)
    key = cfg.preparation_key()
    if progress is None:
        progress = os.isatty(2)
    try:
        with _locked(out_dir):
            manifest = _is_current(out_dir, key, cfg)
            if manifest is not None:
                log(f"data: {out_dir} is up to date ({_summary(manifest)})")
                return manifest
            if cfg.spm_model:  # the existing SentencePiece model must have every language's tag
                check_spm_languages(cfg.spm_model, _languages(cfg))
            fingerprint = corpus_fingerprint(cfg)
            old = os.path.join(out_dir, MANIFEST)
            if os.path.exists(old):
                os.remove(old)  # from here on the folder is incomplete until the new one is written
            return _prepare(cfg, out_dir, key, fingerprint, log, progress)
    except DataError:
        # Bad input: what this call created holds nothing worth resuming (fixing the input
        # changes its fingerprint, which discards the work anyway), so leave no trace of it.
        if created:
            shutil.rmtree(created, ignore_errors=True)
        raise


def check_corpus(cfg: DataConfig) -> None:
    """The checks that need no pass over the text: the corpus folder, its file names, kinds,
    encodings marks and language codes, the selected pairs and their splits. Cheap, so they run
    before anything is created."""
    if cfg.corpus == BUNDLED_DJANGO or cfg.corpus.startswith(GETTEXT_PREFIX):
        root = django_locale_root() if cfg.corpus == BUNDLED_DJANGO else cfg.corpus[len(GETTEXT_PREFIX):]
        if not os.path.isdir(root):
            what = "is not a folder" if os.path.lexists(root) else "does not exist"
            raise DataError(f"data.corpus={cfg.corpus!r}: {root} {what} ({PATH_RULE}); give a folder of gettext "
                            "catalogs (.po/.mo) after gettext:")
        catalogs = find_catalogs(root)
        missing = [language for language in cfg.languages if language not in catalogs]
        if missing:
            raise DataError(f"data.languages: no catalogs for {missing} under {root}; available: "
                            f"{', '.join(catalogs)}")
    else:
        check_layout(select_pairs(list_pairs(cfg.corpus), cfg.languages))


def _languages(cfg: DataConfig) -> list[str]:
    """Every language of the corpus `cfg` selects, English first for gettext corpora."""
    if cfg.corpus == BUNDLED_DJANGO or cfg.corpus.startswith(GETTEXT_PREFIX):
        root = django_locale_root() if cfg.corpus == BUNDLED_DJANGO else cfg.corpus[len(GETTEXT_PREFIX):]
        return ["en", *(cfg.languages or find_catalogs(root))]
    return corpus_languages(select_pairs(list_pairs(cfg.corpus), cfg.languages))


def _start_work(out_dir: str, key: dict, fingerprint: str, log) -> str:
    """The work folder of this config and corpus. Work left by an interrupted run with the same
    state is kept (that is the resumption); anything prepared from another state is removed."""
    work = os.path.join(out_dir, WORK)
    state = {"format": FORMAT_VERSION, "config_key": key, "corpus_fingerprint": fingerprint}
    path = os.path.join(work, "state.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            if json.load(handle) == state:
                log("data: resuming an interrupted preparation")
                for tmp in glob.glob(os.path.join(out_dir, "shards", "*", "*.tmp-*")):
                    os.remove(tmp)  # left by killed workers; their shards are redone
                return work
    stale = [work, os.path.join(out_dir, "shards"), os.path.join(out_dir, "corpus")]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    outputs = [spm_model_path(out_dir), os.path.splitext(spm_model_path(out_dir))[0] + ".vocab"]
    outputs += [split_prefix(out_dir, split) + ".shards.json" for split in SPLITS]
    outputs += [os.path.join(out_dir, f"validation_report.{ext}") for ext in ("json", "tsv")]
    for output in outputs:  # a preparation of another state
        if os.path.exists(output):
            os.remove(output)
    os.makedirs(work)
    _write_json(path, state)
    return work


def _corpus_dir(cfg: DataConfig, out_dir: str, log) -> str:
    if cfg.corpus != BUNDLED_DJANGO and not cfg.corpus.startswith(GETTEXT_PREFIX):
        return os.path.abspath(cfg.corpus)
    corpus_dir = os.path.join(out_dir, "corpus")
    if not os.path.exists(os.path.join(corpus_dir, "corpus.json")):
        if cfg.corpus == BUNDLED_DJANGO:
            log(f"data: building the bundled corpus from Django's catalogs ({', '.join(cfg.languages)})")
            build_django_corpus(corpus_dir, cfg.languages, cfg.dev_size, cfg.test_size, cfg.seed)
        else:
            root = cfg.corpus[len(GETTEXT_PREFIX):]
            log(f"data: importing the gettext catalogs under {root}")
            summary = build_gettext_corpus(corpus_dir, root, cfg.languages, cfg.dev_size,
                                           cfg.test_size, cfg.seed, f"gettext catalogs under {root}")
            if summary["skipped"]:
                log(f"data: skipped languages with too few pairs: {summary['skipped']}")
    return corpus_dir


def _rate(n: int, seconds: float) -> str:
    return f"{count(n, 'line pair', spec=',')} in {seconds:.1f} s ({n / max(seconds, 1e-9):,.0f}/s)"


def _earlier(shards: int) -> str:
    return f"; {count(shards, 'shard')} {'was' if shards == 1 else 'were'} done by an earlier run" if shards else ""


def _prepare(cfg: DataConfig, out_dir: str, key: dict, fingerprint: str, log, progress) -> dict:
    start = time.perf_counter()
    work = _start_work(out_dir, key, fingerprint, log)
    corpus_dir = _corpus_dir(cfg, out_dir, log)
    available = list_pairs(corpus_dir)
    pairs = select_pairs(available, cfg.languages)
    languages = corpus_languages(pairs)
    directions = [direction for pair in pairs for direction in pair.directions()]
    plan_path = os.path.join(work, "plan.json")
    if os.path.exists(plan_path):
        with open(plan_path, encoding="utf-8") as handle:
            shards = [shard_from_dict(values) for values in json.load(handle)]
    else:
        shards = plan_shards(pairs, cfg.shard_size, SPLITS)
        _write_json(plan_path, [shard.to_dict() for shard in shards])
    check_layout(pairs)
    workers = worker_count(cfg.workers)
    lines = {pair.name: {} for pair in pairs}
    for shard in shards:
        lines[shard.name][shard.split] = lines[shard.name].get(shard.split, 0) + shard.lines
    total = sum(shard.lines for shard in shards)
    log(f"data: {len(pairs)} of {count(len(available), 'pair')}, {count(len(directions), 'direction')}, "
        f"{count(total, 'line pair', spec=',')} in {count(len(shards), 'shard')}, {count(workers, 'worker')}")

    clock = time.perf_counter()
    todo = [(s, work, cfg.max_chars) for s in shards if not check_done(work, s)]
    for _ in run_tasks(check_shard, todo, workers, "validate", lambda t: t[0].lines, progress=progress):
        pass
    for _, group in groupby(shards, key=lambda s: (s.split, s.pair)):
        deduplicate(list(group), work)
    log(f"data: validated {_rate(sum(t[0].lines for t in todo), time.perf_counter() - clock)}"
        + _earlier(len(shards) - len(todo)))
    check_splits(pairs, shards, {s.id: count_reasons(np.load(final_path(work, s))) for s in shards})

    model_path = spm_model_path(out_dir)
    taken = make_spm(cfg, [s for s in shards if s.split == "train"], [p.langs for p in pairs], languages,
                     work, model_path, workers, log, progress)
    tokenizer = load_tokenizer(model_path)
    dtype = token_dtype(tokenizer.vocab_size)  # imports megatron-core here, once, before forking

    clock = time.perf_counter()
    limits = {"spm_model": model_path, "max_source_len": cfg.max_source_len,
              "max_target_len": cfg.max_target_len, "max_length_ratio": cfg.max_length_ratio}
    todo = [(s, out_dir, work, limits) for s in shards if not shard_done(out_dir, s)]
    for _ in run_tasks(binarize_shard, todo, workers, "binarise", lambda t: t[0].lines,
                       setup=lambda: {"tokenizer": load_tokenizer(model_path)}, progress=progress):
        pass
    log(f"data: binarised {_rate(sum(t[0].lines for t in todo), time.perf_counter() - clock)}"
        + _earlier(len(shards) - len(todo)))

    stats = {shard.id: load_stats(out_dir, shard) for shard in shards}
    check_splits(pairs, shards, {shard.id: stats[shard.id]["reasons"] for shard in shards})
    report = build_report([pair.name for pair in pairs], shards, stats)
    for line in write_report(report, out_dir):
        log(line)
    tags = [[tokenizer.tag_id(lang) for lang in pair.langs] for pair in pairs]
    manifest_shards = {}
    for split in SPLITS:
        index = split_index(pairs, tags, directions, shards, stats, split, out_dir)
        _write_json(split_prefix(out_dir, split) + ".shards.json", index)
        manifest_shards[split] = [s["path"][len("shards/"):] for p in index["pairs"] for s in p["shards"]]
    counts = {split: dict.fromkeys(directions, 0) for split in SPLITS}
    for shard in shards:
        for direction in pairs[shard.pair].directions():
            counts[shard.split][direction] += stats[shard.id]["reasons"]["kept"]
    manifest = {
        "format": FORMAT_VERSION,
        "languages": languages,
        "directions": directions,
        "pairs": lines,
        "splits": list(SPLITS),
        "counts": counts,
        "dropped": {split: {name: {r: n for r, n in entry[split].items() if r not in ("lines", "kept")}
                            for name, entry in report["pairs"].items() if split in entry}
                    for split in SPLITS},
        "tokens": {split: sum(sum(stats[s.id]["tokens"].values()) for s in shards if s.split == split)
                   for split in SPLITS},
        "vocab_size": tokenizer.vocab_size,
        "special_ids": {"pad": 0, "unk": 1, "bos": 2, "eos": 3},
        "tags": {language: tokenizer.tag_id(language) for language in languages},
        "token_dtype": dtype.__name__,
        "spm_model": SPM_MODEL,
        "spm_sha256": _sha256(model_path),
        "spm_sample": taken,
        "shards": manifest_shards,
        "shard_size": cfg.shard_size,
        # The raw text stays where it is: evaluation reads references from it, undropped.
        # (relative to out_dir when inside it, so the prepared folder can move; else absolute).
        "corpus_dir": os.path.relpath(os.path.abspath(corpus_dir), os.path.abspath(out_dir))
        if os.path.abspath(corpus_dir).startswith(os.path.abspath(out_dir) + os.sep)
        else os.path.abspath(corpus_dir),
        "corpus_fingerprint": fingerprint,
        "config": cfg.to_dict(),
        "config_key": key,
        "seconds": round(time.perf_counter() - start, 2),
    }
    _write_json(os.path.join(out_dir, MANIFEST), manifest)
    shutil.rmtree(work, ignore_errors=True)
    log(f"data: prepared {out_dir} in {manifest['seconds']:.1f} s ({_summary(manifest)})")
    return manifest


def split_index(
    pairs: list[CorpusPair],
    tags: list[list[int]],
    directions: list[str],
    shards: list[Shard],
    stats: dict[str, dict],
    split: str,
    out_dir: str,
) -> dict:
    """What :class:`data.dataset.PairDataset` reads (``<split>.shards.json``): per pair its tag
    ids and non-empty shards, paths relative to ``out_dir``."""
    entries = [{"name": pair.name, "langs": list(pair.langs), "tags": tags[k], "shards": []}
               for k, pair in enumerate(pairs)]
    for shard in shards:
        kept = stats[shard.id]["reasons"]["kept"]
        if shard.split == split and kept:  # megatron cannot map an empty .bin
            path = os.path.relpath(output_prefix(out_dir, shard), out_dir)
            entries[shard.pair]["shards"].append({"path": path, "pairs": kept})
    return {"split": split, "directions": directions, "pairs": entries}


def _summary(manifest: dict) -> str:
    train = sum(manifest["counts"]["train"].values())
    return (
        f"{count(len(manifest['directions']), 'direction')}, {count(train, 'training example', spec=',')}, "
        f"vocab {manifest['vocab_size']}"
    )

"""The SentencePiece model of a run's data: trained on the corpus, or an existing one
(`data.spm_model`). A fine-tuned model must see the token ids its pretrained model learnt, so its
data is encoded with the pretrained run's SentencePiece model: that model is read from a `.model`
file, a run directory, its prepared data, a checkpoint folder or a consolidated model file, and
refused when the corpus has a language it has no tag for, before anything is tokenised."""
from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile

from data.errors import DataError
from data.spm import Tokenizer, language_tag, train_spm, write_sample
from schema.fields import PATH_RULE
from schema.text import count

CHECKPOINT_FILE = "mp_rank_00_model_states.pt"  # what marks a DeepSpeed checkpoint folder


def _model_in(folder: str) -> str | None:
    """The SentencePiece model file of a prepared data folder (its manifest names it); None for
    a folder without one, or whose manifest.json is another kind's (a checkpoint's lists files)."""
    manifest = os.path.join(folder, "manifest.json")
    if not os.path.isfile(manifest):
        return None
    try:
        with open(manifest, encoding="utf-8") as handle:
            record = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or "spm_sha256" not in record:
        return None
    return os.path.join(folder, record.get("spm_model", "spm.model"))


def read_spm(source: str) -> bytes:
    """The serialized SentencePiece model `source` names (see DataConfig.spm_model); a DataError
    naming data.spm_model when there is none."""
    where = f"data.spm_model={source!r}"
    if os.path.isfile(source):
        if zipfile.is_zipfile(source):  # a torch.save archive: a consolidated model file
            from runtime.safe_load import UnreadableFile, UnsafeFile, load

            try:  # weights-only: nothing that runs code; memory-mapped: only the SentencePiece bytes are read
                package = load(source, allowed=(), mmap=True)
            except UnsafeFile as e:
                raise DataError(f"{where}: {str(e).split(': ', 1)[1]}") from None
            except UnreadableFile as e:
                raise DataError(f"{where}: cannot be read as a model file ({e.why})") from None
            data = package.get("spm_model") if isinstance(package, dict) else None
            if not isinstance(data, bytes):
                raise DataError(f"{where}: this file holds no SentencePiece model; give a .model file, a run "
                                "directory or a consolidated model file (./run.sh convert)")
        else:
            with open(source, "rb") as handle:
                data = handle.read()
        tokenizer(data, where)  # a SentencePiece model with this trainer's special ids
        return data
    if not os.path.isdir(source):
        raise DataError(f"{where}: no such file or folder ({PATH_RULE})")
    folders = [source, os.path.join(source, "data")]
    if os.path.exists(os.path.join(source, CHECKPOINT_FILE)) or os.path.isdir(os.path.join(source, "zero")):
        folders = [os.path.join(source, os.pardir, os.pardir, "data")]  # <run>/checkpoints/<tag>: the run's data
    if os.path.basename(os.path.normpath(source)) == "checkpoints":
        folders.append(os.path.join(source, os.pardir, "data"))
    for folder in folders:
        path = _model_in(folder)
        if path is not None:
            try:
                with open(path, "rb") as handle:
                    return handle.read()
            except OSError as e:
                raise DataError(f"{where}: {path} cannot be read ({e.strerror})") from None
    raise DataError(f"{where}: no prepared data in this folder or its data/ (manifest.json missing); give a "
                    ".model file, a run directory, a checkpoint folder or a consolidated model file")


def tokenizer(data: bytes, where: str) -> Tokenizer:
    """The model `data` (`where` names it in messages); a DataError for anything else."""
    try:
        return Tokenizer(where, proto=data)
    except RuntimeError as e:  # SentencePiece cannot parse it
        raise DataError(f"{where}: not a SentencePiece model ({str(e).splitlines()[0][:120]})") from None


def spm_sha256(source: str) -> str:
    return hashlib.sha256(read_spm(source)).hexdigest()


def check_spm_languages(source: str, languages: list[str]) -> bytes:
    """The model `source` names, when it has the tag of every language of the corpus."""
    data = read_spm(source)
    tags = tokenizer(data, f"data.spm_model={source!r}").tags
    missing = [language for language in languages if language not in tags]
    if missing:
        raise DataError(f"data.spm_model={source!r}: its SentencePiece model has no tag for "
                        f"{', '.join(missing)} ({' '.join(map(language_tag, missing))}), which the corpus needs; it "
                        f"has tags for {', '.join(sorted(tags)) or 'no language'}. Leave those languages out of "
                        "data.languages, or train a new SentencePiece model (data.spm_model empty; a model "
                        "trained on the old one's ids then starts over)")
    return data


def make_spm(cfg, train_shards: list, pair_langs: list, languages: list[str], work: str, model_path: str,
             workers: int, log, progress: bool) -> dict[str, int]:
    """The data's SentencePiece model at `model_path`: `cfg.spm_model`'s, or one trained on a
    temperature-sampled subset of the kept training text (`cfg`: DataConfig). Done once per
    preparation (its record in `work` survives an interruption); returns the lines sampled per
    language (none for an existing model)."""
    info = os.path.join(work, "spm.json")
    if not os.path.exists(info):
        clock = time.perf_counter()
        if cfg.spm_model:
            data = check_spm_languages(cfg.spm_model, languages)
            with open(model_path + ".tmp", "wb") as handle:
                handle.write(data)
            os.replace(model_path + ".tmp", model_path)
            size = tokenizer(data, cfg.spm_model).vocab_size
            log(f"data: using the SentencePiece model of {cfg.spm_model} (vocab {size}) instead of training one")
            taken: dict[str, int] = {}
        else:
            sample = os.path.join(work, "spm-sample.txt")
            taken = write_sample(train_shards, pair_langs, work, sample, cfg.spm_sample_sentences,
                                 cfg.spm_temperature, cfg.seed, workers, progress)
            log(f"data: training SentencePiece ({cfg.spm_model_type}, vocab {cfg.vocab_size}) on "
                f"{count(sum(taken.values()), 'sampled line', spec=',')}")
            train_spm(sample, model_path, languages, cfg.vocab_size, cfg.spm_model_type,
                      cfg.character_coverage, cfg.spm_normalization)
        with open(info, "w", encoding="utf-8") as handle:
            json.dump({"sample": taken, "seconds": time.perf_counter() - clock}, handle)
    with open(info, encoding="utf-8") as handle:
        return json.load(handle)["sample"]


def vocabulary_difference(a: bytes, b: bytes) -> str | None:
    """How two SentencePiece models map ids to other pieces (None: every id is the same piece)."""
    if a == b:
        return None
    first, second = tokenizer(a, "a model").sp, tokenizer(b, "a model").sp
    if first.get_piece_size() != second.get_piece_size():
        return f"{first.get_piece_size()} pieces there, {second.get_piece_size()} here"
    for index in range(first.get_piece_size()):
        if first.id_to_piece(index) != second.id_to_piece(index):
            return f"id {index} is {first.id_to_piece(index)!r} there, {second.id_to_piece(index)!r} here"
    return None

"""Joint SentencePiece model with target-language tags.

One model serves every language (shared source/target/output embedding needs one vocabulary).
The tags ``<2xx>`` are user-defined symbols, so SentencePiece never splits them and each is one
id. Special ids are fixed (pad 0, unk 1, bos 2, eos 3) because the model and the batcher rely on
them without reading the model file.
"""

import os
import re
import tempfile
from collections.abc import Iterable

import numpy as np
import sentencepiece as spm

from data.errors import DataError
from data.sampling import draws, temperature_counts
from data.shards import Shard, raw_rows
from data.validate import KEPT, final_path
from data.workers import ordered, run_tasks

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
_TAG = re.compile(r"^<2[^<>\s]+>$")


def language_tag(language: str) -> str:
    """Tag piece that asks for output in ``language``, OPUS-100 style: ``<2de>``."""
    return f"<2{language}>"


def _sample_shard(task: tuple[Shard, str, dict[int, tuple[np.ndarray, np.ndarray]]]) -> list[str]:
    """Worker: the picked lines of one shard, each repeated as often as it was drawn.
    ``picks[side] = (ranks among the shard's kept lines, times drawn)``, ranks sorted."""
    shard, work_dir, picks = task
    kept = np.flatnonzero(np.load(final_path(work_dir, shard)) == KEPT)
    wanted = {side: dict(zip(kept[ranks].tolist(), counts.tolist(), strict=True))
              for side, (ranks, counts) in picks.items()}
    out: list[str] = []
    line = 0
    for _, rows in raw_rows(shard):
        for row in rows:
            for side, lines in wanted.items():
                if line in lines:
                    out.extend([row[side].decode("utf-8").strip()] * lines[line])
            line += 1
    return out


def write_sample(
    shards: list[Shard],
    pair_langs: list[tuple[str, str]],
    work_dir: str,
    path: str,
    total: int,
    temperature: float,
    seed: int,
    workers: int = 1,
    progress: bool = False,
) -> dict[str, int]:
    """Write a temperature-sampled subset of the kept train text of every language to ``path``.

    A language's text is its side of every pair it is in (English appears in all English-centric
    pairs). The subset holds ``min(total, all kept lines)`` lines; language ``l`` gets
    ``round(size * p_l)`` of them, drawn from a seeded permutation of its lines (without
    replacement unless it is up-sampled; see :func:`data.sampling.draws`). Memory grows with the
    subset, never with the corpus. Returns the number of lines taken per language.
    """
    sources: dict[str, list[tuple[int, int, int]]] = {}  # language → [(shard, side, kept)]
    for k, shard in enumerate(shards):
        kept = int((np.load(final_path(work_dir, shard)) == KEPT).sum())
        for side, language in enumerate(pair_langs[shard.pair]):
            sources.setdefault(language, []).append((k, side, kept))
    languages = sorted(sources)
    sizes = np.array([sum(n for _, _, n in sources[lang]) for lang in languages])
    if not sizes.sum():
        raise DataError("no kept training line: SentencePiece needs training text")
    wants = temperature_counts(sizes, temperature, int(min(total, sizes.sum())))
    picks: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    taken = {}
    for index, (language, n, want) in enumerate(zip(languages, sizes, wants, strict=True)):
        if n == 0:
            continue
        taken[language] = int(want)
        # (seed, 7, language): streams of their own, apart from the batch order's.
        ranks = np.sort(draws(int(n), 0, int(want), (seed, 7, index)))
        starts = np.cumsum([0] + [kept for _, _, kept in sources[language]])
        owner = np.searchsorted(starts, ranks, side="right") - 1
        for j in np.unique(owner):
            k, side, _ = sources[language][j]
            local, counts = np.unique(ranks[owner == j] - starts[j], return_counts=True)
            picks.setdefault(k, {})[side] = (local, counts)
    tasks = [(shards[k], work_dir, picks[k]) for k in sorted(picks)]
    results = run_tasks(_sample_shard, tasks, workers, "spm sample",
                        weight=lambda task: task[0].lines, progress=progress)
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        for lines in ordered(results, tasks):
            out.writelines(line + "\n" for line in lines)
    return taken


def train_spm(
    sample_path: str,
    model_path: str,
    languages: list[str],
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    normalization: str = "identity",
) -> str:
    """Train the joint model in-process on the sample and save it atomically at ``model_path``
    (``.model``; a ``.vocab`` listing sits beside it). Returns ``model_path``.

    Byte fallback is on: a character the sample never showed becomes its UTF-8 bytes instead of
    <unk>, so with ``identity`` normalisation every text survives text → ids → text exactly."""
    if not model_path.endswith(".model"):
        raise ValueError("model_path must end in .model")
    folder = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".spm-tmp-", dir=folder) as tmp:
        prefix = os.path.join(tmp, "spm")
        try:
            spm.SentencePieceTrainer.train(
                input=sample_path,
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
                normalization_rule_name=normalization,
                # Keep runs of spaces: collapsing them would break the exact round trip.
                remove_extra_whitespaces=normalization != "identity",
                byte_fallback=True,
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                user_defined_symbols=[language_tag(lang) for lang in languages],
                # The sample is already the subset we want: use all of it, in file order.
                input_sentence_size=0,
                shuffle_input_sentence=False,
                num_threads=os.cpu_count() or 1,
                minloglevel=2,  # errors only; the trainer logs every step otherwise
            )
        except RuntimeError as error:
            raise DataError(
                f"SentencePiece training failed: {error}. With a small corpus lower "
                "data.vocab_size; it must also exceed 256 byte pieces plus the distinct characters."
            ) from None
        _strip_machine_fields(prefix + ".model")
        os.replace(prefix + ".vocab", model_path[: -len(".model")] + ".vocab")
        os.replace(prefix + ".model", model_path)
    return model_path


def _strip_machine_fields(path: str) -> None:
    """Drop the temporary paths and thread count SentencePiece records in the model, so the same
    text and settings give a byte-identical file on any machine and the manifest's sha256
    identifies the vocabulary itself."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    with open(path, "rb") as handle:
        proto.ParseFromString(handle.read())
    for name in ("input", "model_prefix", "num_threads"):
        proto.trainer_spec.ClearField(name)
    with open(path, "wb") as handle:
        handle.write(proto.SerializeToString())


class Tokenizer:
    """A loaded joint model: text ↔ ids, plus the special and tag ids."""

    def __init__(self, model_path: str, proto: bytes | None = None) -> None:
        """The model in the file ``model_path``, or the serialized model ``proto`` (then
        ``model_path`` only names it in messages)."""
        self.path = model_path
        self.sp = (spm.SentencePieceProcessor(model_file=model_path) if proto is None
                   else spm.SentencePieceProcessor(model_proto=proto))
        specials = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if specials != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise DataError(f"{model_path} has special ids {specials}, expected (0, 1, 2, 3)")
        self.pad_id, self.unk_id, self.bos_id, self.eos_id = specials
        # Tags sit right after the control ids (user-defined symbols are numbered first).
        self.tags: dict[str, int] = {}
        for index in range(4, self.sp.get_piece_size()):
            piece = self.sp.id_to_piece(index)
            if not _TAG.match(piece):
                break
            self.tags[piece[2:-1]] = index
        self._skip = np.zeros(self.vocab_size, dtype=bool)
        self._skip[[PAD_ID, BOS_ID, *self.tags.values()]] = True

    @property
    def vocab_size(self) -> int:
        """Number of ids, including specials and tags."""
        return self.sp.get_piece_size()

    def tag_id(self, language: str) -> int:
        """Id of ``<2language>``; an error names the languages the model knows."""
        try:
            return self.tags[language]
        except KeyError:
            raise DataError(
                f"{self.path} has no tag for {language!r}; it knows {sorted(self.tags)}"
            ) from None

    def encode(self, text: str) -> list[int]:
        """Piece ids of ``text`` (no tag, no eos)."""
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], threads: int = 0) -> list[list[int]]:
        """Piece ids of many texts on ``threads`` SentencePiece threads (0: one per core; the
        binarisation workers use 1, since they are already one process per core)."""
        return self.sp.encode(texts, out_type=int, num_threads=threads or os.cpu_count() or 1)

    def encode_source(self, text: str, target_language: str) -> list[int]:
        """Model source: ``[<2tgt>] + pieces + [eos]``."""
        return [self.tag_id(target_language), *self.encode(text), self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``: stops at the first eos, drops pad, bos and language tags."""
        kept = []
        for index in ids:
            index = int(index)
            if index == self.eos_id:
                break
            if not self._skip[index]:
                kept.append(index)
        return self.sp.decode(kept)


def load_tokenizer(model_path: str) -> Tokenizer:
    """Load the joint model written by :func:`train_spm`."""
    if not os.path.exists(model_path):
        raise DataError(f"no SentencePiece model at {model_path}; run data preparation first")
    return Tokenizer(model_path)

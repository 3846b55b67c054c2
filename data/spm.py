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

from data.corpus import CorpusPair, count_lines, iter_lines, read_pair
from data.errors import DataError
from data.sampling import multiplicities, temperature_counts

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
_TAG = re.compile(r"^<2[^<>\s]+>$")


def language_tag(language: str) -> str:
    """Tag piece that asks for output in ``language``, OPUS-100 style: ``<2de>``."""
    return f"<2{language}>"


def _side_lines(pair: CorpusPair, split: str, language: str) -> Iterable[str]:
    """Lines of one language of a pair; reading only that file keeps the sampling pass cheap."""
    files = pair.files[split]
    if len(files) == 2:
        for _, line in iter_lines(files[pair.langs.index(language)]):
            yield line.strip()
    else:
        side = pair.langs.index(language)
        for both in read_pair(pair, split):
            yield both[side]


def write_sample(
    pairs: list[CorpusPair], path: str, total: int, temperature: float, seed: int
) -> dict[str, int]:
    """Write a temperature-sampled subset of the train text of every language to ``path``.

    Each language's text is the concatenation of its side of every pair (English appears in all
    English-centric pairs). The subset holds ``min(total, all lines)`` lines; language ``l`` gets
    ``round(size * p_l)`` of them, without replacement while it has enough lines and by repeating
    its lines when it is up-sampled. Only the chosen line numbers are kept in memory, so this
    works on corpora far larger than the subset. Returns the number of lines taken per language.
    """
    sources: dict[str, list[tuple[CorpusPair, int]]] = {}
    for pair in pairs:
        if "train" not in pair.files:
            continue
        lines = count_lines(pair.files["train"][0])
        for language in pair.langs:
            sources.setdefault(language, []).append((pair, lines))
    if not sources:
        raise DataError("no pair has a train split; SentencePiece needs training text")
    languages = sorted(sources)
    sizes = np.array([sum(n for _, n in sources[lang]) for lang in languages])
    size = int(min(total, sizes.sum()))
    wants = temperature_counts(sizes, temperature, size)
    rng = np.random.default_rng([seed, 7])  # 7: a stream of its own, apart from the batch order
    taken = {}
    with open(path, "w", encoding="utf-8", newline="\n") as out:
        for language, n, want in zip(languages, sizes, wants, strict=True):
            if n == 0:
                continue
            repeats = multiplicities(int(n), int(want), rng)
            taken[language] = int(want)
            offset = 0
            for pair, lines in sources[language]:
                counts = repeats[offset : offset + lines]
                offset += lines
                for line, count in zip(_side_lines(pair, "train", language), counts, strict=True):
                    if count and line:
                        out.write((line + "\n") * int(count))
    return taken


def train_spm(
    pairs: list[CorpusPair],
    model_path: str,
    languages: list[str],
    vocab_size: int,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    sample_sentences: int = 200_000,
    temperature: float = 5.0,
    seed: int = 1,
) -> str:
    """Train the joint model in-process on a temperature-sampled subset and save it atomically
    at ``model_path`` (``.model``; a ``.vocab`` listing sits beside it). Returns ``model_path``."""
    if not model_path.endswith(".model"):
        raise ValueError("model_path must end in .model")
    folder = os.path.dirname(os.path.abspath(model_path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".spm-tmp-", dir=folder) as tmp:
        sample = os.path.join(tmp, "sample.txt")
        write_sample(pairs, sample, sample_sentences, temperature, seed)
        prefix = os.path.join(tmp, "spm")
        try:
            spm.SentencePieceTrainer.train(
                input=sample,
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=character_coverage,
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
                "data.vocab_size; it must also exceed the number of distinct characters."
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

    def __init__(self, model_path: str) -> None:
        self.path = model_path
        self.sp = spm.SentencePieceProcessor(model_file=model_path)
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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Piece ids of many texts, encoded on all cores by SentencePiece's own thread pool."""
        return self.sp.encode(texts, out_type=int, num_threads=os.cpu_count() or 1)

    def encode_source(self, text: str, target_language: str) -> list[int]:
        """Model source: ``[<2tgt>] + pieces + [eos]``."""
        return [self.tag_id(target_language), *self.encode(text), self.eos_id]

    def encode_target(self, text: str) -> list[int]:
        """Model target: ``pieces + [eos]``."""
        return [*self.encode(text), self.eos_id]

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

"""Reading an OPUS-100-style corpus folder.

Layout: one sub-folder per language pair, holding line-aligned files
``opus.<a>-<b>-<split>.<a>`` and ``opus.<a>-<b>-<split>.<b>`` for split in train/dev/test, or
instead one ``opus.<a>-<b>-<split>.tsv`` whose lines are ``<a text>\\t<b text>``. Language codes
come from the file names (so they must not contain ``-``); a pair may lack a split (OPUS-100's
zero-shot pairs only have test). Every pair is used in both directions, a→b and b→a.
"""

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from data.errors import DataError

SPLITS = ("train", "dev", "test")
_FILE = re.compile(r"^opus\.([^-./]+)-([^-./]+)-(train|dev|test)\.([^-./]+)$")


@dataclass(frozen=True)
class CorpusPair:
    """One language pair folder of the corpus."""

    name: str
    """Folder name, e.g. ``en-de``."""
    langs: tuple[str, str]
    """The two language codes, in the order of the file names (``opus.en-de-*`` → en, de)."""
    files: dict[str, tuple[str, ...]] = field(compare=False)
    """Per split: ``(file of langs[0], file of langs[1])`` or ``(tsv file,)``."""

    def directions(self) -> list[str]:
        """Both translation directions, ``"a-b"`` then ``"b-a"``."""
        a, b = self.langs
        return [f"{a}-{b}", f"{b}-{a}"]


def _scan_pair(folder: str, name: str) -> CorpusPair | None:
    found: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    for filename in sorted(os.listdir(folder)):
        match = _FILE.match(filename)
        if match:
            a, b, split, lang = match.groups()
            found.setdefault((a, b), {}).setdefault(split, {})[lang] = os.path.join(
                folder, filename
            )
    if not found:
        return None
    if len(found) > 1:
        raise DataError(f"{folder} mixes the pairs {sorted(found)}; keep one pair per folder")
    (a, b), by_split = next(iter(found.items()))
    files: dict[str, tuple[str, ...]] = {}
    for split, by_lang in by_split.items():
        if set(by_lang) == {a, b}:
            files[split] = (by_lang[a], by_lang[b])
        elif set(by_lang) == {"tsv"}:
            files[split] = (by_lang["tsv"],)
        else:
            expected = ", ".join(f"opus.{a}-{b}-{split}.{x}" for x in (a, b))
            raise DataError(
                f"{folder}: split {split!r} has files for {sorted(by_lang)}; expected {expected} "
                f"(or opus.{a}-{b}-{split}.tsv)"
            )
    return CorpusPair(name=name, langs=(a, b), files=files)


def list_pairs(corpus_dir: str) -> list[CorpusPair]:
    """Every pair folder of the corpus, sorted by name. Folders without ``opus.*`` files are
    ignored (hidden ones too)."""
    if not os.path.isdir(corpus_dir):
        raise DataError(
            f"corpus folder {corpus_dir!r} does not exist; set data.corpus to an OPUS-100-style "
            "folder or to 'bundled:django'"
        )
    pairs = []
    for name in sorted(os.listdir(corpus_dir)):
        folder = os.path.join(corpus_dir, name)
        if name.startswith(".") or not os.path.isdir(folder):
            continue
        pair = _scan_pair(folder, name)
        if pair is not None:
            pairs.append(pair)
    if not pairs:
        raise DataError(
            f"no pair folders with opus.<src>-<tgt>-<split>.<lang> files under {corpus_dir!r}"
        )
    return pairs


def select_pairs(pairs: list[CorpusPair], languages: list[str]) -> list[CorpusPair]:
    """Pairs whose every language is English or in ``languages``; all pairs if it is empty.
    A listed language that no pair provides is an error rather than silently missing."""
    if not languages:
        return list(pairs)
    allowed = set(languages) | {"en"}
    chosen = [pair for pair in pairs if set(pair.langs) <= allowed]
    provided = {lang for pair in chosen for lang in pair.langs}
    missing = [lang for lang in languages if lang not in provided]
    if missing:
        available = sorted({lang for pair in pairs for lang in pair.langs} - {"en"})
        raise DataError(
            f"no corpus pair provides {missing}; available languages: {available} "
            "(or set data.languages: [] to use every pair)"
        )
    return chosen


def corpus_languages(pairs: list[CorpusPair]) -> list[str]:
    """All language codes of the pairs, English first, then sorted."""
    langs = sorted({lang for pair in pairs for lang in pair.langs})
    return (["en"] if "en" in langs else []) + [lang for lang in langs if lang != "en"]


def count_lines(path: str) -> int:
    """Number of lines as the readers below see them (split on ``\\n`` only; a last line without
    a newline still counts)."""
    count = 0
    last = b"\n"
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def iter_lines(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file, line terminator removed."""
    # newline="\n": a stray "\r" inside a line must not split it, or the sides drift apart.
    with open(path, encoding="utf-8", newline="\n") as handle:
        try:
            for number, line in enumerate(handle, start=1):
                yield number, line.rstrip("\n").rstrip("\r")
        except UnicodeDecodeError as error:
            raise DataError(f"{path} is not valid UTF-8 ({error}); convert it first") from None


def read_pair(pair: CorpusPair, split: str) -> Iterator[tuple[str, str]]:
    """Aligned ``(langs[0] line, langs[1] line)`` of one split, whitespace-stripped; nothing if
    the pair has no such split. Unequal line counts raise ``DataError`` before anything is read."""
    files = pair.files.get(split)
    if files is None:
        return
    if len(files) == 1:
        for number, line in iter_lines(files[0]):
            parts = line.split("\t")
            if len(parts) != 2:
                raise DataError(
                    f"{files[0]} line {number} has {len(parts) - 1} tabs; a .tsv line must be "
                    "'source<TAB>target'"
                )
            yield parts[0].strip(), parts[1].strip()
        return
    counts = [count_lines(path) for path in files]
    if counts[0] != counts[1]:
        raise DataError(
            f"line counts differ: {files[0]} has {counts[0]} lines but {files[1]} has "
            f"{counts[1]}; the two sides of a pair must be line-aligned"
        )
    for (_, left), (_, right) in zip(iter_lines(files[0]), iter_lines(files[1]), strict=True):
        yield left.strip(), right.strip()


def validate_pairs(pairs: list[CorpusPair]) -> dict[str, dict[str, int]]:
    """Line counts ``{pair: {split: lines}}``, checking every two-file split is aligned, so a
    broken corpus fails before any slow step."""
    counts: dict[str, dict[str, int]] = {}
    for pair in pairs:
        counts[pair.name] = {}
        for split, files in sorted(pair.files.items()):
            lines = [count_lines(path) for path in files]
            if len(set(lines)) > 1:
                raise DataError(
                    f"line counts differ: {files[0]} has {lines[0]} lines but {files[1]} has "
                    f"{lines[1]}; the two sides of a pair must be line-aligned"
                )
            counts[pair.name][split] = lines[0]
    return counts


def read_direction(pair: CorpusPair, split: str, direction: str) -> Iterator[tuple[str, str]]:
    """Aligned ``(source, target)`` lines for ``direction`` ("de-en") of this pair, unfiltered:
    what an evaluator scores against."""
    src, tgt = direction.split("-")
    if (src, tgt) == pair.langs:
        yield from read_pair(pair, split)
    elif (tgt, src) == pair.langs:
        for left, right in read_pair(pair, split):
            yield right, left
    else:
        raise DataError(f"direction {direction!r} is not one of {pair.directions()}")

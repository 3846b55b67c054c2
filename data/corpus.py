"""Reading parallel text from the corpus layouts users have.

``data.corpus`` names a folder; every file below it (at any depth) whose name follows one of these
patterns is part of the corpus:

- OPUS-100: ``opus.<a>-<b>-<split>.<a>`` and ``opus.<a>-<b>-<split>.<b>`` (line-aligned), or one
  ``opus.<a>-<b>-<split>.tsv`` whose lines are ``<a text>\\t<b text>``; split is train/dev/test.
- Plain file pairs (fairseq's raw naming): ``<split>.<a>-<b>.<a>`` and ``<split>.<a>-<b>.<b>``,
  or ``<split>.<a>-<b>.tsv``; split is train, dev (or ``valid``) or test.

Language codes come from the file names and are validated (:func:`check_language`). A pair may
lack a split (OPUS-100's zero-shot pairs only have test). Every pair is used in both directions.
"""

import contextlib
import errno
import functools
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from data.errors import DataError
from schema.fields import PATH_RULE
from schema.text import count

SPLITS = ("train", "dev", "test")
# Byte-order marks, longest first (UTF-32LE's starts with UTF-16LE's).
BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xef\xbb\xbf", "UTF-8"),
        (b"\xff\xfe", "UTF-16LE"), (b"\xfe\xff", "UTF-16BE"))
BLOCK_BYTES = 1 << 24  # read size when indexing lines: large enough for numpy to pay off
_OPUS = re.compile(r"^opus\.([^-./]+)-([^-./]+)-(train|dev|test)\.([^-./]+)$")
_PLAIN = re.compile(r"^(train|dev|valid|test)\.([^-./]+)-([^-./]+)\.([^-./]+)$")
# ISO 639-1/639-3 code, then optional subtags for script or region: de, ast, pt_BR, zh_Hans,
# sr_Latn, eng_Latn. Lower-case first part and "_" (never "-", which separates the pair).
_CODE = re.compile(r"^[a-z]{2,3}(_[A-Za-z0-9]{2,8})*$")


# Where the ISO 639 tables are: pycountry's copy when it is installed, else the system's
# iso-codes package (Debian/Ubuntu `iso-codes`, the same data). Without either, codes are
# checked for their form only.
ISO_CODE_FOLDERS = ("/usr/share/iso-codes/json",)


@functools.cache
def known_languages() -> frozenset[str] | None:
    """Every ISO 639-1/-2/-3/-5 code, or None when no table is installed."""
    folders = list(ISO_CODE_FOLDERS)
    with contextlib.suppress(ImportError):
        import pycountry

        folders.insert(0, os.path.join(os.path.dirname(pycountry.__file__), "databases"))
    codes: set[str] = set()
    for folder in folders:
        for part in ("639-2", "639-3", "639-5"):
            for name in (f"iso{part}.json", f"iso_{part}.json"):
                path = os.path.join(folder, name)
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as handle:
                        for entry in json.load(handle).get(part, []):
                            codes.update(entry.get(k) for k in ("alpha_2", "alpha_3", "bibliographic"))
    codes.discard(None)
    return frozenset(codes) or None


def check_language(code: str, where: str) -> str:
    """``code`` if it is a valid language code, else a ``DataError`` that says where it came from."""
    if not isinstance(code, str) or not _CODE.match(code):
        raise DataError(
            f"{where}: {code!r} is not a language code; use an ISO 639 code with optional "
            "'_Script' or '_REGION' subtags (de, ast, pt_BR, zh_Hans)"
        )
    known = known_languages()
    if known is not None and code.split("_")[0] not in known:
        raise DataError(
            f"{where}: {code.split('_')[0]!r} is not an ISO 639 language code; check the "
            "spelling (de, ast, pt_BR, zh_Hans)"
        )
    return code


@dataclass(frozen=True)
class CorpusPair:
    """One language pair of the corpus."""

    name: str
    """``<a>-<b>``, in the order of the file names."""
    langs: tuple[str, str]
    """The two language codes."""
    files: dict[str, tuple[str, ...]] = field(compare=False)
    """Per split: ``(file of langs[0], file of langs[1])`` or ``(tsv file,)``."""

    def directions(self) -> list[str]:
        """Both translation directions, ``"a-b"`` then ``"b-a"``."""
        a, b = self.langs
        return [f"{a}-{b}", f"{b}-{a}"]


def _match(filename: str) -> tuple[str, str, str, str] | None:
    """``(a, b, split, extension)`` of a corpus file name, None for other files."""
    if match := _OPUS.match(filename):
        a, b, split, ext = match.groups()
        return a, b, split, ext
    if match := _PLAIN.match(filename):
        split, a, b, ext = match.groups()
        return a, b, "dev" if split == "valid" else split, ext
    if filename.startswith("opus."):  # a typo here would otherwise drop data silently
        raise DataError(
            f"{filename}: not an OPUS-100 file name; expected opus.<a>-<b>-<train|dev|test>.<lang>"
        )
    return None


def _candidates(corpus_dir: str) -> Iterator[str]:
    """Every file below ``corpus_dir``, hidden ones left out, in a fixed order. Any depth, so
    that OPUS-100's release folder (``supervised/``, ``zero-shot/``) can be given as it is, and
    through symbolic links to folders (a link back to a folder above is a loop and an error)."""
    def walk_error(error: OSError) -> None:
        raise DataError(f"{error.filename}: cannot be read ({error.strerror}); fix its permissions")

    seen: set[str] = set()
    for folder, subfolders, files in os.walk(corpus_dir, followlinks=True, onerror=walk_error):
        seen.add(os.path.realpath(folder))
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in subfolders:
            path = os.path.join(folder, name)
            if os.path.islink(path) and os.path.realpath(path) in seen | _ancestors(folder):
                raise DataError(f"{path}: symbolic link to {os.path.realpath(path)}, a folder that is "
                                "already read (a loop, or the same text twice); remove the link")
            if _OPUS.match(name) or _PLAIN.match(name):
                raise DataError(f"{path}: is a folder, but its name is that of a corpus file; "
                                "rename it or replace it by the text file")
        for name in sorted(files):
            if not name.startswith("."):
                yield os.path.join(folder, name)


def _ancestors(folder: str) -> set[str]:
    real, parents = os.path.realpath(folder), set()
    while real not in parents:
        parents.add(real)
        real = os.path.dirname(real)
    return parents


def check_file(path: str) -> None:
    """A corpus file must be a readable regular file (or a link to one) whose text is UTF-8
    without a byte-order mark; anything else stops here, naming the file and what to do."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{path}: dangling symbolic link (its target {os.path.realpath(path)} does not "
                        "exist); fix or remove the link") from None
    except OSError as error:
        kind = "symbolic link loop" if error.errno == errno.ELOOP else error.strerror
        raise DataError(f"{path}: {kind}; fix or remove it") from None
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"{path}: not a regular file; a corpus file must be plain text")
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror}); fix its permissions") from None
    for mark, encoding in BOMS:
        if head.startswith(mark):
            if encoding == "UTF-8":
                raise DataError(f"{path}: starts with a UTF-8 byte-order mark; remove it "
                                f"(sed -i '1s/^\\xEF\\xBB\\xBF//' {path})")
            raise DataError(f"{path}: is {encoding} text; convert it to UTF-8 "
                            f"(iconv -f {encoding} -t UTF-8)")


def list_pairs(corpus_dir: str) -> list[CorpusPair]:
    """Every pair of the corpus, sorted by name; malformed names and incomplete or doubly given
    splits stop with an error naming the files."""
    if not os.path.isdir(corpus_dir):
        what = "is not a folder" if os.path.lexists(corpus_dir) else "does not exist"
        raise DataError(
            f"data.corpus: {os.path.abspath(corpus_dir)} {what} ({PATH_RULE}); set data.corpus to a corpus folder, "
            "'gettext:<folder of .po/.mo catalogs>' or 'bundled:django'"
        )
    found: dict[tuple[str, str], dict[str, dict[str, str]]] = {}
    for path in _candidates(corpus_dir):
        parsed = _match(os.path.basename(path))
        if parsed is None:
            continue
        a, b, split, ext = parsed
        check_file(path)
        for code in (a, b):
            check_language(code, path)
        if a == b:
            raise DataError(f"{path}: a pair needs two different languages, got {a}-{a}")
        if ext not in (a, b, "tsv"):
            raise DataError(f"{path}: the extension must be {a}, {b} or tsv, not {ext!r}")
        if (b, a) in found:
            other = next(iter(next(iter(found[(b, a)].values())).values()))
            raise DataError(f"{path}: pair {a}-{b} is also given as {b}-{a} ({other}); keep one order")
        by_ext = found.setdefault((a, b), {}).setdefault(split, {})
        if ext in by_ext:
            raise DataError(f"{path} and {by_ext[ext]} both give split {split} of {a}-{b}")
        by_ext[ext] = path
    if not found:
        raise DataError(
            f"no corpus files under {corpus_dir!r}: expected opus.<a>-<b>-<split>.<lang> "
            "(OPUS-100) or <split>.<a>-<b>.<lang> / <split>.<a>-<b>.tsv files"
        )
    pairs = []
    for (a, b), by_split in sorted(found.items()):
        files: dict[str, tuple[str, ...]] = {}
        for split, by_ext in sorted(by_split.items()):
            if set(by_ext) == {a, b}:
                files[split] = (by_ext[a], by_ext[b])
            elif set(by_ext) == {"tsv"}:
                files[split] = (by_ext["tsv"],)
            else:
                raise DataError(
                    f"split {split} of {a}-{b} has {sorted(by_ext.values())}; give both "
                    f"sides ({a} and {b} files) or one .tsv"
                )
        seen: dict[str, str] = {}
        for path in (p for paths in files.values() for p in paths):
            real = os.path.realpath(path)
            if real in seen:
                raise DataError(f"{path} and {seen[real]} are the same file; each side and split "
                                "of a pair needs its own text")
            seen[real] = path
        pairs.append(CorpusPair(name=f"{a}-{b}", langs=(a, b), files=files))
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


def line_offsets(path: str, every: int) -> tuple[int, list[int]]:
    """``(number of lines, byte offset of lines 0, every, 2·every, …)`` of a file, lines split on
    ``\\n`` only (a last line without a newline still counts). One vectorised pass over the
    bytes, so indexing a corpus costs about as much as reading it."""
    count, offsets, position = 0, [0], 0
    with open(path, "rb") as handle:
        while block := handle.read(BLOCK_BYTES):
            if (nul := block.find(b"\0")) >= 0:
                line = count + block.count(b"\n", 0, nul) + 1
                hint = ("the file looks like UTF-16 or UTF-32; convert it to UTF-8 with iconv"
                        if block.count(b"\0", nul, nul + 64) >= 16 else "remove the NUL bytes or the line")
                raise DataError(f"{path} line {line}: contains a NUL byte (binary data?); {hint}")
            if not position and b"\n" not in block and b"\r" in block.rstrip(b"\r"):
                raise DataError(f"{path}: lines end in CR only (old Mac line endings), so the file "
                                f"reads as one line; convert it (tr '\\r' '\\n' < {path})")
            ends = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
            # Line k·every starts right after newline number k·every - 1.
            first = -(-count // every) * every
            wanted = np.arange(max(first, every), count + len(ends) + 1, every) - 1 - count
            wanted = wanted[(wanted >= 0) & (wanted < len(ends))]
            offsets.extend((position + ends[wanted] + 1).tolist())
            count += len(ends)
            position += len(block)
            last = block[-1:]
    if position and last != b"\n":
        count += 1
    # A boundary at the very end of the file starts no line.
    return count, [o for i, o in enumerate(offsets) if i * every < count or i == 0]


def read_lines(path: str, offset: int, n: int) -> list[bytes]:
    """``n`` raw lines starting at byte ``offset``, terminators (``\\n``, ``\\r\\n``) removed."""
    lines = []
    with open(path, "rb") as handle:
        handle.seek(offset)
        for _ in range(n):
            line = handle.readline()
            if not line:
                break
            lines.append(line.rstrip(b"\n").rstrip(b"\r"))
    if len(lines) != n:
        raise DataError(f"{path} changed while being read (expected {count(n, 'line')} at {offset})")
    return lines


def split_tsv(path: str, number: int, line: bytes) -> tuple[bytes, bytes]:
    """The two fields of a TSV line; anything else stops with the file and line number."""
    parts = line.split(b"\t")
    if len(parts) != 2:
        raise DataError(
            f"{path} line {number} has {len(parts) - 1} tabs; a .tsv line must be "
            "'source<TAB>target' (fix or remove the line)"
        )
    return parts[0], parts[1]


def count_pair_lines(pair: CorpusPair, split: str, every: int = 1 << 62) -> list[tuple[int, list]]:
    """``[(lines, offsets)]`` per file of one split (see :func:`line_offsets`); two-file splits
    whose line counts differ stop here, before any slow step, naming both files and counts."""
    files = pair.files[split]
    result = [line_offsets(path, every) for path in files]
    for path, (lines, _) in zip(files, result, strict=True):
        if lines == 0:
            raise DataError(f"{path}: empty file; fill it or remove it (and its other side)")
    if len(files) == 2 and result[0][0] != result[1][0]:
        raise DataError(
            f"line counts differ: {files[0]} has {count(result[0][0], 'line')} but {files[1]} has "
            f"{result[1][0]}; the two sides of a pair must be line-aligned"
        )
    return result


def read_pair(pair: CorpusPair, split: str) -> Iterator[tuple[str, str]]:
    """Aligned ``(langs[0] line, langs[1] line)`` of one split, unfiltered and whitespace-stripped:
    what an evaluator scores against. Nothing if the pair has no such split."""
    files = pair.files.get(split)
    if files is None:
        return
    (lines, _), *_ = count_pair_lines(pair, split)
    raw = [read_lines(path, 0, lines) for path in files]
    rows = zip(*raw) if len(files) == 2 else (split_tsv(files[0], i + 1, x) for i, x in enumerate(raw[0]))
    for number, (left, right) in enumerate(rows, start=1):
        try:
            yield left.decode("utf-8").strip(), right.decode("utf-8").strip()
        except UnicodeDecodeError as error:
            raise DataError(f"{files[0]} (or its other side) line {number}: {error}") from None


def read_direction(pair: CorpusPair, split: str, direction: str) -> Iterator[tuple[str, str]]:
    """Aligned ``(source, target)`` lines for ``direction`` ("de-en") of this pair, unfiltered."""
    src, tgt = direction.split("-")
    if (src, tgt) == pair.langs:
        yield from read_pair(pair, split)
    elif (tgt, src) == pair.langs:
        for left, right in read_pair(pair, split):
            yield right, left
    else:
        raise DataError(f"direction {direction!r} is not one of {pair.directions()}")

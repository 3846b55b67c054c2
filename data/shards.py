"""Cutting the corpus into shards: the unit of parallel work, of resumption and of storage.

A shard is a run of at most ``data.shard_size`` consecutive lines of one split of one pair. Every
per-shard step (validation, binarisation) reads only its own byte range of the input files, so
a worker's memory depends on the shard size and never on the corpus size, and a finished
shard's outputs are never recomputed.
"""

import os
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from itertools import islice

from data.corpus import CorpusPair, count_pair_lines, split_tsv
from data.errors import DataError

# Lines read and processed at a time inside a shard: bounds the text held in memory.
CHUNK_LINES = 10_000


@dataclass(frozen=True)
class Shard:
    """One unit of work; plain data so that it pickles to a worker cheaply."""

    pair: int
    """Index of the pair in the prepared pair list."""
    name: str
    """Pair name, ``en-de``."""
    split: str
    number: int
    """Position among the shards of this pair and split."""
    first_line: int
    """0-based line of the split's file(s) where the shard starts."""
    lines: int
    files: tuple[str, ...]
    """The split's two side files, or its one TSV file."""
    offsets: tuple[int, ...]
    """Byte offset of ``first_line`` in each file."""

    @property
    def id(self) -> str:
        """``train/en-de.00003``: names every file the shard produces."""
        return f"{self.split}/{self.name}.{self.number:05d}"

    def to_dict(self) -> dict:
        return asdict(self)


def plan_shards(pairs: list[CorpusPair], shard_size: int, splits: tuple[str, ...]) -> list[Shard]:
    """All shards of the corpus in a fixed order (split, pair, position). Reads every file once to
    count lines and find the shard boundaries; unequal line counts stop here."""
    shards = []
    for split in splits:
        for index, pair in enumerate(pairs):
            if split not in pair.files:
                continue
            counted = count_pair_lines(pair, split, every=shard_size)
            lines = counted[0][0]
            for number, start in enumerate(range(0, lines, shard_size)):
                shards.append(
                    Shard(
                        pair=index,
                        name=pair.name,
                        split=split,
                        number=number,
                        first_line=start,
                        lines=min(shard_size, lines - start),
                        files=pair.files[split],
                        offsets=tuple(offsets[number] for _, offsets in counted),
                    )
                )
    return shards


def shard_from_dict(values: dict) -> Shard:
    return Shard(**{**values, "files": tuple(values["files"]), "offsets": tuple(values["offsets"])})


def raw_rows(shard: Shard) -> Iterator[tuple[int, list[tuple[bytes, bytes]]]]:
    """``(first line number, [(side a, side b) raw bytes])`` chunk by chunk; line numbers are
    1-based as editors show them. A malformed TSV line stops with its file and line number."""
    with ExitStack() as stack:
        handles = [stack.enter_context(open(path, "rb")) for path in shard.files]
        for handle, offset in zip(handles, shard.offsets, strict=True):
            handle.seek(offset)
        done = 0
        while done < shard.lines:
            count = min(CHUNK_LINES, shard.lines - done)
            first = shard.first_line + done + 1
            sides = []
            for path, handle in zip(shard.files, handles, strict=True):
                lines = [line.rstrip(b"\n").rstrip(b"\r") for line in islice(handle, count)]
                if len(lines) != count:
                    raise DataError(f"{path} changed while being read; prepare again")
                sides.append(lines)
            if len(sides) == 2:
                rows = list(zip(sides[0], sides[1], strict=True))
            else:
                path = shard.files[0]
                rows = [split_tsv(path, first + i, line) for i, line in enumerate(sides[0])]
            yield first, rows
            done += count


def output_prefix(out_dir: str, shard: Shard) -> str:
    """Prefix of a shard's binarised files, ``<out>/shards/train/en-de.00003``."""
    return os.path.join(out_dir, "shards", shard.id)

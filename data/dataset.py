"""A binarised split as the trainer sees it: examples of every direction over many shards.

The split index ``<prefix>.shards.json`` lists the pairs, their language tag ids and their
shards. Examples are numbered direction by direction in the order of the manifest's
``directions`` (``a-b`` then ``b-a`` for each pair): example ``j`` of direction ``a-b`` is
``([<2b>] + a_j + [eos], b_j + [eos])`` and of ``b-a`` the other way round, where ``a_j``/``b_j``
are the pieces stored for line pair ``j`` of that pair. Shards are opened on first use, and the
per-example arrays (:attr:`PairDataset.src_lens` etc.) are built only if asked for, so opening a
split of billions of pairs costs nothing and the batcher reads just the lengths it needs from
the memory-mapped indexes.
"""

import json
import os
import resource

import numpy as np

from data.binarize import SIDES, open_indexed
from data.errors import DataError
from data.spm import EOS_ID
from schema.text import count


def _raise_open_file_limit(shards: int) -> None:
    """Each open shard maps four files, and Python's mmap keeps a descriptor per map."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 4 * shards + 256
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            raise DataError(
                f"this split has {count(shards, 'shard')}, which needs {count(needed, 'open file')}, but the limit "
                f"is {hard}; raise it (ulimit -n) or prepare with a larger data.shard_size"
            )


class PairDataset:
    """One binarised split (``prefix`` = ``<data dir>/<split>``); with ``directions`` (``en-de``, …)
    only those directions have examples (the others count 0: direction indices stay the
    manifest's)."""

    def __init__(self, prefix: str, directions: list[str] | None = None) -> None:
        self.prefix = prefix
        path = prefix + ".shards.json"
        if not os.path.exists(path):
            raise DataError(f"missing {path}; prepare the data again (./run.sh prepare CONFIG)")
        with open(path, encoding="utf-8") as handle:
            index = json.load(handle)
        folder = os.path.dirname(os.path.abspath(path))
        self.directions: list[str] = index["directions"]
        self._tags = np.array([pair["tags"] for pair in index["pairs"]], dtype=np.int64)
        self._shards = [
            [os.path.join(folder, shard["path"]) for shard in pair["shards"]]
            for pair in index["pairs"]
        ]
        # Start of each shard within its pair (line pairs), last entry = pair size.
        self._starts = [
            np.cumsum([0] + [shard["pairs"] for shard in pair["shards"]]) for pair in index["pairs"]
        ]
        _raise_open_file_limit(sum(map(len, self._shards)))
        self._open: dict[tuple[int, int], tuple] = {}
        pair_sizes = np.array([starts[-1] for starts in self._starts], dtype=np.int64)
        self.direction_sizes = np.repeat(pair_sizes, 2)
        """Examples per direction, in the order of :attr:`directions`."""
        self.selected = list(directions or [])
        """The directions chosen (empty: all)."""
        if self.selected:
            unknown = sorted(set(self.selected) - set(self.directions))
            if unknown:
                raise DataError(f"data.directions: {', '.join(unknown)} not in {path} (it has "
                                f"{', '.join(self.directions)})")
            self.direction_sizes[[d not in self.selected for d in self.directions]] = 0
        self.offsets = np.concatenate([[0], np.cumsum(self.direction_sizes)])
        """Global index of each direction's first example (last entry: the total)."""
        self._cache: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _sides(self, pair: int, shard: int) -> tuple:
        key = (pair, shard)
        if key not in self._open:
            prefix = self._shards[pair][shard]
            self._open[key] = tuple(open_indexed(f"{prefix}.{side}") for side in SIDES)
        return self._open[key]

    def side_lengths(self, pair: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Piece counts of sides a and b of line pairs ``rows`` of ``pair`` (vectorised)."""
        rows = np.asarray(rows, dtype=np.int64)
        starts = self._starts[pair]
        owner = np.searchsorted(starts, rows, side="right") - 1
        out = np.zeros((2, len(rows)), dtype=np.int64)
        for shard in np.unique(owner):
            mask = owner == shard
            for k, side in enumerate(self._sides(pair, int(shard))):
                out[k, mask] = side.sequence_lengths[rows[mask] - starts[shard]]
        return out[0], out[1]

    def lengths(self, direction: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source lengths, target lengths)`` of examples ``rows`` of one direction, counting
        the tag and eos of the source and the eos of the target."""
        a, b = self.side_lengths(direction // 2, rows)
        source, target = (a, b) if direction % 2 == 0 else (b, a)
        return source + 2, target + 1

    def example(self, direction: int, row: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source ids, target ids)`` of example ``row`` of ``direction``, as int64."""
        pair, flip = divmod(direction, 2)
        starts = self._starts[pair]
        shard = int(np.searchsorted(starts, row, side="right") - 1)
        a, b = (side[int(row - starts[shard])] for side in self._sides(pair, shard))
        source, target = (b, a) if flip else (a, b)
        src = np.empty(len(source) + 2, dtype=np.int64)
        src[0], src[1:-1], src[-1] = self._tags[pair, 1 - flip], source, EOS_ID
        tgt = np.empty(len(target) + 1, dtype=np.int64)
        tgt[:-1], tgt[-1] = target, EOS_ID
        return src, tgt

    def locate(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(direction, row)`` of global example indices."""
        index = np.asarray(index, dtype=np.int64)
        direction = np.searchsorted(self.offsets, index, side="right") - 1
        return direction, index - self.offsets[direction]

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source ids, target ids)`` of global example ``index``."""
        direction, row = self.locate(np.array([index]))
        return self.example(int(direction[0]), int(row[0]))

    def _materialise(self) -> None:
        src, tgt = [], []
        for direction, size in enumerate(self.direction_sizes):
            s, t = self.lengths(direction, np.arange(size))
            src.append(s)
            tgt.append(t)
        self._cache["src_lens"] = np.concatenate(src) if src else np.zeros(0, np.int64)
        self._cache["tgt_lens"] = np.concatenate(tgt) if tgt else np.zeros(0, np.int64)

    @property
    def src_lens(self) -> np.ndarray:
        """Source length of every example (one array for the whole split: for dev/test sets
        and tests; the training batcher reads lengths window by window instead)."""
        if "src_lens" not in self._cache:
            self._materialise()
        return self._cache["src_lens"]

    @property
    def tgt_lens(self) -> np.ndarray:
        """Target length of every example (see :attr:`src_lens`)."""
        if "tgt_lens" not in self._cache:
            self._materialise()
        return self._cache["tgt_lens"]

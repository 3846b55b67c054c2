"""The trainer's data feed: deterministic, resumable, length-bucketed, temperature-sampled.

One epoch of training is built from ``(seed, epoch)`` alone:

1. ``epoch_order``: direction ``i`` (``n_i`` examples) contributes ``round(N·p_i)`` examples,
   ``p_i ∝ (n_i/N)^(1/T)``, ``N = Σn``; see :func:`data.sampling.multiplicities` for how
   examples are repeated or left out. With T=1 every example appears exactly once.
2. ``make_batches``: shuffle, stable-sort by (source length, target length) so that similar
   lengths share a batch (little padding) while ties stay random, cut greedily under the token
   budget, shuffle the batch order.

Because nothing else feeds the order, resuming needs only ``(epoch, position)``: rebuild the
epoch and skip ``position`` batches.
"""

import warnings

import numpy as np
import torch

from data.binarize import open_indexed
from data.errors import DataError
from data.sampling import multiplicities, temperature_counts
from data.spm import BOS_ID, PAD_ID


class PairDataset:
    """One binarised split: ``<prefix>.src``, ``<prefix>.tgt`` and ``<prefix>.dir.npy``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.src = open_indexed(prefix + ".src")
        self.tgt = open_indexed(prefix + ".tgt")
        # Direction index of every example, into the manifest's ``directions``.
        self.dir_ids = np.load(prefix + ".dir.npy")
        self.src_lens = np.asarray(self.src.sequence_lengths, dtype=np.int64)
        self.tgt_lens = np.asarray(self.tgt.sequence_lengths, dtype=np.int64)
        sizes = {len(self.src_lens), len(self.tgt_lens), len(self.dir_ids)}
        if len(sizes) != 1:
            raise DataError(
                f"{prefix}: .src has {len(self.src_lens)} sequences, .tgt {len(self.tgt_lens)}, "
                f".dir.npy {len(self.dir_ids)}; prepare the data again"
            )

    def __len__(self) -> int:
        return len(self.src_lens)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source ids, target ids)`` of one example, as stored (tag+pieces+eos, pieces+eos)."""
        index = int(index)
        return self.src[index], self.tgt[index]


def collate(
    samples: list[tuple[np.ndarray, np.ndarray]], pad_id: int = PAD_ID, bos_id: int = BOS_ID
) -> dict:
    """Right-padded int64 tensors: ``src`` [B,S]; ``tgt_out`` [B,T] (the target, ending in eos)
    and ``tgt_in`` [B,T] = ``[bos] + target[:-1]`` (teacher forcing); ``ntokens`` counts the
    non-pad target tokens the loss is averaged over, ``nsentences`` the examples."""
    width_src = max(len(src) for src, _ in samples)
    width_tgt = max(len(tgt) for _, tgt in samples)
    src = np.full((len(samples), width_src), pad_id, dtype=np.int64)
    tgt_in = np.full((len(samples), width_tgt), pad_id, dtype=np.int64)
    tgt_out = np.full((len(samples), width_tgt), pad_id, dtype=np.int64)
    for row, (source, target) in enumerate(samples):
        src[row, : len(source)] = source
        tgt_out[row, : len(target)] = target
        tgt_in[row, 0] = bos_id
        tgt_in[row, 1 : len(target)] = target[:-1]
    return {
        "src": torch.from_numpy(src),
        "tgt_in": torch.from_numpy(tgt_in),
        "tgt_out": torch.from_numpy(tgt_out),
        "ntokens": int(sum(len(target) for _, target in samples)),
        "nsentences": len(samples),
    }


def epoch_order(dir_ids: np.ndarray, temperature: float, seed: int, epoch: int) -> np.ndarray:
    """Example indices of one training epoch, temperature-sampled over directions (unsorted;
    up-sampled examples appear several times). The epoch keeps the corpus size ``N``."""
    dir_ids = np.asarray(dir_ids)
    directions, inverse = np.unique(dir_ids, return_inverse=True)
    groups = [np.flatnonzero(inverse == k) for k in range(len(directions))]
    sizes = np.array([len(group) for group in groups])
    wants = temperature_counts(sizes, temperature, int(sizes.sum()))
    # (seed, epoch, 1): a stream apart from make_batches' (seed, epoch).
    rng = np.random.default_rng((seed, epoch, 1))
    parts = [
        np.repeat(group, multiplicities(len(group), int(want), rng))
        for group, want in zip(groups, wants, strict=True)
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _cut(sorted_ids: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int):
    """Greedy cut of length-sorted examples: a batch grows while ``n · max(longest source,
    longest target)``, i.e. the size of its padded tensors, stays within ``max_tokens``."""
    batches = []
    start, longest = 0, 0
    widths = np.maximum(src_lens[sorted_ids], tgt_lens[sorted_ids]).tolist()
    for i, width in enumerate(widths):
        if width > max_tokens:
            raise DataError(
                f"an example of {width} tokens exceeds max_tokens={max_tokens}; raise "
                "data.max_tokens or lower data.max_source_len / data.max_target_len"
            )
        longest = max(longest, width)
        if (i - start + 1) * longest > max_tokens:
            batches.append(sorted_ids[start:i])
            start, longest = i, width
    if start < len(widths):
        batches.append(sorted_ids[start:])
    return batches


def _sort_by_length(ids: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray) -> np.ndarray:
    # lexsort is stable and sorts by the last key first: source length, then target length.
    return ids[np.lexsort((tgt_lens[ids], src_lens[ids]))]


def make_batches(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    seed: int,
    epoch: int,
    order: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Length-bucketed batches of ``order`` (default: every index once), in a seeded random
    order. Each entry of ``order`` lands in exactly one batch; the result depends only on the
    arguments, so the same call on another rank or after a restart gives the same batches."""
    src_lens, tgt_lens = np.asarray(src_lens), np.asarray(tgt_lens)
    ids = np.arange(len(src_lens)) if order is None else np.asarray(order, dtype=np.int64)
    rng = np.random.default_rng((seed, epoch))
    # Shuffle before the stable sort so that examples of equal lengths are mixed across
    # directions instead of following the file order.
    ids = _sort_by_length(ids[rng.permutation(len(ids))], src_lens, tgt_lens)
    batches = _cut(ids, src_lens, tgt_lens, max_tokens)
    return [batches[k] for k in rng.permutation(len(batches))]


def _collate_ids(dataset: PairDataset, ids: np.ndarray) -> dict:
    batch = collate([dataset[i] for i in ids])
    batch["ids"] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    batch["dirs"] = torch.from_numpy(dataset.dir_ids[ids].astype(np.int64))
    return batch


def eval_batches(dataset: PairDataset, max_tokens: int) -> list[dict]:
    """Every example of a split once, length-sorted, no sampling and no shuffling: validation
    loss is then comparable across runs. Batches carry ``ids`` and ``dirs`` (per-direction loss)."""
    ids = _sort_by_length(np.arange(len(dataset)), dataset.src_lens, dataset.tgt_lens)
    return [
        _collate_ids(dataset, batch)
        for batch in _cut(ids, dataset.src_lens, dataset.tgt_lens, max_tokens)
    ]


class BatchStream:
    """Endless stream of training micro-batches over epochs, resumable exactly.

    With data parallelism, every rank builds the same global sequence of batches and keeps every
    ``dp_size``-th one starting at ``dp_rank``; ``next_step(n)`` consumes ``n · dp_size`` global
    batches, so all ranks stay at the same ``(epoch, position)``.
    """

    def __init__(
        self,
        dataset: PairDataset,
        max_tokens: int,
        seed: int,
        temperature: float,
        start_state: dict | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        if len(dataset) == 0:
            raise DataError(f"{dataset.prefix} has no examples to train on")
        self.dataset = dataset
        self.max_tokens = max_tokens
        self.seed = seed
        self.temperature = temperature
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch = 0
        """Epoch the last batch came from (0-based)."""
        self.position = 0
        """Global batches of ``epoch`` consumed so far."""
        self._batches: list[np.ndarray] | None = None
        if start_state is not None:
            self.load_state_dict(start_state)

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """Global batches (example indices) of ``epoch``."""
        order = epoch_order(self.dataset.dir_ids, self.temperature, self.seed, epoch)
        lens = (self.dataset.src_lens, self.dataset.tgt_lens)
        return make_batches(*lens, self.max_tokens, self.seed, epoch, order=order)

    def _current(self) -> list[np.ndarray]:
        if self._batches is None:
            self._batches = self.epoch_batches(self.epoch)
        return self._batches

    def next_step(self, n: int) -> list[dict]:
        """The next ``n`` collated micro-batches of this rank, crossing into the next epoch
        when the current one is used up."""
        out = []
        for k in range(n * self.dp_size):
            if self.position >= len(self._current()):
                self.epoch, self.position, self._batches = self.epoch + 1, 0, None
            ids = self._current()[self.position]
            self.position += 1
            if k % self.dp_size == self.dp_rank:
                out.append(_collate_ids(self.dataset, ids))
        return out

    def state_dict(self) -> dict:
        """Position in the stream plus the settings that define the order."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "num_examples": len(self.dataset),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken. If the order-defining settings changed,
        the old position means nothing in the new order: start the following epoch afresh."""
        self.epoch, self.position, self._batches = int(state["epoch"]), int(state["position"]), None
        settings = ("seed", "temperature", "max_tokens")
        changed = [key for key in settings if key in state and state[key] != getattr(self, key)]
        if state.get("num_examples", len(self.dataset)) != len(self.dataset):
            changed.append("num_examples")
        if changed:
            warnings.warn(
                f"data order settings changed since the checkpoint ({', '.join(changed)}); "
                f"continuing from the start of epoch {self.epoch + 1}",
                stacklevel=2,
            )
            self.epoch, self.position = self.epoch + 1, 0

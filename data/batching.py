"""The trainer's data feed: deterministic, resumable, length-bucketed, temperature-sampled.

An epoch draws ``N = Σ n_d`` examples: direction ``d`` (``n_d`` examples) contributes
``w_d = round(N·p_d)``, ``p_d ∝ (n_d/N)^(1/T)``, taken from a seeded permutation of its examples
that starts again when used up (:func:`data.sampling.draws`); with T=1 every example appears
exactly once. The epoch is cut into ``K = ⌈N / window⌉`` windows and window ``k`` takes draws
``[w_d·k/K, w_d·(k+1)/K)`` of every direction, so each window mixes all directions in their
sampled proportions. Inside a window the examples are shuffled, stable-sorted by length
(:func:`length_order`) and cut greedily under the token budget (length bucketing), and the
batches are shuffled.

Only one window (default ≤ 1M examples) is ever in memory, whatever the corpus size, and the
order is a function of ``(seed, epoch, window)`` alone: resuming needs ``(epoch, window,
position)``, stored in training checkpoints by :meth:`BatchStream.state_dict`.
"""

import math

import numpy as np
import torch

from data.dataset import PairDataset
from data.errors import DataError
from data.sampling import draws, temperature_counts
from data.spm import BOS_ID, PAD_ID

WINDOW = 1_000_000
"""Examples sorted together for length bucketing: large enough that batches are nearly
padding-free, small enough (~50 MB of index arrays) to rebuild in well under a second."""
ORDER_SETTINGS = {"max_tokens": "data.max_tokens", "temperature": "data.sampling_temperature",
                  "directions": "data.directions", "seed": "data.seed", "window_size": "the bucketing window",
                  "num_examples": "the training examples"}
"""The stream's state entries that define the batch order → what a user changes to change them."""


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


def cut_batches(
    ids: np.ndarray, src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int
) -> list[np.ndarray]:
    """Greedy cut of length-sorted examples (``src_lens``/``tgt_lens`` aligned with ``ids``): a
    batch grows while ``n · max(longest source, longest target)`` — the size of its padded
    tensors, hence of every pipeline stage's activations — stays within ``max_tokens``."""
    widths = np.maximum(src_lens, tgt_lens)
    if len(widths) and widths.max() > max_tokens:
        raise DataError(
            f"an example of {int(widths.max())} tokens exceeds max_tokens={max_tokens}; raise "
            "data.max_tokens or lower data.max_source_len / data.max_target_len"
        )
    batches, start, longest = [], 0, 0
    for i, width in enumerate(widths.tolist()):
        longest = max(longest, width)
        if (i - start + 1) * longest > max_tokens:
            batches.append(ids[start:i])
            start, longest = i, width
    if start < len(widths):
        batches.append(ids[start:])
    return batches


def length_order(src_lens: np.ndarray, tgt_lens: np.ndarray) -> np.ndarray:
    """Stable sort by the padded width ``max(source, target)`` (what the token budget counts),
    then target, then source length. On the bundled corpus this gives 19% fewer batches and 10%
    padding instead of 17% compared with sorting by source length first."""
    return np.lexsort((src_lens, tgt_lens, np.maximum(src_lens, tgt_lens)))


def bucket_batches(
    src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, seed: tuple
) -> list[np.ndarray]:
    """Length-bucketed batches of positions ``0..n-1`` (into the length arrays), in a seeded
    random order; every position lands in exactly one batch. Shuffling before the stable sort
    mixes examples of equal lengths across directions instead of following the file order."""
    rng = np.random.default_rng(seed)
    shuffle = rng.permutation(len(src_lens))
    order = shuffle[length_order(src_lens[shuffle], tgt_lens[shuffle])]
    batches = cut_batches(order, src_lens[order], tgt_lens[order], max_tokens)
    return [batches[k] for k in rng.permutation(len(batches))]


def collate_ids(dataset: PairDataset, ids: np.ndarray) -> dict:
    """Collated batch of global example ``ids``, plus ``ids`` and ``dirs`` (direction indices,
    for per-direction losses)."""
    directions, rows = dataset.locate(ids)
    batch = collate([dataset.example(int(d), int(r)) for d, r in zip(directions, rows, strict=True)])
    batch["ids"] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    batch["dirs"] = torch.from_numpy(directions.astype(np.int64))
    return batch


def eval_batches(dataset: PairDataset, max_tokens: int) -> list[dict]:
    """Every example of a split once, length-sorted, no sampling and no shuffling: validation
    loss is then comparable across runs."""
    order = length_order(dataset.src_lens, dataset.tgt_lens)
    batches = cut_batches(order, dataset.src_lens[order], dataset.tgt_lens[order], max_tokens)
    return [collate_ids(dataset, batch) for batch in batches]


class BatchStream:
    """Endless stream of training micro-batches over epochs, resumable exactly. Every rank
    builds the same global sequence; the trainer hands each data-parallel replica its share."""

    def __init__(
        self,
        dataset: PairDataset,
        max_tokens: int,
        seed: int,
        temperature: float,
        start_state: dict | None = None,
        window: int = WINDOW,
    ) -> None:
        if len(dataset) == 0:
            raise DataError(f"{dataset.prefix} has no examples to train on")
        self.dataset = dataset
        self.max_tokens = max_tokens
        self.seed = seed
        self.temperature = temperature
        self.window = window
        sizes = dataset.direction_sizes
        self.wants = temperature_counts(sizes, temperature, int(sizes.sum()))
        """Examples each direction contributes to an epoch."""
        self.windows = max(1, math.ceil(int(self.wants.sum()) / window))
        """Windows per epoch."""
        self.epoch = 0
        """Epoch the last batch came from (0-based)."""
        self.window_index = 0
        """Window of ``epoch`` the last batch came from."""
        self.position = 0
        """Batches of that window consumed so far."""
        self._batches: list[np.ndarray] | None = None
        self.order_changed = ""
        """Why a resumed stream starts a new epoch (`load_state_dict`), or ''."""
        if start_state is not None:
            self.load_state_dict(start_state)

    def window_examples(self, epoch: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(global ids, source lengths, target lengths)`` of window ``k`` of ``epoch``."""
        ids, src, tgt = [], [], []
        for d in np.flatnonzero(self.wants):
            want = int(self.wants[d])
            lo, hi = want * k // self.windows, want * (k + 1) // self.windows
            if hi <= lo:
                continue
            # Tags 1 and 2 keep this stream apart from the bucketing shuffle's (and from the
            # SentencePiece sample's (seed, 7, language)).
            rows = draws(int(self.dataset.direction_sizes[d]), lo, hi, (self.seed, epoch, int(d), 1))
            s, t = self.dataset.lengths(int(d), rows)
            ids.append(self.dataset.offsets[d] + rows)
            src.append(s)
            tgt.append(t)
        return np.concatenate(ids), np.concatenate(src), np.concatenate(tgt)

    def window_plan(self, epoch: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """:meth:`window_examples` plus the window's batches as positions into those arrays."""
        ids, src, tgt = self.window_examples(epoch, k)
        return ids, src, tgt, bucket_batches(src, tgt, self.max_tokens, (self.seed, epoch, k, 2))

    def window_batches(self, epoch: int, k: int) -> list[np.ndarray]:
        """Global batches (example ids) of window ``k`` of ``epoch``."""
        ids, _, _, batches = self.window_plan(epoch, k)
        return [ids[b] for b in batches]

    def _current(self) -> list[np.ndarray]:
        if self._batches is None:
            self._batches = self.window_batches(self.epoch, self.window_index)
        return self._batches

    def next_step(self, n: int) -> list[dict]:
        """The next ``n`` collated micro-batches, crossing into the next window or epoch when
        the current one is used up."""
        out = []
        for _ in range(n):
            while self.position >= len(self._current()):
                self.window_index, self.position, self._batches = self.window_index + 1, 0, None
                if self.window_index == self.windows:
                    self.epoch, self.window_index = self.epoch + 1, 0
            out.append(collate_ids(self.dataset, self._current()[self.position]))
            self.position += 1
        return out

    def state_dict(self) -> dict:
        """Position in the stream plus the settings that define the order."""
        return {
            "epoch": self.epoch,
            "window": self.window_index,
            "position": self.position,
            "seed": self.seed,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "window_size": self.window,
            "num_examples": len(self.dataset),
            "directions": self.dataset.selected,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where ``state`` was taken. If the order-defining settings changed,
        the old position means nothing in the new order: start the following epoch afresh, and
        say why in ``order_changed`` (the trainer's rank 0 prints it and writes it to train.log;
        every rank would otherwise say it)."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.window_index, self._batches = int(state.get("window", 0)), None
        current = {**self.state_dict(), "num_examples": len(self.dataset)}
        changed = [key for key in ORDER_SETTINGS if key in state and state[key] != current[key]]
        self.order_changed = ""
        if changed:
            self.epoch, self.window_index, self.position = self.epoch + 1, 0, 0
            self.order_changed = (f"the batch order changed since the checkpoint "
                                  f"({', '.join(ORDER_SETTINGS[key] for key in changed)}): the data stream "
                                  f"continues at the start of epoch {self.epoch}, not where the checkpoint left it")


def epoch_stats(stream: BatchStream, epoch: int = 0, max_windows: int | None = None) -> dict:
    """What an epoch looks like, from lengths alone (no token is read): batches, examples and
    tokens, the padding fraction (pad slots / all slots of the src and tgt tensors), batch sizes
    and widths, and examples per direction. ``max_windows`` limits the work on huge corpora; the
    result then says how many windows it covers."""
    windows = stream.windows if max_windows is None else min(max_windows, stream.windows)
    per_direction = np.zeros(len(stream.dataset.direction_sizes), dtype=np.int64)
    batches = examples = src_tokens = tgt_tokens = src_slots = tgt_slots = 0
    sizes, widths = [], []
    for k in range(windows):
        ids, src, tgt, plan = stream.window_plan(epoch, k)
        for batch in plan:
            s, t = src[batch], tgt[batch]
            batches += 1
            examples += len(batch)
            src_tokens, tgt_tokens = src_tokens + int(s.sum()), tgt_tokens + int(t.sum())
            src_slots += len(batch) * int(s.max())
            tgt_slots += len(batch) * int(t.max())
            sizes.append(len(batch))
            widths.append(max(int(s.max()), int(t.max())))
        per_direction += np.bincount(stream.dataset.locate(ids)[0], minlength=len(per_direction))
    slots = src_slots + tgt_slots
    return {
        "epoch": epoch,
        "windows": f"{windows} of {stream.windows}",
        "batches": batches,
        "examples": examples,
        "src_tokens": src_tokens,
        "tgt_tokens": tgt_tokens,
        "padding_fraction": 1 - (src_tokens + tgt_tokens) / max(slots, 1),
        "src_padding_fraction": 1 - src_tokens / max(src_slots, 1),
        "tgt_padding_fraction": 1 - tgt_tokens / max(tgt_slots, 1),
        "mean_batch_size": examples / max(batches, 1),
        "max_batch_size": max(sizes, default=0),
        "max_width": max(widths, default=0),
        "max_tokens": stream.max_tokens,
        "examples_per_direction": dict(
            zip(stream.dataset.directions, per_direction.tolist(), strict=True)
        ),
    }

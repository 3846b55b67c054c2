"""Temperature sampling and seeded permutations that never materialise the corpus.

Both the SentencePiece subset and the training order draw from groups (languages, directions) of
up to billions of items, so nothing here allocates memory proportional to a group: a permutation
is a keyed bijection evaluated only at the positions asked for.
"""

import numpy as np

from data.errors import DataError

_ROUNDS = 4
_MIX1 = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xBF58476D1CE4E5B9)


def temperature_probs(sizes: np.ndarray, temperature: float) -> np.ndarray:
    """``p_i ∝ (n_i / Σn)^(1/T)``: T=1 keeps the natural proportions, larger T flattens them
    towards uniform, so small languages or directions are seen more often."""
    sizes = np.asarray(sizes, dtype=np.float64)
    if sizes.sum() <= 0:
        raise DataError("nothing to sample from: every group is empty")
    weights = (sizes / sizes.sum()) ** (1.0 / temperature)
    weights[sizes == 0] = 0.0
    return weights / weights.sum()


def temperature_counts(sizes: np.ndarray, temperature: float, total: int) -> np.ndarray:
    """How many of ``total`` draws each group gets: ``round(total * p_i)``, at least one for a
    non-empty group. With T=1 and ``total = Σn`` this is exactly ``n_i``."""
    sizes = np.asarray(sizes)
    counts = np.rint(total * temperature_probs(sizes, temperature)).astype(np.int64)
    return np.where(sizes > 0, np.maximum(counts, 1), 0)


def _keys(seed: tuple) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2**63, size=_ROUNDS, dtype=np.uint64)


def _feistel(x: np.ndarray, half: int, keys: np.ndarray) -> np.ndarray:
    """A balanced Feistel network on ``2·half``-bit integers: a bijection for any round
    function, here a multiply–xorshift hash of the right half and the round key whose top
    ``half`` bits (the well-mixed ones of a product) are used."""
    mask = np.uint64((1 << half) - 1)
    shift, top = np.uint64(half), np.uint64(64 - half)
    left, right = x >> shift, x & mask
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps on purpose
        for key in keys:
            mixed = (right + key) * _MIX1
            mixed ^= mixed >> np.uint64(31)
            mixed *= _MIX2
            left, right = right, left ^ (mixed >> top)
    return (left << shift) | right


def permute(positions: np.ndarray, n: int, seed: tuple) -> np.ndarray:
    """``π(positions)`` for a seeded pseudo-random permutation π of ``range(n)``.

    The Feistel network permutes the smallest even-bit power of two ≥ n (at most 4n); values that
    land outside ``range(n)`` are fed through again ("cycle walking"), which stays a bijection of
    ``range(n)`` and needs fewer than four rounds on average.
    """
    positions = np.asarray(positions, dtype=np.uint64)
    if n <= 1:
        return np.zeros(len(positions), dtype=np.int64)
    half = (max(2, (n - 1).bit_length()) + 1) // 2
    keys = _keys(seed)
    out = _feistel(positions, half, keys)
    outside = np.flatnonzero(out >= n)
    while len(outside):
        out[outside] = _feistel(out[outside], half, keys)
        outside = outside[out[outside] >= n]
    return out.astype(np.int64)


def draws(n: int, start: int, stop: int, seed: tuple) -> np.ndarray:
    """Items ``start .. stop-1`` of an endless draw sequence over ``range(n)``: the seeded
    permutation, then again, and so on (draw ``k`` is ``π(k mod n)``).

    Taking the first ``w`` draws takes every item ``w // n`` times and ``w % n`` distinct items
    once more: the expected frequencies of sampling with replacement with less variance, so an
    up-sampled group shows every item and a down-sampled one never repeats.
    """
    return permute(np.arange(start, stop, dtype=np.int64) % n, n, seed)

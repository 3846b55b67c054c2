"""Temperature sampling, shared by the SentencePiece subset and the training order."""

import numpy as np

from data.errors import DataError


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


def multiplicities(n: int, want: int, rng: np.random.Generator) -> np.ndarray:
    """How often each of ``n`` items is taken so that ``want`` are taken in all.

    Every item is taken ``want // n`` times and ``want % n`` distinct items once more. This has
    the expected frequencies of sampling with replacement but less variance: an up-sampled group
    shows every example, a down-sampled one never repeats, and ``want == n`` takes each once.
    """
    taken = np.full(n, want // n, dtype=np.int64)
    rest = want % n
    if rest:
        taken[rng.choice(n, size=rest, replace=False)] += 1
    return taken

"""Paired comparison of two sets of per-question scores on the same questions (a backend against the reference).

The difference is mean(score - reference) over the questions; its 95% interval is a paired bootstrap percentile
interval (questions resampled with replacement, both scores of a question kept together), seeded, so the same
scores give the same interval. `n_for_half_width` is how many questions a 95% interval of `half_width` needs at the
observed spread of the per-question differences (normal approximation: n = (z * sd / half_width)^2).
`mcnemar_exact_p` tests pass/fail scores for a difference: the exact two-sided McNemar test on the discordant pairs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

Z_95 = 1.959963984540054
RESAMPLES = 10_000
HALF_WIDTH = 0.03  # three points on a 0-100 scale
_CHUNK = 1_000


@dataclass(frozen=True)
class PairedDifference:
    """mean(score - reference) over `n` paired questions with its 95% interval; `differ`: questions whose scores
    differ; `n_needed`: questions for a ±HALF_WIDTH interval at this spread (None when no question differs)."""

    n: int
    mean: float
    low: float
    high: float
    differ: int
    n_needed: int | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def n_for_half_width(differences: Sequence[float], half_width: float = HALF_WIDTH) -> int | None:
    """Questions a 95% interval of ±half_width needs, from the sample sd of the differences; None if sd is 0."""
    if half_width <= 0:
        raise ValueError(f"half_width must be > 0, got {half_width}")
    d = np.asarray(differences, dtype=np.float64)
    if d.size < 2 or not d.std() > 0:
        return None
    return math.ceil((Z_95 * d.std(ddof=1) / half_width) ** 2)


def paired_difference(
    scores: Sequence[float], reference: Sequence[float], *, resamples: int = RESAMPLES, seed: int = 0,
    half_width: float = HALF_WIDTH,
) -> PairedDifference:
    """`scores` minus `reference` (same questions, same order) with a paired bootstrap 95% interval."""
    a, b = np.asarray(scores, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"need two equally long, non-empty score lists, got {a.size} and {b.size}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("scores must be finite")
    if resamples < 100:
        raise ValueError(f"resamples must be >= 100, got {resamples}")
    d = a - b
    rng = np.random.default_rng(seed)
    means = np.concatenate([
        d[rng.integers(0, d.size, size=(min(_CHUNK, resamples - start), d.size))].mean(axis=1)
        for start in range(0, resamples, _CHUNK)
    ])
    low, high = np.percentile(means, [2.5, 97.5])
    return PairedDifference(int(d.size), float(d.mean()), float(low), float(high), int(np.count_nonzero(d)),
                            n_for_half_width(d, half_width))


def mcnemar_exact_p(scores: Sequence[float], reference: Sequence[float]) -> float:
    """Exact two-sided McNemar p-value of pass/fail scores (0 or 1) on the same questions: of the n questions
    passed by one side only, b by `scores`, under no difference b ~ Binomial(n, 1/2); p = min(1, 2 P[X <= min(b,
    n - b)]), 1 when no question differs."""
    if len(scores) != len(reference) or not scores:
        raise ValueError(f"need two equally long, non-empty score lists, got {len(scores)} and {len(reference)}")
    if any(x not in (0, 1) for x in (*scores, *reference)):
        raise ValueError("McNemar's test takes pass/fail scores of 0 or 1")
    only_scores = sum(1 for a, b in zip(scores, reference) if a > b)
    n = only_scores + sum(1 for a, b in zip(scores, reference) if a < b)
    tail = sum(math.comb(n, k) for k in range(min(only_scores, n - only_scores) + 1))
    return min(1.0, 2 * tail / 2**n)

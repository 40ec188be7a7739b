"""A metric across repeats: the mean of the per-repeat values and its 95% confidence interval (Student t)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def _t_coverage(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer `df` (Abramowitz & Stegun 26.7.3 and 26.7.4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        term = total = math.cos(theta) if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            total += term
        return 2 / math.pi * (theta + math.sin(theta) * total)
    term = total = 1.0
    for j in range(1, df // 2):
        term *= c2 * (2 * j - 1) / (2 * j)
        total += term
    return math.sin(theta) * total


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (bisection on the exact CDF)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    low, high = 0.0, 64.0  # t(0.975, 1) = 12.7
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_coverage(mid, df) < 0.95 else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class MeanCI:
    mean: float
    half_width: float | None  # None with a single repeat
    n: int


def mean_ci95(values: Sequence[float]) -> MeanCI:
    """Mean and 95% confidence half-width (Student t) of independent repeat values."""
    if not values:
        raise ValueError("no values to average")
    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return MeanCI(float(v[0]), None, 1)
    half = t_quantile_975(len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return MeanCI(float(v.mean()), half, len(v))

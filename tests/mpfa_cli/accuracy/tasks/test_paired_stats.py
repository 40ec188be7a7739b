"""Paired bootstrap interval of a score difference, the questions a ±3-point interval needs, and the exact McNemar
test of pass/fail scores."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpfa.mpfa_cli.accuracy.tasks.paired_stats import Z_95, mcnemar_exact_p, n_for_half_width, paired_difference


def test_identical_scores_differ_by_exactly_zero():
    diff = paired_difference([1, 0, 1, 1], [1, 0, 1, 1])
    assert (diff.mean, diff.low, diff.high, diff.differ, diff.n_needed) == (0.0, 0.0, 0.0, 0, None)


def test_interval_covers_the_mean_and_matches_the_normal_width():
    rng = np.random.default_rng(5)
    ref = rng.integers(0, 2, 400).astype(float)
    flip = rng.random(400) < 0.15
    other = np.where(flip, 1 - ref, ref)
    diff = paired_difference(other, ref, seed=1)
    d = other - ref
    assert diff.n == 400 and diff.differ == int(flip.sum())
    assert diff.low < diff.mean < diff.high and diff.mean == pytest.approx(d.mean())
    normal = Z_95 * d.std(ddof=1) / math.sqrt(d.size)
    assert (diff.high - diff.low) / 2 == pytest.approx(normal, rel=0.1)
    assert paired_difference(other, ref, seed=1) == diff  # seeded
    assert diff.n_needed == n_for_half_width(d) == math.ceil((Z_95 * d.std(ddof=1) / 0.03) ** 2)


def test_a_systematic_loss_excludes_zero():
    ref = np.ones(200)
    other = ref.copy()
    other[:30] = 0  # 15 points lost
    diff = paired_difference(other, ref)
    assert diff.high < 0 and diff.mean == pytest.approx(-0.15)


def test_bad_inputs():
    with pytest.raises(ValueError, match="equally long"):
        paired_difference([1, 0], [1])
    with pytest.raises(ValueError, match="finite"):
        paired_difference([float("nan")], [1.0])
    with pytest.raises(ValueError, match="half_width"):
        n_for_half_width([1, 0], 0)


def _pairs(only_first: int, only_second: int, both: int = 3) -> tuple[list[int], list[int]]:
    return [1] * only_first + [0] * only_second + [1] * both, [0] * only_first + [1] * only_second + [1] * both


@pytest.mark.parametrize("only_first, only_second, p", [
    (0, 0, 1.0), (1, 1, 1.0), (5, 0, 2 / 32), (0, 6, 2 / 64), (2, 8, 2 * (1 + 10 + 45) / 1024), (3, 4, 1.0),
])
def test_mcnemar_is_the_exact_two_sided_binomial_test_of_the_discordant_pairs(only_first, only_second, p):
    scores, reference = _pairs(only_first, only_second)
    assert mcnemar_exact_p(scores, reference) == pytest.approx(p, rel=1e-12)
    assert mcnemar_exact_p(reference, scores) == pytest.approx(p, rel=1e-12)  # two-sided: symmetric


def test_mcnemar_refuses_scores_that_are_not_paired_passes_and_fails():
    for scores, reference in (([1, 0], [1]), ([], []), ([0.5], [1]), ([float("nan")], [1])):
        with pytest.raises(ValueError):
            mcnemar_exact_p(scores, reference)

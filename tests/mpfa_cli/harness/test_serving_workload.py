"""Deterministic prompts, arrival schedules, and the workload hash."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mpfa.mpfa_cli.harness import serving_workload


def test_token_ids_are_shake256_words():
    ids = serving_workload.hashed_token_ids(b"key", 5, (100, 200))
    digest = hashlib.shake_256(b"key").digest(20)
    assert ids == [100 + int.from_bytes(digest[4 * i: 4 * i + 4], "little") % 100 for i in range(5)]


def test_prompts_are_exact_deterministic_and_distinct():
    prompts = serving_workload.make_prompts(seed=4, num_requests=6, input_len=777)
    assert all(len(p) == 777 for p in prompts)
    low, high = serving_workload.VOCAB_RANGE
    assert all(low <= t < high for p in prompts for t in p)
    assert prompts == serving_workload.make_prompts(seed=4, num_requests=6, input_len=777)
    assert prompts[3] == serving_workload.make_prompt(4, 3, 777)  # prompt i does not depend on how many are made
    assert len({tuple(p) for p in prompts}) == 6
    assert serving_workload.make_prompts(seed=5, num_requests=1, input_len=777)[0] != prompts[0]
    # spread over the whole range, not a few values
    assert len(set(prompts[0])) > 700 and min(prompts[0]) < low + 500 and max(prompts[0]) > high - 500


@pytest.mark.parametrize("call", [
    lambda: serving_workload.make_prompt(0, 0, 0),
    lambda: serving_workload.make_prompts(0, -1, 5),
    lambda: serving_workload.hashed_token_ids(b"k", 3, (5, 5)),
    lambda: serving_workload.arrival_times(5, 0.0),
    lambda: serving_workload.arrival_times(5, float("inf")),
    lambda: serving_workload.arrival_times(5, 1.0, burstiness=0.0),
])
def test_bad_parameters_raise(call):
    with pytest.raises(ValueError):
        call()


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.5])
def test_arrival_gaps_have_the_requested_rate_and_burstiness(burstiness):
    times = serving_workload.arrival_times(40001, rate=8.0, burstiness=burstiness, seed=3)
    assert times[0] == 0.0 and len(times) == 40001
    gaps = np.diff(times)
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    # gamma with shape k has coefficient of variation 1/sqrt(k); Poisson (k = 1) has CV 1
    assert gaps.std() / gaps.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)
    assert times == serving_workload.arrival_times(40001, rate=8.0, burstiness=burstiness, seed=3)
    assert times != serving_workload.arrival_times(40001, rate=8.0, burstiness=burstiness, seed=4)


def test_arrival_edge_counts():
    assert serving_workload.arrival_times(0, 1.0) == []
    assert serving_workload.arrival_times(1, 1.0) == [0.0]


def test_workload_hash_is_canonical_and_sensitive():
    base = dict(seed=0, input_len=512, output_len=32, num_requests=16, load={"concurrency": 4})
    h = serving_workload.workload_hash(**base)
    assert len(h) == 64 and h == serving_workload.workload_hash(**dict(reversed(list(base.items()))))
    for key, value in [("seed", 1), ("input_len", 513), ("output_len", 33), ("num_requests", 17),
                       ("load", {"concurrency": 8})]:
        assert serving_workload.workload_hash(**{**base, key: value}) != h

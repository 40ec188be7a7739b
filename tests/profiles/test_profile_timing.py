"""Timing summaries, repetition counts and input-set rotation (the CPU-side logic of the microbenchmark)."""
import pytest
import torch

from mpfa.mpfa_cli.errors import ProfileError
from mpfa.profiles.inputs import random_tensor, rotation_sets
from mpfa.profiles.timing import repetitions, summarize

MB = 1024 * 1024


def test_summarize_orders_samples():
    summary = summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (summary.median_ms, summary.min_ms, summary.max_ms, summary.samples) == (3.0, 1.0, 5.0, 5)
    assert (summary.p20_ms, summary.p80_ms) == (2.0, 4.0)
    assert summarize([1.0, 2.0]).median_ms == 1.5
    with pytest.raises(ValueError):
        summarize([])


def test_repetitions_aim_at_a_fixed_timed_span():
    assert repetitions(15.0) == 100  # 1.5 s / 15 ms
    assert repetitions(0.01) == 100  # capped
    assert repetitions(1000.0) == 10  # floor
    assert repetitions(50.0) == 30


def test_rotation_spans_l2_within_budget():
    # Small sets: enough of them to cover 4 x L2 (4 * 50 MB / 10 MB = 20), capped at 16.
    assert rotation_sets(10 * MB, 50 * MB, 10_000 * MB) == 16
    assert rotation_sets(40 * MB, 50 * MB, 10_000 * MB) == 5
    # Large sets: the minimum of two.
    assert rotation_sets(4000 * MB, 50 * MB, 100_000 * MB) == 2
    # The budget wins over the wish, down to a single set.
    assert rotation_sets(4000 * MB, 50 * MB, 5000 * MB) == 1
    with pytest.raises(ProfileError, match="only"):
        rotation_sets(4000 * MB, 50 * MB, 3000 * MB)


def test_random_tensor_fills_every_chunk_in_fp8(monkeypatch):
    monkeypatch.setattr("mpfa.profiles.inputs._FILL_CHUNK", 1000)
    generator = torch.Generator().manual_seed(3)
    values = random_tensor((7, 5, 100), torch.float8_e4m3fn, torch.device("cpu"), generator).float()
    assert values.shape == (7, 5, 100) and torch.isfinite(values).all()
    # Chunks are independent draws: no chunk repeats the first, and the values look standard normal.
    chunks = values.view(-1)[:3000].view(3, 1000)
    assert not torch.equal(chunks[0], chunks[1]) and not torch.equal(chunks[1], chunks[2])
    assert abs(values.mean().item()) < 0.1 and 0.9 < values.std().item() < 1.1

"""The variant study's summary: KV bytes per candidate numerics and FP8 K on the worst heads."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from mpfa.kernels.kv_capacity import kv_bytes_per_token
from mpfa.mpfa_cli.accuracy.variant_study import (fp8_k_on_worst_heads, kv_bytes, print_variant_study,
                                                   summarize_variants)


def test_kv_bytes_change_only_with_the_k_cache_format() -> None:
    mpfa = kv_bytes_per_token("mpfa", 128, 6)
    for name in ("mpfa", "mpfa-q8", "mpfa-had128", "mpfa-q8-had128-k46", "mpfa-qk8tile-psum"):
        assert kv_bytes(name, 128, 6) == mpfa, name
    assert kv_bytes("mpfa-k8", 128, 6) == mpfa - (64 + 8) + (128 + 1)  # e4m3 K and its power-of-two scale byte
    assert kv_bytes("fp8-calibrated", 128, 6) == kv_bytes_per_token("fp8", 128) == 256


ROWS = [
    {"layer": 0, "kv_head": 0, "mpfa": 0.10, "mpfa-k8": 0.05},
    {"layer": 0, "kv_head": 1, "mpfa": 0.02, "mpfa-k8": 0.01},
    {"layer": 1, "kv_head": 0, "mpfa": 0.04, "mpfa-k8": 0.03},
    {"layer": 1, "kv_head": 1, "mpfa": 0.06, "mpfa-k8": 0.02},
]


def test_fp8_k_goes_to_the_heads_where_nvfp4_k_errs_most() -> None:
    mix = fp8_k_on_worst_heads(ROWS, 0.5, 128, 6)
    assert mix["heads"] == [(0, 0), (1, 1)]
    assert mix["mean"] == pytest.approx((0.05 + 0.02 + 0.04 + 0.02) / 4) and mix["worst"] == 0.05
    assert mix["bytes"] == pytest.approx(kv_bytes("mpfa", 128, 6) + (128 + 1 - 72) / 2)
    none = fp8_k_on_worst_heads(ROWS, 0.0, 128, 6)
    assert none["heads"] == [] and none["bytes"] == kv_bytes("mpfa", 128, 6) and none["worst"] == 0.10
    with pytest.raises(ValueError, match="share"):
        fp8_k_on_worst_heads(ROWS, 1.5, 128, 6)


def test_summary_gives_mean_worst_head_and_ratio_to_mpfa() -> None:
    mpfa, k8 = summarize_variants(ROWS, ["mpfa", "mpfa-k8"], 128, 6)
    assert mpfa["mean"] == pytest.approx(0.055) and mpfa["worst"] == 0.10 and mpfa["worst_head"] == (0, 0)
    assert k8["vs_mpfa"] == pytest.approx(0.0275 / 0.055) and k8["bytes"] == kv_bytes("mpfa-k8", 128, 6)


def test_study_on_the_real_fixture_prints_the_table_and_the_mix() -> None:
    console = Console(record=True, width=200)
    fixture = Path(__file__).parents[2] / "fixtures" / "activations" / "smollm2-135m.pt"
    rows = print_variant_study(fixture, ["mpfa", "mpfa-q8", "mpfa-k8"], group_size=3, console=console)
    text = console.export_text()
    assert len(rows) == 2 and all(r["mpfa-q8"] < r["mpfa"] for r in rows)  # FP8 Q errs less than NVFP4 Q here
    assert "mpfa-q8" in text and "FP8 K on the worst 25.0% of heads" in text
    assert f"{kv_bytes('mpfa-k8', 64, 3):g}" in text

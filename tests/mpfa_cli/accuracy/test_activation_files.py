"""Activation files, head/layer selection and the accuracy helpers, on synthetic tensors (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from rich.console import Console

from mpfa.mpfa_cli.accuracy.kernel_error import (load_or_capture, print_kernel_accuracy, recovery, relative_l2,
                                                 render_accuracy_table, run_kernel_accuracy, summarize)
from mpfa.mpfa_cli.accuracy.capture import (ActivationSet, CaptureError, LayerQKV, _select_heads, evenly_spaced_layers,
                                            select_layers)


def _random_set(seed: int, layers=(3, 5), tokens=48, hq=4, hkv=2, d=64) -> ActivationSet:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return ActivationSet(
        model="synthetic",
        text_source="randn",
        scaling=d**-0.5,
        kv_heads=list(range(hkv)),
        q_heads=list(range(hq)),
        layers=[LayerQKV(i, rand(tokens, hq, d), rand(tokens, hkv, d), rand(tokens, hkv, d)) for i in layers],
    )


def test_save_load_round_trip_is_exact(tmp_path):
    acts = _random_set(1)
    acts.save(tmp_path / "a.pt")
    back = ActivationSet.load(tmp_path / "a.pt")
    assert (back.model, back.text_source, back.scaling) == (acts.model, acts.text_source, acts.scaling)
    assert (back.kv_heads, back.q_heads) == (acts.kv_heads, acts.q_heads)
    for a, b in zip(acts.layers, back.layers):
        assert a.layer == b.layer
        assert all(torch.equal(x, y) for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v)))


def test_foreign_or_missing_activation_file_is_a_clear_error(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(CaptureError, match="not an activation file"):
        ActivationSet.load(tmp_path / "junk.pt")
    torch.save({"something": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(CaptureError, match="not an mpfa activation file"):
        ActivationSet.load(tmp_path / "other.pt")
    with pytest.raises(CaptureError, match="no such activation file"):
        ActivationSet.load(tmp_path / "absent.pt")


def test_head_selection_keeps_gqa_groups():
    assert _select_heads(12, 2, None, None) == ([0, 1], list(range(12)))
    assert _select_heads(12, 2, [1], 2) == ([1], [6, 7])
    assert _select_heads(9, 3, [0, 2], 1) == ([0, 2], [0, 6])
    with pytest.raises(CaptureError, match="kv_heads"):
        _select_heads(12, 2, [2], None)
    with pytest.raises(CaptureError, match="q_per_kv"):
        _select_heads(12, 2, None, 7)


def test_layer_selection():
    assert select_layers(28, None) == evenly_spaced_layers(28)
    assert select_layers(28, "all") == list(range(28))  # --layers all: every layer, not the default 8
    assert select_layers(28, [5, 2, 5]) == [2, 5]
    for bad in ([28], [-1], []):
        with pytest.raises(CaptureError, match="layers must be in"):
            select_layers(28, bad)


def test_evenly_spaced_layers_span_first_to_last():
    assert evenly_spaced_layers(28) == [0, 4, 8, 12, 15, 19, 23, 27]
    assert evenly_spaced_layers(5) == [0, 1, 2, 3, 4]


def test_layer_filter_of_an_activation_file(tmp_path):
    _random_set(2, layers=(1, 4, 7)).save(tmp_path / "a.pt")
    assert [lay.layer for lay in load_or_capture(tmp_path / "a.pt", layers=[7, 1]).layers] == [1, 7]
    with pytest.raises(ValueError, match=r"layers \[2\] were not captured"):
        load_or_capture(tmp_path / "a.pt", layers=[2])
    with pytest.raises(ValueError, match="neither an activation file nor a known model"):
        load_or_capture(tmp_path / "qwen-typo")


def test_relative_l2_and_recovery():
    gen = torch.Generator().manual_seed(3)
    ref = torch.randn(32, 4, 64, generator=gen, dtype=torch.float64)
    noise = torch.randn(32, 4, 64, generator=gen, dtype=torch.float64)
    assert relative_l2(ref + 0.01 * noise, ref) == pytest.approx(0.01 * noise.norm().item() / ref.norm().item())
    assert math.isnan(relative_l2(ref.clone().index_fill_(0, torch.tensor([5]), math.nan), ref))
    assert recovery(0.2, 0.05) == pytest.approx(0.75)


def test_rows_per_layer_and_kv_head_on_random_inputs():
    acts = _random_set(4)
    rows = run_kernel_accuracy(acts, ["bf16", "qk4-pv8-direct", "mpfa"])
    assert [(r["layer"], r["kv_head"], r["q_heads"]) for r in rows] == [
        (3, 0, [0, 1]), (3, 1, [2, 3]), (5, 0, [0, 1]), (5, 1, [2, 3])
    ]
    assert all(0 < r["bf16"] < 1e-2 and 0 < r["mpfa"] < 1 for r in rows)
    mean = summarize(rows, ["bf16", "qk4-pv8-direct", "mpfa"])
    assert mean["mpfa"] == pytest.approx(sum(r["mpfa"] for r in rows) / 4)
    assert mean["recovery_of_mean"] == pytest.approx(recovery(mean["qk4-pv8-direct"], mean["mpfa"]))
    assert render_accuracy_table(rows, ["bf16", "qk4-pv8-direct", "mpfa"]).row_count == len(rows) + 1


def test_unknown_variant_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown or missing variants"):
        run_kernel_accuracy(_random_set(5), ["bf16", "fp4"])
    with pytest.raises(ValueError, match="unknown or missing variants"):
        run_kernel_accuracy(_random_set(5), ["float64"])


def test_study_report_prints_both_tables(tmp_path):
    _random_set(6).save(tmp_path / "a.pt")
    console = Console(record=True, width=200)
    rows = print_kernel_accuracy(tmp_path / "a.pt", ["qk4-pv8-direct", "mpfa"], layers=[5], console=console)
    text = console.export_text()
    assert [(r["layer"], r["kv_head"]) for r in rows] == [(5, 0), (5, 1)]
    assert "recovery of the qk4-pv8-direct error by mpfa" in text and "k centered" in text

"""`mpfa profile characterize` without a GPU: the share arithmetic of the ablation ladder on hand-made timings,
the 128 x 128 block count, the report table and JSON, and the one-line errors (no CUDA device, bad arguments)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.errors import ProfileError
from mpfa.profiles import characterize as ch
from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.timing import summarize

# The fp8 kernel's ladder as `prefill_launch.ablation_ladder` gives it: (label, ablation name, piece removed).
LADDER = [("full", "full", None), ("-exp2", "-exp2", "exp2"), ("-exp2 -rowstats", "-exp2-rowstats", "rowstats"),
          ("QK MMA + copies only", "-exp2-rowstats-pv", "pv")]
REMOVED = [removed for _, _, removed in LADDER]


def test_shares_are_differences_of_consecutive_steps():
    shares = ch.ladder_shares([100.0, 80.0, 70.0, 40.0], REMOVED)
    assert [(s.piece, s.ms) for s in shares] == [("exp2", 20.0), ("rowstats", 10.0), ("pv", 30.0),
                                                 ("qk+rest", 40.0)]
    assert [s.fraction for s in shares] == pytest.approx([0.2, 0.1, 0.3, 0.4])
    assert sum(s.fraction for s in shares) == pytest.approx(1.0)  # the pieces and the remainder add up to full
    summary = ch.summary_fractions(shares)
    assert summary["softmax"] == pytest.approx(0.3) and summary["mma_upper_bound"] == pytest.approx(0.7)


def test_the_fp8_kernel_ladder_removes_exp2_then_row_statistics_then_pv():
    from mpfa.kernels.sm90.prefill_launch import ablation_ladder

    assert [(label, removed) for label, _, removed in ablation_ladder(ch.KERNEL)] == \
        [(label, removed) for label, _, removed in LADDER]


def test_shares_keep_negative_differences_and_need_every_step():
    shares = ch.ladder_shares([50.0, 51.0, 40.0], [None, "exp2", "rowstats"])
    assert shares[0].ms == pytest.approx(-1.0) and shares[0].fraction == pytest.approx(-0.02)
    assert ch.ladder_shares([50.0, None, 40.0], [None, "exp2", "rowstats"]) is None
    with pytest.raises(ValueError):
        ch.ladder_shares([50.0, 40.0], ["exp2", "rowstats"])  # must start with the full kernel
    with pytest.raises(ValueError):
        ch.ladder_shares([0.0, 0.0], [None, "exp2"])


def test_block_count_and_time_per_block():
    assert ch.causal_blocks(64 * 1024, 1, 32) == 32 * 512 * 513 // 2  # 512 blocks of 128 tokens
    assert ch.causal_blocks(300, 2, 8) == 2 * 8 * 6  # 3 blocks (the last partial), 3 * 4 / 2 each
    assert ch.causal_blocks(256, 1, 1, causal=False) == 4
    # 288.5 ms on 132 SMs over 64K causal: ~9.0 SM-us per 128x128 block
    assert ch.sm_us_per_block(288.5, ch.causal_blocks(65536, 1, 32), 132) == pytest.approx(9.0, rel=0.01)
    with pytest.raises(ValueError):
        ch.sm_us_per_block(1.0, 0, 132)


def _result(medians, context=(("fa4-bf16", 57.2),)) -> ch.CharacterizeResult:
    w = AttentionWorkload("prefill", 65536, 1, 32, 8, 128)
    ladder = [ch.LadderRow(label, name, removed, None if ms is None else summarize([ms, ms * 1.01]), 3.0,
                           None if ms is not None else "RuntimeError: boom")
              for (label, name, removed), ms in zip(LADDER, medians)]
    rows = [ch.ContextRow(name, "a kernel", summarize([ms])) for name, ms in context]
    return ch.CharacterizeResult(w, "NVIDIA H200", 132, ch.causal_blocks(65536, 1, 32), "fp8", ladder, rows)


def test_table_rows_and_json(tmp_path):
    result = _result([288.0, 240.0, 200.0, 120.0])
    headers, rows = ch.table_rows(result)
    assert headers[:5] == ["kernel", "removed", "median ms", "p20-p80 ms", "SM-us / 128x128 block"]
    assert [row[0] for row in rows] == ["mpfa fp8 full", "mpfa fp8 -exp2", "mpfa fp8 -exp2 -rowstats",
                                        "mpfa fp8 QK MMA + copies only", "fa4-bf16"]
    assert rows[1][6] == "exp2 +16.7%" and rows[0][7] == "real kernel" and "meaningless" in rows[1][7]
    assert rows[-1][5] == f"{57.2 / result.ladder[0].timing.median_ms:.2f}"
    path = result.write_json(tmp_path)
    data = json.loads(path.read_text())
    assert data["kind"] == "characterize" and data["blocks_128x128"] == result.blocks and data["kernel"] == "fp8"
    assert path.name == "characterize-fp8-s65536-b1-h32x8-d128.json"
    assert [s["piece"] for s in data["shares"]] == ["exp2", "rowstats", "pv", "qk+rest"]
    assert data["ladder"][0]["sm_us_per_block"] == pytest.approx(result.per_block_us(288.0 * 1.005), rel=1e-6)
    assert data["summary"]["softmax"] == pytest.approx((48.0 + 40.0) / 288.0)


def test_report_with_the_direct_build_and_no_dequantization_step():
    """The summary says the dequantization is the operand pass's, and the direct build gives the compensation."""
    from rich.console import Console

    result = _result([47.0, 40.0, 36.0, 30.0], context=())
    assert result.compensation() is None  # no direct build timed
    result.direct = ch.LadderRow(ch.DIRECT_LABEL, "full", None, summarize([43.2]), 3.0)
    assert result.compensation() == pytest.approx(47.0 * 1.005 / 43.2)
    data = result.to_json()
    assert data["compensation_full_over_direct"] == pytest.approx(47.0 * 1.005 / 43.2)
    assert data["direct"]["label"] == "direct (no Delta_S)"
    headers, rows = ch.table_rows(result)
    assert rows[-1][0] == "mpfa fp8 direct (no Delta_S)" and rows[-1][6] == "compensation +8.5%"
    console = Console(width=200, record=True)
    ch.render_characterize(result, console)
    text = console.export_text()
    assert "MpFA prefill (fp8)" in text and "mpfa fp8 QK MMA + copies only" in text
    assert "dequantization in the operand pass (not ablated)" in text and "exp2 14.9%" in text
    assert "compensation (Delta_S): the full kernel takes 1.093x its direct build's time" in text


def test_a_shape_the_fp8_kernel_does_not_take_is_a_clear_error(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="fp8 prefill kernel needs a GQA group of 1 to 8"):
        ch.run_characterize(4096, heads=(72, 8), out_dir=tmp_path / "out")
    monkeypatch.setenv("MPFA_PREFILL_KERNEL", "mma-sync")  # the serving override does not change what is ablated
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfileError, match="no CUDA device"):
        ch.run_characterize(4096, out_dir=tmp_path / "out")


def test_a_failed_step_leaves_shares_out():
    from rich.console import Console

    result = _result([288.0, None, 200.0, 120.0])
    result.direct = ch.LadderRow(ch.DIRECT_LABEL, "full", None, summarize([270.0]), 3.0)
    assert result.shares() is None and result.to_json()["shares"] is None
    console = Console(width=200, record=True)
    ch.render_characterize(result, console)
    text = console.export_text()
    assert "RuntimeError: boom" in text and "shares: not computed" in text
    assert "the full kernel takes 1.072x its direct build's time" in text  # needs the full kernel only


def test_run_characterize_needs_cuda(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ProfileError, match="no CUDA device"):
        ch.run_characterize(4096, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="head dim 128"):
        ch.run_characterize(4096, head_dim=64, out_dir=tmp_path / "out")
    with pytest.raises(ValueError, match="unknown backend"):
        ch.run_characterize(4096, out_dir=tmp_path / "out", context=("fa9",))


def test_cli_without_gpu_is_a_one_line_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    env = {**os.environ, "MPFA_DB": str(tmp_path / "results.db"), "COLUMNS": "200"}
    result = subprocess.run([sys.executable, "-m", "mpfa.mpfa_cli", "profile", "characterize", "--seq", "64k",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "results.db").exists()
    bad = CliRunner().invoke(app, ["profile", "characterize", "--seq", "lots"], env=env)  # refused before any work
    assert bad.exit_code == 2 and "lots" in bad.stderr

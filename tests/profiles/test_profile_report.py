"""Derived rates (TFLOPS, GB/s, % of peak, speedup) and the rendered tables."""
import json
from pathlib import Path

import pytest
from rich.console import Console

from mpfa.profiles.attention_workload import BF16, BF16_Q_FP8_KV, MPFA, AttentionWorkload
from mpfa.profiles.ncu import parse_raw_csv
from mpfa.profiles.profile_sections import format_sections, render_profile, sections
from mpfa.profiles.profile_result import (ERROR, OK, BackendResult, KernelTotal, NcuKernel, NcuResult, Peaks,
                                          ProfileResult, TraceResult)
from mpfa.profiles.timing import summarize

WORKLOAD = AttentionWorkload("prefill", 16384, 1, 32, 8, 128)


def _timed(backend, math_dtype, fmt, times_ms):
    return BackendResult(backend, OK, math_dtype, WORKLOAD.flops(), WORKLOAD.bytes_needed(fmt),
                         description=f"{backend} kernel [paged]", num_sets=2, set_bytes=1, prepare_s=1.0,
                         first_call_s=2.5, times_ms=times_ms, timing=summarize(times_ms))


def _result():
    rows = [_timed("fa4-bf16", "bf16", BF16, [4.0, 4.4, 4.2]),
            _timed("flashinfer-fp8", "bf16", BF16_Q_FP8_KV, [8.4, 8.0, 8.8]),
            BackendResult("mpfa", ERROR, "fp8", WORKLOAD.flops(), WORKLOAD.bytes_needed(MPFA),
                          error="RuntimeError: CUDA out of memory"),
            BackendResult("flashinfer-bf16", ERROR, "bf16", WORKLOAD.flops(), None,
                          error="RuntimeError: JIT compilation failed")]
    peaks = Peaks(copy_gbps=4000.0, bf16_tflops=700.0, fp8_tflops=None, errors={"fp8_tflops": "no _scaled_mm"})
    return ProfileResult(WORKLOAD, "fa4-bf16", "NVIDIA H200", {"torch": "2.x"}, peaks, rows)


def test_derived_rates_from_the_median():
    result = _result()
    fa4 = result.derived(result.row("fa4-bf16"))
    assert fa4.tflops == pytest.approx(WORKLOAD.flops() / 4.2e-3 / 1e12)
    assert fa4.pct_compute_peak == pytest.approx(100 * fa4.tflops / 700.0)
    assert fa4.gbps == pytest.approx(WORKLOAD.bytes_needed(BF16) / 4.2e-3 / 1e9)
    assert fa4.pct_bandwidth_peak == pytest.approx(100 * fa4.gbps / 4000.0)
    assert fa4.speedup == pytest.approx(1.0)
    assert result.derived(result.row("flashinfer-fp8")).speedup == pytest.approx(4.2 / 8.4)
    mpfa = result.derived(result.row("mpfa"))
    assert mpfa.tflops is None and mpfa.speedup is None  # failed: no number at all


def test_missing_peak_or_reference_gives_no_percentage():
    result = _result()
    result.backends[0].math_dtype = "fp8"  # the FP8 peak failed to measure
    assert result.derived(result.row("fa4-bf16")).pct_compute_peak is None
    result.reference = "fa3"  # a reference that was not run
    assert result.derived(result.row("flashinfer-fp8")).speedup is None


def test_timing_table_rows():
    table = sections(_result())[0]
    rows = {row[0]: row for row in table.rows}
    assert rows["fa4-bf16"][1] == "4.200" and rows["fa4-bf16"][8] == "1.00"
    assert rows["flashinfer-fp8"][8] == "0.50"
    assert rows["fa4-bf16"][9] == "3.5"  # setup: prepare 1.0 s + first call 2.5 s
    assert rows["mpfa"][1] == "-" and rows["mpfa"][-1] == "error: RuntimeError: CUDA out of memory"
    assert rows["mpfa"][7] != "-"  # the bytes MpFA needs are known before its kernel runs
    assert rows["flashinfer-bf16"][-1] == "error: RuntimeError: JIT compilation failed"
    assert any("no _scaled_mm" in note for note in table.notes)


def test_ncu_and_trace_sections_only_when_present():
    result = _result()
    assert len(sections(result)) == 1
    metrics = {"gpu__time_duration.sum": 4_200_000.0, "launch__shared_mem_per_block_static": 1024.0,
               "launch__shared_mem_per_block_dynamic": 197_632.0, "dram__bytes_read.sum": 3.0e8}
    long_name = "kernel_FlashAttentionForwardSm90" + "x" * 100
    result.ncu = [NcuResult("fa4-bf16", ["ncu"], [NcuKernel(long_name, metrics, {})]),
                  NcuResult("flashinfer-fp8", ["ncu"], error="ncu may not read the GPU performance counters")]
    result.traces = [TraceResult("fa4-bf16", "torch.profiler", 5, [KernelTotal("attn", 5, 21_000.0)],
                                 note="nsys failed (no report)")]
    ncu_table, trace_table = sections(result)[1:]
    fa4 = ncu_table.rows[0]
    assert fa4[1].endswith("...") and len(fa4[1]) == 80
    assert fa4[2] == "4,200.0" and fa4[5] == "300.0" and fa4[-1] == "194.0"  # us, MB, KB
    assert ncu_table.rows[1][1].startswith("error: ncu may not read")
    assert trace_table.rows[0][-1] == "4,200.0"  # us per op call: 21 ms over 5 launches
    assert trace_table.notes == ["fa4-bf16: nsys failed (no report)"]


def test_rich_and_plain_rendering(capsys):
    result = _result()
    console = Console(record=True, width=250)
    render_profile(result, console)
    text = console.export_text()
    assert "fa4-bf16 kernel [paged]" in text  # brackets are literal text, not rich markup
    assert "CUDA out of memory" in text and "NVIDIA H200" in text
    plain = format_sections(sections(result))
    assert plain.splitlines()[0] == f"{WORKLOAD.label()} on NVIDIA H200"
    assert "error: RuntimeError: JIT compilation failed" in plain


def test_render_falls_back_to_plain_text(capsys):
    class BrokenConsole:
        def print(self, *args, **kwargs):
            raise OSError("not a terminal")

    render_profile(_result(), BrokenConsole())
    assert capsys.readouterr().out.strip() == format_sections(sections(_result()))


def test_json_has_raw_times_and_derived_rates(tmp_path):
    result = _result()
    path = result.write_json(tmp_path)
    assert path.name == "profile-prefill-s16384-b1-h32x8-d128.json" and result.json_path == str(path)
    data = json.loads(path.read_text())
    fa4 = data["backends"][0]
    assert fa4["times_ms"] == [4.0, 4.4, 4.2] and fa4["timing"]["median_ms"] == 4.2
    assert fa4["derived"]["speedup"] == pytest.approx(1.0)
    assert data["backends"][2]["status"] == "error" and data["backends"][2]["derived"]["tflops"] is None
    assert data["workload"]["seq"] == 16384 and data["peaks"]["bf16_tflops"] == 700.0


def test_ncu_columns_from_a_real_h200_capture():
    """FA4 prefill 64K as ncu measured it on the H200: the row shows its real figures, tensor pipe included."""
    capture = Path(__file__).parents[1] / "fixtures" / "profiles" / "ncu_h200_prefill64k_fa4.csv"
    result = _result()
    result.ncu = [NcuResult("fa4-bf16", ["ncu"], parse_raw_csv(capture.read_text()))]
    table = sections(result)[1]
    assert table.headers[2:] == ["time us", "SM %", "tensor pipe %", "DRAM rd MB", "DRAM wr MB", "DRAM %",
                                 "occupancy %", "regs", "smem KB"]
    assert table.rows[0][2:] == ["52,605.4", "77.7", "77.7", "1,586.1", "523.3", "0.8", "14.0", "168", "161.0"]

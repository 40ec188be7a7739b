"""nsys command lines and kernel summary, the torch.profiler Chrome-trace totals, and the nsys fallback."""
import json
import subprocess

import pytest
import torch

from mpfa.mpfa_cli.errors import ToolError
from mpfa.profiles import microbench, nsys
from mpfa.profiles.attention_workload import AttentionWorkload
from mpfa.profiles.registry import adapter_for
from mpfa.profiles.profile_result import TraceResult
from mpfa.profiles.torch_trace import kernel_totals

WORKLOAD = AttentionWorkload("prefill", 4096, 1, 32, 8, 128)

# Hand-made in the documented layout of `nsys stats --report cuda_gpu_kern_sum --format csv` (not a capture).
KERN_SUM = """Generating SQLite file report.sqlite from report.nsys-rep
Processing [report.sqlite] with [/opt/nsys/reports/cuda_gpu_kern_sum.py]...

"Time (%)","Total Time (ns)","Instances","Avg (ns)","Med (ns)","Min (ns)","Max (ns)","StdDev (ns)","Name"
"10.5","21000","5","4200.0","4200.0","4100","4300","70.7","MergeStatesKernel"
"89.5","179000","5","35800.0","35800.0","35000","36500","600.0","BatchPrefillWithPagedKVCacheKernel<...>"
"""


def test_nsys_command_lines(tmp_path):
    profile = nsys.nsys_profile_command("/x/nsys", tmp_path / "nsys-a", ["python", "-m", "m"])
    joined = " ".join(profile)
    assert profile[:2] == ["/x/nsys", "profile"] and profile[-3:] == ["python", "-m", "m"]
    assert "--capture-range cudaProfilerApi" in joined and f"--output {tmp_path / 'nsys-a'}" in joined
    stats = nsys.nsys_stats_command("/x/nsys", tmp_path / "r.nsys-rep")
    assert stats[:2] == ["/x/nsys", "stats"] and "cuda_gpu_kern_sum" in stats and stats[-1].endswith("r.nsys-rep")


def test_parse_kernel_summary_sorts_by_total():
    totals = nsys.parse_kernel_summary(KERN_SUM)
    assert [(k.name, k.calls, k.total_us) for k in totals] == [
        ("BatchPrefillWithPagedKVCacheKernel<...>", 5, 179.0), ("MergeStatesKernel", 5, 21.0)]
    assert totals[0].avg_us == pytest.approx(35.8)
    with pytest.raises(ToolError, match="no kernel summary"):
        nsys.parse_kernel_summary("SKIPPED: report.sqlite does not contain CUDA kernel data.")


def _fake_nsys(monkeypatch, writes_report: bool, stats_stdout: str = KERN_SUM):
    monkeypatch.setattr(nsys, "find_tool", lambda name: "/fake/nsys")

    def run(command, timeout_s):
        if command[1] == "profile":
            if writes_report:
                output = command[command.index("--output") + 1]
                open(output + ".nsys-rep", "w").close()
            return subprocess.CompletedProcess(command, 0, "Collecting data...", "")
        return subprocess.CompletedProcess(command, 0, stats_stdout, "")

    monkeypatch.setattr(nsys, "run_tool", run)


def test_trace_with_nsys(monkeypatch, tmp_path):
    _fake_nsys(monkeypatch, writes_report=True)
    trace = nsys.trace_with_nsys(adapter_for("flashinfer-fp8"), WORKLOAD, tmp_path, launches=5, warmup=2)
    assert trace.source == "nsys" and trace.launches == 5 and trace.kernels[0].calls == 5


def test_missing_report_is_a_tool_error_even_with_a_stale_one(monkeypatch, tmp_path):
    (tmp_path / "nsys-flashinfer-fp8.nsys-rep").write_text("from an earlier run")
    _fake_nsys(monkeypatch, writes_report=False)
    with pytest.raises(ToolError, match="nsys wrote no report"):
        nsys.trace_with_nsys(adapter_for("flashinfer-fp8"), WORKLOAD, tmp_path, launches=5, warmup=2)


def test_chrome_trace_totals_keep_only_gpu_kernels():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "attn", "dur": 100.0},
        {"ph": "X", "cat": "kernel", "name": "merge", "dur": 7.5},
        {"ph": "X", "cat": "kernel", "name": "attn", "dur": 102.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "dur": 3.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 4.0},
        {"ph": "f", "cat": "ac2g", "name": "attn"},
        {"ph": "M", "name": "process_name"},
    ]}
    totals = kernel_totals(trace)
    assert [(k.name, k.calls, k.total_us) for k in totals] == [("attn", 2, 202.0), ("merge", 1, 7.5)]


def test_a_real_cpu_only_trace_has_no_gpu_kernels(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "trace.json"
    profiler.export_chrome_trace(str(path))
    assert kernel_totals(json.loads(path.read_text())) == []


def test_nsys_failure_falls_back_to_torch_profiler_once(monkeypatch, tmp_path):
    tried = []

    def failing_nsys(adapter, workload, out_dir, launches, warmup):
        tried.append(adapter.name)
        raise ToolError("nsys wrote no report (exit status 0): Generating report failed")

    def in_process(adapter, workload, device, out_dir, note):
        return TraceResult(adapter.name, "torch.profiler", 5, note=note)

    monkeypatch.setattr(microbench.nsys_tracer, "trace_with_nsys", failing_nsys)
    monkeypatch.setattr(microbench, "_trace_in_process", in_process)
    messages = []
    adapters = [adapter_for("fa4-bf16"), adapter_for("flashinfer-fp8")]
    traces = microbench.trace_backends(adapters, WORKLOAD, None, tmp_path, messages.append)
    assert tried == ["fa4-bf16"]  # nsys is not retried once it failed on this host
    assert [t.source for t in traces] == ["torch.profiler", "torch.profiler"]
    assert all("Generating report failed" in t.note and "torch.profiler" in t.note for t in traces)
    assert any("falling back to torch.profiler" in message for message in messages)


# Real torch.profiler (CUPTI) traces captured on the H200 by
# `mpfa profile decode --seq 8k --batch 1 --backend fa4-bf16,mpfa --nsys` (nsys missing there -> torch.profiler).
def _captured(backend: str):
    from pathlib import Path

    from mpfa.profiles.torch_trace import load_trace

    return load_trace(Path(__file__).parents[1] / "fixtures" / "profiles" / f"torch_trace_h200_decode8k_b1_{backend}.json")


def test_captured_traces_total_each_kernel_launch():
    fa4 = kernel_totals(_captured("fa4-bf16"))
    assert [(k.name.startswith("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90"), k.calls) for k in fa4] == [
        (True, 5)]
    assert fa4[0].total_us == pytest.approx(492.893, abs=1e-3)
    mpfa = kernel_totals(_captured("mpfa"))
    assert [("SplitKVDecodeSm90" in k.name, "DecodeMergeSm90" in k.name, k.calls) for k in mpfa] == [
        (True, False, 5), (False, True, 5)]
    assert [round(k.total_us, 3) for k in mpfa] == [167.423, 11.455]
    assert mpfa[0].avg_us == pytest.approx(33.485, abs=1e-3)


def test_captured_traces_classify_every_kernel_as_attention():
    from mpfa.profiles.breakdown import stage_breakdown
    from mpfa.profiles.kernel_categories import ATTENTION

    for backend, launches in (("fa4-bf16", 5), ("mpfa", 10)):
        stage = stage_breakdown(_captured(backend), "decode", backend)
        shares = {c.category: c.launches for c in stage.categories}
        assert shares[ATTENTION] == launches and sum(shares.values()) == launches
        assert 0 < stage.gpu_us < stage.window_us


def test_mpfa_kernel_regex_picks_the_split_kv_kernel_not_the_merge():
    """ncu profiles the first launch after warmup that matches: for MpFA decode it must be the split-KV kernel
    (an earlier regex also matched the merge, and ncu measured the 4 us merge instead)."""
    import re

    from mpfa.profiles.kernels_mpfa import MpfaAdapter

    names = [k.name for k in kernel_totals(_captured("mpfa"))]
    assert [bool(re.search(MpfaAdapter.kernel_regex, n)) for n in names] == [True, False]

"""Nsight Systems: trace a backend's launches in a child process and total the GPU time per kernel.

The child brackets its timed launches with cudaProfilerStart/Stop and nsys records only that range
(`--capture-range cudaProfilerApi`). `nsys stats --report cuda_gpu_kern_sum --format csv` then sums the
kernels. nsys may record and still fail to write the report; that raises ToolError so the caller can fall back
to torch.profiler.
"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

from ..mpfa_cli.errors import ToolError
from .attention_workload import AttentionWorkload
from .kernel_adapter import KernelAdapter
from .launch_one import launch_arguments
from .profile_result import KernelTotal, TraceResult
from .tools import find_tool, output_tail, parse_number, run_tool

REPORT_SUFFIXES = (".nsys-rep", ".qdrep")  # current and pre-2021.4 nsys
TIMEOUT_S = 540.0


def nsys_profile_command(nsys: str, report_base: Path, target: list[str]) -> list[str]:
    return [nsys, "profile", "--trace", "cuda", "--capture-range", "cudaProfilerApi",
            "--capture-range-end", "stop", "--force-overwrite", "true", "--output", str(report_base), *target]


def nsys_stats_command(nsys: str, report: Path) -> list[str]:
    return [nsys, "stats", "--report", "cuda_gpu_kern_sum", "--format", "csv", "--force-export", "true",
            str(report)]


def parse_kernel_summary(text: str) -> list[KernelTotal]:
    """Kernels in `nsys stats --report cuda_gpu_kern_sum --format csv` output, by total time, largest first."""
    lines = text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if "Total Time (ns)" in line and "Name" in line), None)
    if header_at is None:
        raise ToolError("nsys stats printed no kernel summary (no kernel in the capture range?)")
    totals = []
    for record in csv.DictReader(lines[header_at:]):
        total_ns, calls = parse_number(record.get("Total Time (ns)") or ""), parse_number(record.get("Instances") or "")
        if total_ns is None or not calls:
            continue
        totals.append(KernelTotal(record["Name"], int(calls), total_ns / 1e3))
    return sorted(totals, key=lambda kernel: kernel.total_us, reverse=True)


def report_paths(report_base: Path) -> list[Path]:
    return [report_base.with_name(report_base.name + suffix) for suffix in REPORT_SUFFIXES]


def find_report(report_base: Path) -> Path | None:
    return next((path for path in report_paths(report_base) if path.is_file()), None)


def trace_with_nsys(adapter: KernelAdapter, workload: AttentionWorkload, out_dir: Path, launches: int,
                    warmup: int) -> TraceResult:
    nsys = find_tool("nsys")
    report_base = out_dir / f"nsys-{adapter.name}"
    target = [sys.executable, *launch_arguments(workload, adapter.name, warmup=warmup, launches=launches,
                                                profiler_range=True)]
    for stale in report_paths(report_base):  # a report left by an earlier run must not pass for this one
        stale.unlink(missing_ok=True)
    recorded = run_tool(nsys_profile_command(nsys, report_base, target), TIMEOUT_S)
    report = find_report(report_base)
    if report is None:
        raise ToolError(f"nsys wrote no report (exit status {recorded.returncode}): {output_tail(recorded)}")
    summary = run_tool(nsys_stats_command(nsys, report), TIMEOUT_S)
    if summary.returncode != 0:
        raise ToolError(f"nsys stats failed: {output_tail(summary)}")
    return TraceResult(adapter.name, "nsys", launches, parse_kernel_summary(summary.stdout), note=f"report: {report}")

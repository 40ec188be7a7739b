"""Nsight Compute: profile one launch of a backend's main attention kernel and read its `--page raw` CSV.

ncu runs `launch_one` for the backend in a child process, skips the warm-up launches of the kernels matching
the backend's name regex (`--launch-skip` counts matching launches only) and profiles the next one.
`--csv --page raw --print-units base` prints a header row, a units row, then one row per profiled kernel.
`mpfa profile prefill|decode --ncu-full` profiles the same launch once with `--set full`, exported to a report
(`export_command`), then prints two pages of that report (`import_page`): `--page details` (read by
profiles/ncu_details.py) and `--page source --print-source sass` (read by profiles/ncu_source.py).
"""
from __future__ import annotations

import csv
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..mpfa_cli.errors import ToolError
from .attention_workload import AttentionWorkload
from .kernel_adapter import KernelAdapter
from .launch_one import launch_arguments
from .profile_result import NcuFullResult, NcuKernel, NcuResult
from .tools import find_tool, output_tail, parse_number, run_tool

CORE_METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",  # achieved occupancy
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_static",
    "launch__shared_mem_per_block_dynamic",
    "launch__grid_size",
    "launch__block_size",
)
# Tensor-pipe utilisation. On the H200 ncu reports warpgroup MMA (wgmma: FA4) under the hmma pipe too (77.7%
# for FA4 prefill) and has no separate gmma metric. Dropped, and the run retried, if this ncu does not know it.
TENSOR_METRICS = ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",)
WARMUP_LAUNCHES = 3
TIMEOUT_S = 540.0
REPORT_SUFFIX = ".ncu-rep"  # ncu appends it to an `--export` name without one
DETAILS_PAGE = ("--page", "details", "--print-units", "base")
SOURCE_PAGE = ("--page", "source", "--print-source", "sass")

Parsed = TypeVar("Parsed")

_METRIC_COLUMN = re.compile(r"[a-z0-9]+__[a-z0-9_.]+")
_PERMISSION = "ERR_NVGPUCTRPERM"
_UNKNOWN_METRIC = re.compile(r"(failed to find|unknown|invalid) metrics?[^\n]*", re.IGNORECASE)
# Unit -> (base unit, factor), for output printed without --print-units base.
_TO_BASE = {
    "Kbyte": ("byte", 1e3), "Mbyte": ("byte", 1e6), "Gbyte": ("byte", 1e9), "Tbyte": ("byte", 1e12),
    "usecond": ("nsecond", 1e3), "msecond": ("nsecond", 1e6), "second": ("nsecond", 1e9),
}


def _one_launch(kernel_regex: str, launch_skip: int) -> list[str]:
    """ncu options selecting one launch of the kernels matching `kernel_regex`, at the clocks it runs at.

    The regex is matched against demangled names: ncu's default base, the bare function name, is `device_kernel`
    for every CUTLASS-launched kernel (FA3's FlashAttnFwdSm90 is a template argument of it)."""
    return ["--clock-control", "none", "--target-processes", "all", "--kernel-name-base", "demangled",
            "--kernel-name", f"regex:{kernel_regex}",
            "--launch-skip", str(launch_skip), "--launch-count", "1"]


def ncu_command(ncu: str, kernel_regex: str, launch_skip: int, metrics: tuple[str, ...],
                target: list[str]) -> list[str]:
    """ncu profiling one launch of `target`'s kernels matching `kernel_regex` and printing the raw page of
    `metrics`."""
    return [ncu, *_one_launch(kernel_regex, launch_skip), "--csv", "--print-units", "base",
            "--page", "raw", "--metrics", ",".join(metrics), *target]


def export_command(ncu: str, kernel_regex: str, launch_skip: int, report: Path, target: list[str]) -> list[str]:
    """ncu profiling one launch of `target`'s kernels matching `kernel_regex` with every section of `--set full`,
    into the report `report` + REPORT_SUFFIX (any old one overwritten)."""
    return [ncu, *_one_launch(kernel_regex, launch_skip), "--set", "full", "--import-source", "no",
            "--export", str(report), "--force-overwrite", *target]


def import_command(ncu: str, report: Path, page: tuple[str, ...]) -> list[str]:
    """ncu printing one page of a saved report as CSV (`page`: DETAILS_PAGE or SOURCE_PAGE)."""
    return [ncu, "--import", str(report), "--csv", *page]


def csv_table(text: str) -> tuple[list[str], list[list[str]]]:
    """The header row of ncu's CSV output (any page) and the rows after it; other lines (==PROF==, program
    output) are ignored."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    header_at = next((i for i, row in enumerate(rows) if "ID" in row and "Kernel Name" in row), None)
    if header_at is None:
        raise ToolError("ncu printed no CSV header (no kernel was profiled)")
    return rows[header_at], rows[header_at + 1:]


def parse_raw_csv(text: str) -> list[NcuKernel]:
    """Kernels in ncu's `--csv --page raw` output."""
    header, body = csv_table(text)
    units: dict[str, str] = {}
    if body and body[0][header.index("ID")] == "":
        units = dict(zip(header, body[0]))
        body = body[1:]
    metric_columns = [name for name in header if _METRIC_COLUMN.fullmatch(name)]
    kernels = []
    for row in body:
        record = dict(zip(header, row))
        metrics, metric_units = {}, {}
        for name in metric_columns:
            metrics[name], metric_units[name] = to_base(parse_number(record.get(name, "")), units.get(name, ""))
        kernels.append(NcuKernel(record["Kernel Name"], metrics, metric_units))
    return kernels


def to_base(value: float | None, unit: str) -> tuple[float | None, str]:
    """(2.5, 'Mbyte') -> (2.5e6, 'byte'); units without a scaled form in _TO_BASE are returned as they are."""
    head, slash, rest = unit.partition("/")
    if head not in _TO_BASE:
        return value, unit
    base, factor = _TO_BASE[head]
    return (None if value is None else value * factor), base + slash + rest


class UnknownMetric(ToolError):
    """This ncu (or this GPU) does not know one of the requested metrics."""


def check_output(stdout: str, stderr: str, kernel_regex: str) -> None:
    """Turn ncu's failure modes into one-line ToolErrors."""
    text = stdout + "\n" + stderr
    if _PERMISSION in text:
        raise ToolError("ncu may not read the GPU performance counters (ERR_NVGPUCTRPERM): run it as root or "
                        "load the NVIDIA driver with NVreg_RestrictProfilingToAdminUsers=0")
    unknown_metric = _UNKNOWN_METRIC.search(text)
    if unknown_metric:
        raise UnknownMetric(unknown_metric.group(0).strip())
    if "No kernels were profiled" in text:
        raise ToolError(f"ncu profiled no kernel matching regex {kernel_regex!r}")


def profile_with_ncu(adapter: KernelAdapter, workload: AttentionWorkload, out_dir: Path) -> NcuResult:
    """Profile one warm launch of `adapter`'s kernel; failures are returned in `NcuResult.error`.

    ncu's raw output is kept as `out_dir/ncu-<backend>.csv`.
    """
    result = NcuResult(adapter.name, [])
    csv_path = out_dir / f"ncu-{adapter.name}.csv"
    try:
        try:
            result.kernels = run_ncu(adapter, workload, CORE_METRICS + TENSOR_METRICS, csv_path, parse_raw_csv,
                                     result)
        except UnknownMetric:
            result.dropped_metrics = list(TENSOR_METRICS)
            result.kernels = run_ncu(adapter, workload, CORE_METRICS, csv_path, parse_raw_csv, result)
    except ToolError as exc:
        result.error = str(exc)
    return result


def _launch_target(adapter: KernelAdapter, workload: AttentionWorkload) -> list[str]:
    """The child process ncu profiles: `launch_one` for `adapter`, warm-up launches first."""
    return [sys.executable, *launch_arguments(workload, adapter.name, warmup=WARMUP_LAUNCHES, launches=1,
                                              profiler_range=False)]


def run_ncu(adapter: KernelAdapter, workload: AttentionWorkload, metrics: tuple[str, ...], csv_path: Path,
            parse: Callable[[str], Parsed], result: NcuResult) -> Parsed:
    """Run `launch_one` for `adapter` under ncu, reading the raw page of `metrics`, and `parse` its CSV.

    The command goes into `result.command` before it runs, so a failed run still says what ran; ncu's stdout is
    kept as `csv_path`. Every failure is a one-line ToolError.
    """
    result.command = ncu_command(find_tool("ncu"), adapter.kernel_regex, WARMUP_LAUNCHES, metrics,
                                 _launch_target(adapter, workload))
    process = run_tool(result.command, TIMEOUT_S)
    csv_path.write_text(process.stdout)
    check_output(process.stdout, process.stderr, adapter.kernel_regex)
    try:
        return parse(process.stdout)
    except ToolError:
        raise ToolError(f"ncu produced no report: {output_tail(process)}") from None


def export_report(adapter: KernelAdapter, workload: AttentionWorkload, report: Path,
                  result: NcuFullResult) -> Path:
    """Profile `launch_one` for `adapter` under ncu's `--set full` into a report; its path (`report` +
    REPORT_SUFFIX). The command goes into `result.command` before it runs; every failure is a one-line ToolError.
    """
    path = report.with_name(report.name + REPORT_SUFFIX)
    path.unlink(missing_ok=True)  # a failed run must not leave an older report to read
    result.command = export_command(find_tool("ncu"), adapter.kernel_regex, WARMUP_LAUNCHES, report,
                                    _launch_target(adapter, workload))
    process = run_tool(result.command, TIMEOUT_S)
    check_output(process.stdout, process.stderr, adapter.kernel_regex)
    if not path.is_file():
        raise ToolError(f"ncu produced no report: {output_tail(process)}")
    return path


def import_page(report: Path, page: tuple[str, ...], csv_path: Path, parse: Callable[[str], Parsed]) -> Parsed:
    """Print one page of a saved report as CSV (kept as `csv_path`) and `parse` it; failures are one-line
    ToolErrors."""
    process = run_tool(import_command(find_tool("ncu"), report, page), TIMEOUT_S)
    csv_path.write_text(process.stdout)
    if process.returncode != 0:
        raise ToolError(f"ncu could not print the {page[1]} page of {report.name}: {output_tail(process)}")
    try:
        return parse(process.stdout)
    except ToolError as exc:
        raise ToolError(f"the {page[1]} page of {report.name}: {exc}") from None

"""Render profiles as sections: a rich table per section, or plain fixed-width text when rich is unavailable."""
from __future__ import annotations

from dataclasses import dataclass

from .profile_result import OK, BackendResult, NcuFullResult, NcuKernel, NcuLoop, ProfileResult

_DASH = "-"
_NAME_WIDTH = 80  # keeps e.g. FA4's '...flash_fwd_sm90FlashAttentionForwardSm90' visible
LOG_WIDTH = 200  # rich's 80-column default would fold the tables when stdout is a log file
_TRACE_TOP = 5  # kernels shown per backend in the trace section
_STALL_TOP = 4  # stall reasons shown per loop
_PRODUCER_TOP = 3  # scoreboard producers shown per loop
_TEXT_COLUMNS = {"kernel", "kernel / note", "source", "category", "loop", "top stall reasons",
                 "scoreboard waits on", "hottest instructions"}  # left-aligned like the first column


@dataclass(frozen=True)
class Section:
    title: str
    headers: list[str]
    rows: list[list[str]]
    notes: list[str]
    left_aligned: bool = False  # every column holds text, not numbers


def num_cell(value: float | None, digits: int = 1) -> str:
    return _DASH if value is None else f"{value:,.{digits}f}"


def short_name(name: str) -> str:
    return name if len(name) <= _NAME_WIDTH else name[:_NAME_WIDTH - 3] + "..."


def _setup_s(row: BackendResult) -> float | None:
    """Input building + planning + first call: where the JIT compiles happen."""
    parts = (row.prepare_s, row.first_call_s)
    return None if None in parts else sum(parts)


def timing_section(result: ProfileResult) -> Section:
    w, peaks = result.workload, result.peaks
    headers = ["backend", "median ms", "p20-p80 ms", "TFLOPS", "% peak", "GB/s", "% copy BW", "GB needed",
               f"x vs {result.reference}", "setup s", "kernel / note"]
    rows = []
    for row in result.backends:
        d = result.derived(row)
        gb_needed = num_cell(row.bytes_needed / 1e9, 3) if row.bytes_needed is not None else _DASH
        if row.status != OK:
            rows.append([row.backend] + [_DASH] * 6 + [gb_needed, _DASH, _DASH, f"error: {row.error}"])
            continue
        t = row.timing
        rows.append([row.backend, num_cell(t.median_ms, 3), f"{t.p20_ms:.3f}-{t.p80_ms:.3f}", num_cell(d.tflops),
                     f"{num_cell(d.pct_compute_peak)} {row.math_dtype}", num_cell(d.gbps, 0),
                     num_cell(d.pct_bandwidth_peak), gb_needed, num_cell(d.speedup, 2), num_cell(_setup_s(row)),
                     row.description])
    notes = [f"peaks measured in this run: copy {num_cell(peaks.copy_gbps, 0)} GB/s (read+write), "
             f"BF16 GEMM {num_cell(peaks.bf16_tflops)} TFLOPS, FP8 GEMM {num_cell(peaks.fp8_tflops)} TFLOPS"]
    notes += [f"peak {name} not measured: {error}" for name, error in peaks.errors.items()]
    notes.append(f"FLOPs {w.flops() / 1e12:.3f} T ({'causal, ' if w.kind == 'prefill' else ''}"
                 f"QK^T + PV only); GB needed = Q + O + K + V once, at each backend's storage size")
    return Section(f"{w.label()} on {result.device}", headers, rows, notes)


def _smem_kb(kernel: NcuKernel) -> float | None:
    parts = [kernel.metrics.get(f"launch__shared_mem_per_block_{kind}") for kind in ("static", "dynamic")]
    return None if all(part is None for part in parts) else sum(part or 0 for part in parts) / 1024


# (header, ncu metric, factor from its base unit, decimals)
_NCU_COLUMNS = (
    ("time us", "gpu__time_duration.sum", 1e-3, 1),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1, 1),
    ("tensor pipe %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active", 1, 1),
    ("DRAM rd MB", "dram__bytes_read.sum", 1e-6, 1),
    ("DRAM wr MB", "dram__bytes_write.sum", 1e-6, 1),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed", 1, 1),
    ("occupancy %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1, 1),
    ("regs", "launch__registers_per_thread", 1, 0),
)


def ncu_section(result: ProfileResult) -> Section:
    headers = ["backend", "kernel", *(column[0] for column in _NCU_COLUMNS), "smem KB"]
    rows, notes = [], []
    for ncu in result.ncu:
        if ncu.error:
            rows.append([ncu.backend, f"error: {ncu.error}"] + [_DASH] * (len(headers) - 2))
        if ncu.dropped_metrics:
            notes.append(f"{ncu.backend}: this ncu lacks {', '.join(ncu.dropped_metrics)}")
        for kernel in ncu.kernels:
            values = [kernel.metrics.get(metric) for _, metric, _, _ in _NCU_COLUMNS]
            cells = [num_cell(None if value is None else value * factor, digits)
                     for value, (_, _, factor, digits) in zip(values, _NCU_COLUMNS)]
            rows.append([ncu.backend, short_name(kernel.name), *cells, num_cell(_smem_kb(kernel))])
    return Section("Nsight Compute, one warm launch of the main attention kernel", headers, rows, notes)


def ncu_full_section(result: ProfileResult) -> Section:
    """The `--ncu-full` bound summaries side by side: a row per fact, a column per backend's kernel."""
    columns = [column for ncu in result.ncu_full for column in _ncu_full_columns(ncu)]
    labels = list(dict.fromkeys(label for _, _, facts in columns for label in facts))
    rows = [["kernel", *(first for _, first, _ in columns)]]
    rows += [[label, *(facts.get(label, _DASH) for _, _, facts in columns)] for label in labels]
    return Section("Nsight Compute --set full: what bounds each kernel", ["fact", *(name for name, _, _ in columns)],
                   rows, [], left_aligned=True)


def _ncu_full_columns(ncu: NcuFullResult) -> list[tuple[str, str, dict[str, str]]]:
    """(header, first cell, facts) per kernel of one backend; a single error column when its run failed."""
    if ncu.error:
        return [(ncu.backend, f"error: {ncu.error}", {})]
    return [(ncu.backend, short_name(summary.kernel), dict(summary.rows)) for summary in ncu.kernels]


def ncu_source_section(results: list[NcuFullResult]) -> Section:
    """The `--ncu-full` source-page summaries: a row per hot loop of each backend's kernel, then the rest."""
    headers = ["backend", "loop", "instructions", "executions", "% of samples", "top stall reasons",
               "scoreboard waits on", "hottest instructions"]
    rows, notes = [], []
    for ncu in results:
        if error := ncu.error or ncu.loops_error:
            rows.append([ncu.backend, f"error: {error}"] + [_DASH] * (len(headers) - 2))
        for index, kernel in enumerate(ncu.loops, 1):
            label = ncu.backend if len(ncu.loops) == 1 else f"{ncu.backend} #{index}"
            notes.append(f"{label}: {short_name(kernel.kernel)}, {kernel.samples:,} warp samples")
            rows += [_loop_row(label, loop) for loop in [*kernel.loops, kernel.rest]]
    notes.append("loop: rows of the source page (from 0) and offsets from the kernel's first instruction; "
                 "% of samples: of the kernel's; stall reasons and hottest instructions: % of the loop's samples "
                 "(unattributed: samples ncu names no reason for); scoreboard waits on: the loop's short and long "
                 "scoreboard samples by the variable-latency instruction whose result they wait for, % of the "
                 "loop's samples (other: none found, e.g. a register's reuse)")
    return Section("Nsight Compute source counters: where each kernel's warps wait", headers, rows, notes)


def _loop_row(label: str, loop: NcuLoop) -> list[str]:
    where = ("rest" if loop.rows is None or loop.offsets is None else
             f"rows {loop.rows[0]}-{loop.rows[1]} (+{loop.offsets[0]:#x}..+{loop.offsets[1]:#x})")
    reasons = ", ".join(f"{reason} {share:.0f}%" for reason, share in loop.stalls[:_STALL_TOP])
    producers = ", ".join(f"{opcode} {share:.0f}%" for opcode, share in loop.scoreboard[:_PRODUCER_TOP])
    hottest = "; ".join(f"{hot.sass} ({hot.share:.1f}% {hot.reason})" for hot in loop.hottest)
    executions = _DASH if loop.executions is None else f"{loop.executions:,}"
    return [label, where, f"{loop.instructions:,}", executions, num_cell(loop.share), reasons or _DASH,
            producers or _DASH, hottest or _DASH]


def trace_section(result: ProfileResult) -> Section:
    headers = ["backend", "source", "kernel", "calls", "total us", "avg us", "us per op"]
    rows, notes = [], []
    for trace in result.traces:
        if trace.error:
            rows.append([trace.backend, trace.source, f"error: {trace.error}"] + [_DASH] * 4)
        for kernel in trace.kernels[:_TRACE_TOP]:
            rows.append([trace.backend, trace.source, short_name(kernel.name), str(kernel.calls),
                         num_cell(kernel.total_us), num_cell(kernel.avg_us),
                         num_cell(kernel.total_us / trace.launches)])
        if trace.note:
            notes.append(f"{trace.backend}: {trace.note}")
    return Section("GPU kernels per backend (trace totals)", headers, rows, notes)


def sections(result: ProfileResult) -> list[Section]:
    found = [timing_section(result)]
    if result.ncu:
        found.append(ncu_section(result))
    if result.traces:
        found.append(trace_section(result))
    if result.ncu_full:
        found += [ncu_full_section(result), ncu_source_section(result.ncu_full)]
    return found


def format_sections(found: list[Section]) -> str:
    """Sections as plain fixed-width text."""
    blocks = []
    for section in found:
        widths = [max(len(cell) for cell in column) for column in zip(section.headers, *section.rows)]
        lines = [section.title] + ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                                   for row in [section.headers, *section.rows]]
        blocks.append("\n".join(lines + section.notes))
    return "\n\n".join(blocks)


def render_sections(found: list[Section], console: object | None = None) -> None:
    """Print sections with rich (to `console`, a rich Console, if given), or as plain text if rich fails."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        out = console if console is not None else Console()
        for section in found:
            table = Table(title=section.title, title_justify="left")
            for index, header in enumerate(section.headers):
                left = section.left_aligned or index == 0 or header in _TEXT_COLUMNS
                table.add_column(header, justify="left" if left else "right")
            for row in section.rows:
                table.add_row(*(Text(cell) for cell in row))
            out.print(table)
            for note in section.notes:
                out.print(Text(note, style="dim"))
    except Exception:  # a terminal rich cannot drive must not lose the numbers
        print(format_sections(found))


def render_profile(result: ProfileResult, console: object | None = None) -> None:
    render_sections(sections(result), console)

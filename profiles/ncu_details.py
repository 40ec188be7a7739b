"""Read Nsight Compute's `--set full --csv --page details` output and say what bounds each kernel.

    mpfa profile ncu-details FILE [FILE ...]

The details page has one row per (kernel ID, section, metric) and one per rule result (a row with an empty Metric
Name). `mpfa profile prefill|decode --ncu-full` profiles each backend's kernel once with `--set full` into a report,
then prints and summarises this page and the source page of it (`profile_full_with_ncu`; the source page is read by
profiles/ncu_source.py); `--ncu` reads the raw page instead (profiles/ncu.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from ..mpfa_cli.errors import ToolError
from .attention_workload import AttentionWorkload
from .kernel_adapter import KernelAdapter
from .ncu import DETAILS_PAGE, SOURCE_PAGE, csv_table, export_report, import_page, to_base
from .ncu_source import hot_loops, parse_source_csv
from .profile_sections import Section, short_name
from .profile_result import NcuBoundSummary, NcuFullResult
from .tools import parse_number

REQUIRED_COLUMNS = ("ID", "Kernel Name", "Block Size", "Grid Size", "Section Name", "Metric Name", "Metric Unit",
                    "Metric Value")
NA = "n/a"

SOL = "GPU Speed Of Light Throughput"
MEMORY_LEVELS = {"L1/TEX": "L1/TEX Cache Throughput", "L2": "L2 Cache Throughput", "DRAM": "DRAM Throughput"}
SCHEDULER = "Scheduler Statistics"
LAUNCH = "Launch Statistics"
OCCUPANCY = "Occupancy"
# "Block Limit <key>" metrics of the Occupancy section: how many blocks per SM each resource allows.
BLOCK_LIMITS = {"Registers": "registers", "Shared Mem": "shared memory", "Warps": "warps", "SM": "SM",
                "Barriers": "barriers"}

_CONFLICT_RULE = re.compile(r"conflict", re.IGNORECASE)
_CONFLICT_ACCESS = re.compile(r"\bfor (shared \w+)")
_CONFLICT_WAYS = re.compile(r"(\d+(?:\.\d+)?)\s*-\s*way bank conflict")
_CONFLICT_SHARE = re.compile(r"(\d+(?:\.\d+)?)% of the overall\b.*?\bwavefronts")
_EXCESS_RULE = "UncoalescedSharedAccess"
_EXCESS_SHARE = re.compile(r"([\d,]+) excessive wavefronts \((\d+(?:\.\d+)?)% of the total ([\d,]+) wavefronts\)")
NO_RULE = "none reported (ncu's rule did not fire)"


@dataclass(frozen=True)
class NcuRule:
    section: str
    name: str
    speedup: float | None  # ncu's estimated speedup, %
    description: str


@dataclass
class NcuDetails:
    kernel: str
    block: tuple[int, ...]
    grid: tuple[int, ...]
    metrics: dict[tuple[str, str], tuple[str, float | str]]  # (section, metric) -> (unit, value)
    rules: list[NcuRule] = field(default_factory=list)

    def number(self, section: str, metric: str) -> float | None:
        value = self.metrics.get((section, metric), ("", None))[1]
        return value if isinstance(value, float) else None


def parse_details(text: str) -> list[NcuDetails]:
    """One entry per profiled kernel (rows grouped by ID); values that are not numbers stay strings."""
    header, body = csv_table(text)
    missing = [column for column in REQUIRED_COLUMNS if column not in header]
    if missing:
        raise ToolError(f"not an ncu details page: the CSV header lacks {', '.join(map(repr, missing))}")
    kernels: dict[str, NcuDetails] = {}
    for row in body:
        record = dict.fromkeys(header, "") | dict(zip(header, row))  # metric rows omit the trailing rule columns
        kernel = kernels.setdefault(record["ID"], NcuDetails(
            record["Kernel Name"], _dims(record["Block Size"]), _dims(record["Grid Size"]), {}))
        if record["Metric Name"]:
            value = record["Metric Value"]
            number = parse_number(value)
            kernel.metrics[record["Section Name"], record["Metric Name"]] = (
                record["Metric Unit"], value if number is None else number)
        elif record.get("Rule Name"):
            kernel.rules.append(NcuRule(record["Section Name"], record["Rule Name"],
                                        parse_number(record.get("Estimated Speedup", "")),
                                        record.get("Rule Description", "")))
    if not kernels:
        raise ToolError("ncu's CSV has a header but no kernel rows")
    for kernel_id, kernel in kernels.items():
        if not kernel.metrics:
            raise ToolError(f"kernel ID {kernel_id} ({short_name(kernel.kernel)}) has no metric rows")
    return list(kernels.values())


def _dims(text: str) -> tuple[int, ...]:
    """'(128, 1, 1)' -> (128, 1, 1)."""
    return tuple(int(number) for number in re.findall(r"\d+", text))


def bound_summary(details: NcuDetails) -> list[tuple[str, str]]:
    """(label, text) rows: the throughputs, issue and occupancy facts that say what bounds the kernel."""
    number = details.number
    return [
        ("launch", f"grid {details.grid}, block {details.block}"),
        ("duration", _duration(details)),
        ("SM (compute) throughput", _percent(number(SOL, "Compute (SM) Throughput"))),
        ("memory throughput", _memory(details)),
        ("issue slots busy", _percent(number("Compute Workload Analysis", "Issue Slots Busy"))),
        ("active warps per scheduler", _count(number(SCHEDULER, "Active Warps Per Scheduler"), 2)),
        ("eligible warps per scheduler", _count(number(SCHEDULER, "Eligible Warps Per Scheduler"), 2)),
        ("cycles with no eligible warp", _percent(number(SCHEDULER, "No Eligible"))),
        ("warp cycles per issued instruction",
         _count(number("Warp State Statistics", "Warp Cycles Per Issued Instruction"), 2)),
        ("occupancy, theoretical / achieved", f"{_percent(number(OCCUPANCY, 'Theoretical Occupancy'))} / "
                                              f"{_percent(number(OCCUPANCY, 'Achieved Occupancy'))}"),
        ("occupancy limiter", _limiter(details)),
        ("registers per thread", _count(number(LAUNCH, "Registers Per Thread"), 0)),
        ("dynamic shared memory per block", _bytes(details, LAUNCH, "Dynamic Shared Memory Per Block")),
        ("executed instructions", _count(number("Instruction Statistics", "Executed Instructions"), 0)),
        ("shared-memory bank conflicts", _bank_conflicts(details.rules)),
        ("excess shared-memory wavefronts", _excess_wavefronts(details.rules)),
    ]


def _percent(value: float | None) -> str:
    return NA if value is None else f"{value:.2f}%"


def _count(value: float | None, digits: int) -> str:
    return NA if value is None else f"{value:,.{digits}f}"


def _duration(details: NcuDetails) -> str:
    unit, value = details.metrics.get((SOL, "Duration"), ("", None))
    if not isinstance(value, float):
        return NA
    nanoseconds, unit = to_base(value, unit)
    return f"{nanoseconds / 1e6:.3f} ms" if unit in ("ns", "nsecond") else f"{value:,} {unit}"


def _bytes(details: NcuDetails, section: str, metric: str) -> str:
    unit, value = details.metrics.get((section, metric), ("", None))
    if not isinstance(value, float):
        return NA
    count, unit = to_base(value, unit)
    return f"{count:,.0f} B ({count / 1024:,.1f} KiB)" if unit.startswith("byte") else f"{value:,} {unit}"


def _memory(details: NcuDetails) -> str:
    """Memory throughput % of peak, and which of L1/TEX, L2 and DRAM is busiest."""
    levels = {level: value for level, metric in MEMORY_LEVELS.items()
              if (value := details.number(SOL, metric)) is not None}
    text = _percent(details.number(SOL, "Memory Throughput"))
    if not levels:
        return text
    busiest = max(levels, key=levels.__getitem__)
    return f"{text} (highest {busiest}: " + ", ".join(f"{level} {_percent(v)}" for level, v in levels.items()) + ")"


def _limiter(details: NcuDetails) -> str:
    """The resource with the smallest block limit per SM (ties name each)."""
    limits = {label: value for key, label in BLOCK_LIMITS.items()
              if (value := details.number(OCCUPANCY, f"Block Limit {key}")) is not None}
    if not limits:
        return NA
    least = min(limits.values())
    names = " and ".join(label for label, value in limits.items() if value == least)
    others = ", ".join(f"{label} {value:.0f}" for label, value in limits.items())
    return f"{names}: {least:.0f} blocks per SM (block limits: {others})"


def _bank_conflicts(rules: list[NcuRule]) -> str:
    found = [rule for rule in rules if _CONFLICT_RULE.search(rule.name)]
    return "; ".join(map(_conflict_text, found)) or NO_RULE


def _conflict_text(rule: NcuRule) -> str:
    access, ways, share = (match.group(1) if (match := pattern.search(rule.description)) else None
                           for pattern in (_CONFLICT_ACCESS, _CONFLICT_WAYS, _CONFLICT_SHARE))
    speedup = "" if rule.speedup is None else f" (estimated speedup {rule.speedup:.2f}%)"
    return (f"{access or 'shared memory'}: {ways or NA}-way, {share or NA}% of the wavefronts are bank conflicts"
            f"{speedup}")


def _excess_wavefronts(rules: list[NcuRule]) -> str:
    """Shared-memory wavefronts beyond one per request (conflicts and uncoalesced accesses, loads and stores)."""
    for rule in rules:
        if rule.name == _EXCESS_RULE and (match := _EXCESS_SHARE.search(rule.description)):
            excess, share, total = match.groups()
            return f"{share}% ({int(excess.replace(',', '')):,} of {int(total.replace(',', '')):,})"
    return NO_RULE


def profile_full_with_ncu(adapter: KernelAdapter, workload: AttentionWorkload, out_dir: Path) -> NcuFullResult:
    """What bounds one warm launch of `adapter`'s kernel (details page) and where its warps wait (source page),
    from one ncu `--set full` run.

    Kept in `out_dir`: the report `ncu-full-<backend>.ncu-rep`, its details page `ncu-full-<backend>.csv` and its
    source page `ncu-source-<backend>.csv`. Failures are returned in `NcuFullResult.error`, or in `loops_error`
    when only the source page failed (the bound summary is kept).
    """
    result = NcuFullResult(adapter.name, [])
    try:
        report = export_report(adapter, workload, out_dir / f"ncu-full-{adapter.name}", result)
        details = import_page(report, DETAILS_PAGE, out_dir / f"ncu-full-{adapter.name}.csv", parse_details)
    except ToolError as exc:
        result.error = str(exc)
        return result
    result.kernels = [NcuBoundSummary(kernel.kernel, bound_summary(kernel)) for kernel in details]
    try:
        pages = import_page(report, SOURCE_PAGE, out_dir / f"ncu-source-{adapter.name}.csv", parse_source_csv)
        result.loops = [hot_loops(page) for page in pages]
    except ToolError as exc:
        result.loops_error = str(exc)
    return result


def summary_section(details: NcuDetails) -> Section:
    return Section(short_name(details.kernel), ["fact", "value"], [list(row) for row in bound_summary(details)], [],
                   left_aligned=True)

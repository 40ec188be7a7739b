"""What a profile run produces, the figures derived from it, and its JSON form."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .attention_workload import AttentionWorkload
from .timing import TimingSummary
from .torch_trace import KernelTotal

OK, ERROR = "ok", "error"


@dataclass
class Peaks:
    """Device ceilings measured in the same run: device-to-device copy and dense GEMM rates."""

    copy_gbps: float | None = None  # (bytes read + bytes written) / time
    bf16_tflops: float | None = None
    fp8_tflops: float | None = None
    errors: dict[str, str] = field(default_factory=dict)

    def tflops_for(self, math_dtype: str) -> float | None:
        return {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops}.get(math_dtype)


@dataclass
class BackendResult:
    backend: str
    status: str  # OK or ERROR
    math_dtype: str
    flops: int
    bytes_needed: float | None
    description: str = ""
    error: str | None = None
    error_detail: str | None = None  # traceback, kept in the JSON only
    num_sets: int = 0
    set_bytes: int = 0
    prepare_s: float | None = None  # wall time to build the inputs and plan (FlashInfer JIT-compiles here)
    first_call_s: float | None = None  # wall time of the first call (FA4 JIT-compiles here)
    times_ms: list[float] = field(default_factory=list)
    timing: TimingSummary | None = None


@dataclass(frozen=True)
class Derived:
    """Rates from the median time; None where a figure or its peak is missing."""

    tflops: float | None
    pct_compute_peak: float | None
    gbps: float | None
    pct_bandwidth_peak: float | None
    speedup: float | None  # reference median / this median


def derive(row: BackendResult, peaks: Peaks, reference: BackendResult | None) -> Derived:
    if row.timing is None:
        return Derived(None, None, None, None, None)
    seconds = row.timing.median_ms / 1e3
    tflops = row.flops / seconds / 1e12
    gbps = row.bytes_needed / seconds / 1e9 if row.bytes_needed is not None else None
    compute_peak = peaks.tflops_for(row.math_dtype)
    speedup = (reference.timing.median_ms / row.timing.median_ms
               if reference is not None and reference.timing is not None else None)
    return Derived(tflops, _percent(tflops, compute_peak), gbps, _percent(gbps, peaks.copy_gbps), speedup)


def _percent(value: float | None, peak: float | None) -> float | None:
    return 100 * value / peak if value is not None and peak else None


@dataclass
class NcuKernel:
    name: str
    metrics: dict[str, float | None]  # in the units of `units` (base units: byte, ns or nsecond, %, ...)
    units: dict[str, str]


@dataclass
class NcuResult:
    backend: str
    command: list[str]
    kernels: list[NcuKernel] = field(default_factory=list)
    dropped_metrics: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class NcuBoundSummary:
    """What bounds one kernel: `ncu_details.bound_summary`'s (label, text) rows."""

    kernel: str
    rows: list[tuple[str, str]]


@dataclass
class NcuHotInstruction:
    sass: str  # shortened
    share: float  # % of its loop's samples
    reason: str  # its most sampled stall reason


@dataclass
class NcuLoop:
    """One hot loop of a kernel's SASS, or (`rows` None) the rest of the kernel: `ncu_source.hot_loops`."""

    rows: tuple[int, int] | None  # first and last instruction: rows of the source page, from 0
    offsets: tuple[int, int] | None  # their addresses less the kernel's first instruction's
    instructions: int
    executions: int | None  # warp-level executions of the loop's first instruction: once per iteration
    share: float  # % of the kernel's warp samples
    stalls: list[tuple[str, float]]  # (reason, % of this loop's samples), most sampled first
    hottest: list[NcuHotInstruction]
    # (opcode of the variable-latency instruction whose result a scoreboard stall waits for, % of this loop's
    # samples), most first: `ncu_source.scoreboard_producers`
    scoreboard: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class NcuKernelLoops:
    """Where one kernel's warps wait: its hot loops and the rest, from ncu's source page."""

    kernel: str
    samples: int  # warp samples in the whole kernel
    loops: list[NcuLoop]
    rest: NcuLoop


@dataclass
class NcuFullResult:
    """`--ncu-full`: one warm launch of a backend's kernel under ncu's `--set full`, summarised from its details
    page (`kernels`) and its source page (`loops`). `error`: the run or the details page failed;
    `loops_error`: only the source page did."""

    backend: str
    command: list[str]
    kernels: list[NcuBoundSummary] = field(default_factory=list)
    error: str | None = None
    loops: list[NcuKernelLoops] = field(default_factory=list)
    loops_error: str | None = None


@dataclass
class TraceResult:
    backend: str
    source: str  # "nsys" or "torch.profiler"
    launches: int  # calls of the backend's attention op inside the trace
    kernels: list[KernelTotal] = field(default_factory=list)
    note: str = ""
    error: str | None = None


@dataclass
class ProfileResult:
    workload: AttentionWorkload
    reference: str
    device: str
    versions: dict[str, str]
    peaks: Peaks
    backends: list[BackendResult]
    ncu: list[NcuResult] = field(default_factory=list)
    traces: list[TraceResult] = field(default_factory=list)
    ncu_full: list[NcuFullResult] = field(default_factory=list)
    json_path: str | None = None

    def row(self, backend: str) -> BackendResult | None:
        return next((row for row in self.backends if row.backend == backend), None)

    def derived(self, row: BackendResult) -> Derived:
        return derive(row, self.peaks, self.row(self.reference))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for row_data, row in zip(data["backends"], self.backends):
            row_data["derived"] = asdict(self.derived(row))
        return data

    def write_json(self, out_dir: Path) -> Path:
        w = self.workload
        path = out_dir / f"profile-{w.kind}-s{w.seq}-b{w.batch}-h{w.q_heads}x{w.kv_heads}-d{w.head_dim}.json"
        self.json_path = str(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

"""`mpfa profile prefill|decode`: time each backend's attention kernel side by side in one process.

For every backend: build its inputs (several rotated sets), call once (JIT compile), time with CUDA events and
report the median next to the copy/GEMM peaks measured in the same run. Optionally re-run each kernel under
Nsight Compute (`ncu=True`: a short metric list; `ncu_full=True`: `--set full`, summarised as what bounds it
and where its warps wait) and trace it with Nsight Systems, falling back to torch.profiler (`nsys=True`).
One backend failing (import error, JIT failure) becomes an error row; the others still run.

    mpfa profile prefill --seq 16384 --backend fa4-bf16,flashinfer-fp8,mpfa --out OUT
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from ..mpfa_cli.errors import ProfileError, ToolError
from . import ncu as ncu_profiler
from . import ncu_details
from . import nsys as nsys_tracer
from .attention_workload import AttentionWorkload
from .inputs import DEFAULT_L2_BYTES, DEFAULT_SEED, rotation_sets
from .kernel_adapter import KernelAdapter, PreparedKernel
from .peaks import measure_peaks
from .registry import REFERENCE_BACKEND, adapter_for
from .profile_result import ERROR, OK, BackendResult, ProfileResult, TraceResult
from .timing import measure, summarize
from .torch_trace import record_trace

if TYPE_CHECKING:
    import torch

Progress = Callable[[str], None]

MEMORY_FRACTION = 0.5  # of free device memory, for one backend's rotated input sets
TRACE_LAUNCHES = 5
TRACE_WARMUP = 2
VERSIONED_PACKAGES = ("torch", "flash-attn-4", "nvidia-cutlass-dsl", "flashinfer-python")


def run_profile(kind: str, seq: int, batch: int, heads: tuple[int, int], head_dim: int, backends: list[str],
                ncu: bool, nsys: bool, out_dir: Path, progress: Progress | None = None,
                ncu_full: bool = False) -> ProfileResult:
    """Profile `backends` on one attention workload; writes the raw result JSON into `out_dir`.

    Raises ValueError for bad arguments and ProfileError when there is no CUDA device.
    """
    workload = AttentionWorkload(kind, seq, batch, heads[0], heads[1], head_dim)
    adapters = [adapter_for(name) for name in dict.fromkeys(backends)]
    if not adapters:
        raise ValueError("no backend given")
    say = progress or (lambda _message: None)

    import torch

    if not torch.cuda.is_available():
        raise ProfileError("no CUDA device: `mpfa profile` runs the attention kernels on a GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    out_dir.mkdir(parents=True, exist_ok=True)

    say("measuring copy bandwidth and BF16/FP8 GEMM peaks")
    peaks = measure_peaks(device)
    torch.cuda.empty_cache()
    rows = [benchmark_backend(adapter, workload, device, say) for adapter in adapters]
    result = ProfileResult(workload, REFERENCE_BACKEND[kind], torch.cuda.get_device_name(device), _versions(),
                           peaks, rows)
    timed = [adapter for adapter, row in zip(adapters, rows) if row.status == OK]
    if nsys:
        result.traces = trace_backends(timed, workload, device, out_dir, say)
    if ncu:
        for adapter in timed:
            say(f"{adapter.name}: Nsight Compute (a child process; compiles again)")
            result.ncu.append(ncu_profiler.profile_with_ncu(adapter, workload, out_dir))
    if ncu_full:
        for adapter in timed:
            say(f"{adapter.name}: Nsight Compute --set full (a child process; compiles again; takes minutes)")
            result.ncu_full.append(ncu_details.profile_full_with_ncu(adapter, workload, out_dir))
    result.write_json(out_dir)
    return result


def _rotated_sets(adapter: KernelAdapter, workload: AttentionWorkload, device: "torch.device") -> tuple[int, int]:
    """(bytes per input set, number of sets) for `adapter` on this device."""
    import torch

    set_bytes = adapter.set_bytes(workload)
    free_bytes, _ = torch.cuda.mem_get_info(device)
    l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", DEFAULT_L2_BYTES)
    return set_bytes, rotation_sets(set_bytes, l2_bytes, MEMORY_FRACTION * free_bytes)


def _one_line(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def benchmark_backend(adapter: KernelAdapter, workload: AttentionWorkload, device: "torch.device",
                      say: Progress) -> BackendResult:
    import torch

    row = BackendResult(adapter.name, OK, adapter.math_dtype, workload.flops(), None)
    prepared: PreparedKernel | None = None
    try:
        row.bytes_needed = workload.bytes_needed(adapter.tensor_format)
        row.set_bytes, row.num_sets = _rotated_sets(adapter, workload, device)
        say(f"{adapter.name}: building {row.num_sets} input set(s) of {row.set_bytes / 1e9:.2f} GB")
        started = time.perf_counter()
        prepared = adapter.prepare(workload, row.num_sets, device, DEFAULT_SEED)
        torch.cuda.synchronize()
        row.prepare_s, row.description = time.perf_counter() - started, prepared.description
        say(f"{adapter.name}: first call (JIT-compiles on first use), then timing")
        measurement = measure(prepared.run, prepared.num_sets)
        row.first_call_s, row.times_ms = measurement.first_call_s, measurement.times_ms
        row.timing = summarize(measurement.times_ms)
        say(f"{adapter.name}: median {row.timing.median_ms:.3f} ms")
    except Exception as exc:  # any backend failure becomes its row's error; the other backends still run
        row.status, row.error, row.error_detail = ERROR, _one_line(exc), traceback.format_exc()
        say(f"{adapter.name}: {row.error}")
    finally:
        del prepared
        torch.cuda.empty_cache()
    return row


def trace_backends(adapters: list[KernelAdapter], workload: AttentionWorkload, device: "torch.device",
                   out_dir: Path, say: Progress) -> list[TraceResult]:
    """nsys per backend; after the first nsys failure, torch.profiler in this process for the rest."""
    traces: list[TraceResult] = []
    nsys_failure: str | None = None
    for adapter in adapters:
        if nsys_failure is None:
            say(f"{adapter.name}: Nsight Systems trace (a child process)")
            try:
                traces.append(nsys_tracer.trace_with_nsys(adapter, workload, out_dir, TRACE_LAUNCHES, TRACE_WARMUP))
                continue
            except ToolError as exc:
                nsys_failure = str(exc)
                say(f"nsys failed ({nsys_failure}); falling back to torch.profiler (CUPTI)")
        traces.append(_trace_in_process(adapter, workload, device, out_dir,
                                        f"nsys failed ({nsys_failure}); recorded with torch.profiler (CUPTI)"))
    return traces


def _trace_in_process(adapter: KernelAdapter, workload: AttentionWorkload, device: "torch.device", out_dir: Path,
                      note: str) -> TraceResult:
    import torch

    trace = TraceResult(adapter.name, "torch.profiler", TRACE_LAUNCHES, note=note)
    prepared: PreparedKernel | None = None
    try:
        _, num_sets = _rotated_sets(adapter, workload, device)
        prepared = adapter.prepare(workload, num_sets, device, DEFAULT_SEED)
        for index in range(TRACE_WARMUP):
            prepared.run(index % num_sets)
        trace_path = out_dir / f"torch-trace-{adapter.name}.json"
        trace.kernels = record_trace(prepared, TRACE_LAUNCHES, trace_path)
        trace.note += f"; trace: {trace_path}"
    except Exception as exc:  # a failed trace is reported in its row, not raised
        trace.error = _one_line(exc)
    finally:
        del prepared
        torch.cuda.empty_cache()
    return trace


def _versions() -> dict[str, str]:
    import torch

    versions = {"cuda (torch build)": str(torch.version.cuda)}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions

"""PyTorch profiler (Kineto) Chrome traces: read them (gzip'd too), total GPU time per kernel, trim them to a
committable size, and record one in this process (the fallback for when nsys cannot write a report)."""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kernel_adapter import PreparedKernel

Trace = dict[str, Any] | list[dict[str, Any]]
# Device-side activity in a Kineto trace; every other category (cpu_op, cuda_runtime, python_function, ...) is
# host-side.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class KernelTotal:
    name: str
    calls: int
    total_us: float

    @property
    def avg_us(self) -> float:
        return self.total_us / self.calls


def load_trace(path: Path) -> Trace:
    """A Chrome trace file, plain JSON or gzip'd (`.gz`, as SGLang writes them)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as stream:
        return json.load(stream)


def write_trace(trace: Trace, path: Path) -> None:
    """Write a Chrome trace as compact JSON, gzip'd when `path` ends in `.gz`."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as stream:
        json.dump(trace, stream, separators=(",", ":"))


def trace_events(trace: Trace) -> list[dict[str, Any]]:
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def gpu_events(trace: Trace, categories: tuple[str, ...] = GPU_CATEGORIES) -> list[dict[str, Any]]:
    """Complete ("X") events of the given device categories, in start-time order."""
    events = [event for event in trace_events(trace)
              if event.get("ph") == "X" and str(event.get("cat", "")).lower() in categories]
    return sorted(events, key=lambda event: float(event.get("ts", 0.0)))


def kernel_totals(trace: Trace, categories: tuple[str, ...] = ("kernel",)) -> list[KernelTotal]:
    """Per-name totals of the trace's device events (`dur` in microseconds), largest total first."""
    calls: dict[str, int] = {}
    total_us: dict[str, float] = {}
    for event in gpu_events(trace, categories):
        name = event["name"]
        calls[name] = calls.get(name, 0) + 1
        total_us[name] = total_us.get(name, 0.0) + float(event.get("dur", 0.0))
    totals = [KernelTotal(name, calls[name], total_us[name]) for name in calls]
    return sorted(totals, key=lambda kernel: kernel.total_us, reverse=True)


def trim_trace(source: Path, target: Path, max_events: int) -> int:
    """Copy `source` to `target` keeping the metadata and the first `max_events` device events (by start time).

    Host-side events are dropped, so a serving trace shrinks to what the kernel breakdown reads; gzip `target`
    (name it `.json.gz`) to keep a fixture small. Returns the number of device events kept.
    """
    if max_events < 1:
        raise ValueError(f"max_events must be >= 1, got {max_events}")
    trace = load_trace(source)
    kept = gpu_events(trace)[:max_events]
    metadata = [event for event in trace_events(trace) if event.get("ph") == "M"]
    trimmed: Trace = {**trace, "traceEvents": metadata + kept} if isinstance(trace, dict) else metadata + kept
    write_trace(trimmed, target)
    return len(kept)


def record_trace(prepared: "PreparedKernel", launches: int, trace_path: Path) -> list[KernelTotal]:
    """Profile `launches` calls (input sets rotated) and write the Chrome trace to `trace_path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for index in range(launches):
            prepared.run(index % prepared.num_sets)
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(trace_path))
    return kernel_totals(load_trace(trace_path))

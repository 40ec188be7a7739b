"""torch.profiler (CUPTI) fallback for when nsys cannot write a report: record a few launches in this
process, export the Chrome trace, and total GPU kernel time per kernel name from it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpfa.profiles.kernel_adapter import PreparedKernel
from mpfa.profiles.results import KernelTotal


def kernel_totals(trace: dict[str, Any] | list[dict[str, Any]]) -> list[KernelTotal]:
    """Per-kernel totals from a Chrome trace (`traceEvents` complete events of category "kernel", `dur` in
    microseconds), largest total first."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    calls: dict[str, int] = {}
    total_us: dict[str, float] = {}
    for event in events:
        if event.get("ph") != "X" or str(event.get("cat", "")).lower() != "kernel":
            continue
        name = event["name"]
        calls[name] = calls.get(name, 0) + 1
        total_us[name] = total_us.get(name, 0.0) + float(event.get("dur", 0.0))
    totals = [KernelTotal(name, calls[name], total_us[name]) for name in calls]
    return sorted(totals, key=lambda kernel: kernel.total_us, reverse=True)


def record_trace(prepared: PreparedKernel, launches: int, trace_path: Path) -> list[KernelTotal]:
    """Profile `launches` calls (input sets rotated) and write the Chrome trace to `trace_path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for index in range(launches):
            prepared.run(index % prepared.num_sets)
        torch.cuda.synchronize()
    profiler.export_chrome_trace(str(trace_path))
    return kernel_totals(json.loads(trace_path.read_text()))

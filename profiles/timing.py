"""Time GPU work with CUDA events, one event pair per launch, and summarise the samples.

Before the timed launches the stream is parked on a sleep kernel so the CPU can queue every launch ahead of
the GPU: the events then bracket GPU execution, not Python launch overhead.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

_PARK_CYCLES = 200_000_000  # ~0.1 s at H200 clocks, longer than queuing the timed launches takes
_TARGET_TIMED_S = 1.5


@dataclass(frozen=True)
class TimingSummary:
    median_ms: float
    min_ms: float
    max_ms: float
    p20_ms: float
    p80_ms: float
    samples: int


def summarize(times_ms: list[float]) -> TimingSummary:
    if not times_ms:
        raise ValueError("no timing samples")
    ordered = sorted(times_ms)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    return TimingSummary(statistics.median(ordered), ordered[0], ordered[-1], quantile(0.2), quantile(0.8),
                         len(ordered))


def repetitions(estimate_ms: float, *, min_reps: int = 10, max_reps: int = 100) -> int:
    """Timed launches for a kernel that takes about `estimate_ms`, so the timed part lasts ~1.5 s."""
    if estimate_ms <= 0:
        return max_reps
    return max(min_reps, min(max_reps, int(_TARGET_TIMED_S * 1000 / estimate_ms)))


@dataclass(frozen=True)
class Measurement:
    first_call_s: float  # wall time of the very first call: JIT compile + launch + run
    times_ms: list[float]


def measure(run: Callable[[int], object], num_sets: int, *, warmup: int = 3) -> Measurement:
    """Time `run(i)` on input sets rotated i = 0, 1, ..., num_sets-1, 0, ... (call it on a CUDA device)."""
    import torch

    started = time.perf_counter()
    run(0)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - started
    probe = [_time_once(run, i % num_sets) for i in range(1, 1 + warmup)]
    reps = repetitions(statistics.median(probe))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    torch.cuda._sleep(_PARK_CYCLES)
    for rep in range(reps):
        starts[rep].record()
        run(rep % num_sets)
        ends[rep].record()
    torch.cuda.synchronize()
    return Measurement(first_call_s, [s.elapsed_time(e) for s, e in zip(starts, ends)])


def _time_once(run: Callable[[int], object], index: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(index)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)

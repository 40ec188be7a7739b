"""Measure the device's ceilings in the profiling process itself: copy bandwidth and BF16/FP8 GEMM rates.

Measured rather than taken from a datasheet, so "% of peak" compares against what this GPU, at its current
clocks and power limit, actually sustains.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .profile_result import Peaks
from .timing import measure, summarize

if TYPE_CHECKING:
    import torch

COPY_BYTES = 1 << 30  # each of source and destination: far beyond L2
GEMM_N = 8192  # square GEMM: large enough to reach the tensor-core plateau on H100/H200


def measure_peaks(device: "torch.device") -> Peaks:
    """Each ceiling that fails to measure is recorded in `errors` and left None."""
    peaks = Peaks()
    probes: dict[str, Callable[[torch.device], float]] = {
        "copy_gbps": copy_gbps, "bf16_tflops": bf16_gemm_tflops, "fp8_tflops": fp8_gemm_tflops}
    for field_name, probe in probes.items():
        try:
            setattr(peaks, field_name, probe(device))
        except Exception as exc:  # one missing op (e.g. FP8 GEMM) must not hide the others
            peaks.errors[field_name] = f"{type(exc).__name__}: {exc}"
    return peaks


def _median_s(run: Callable[[int], object]) -> float:
    return summarize(measure(run, 1).times_ms).median_ms / 1e3


def copy_gbps(device: "torch.device") -> float:
    import torch

    src = torch.ones(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _median_s(lambda _: dst.copy_(src))
    return 2 * COPY_BYTES / seconds / 1e9


def bf16_gemm_tflops(device: "torch.device") -> float:
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(GEMM_N, GEMM_N, dtype=torch.bfloat16, device=device, generator=generator)
            for _ in range(2))
    out = torch.empty_like(a)
    seconds = _median_s(lambda _: torch.matmul(a, b, out=out))
    return 2 * GEMM_N**3 / seconds / 1e12


def fp8_gemm_tflops(device: "torch.device") -> float:
    """FP8 e4m3 x e4m3 -> BF16 through cuBLASLt (`torch._scaled_mm`, B column-major as it requires)."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    a, b_rows = (torch.randn(GEMM_N, GEMM_N, device=device, generator=generator).to(torch.float8_e4m3fn)
                 for _ in range(2))
    b = b_rows.t()
    scale = torch.ones((), dtype=torch.float32, device=device)
    seconds = _median_s(lambda _: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16))
    return 2 * GEMM_N**3 / seconds / 1e12

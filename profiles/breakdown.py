"""GPU time of one profiled serving stage (prefill or decode) split by kernel category (paper Fig. 1)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..mpfa_cli.errors import ServingProfileError
from .kernel_categories import CATEGORIES, classify
from .torch_trace import GPU_CATEGORIES, KernelTotal, Trace, gpu_events, kernel_totals

TOP_KERNELS = 8  # largest kernels kept per stage, to check the classification by eye


@dataclass
class CategoryTotal:
    category: str
    launches: int
    total_us: float


@dataclass
class StageBreakdown:
    stage: str  # "prefill" or "decode"
    trace_path: str
    gpu_us: float  # summed duration of every device event (kernels, memcpy, memset)
    window_us: float  # first device event's start to the last one's end
    categories: list[CategoryTotal]  # one per CATEGORIES entry, in that order
    top_kernels: list[KernelTotal] = field(default_factory=list)

    def total_us(self, category: str) -> float:
        return next(total.total_us for total in self.categories if total.category == category)

    def share(self, category: str) -> float:
        """Fraction of the summed GPU time spent in `category`."""
        return self.total_us(category) / self.gpu_us


def stage_breakdown(trace: Trace, stage: str, trace_path: str) -> StageBreakdown:
    """Total the trace's device events per category; a trace without any is a ServingProfileError."""
    events = gpu_events(trace)
    if not any(float(event.get("dur", 0.0)) > 0 for event in events):
        raise ServingProfileError(f"the {stage} trace {trace_path} holds no GPU activity (was it recorded with "
                                  f"activity GPU, on a CUDA device?)")
    launches = dict.fromkeys(CATEGORIES, 0)
    total_us = dict.fromkeys(CATEGORIES, 0.0)
    for event in events:
        category = classify(event["name"])
        launches[category] += 1
        total_us[category] += float(event.get("dur", 0.0))
    window_us = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events) - float(events[0]["ts"])
    return StageBreakdown(
        stage=stage, trace_path=trace_path, gpu_us=sum(total_us.values()), window_us=window_us,
        categories=[CategoryTotal(category, launches[category], total_us[category]) for category in CATEGORIES],
        top_kernels=kernel_totals(trace, GPU_CATEGORIES)[:TOP_KERNELS],
    )

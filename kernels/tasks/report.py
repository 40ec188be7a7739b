"""Task-accuracy results: per-task scores of each variant, the loss vs BF16 and MpFA's recovery; JSON and a table.

loss(v) = score(bf16) - score(v) on the task's primary metric (positive = worse than BF16);
recovery = (loss(qk4-pv8-direct) - loss(mpfa)) / loss(qk4-pv8-direct), undefined when the direct variant loses
nothing (then there is nothing to recover).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

BASELINE = "bf16"
DIRECT = "qk4-pv8-direct"
MPFA = "mpfa"
AGREEMENT = "same_as_bf16"  # share of examples with the same output (answer, chosen option) as BF16


@dataclass
class TaskScores:
    """One task's mean metrics per variant (`metrics[variant][metric]`, in [0, 1]); `primary` drives loss."""

    task: str
    primary: str
    examples: int
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def score(self, variant: str) -> float:
        return self.metrics[variant][self.primary]

    def losses(self) -> dict[str, float]:
        """Loss vs BF16 of every variant (empty when BF16 did not run)."""
        if BASELINE not in self.metrics:
            return {}
        return {v: self.score(BASELINE) - self.score(v) for v in self.metrics if v != BASELINE}

    def recovery(self) -> float | None:
        """Share of the direct variant's loss that MpFA recovers; None when undefined."""
        losses = self.losses()
        if DIRECT not in losses or MPFA not in losses or losses[DIRECT] <= 0:
            return None
        return (losses[DIRECT] - losses[MPFA]) / losses[DIRECT]


@dataclass
class TaskAccuracyReport:
    """A `mpfa accuracy task` run: what ran (`params`) and the scores of each task."""

    model: str
    device: str
    params: dict[str, Any]
    tasks: list[TaskScores]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "params": self.params,
            "tasks": [dict(asdict(t), losses=t.losses(), recovery=t.recovery()) for t in self.tasks],
        }


def render_task_accuracy(report: TaskAccuracyReport, console) -> None:
    """One rich table: per task the primary score of each variant, its loss vs BF16 and the recovery."""
    from rich.table import Table

    variants = list(report.params["variants"])
    table = Table(title=f"Task accuracy ({report.model}, {report.device}; loss vs {BASELINE})")
    for col in ("task", "metric", "n", *variants, "recovery"):
        table.add_column(col, justify="left" if col in ("task", "metric") else "right")
    for t in report.tasks:
        losses = t.losses()
        cells = []
        for v in variants:
            text = f"{100 * t.score(v):.1f}"
            cells.append(text if v not in losses else f"{text} ({-100 * losses[v]:+.1f})")
        rec = t.recovery()
        table.add_row(t.task, t.primary, str(t.examples), *cells, "n/a" if rec is None else f"{100 * rec:.1f}%")
        if all(AGREEMENT in t.metrics[v] for v in variants):
            same = [f"{100 * t.metrics[v][AGREEMENT]:.0f}%" for v in variants]
            table.add_row("", f"{AGREEMENT}", "", *same, "", style="dim")
    console.print(table)

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

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> TaskAccuracyReport:
        tasks = [TaskScores(t["task"], t["primary"], t["examples"], t["metrics"], t["seconds"]) for t in doc["tasks"]]
        return cls(doc["model"], doc["device"], doc["params"], tasks)


# What must agree for shards to be parts of one run (the rest of `params` says which examples a shard holds).
_SAME_RUN = ("variants", "context_pad", "max_new_tokens")


def merge_reports(shards: list[TaskAccuracyReport]) -> TaskAccuracyReport:
    """One report from runs over disjoint example ranges (`--offset` / `--limit`) of the same model, device and
    settings: per task, every metric is the example-weighted mean of the shards' and the seconds add up;
    `params["examples"][task]` lists the [start, end) ranges merged. Overlaps or mismatches raise ValueError."""
    if not shards:
        raise ValueError("nothing to merge")
    first = shards[0]
    for shard in shards[1:]:
        if (shard.model, shard.device) != (first.model, first.device):
            raise ValueError(f"cannot merge {shard.model} on {shard.device} with {first.model} on {first.device}")
        for key in _SAME_RUN:
            if shard.params.get(key) != first.params.get(key):
                raise ValueError(f"cannot merge runs with different {key}: "
                                 f"{shard.params.get(key)} and {first.params.get(key)}")
    by_task: dict[str, list[tuple[int, TaskScores]]] = {}
    for shard in shards:
        for scores in shard.tasks:
            by_task.setdefault(scores.task, []).append((int(shard.params.get("offset", 0)), scores))
    merged, ranges = [], {}
    for task, parts in by_task.items():
        parts.sort(key=lambda part: part[0])
        spans = [(start, start + scores.examples) for start, scores in parts]
        for (_, end), (start, _) in zip(spans, spans[1:]):
            if start < end:
                raise ValueError(f"{task}: example ranges overlap ({', '.join(f'[{a}, {b})' for a, b in spans)})")
        ranges[task] = [list(span) for span in spans]
        merged.append(_merge_task(task, [scores for _, scores in parts]))
    params = {key: first.params.get(key) for key in _SAME_RUN}
    params.update(tasks=list(by_task), examples=ranges)
    return TaskAccuracyReport(first.model, first.device, params, merged)


def _merge_task(task: str, parts: list[TaskScores]) -> TaskScores:
    total = sum(p.examples for p in parts)
    out = TaskScores(task, parts[0].primary, total)
    for variant, metrics in parts[0].metrics.items():
        if any(p.primary != out.primary or set(p.metrics.get(variant, {})) != set(metrics) for p in parts):
            raise ValueError(f"{task}: the shards did not measure the same metrics of {variant}")
        out.metrics[variant] = {m: sum(p.metrics[variant][m] * p.examples for p in parts) / total for m in metrics}
        out.seconds[variant] = sum(p.seconds.get(variant, 0.0) for p in parts)
    return out


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

"""The accuracy figures: served scores per task (one panel each) against the context length, the reference's
interval-free line and each other backend's paired 95% interval of the difference as an error bar; and an `mpfa accuracy
task` result as grouped bars per variant (score, loss vs BF16, recovery)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..reports.plot import figure_paths, plt, save_figure
from ..reports.tables import context_label
from .served import ServedAccuracy, SummaryRow

if TYPE_CHECKING:  # importing mpfa.kernels loads torch
    from .tasks.task_report import TaskAccuracyReport


def plot_accuracy(report: ServedAccuracy | TaskAccuracyReport, out: Path, fmt: str = "png") -> list[Path]:
    """`mpfa plot --accuracy`: the figure of a served result or of an `mpfa accuracy task` report, beside `out` as
    `fmt` (png, svg or both); returns the paths."""
    if isinstance(report, ServedAccuracy):
        return plot_served_accuracy(report, out, fmt)
    return plot_task_accuracy(report, out, fmt)


def plot_served_accuracy(result: ServedAccuracy, out: Path, fmt: str = "png") -> list[Path]:
    """Write the figure beside `out` as `fmt` (png, svg or both); returns the paths."""
    rows = result.summary()
    if not rows:
        raise UserError(f"served accuracy result of {result.model} holds no scores: nothing to plot")
    tasks = list(dict.fromkeys(r.task for r in rows))
    width, height = ACCURACY_PANEL_SIZE
    fig, axes = plt.subplots(1, len(tasks), figsize=(width * len(tasks), height), squeeze=False,
                             constrained_layout=True)
    colours = plt.get_cmap("tab10")
    for ax, task in zip(axes[0], tasks):
        of_task = [r for r in rows if r.task == task]
        lengths = list(dict.fromkeys(r.length for r in of_task))
        for index, backend in enumerate(result.backends):
            points: list[SummaryRow] = [r for r in of_task if r.backend == backend]
            if not points:
                continue
            x = [lengths.index(r.length) for r in points]
            y = [100 * r.score for r in points]
            below = [100 * (r.difference.mean - r.difference.low) if r.difference else 0 for r in points]
            above = [100 * (r.difference.high - r.difference.mean) if r.difference else 0 for r in points]
            is_ref = backend == result.ref  # dashed, on top: a backend scoring the same shows beneath it
            ax.errorbar(x, y, yerr=[below, above], marker="o", linestyle="--" if is_ref else "-", capsize=3,
                        color=colours(index % 10), label=backend, zorder=3 if is_ref else 2)
        ax.set_xticks(range(len(lengths)), ["natural" if n is None else context_label(n) for n in lengths])
        ax.set_ylim(0, 105)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("score (%)")
        ax.set_title(f"{task} ({of_task[0].n} questions per point)", fontsize="medium")
        ax.grid(True, alpha=0.3)
    legend = {label: handle for ax in axes[0] for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(legend.values(), legend.keys(), loc="outside right upper", fontsize="small")  # clear of the lines
    title = f"Task accuracy: {result.model}; error bars: paired 95% interval of the difference to {result.ref}"
    fig.suptitle(f"SIMULATED (no model ran) — {title}" if result.simulated else title, fontsize="medium")
    return save_figure(fig, figure_paths(out, fmt))


# The accuracy figure: one panel per task, this wide and tall (inches) at DPI.
ACCURACY_PANEL_SIZE = (4.8, 4.6)


def plot_task_accuracy(report: TaskAccuracyReport, out: Path, fmt: str = "png") -> list[Path]:
    """Grouped bars for one `mpfa accuracy task` result: per task (one panel each) every variant's primary score,
    annotated with its loss vs BF16 and, below its name, the share of outputs identical to BF16's; the panel title
    carries the recovery. Writes it beside `out` as `fmt` (png, svg or both) and returns the paths."""
    from .tasks.task_report import AGREEMENT, BASELINE, DIRECT, MPFA

    if not report.tasks:
        raise UserError(f"accuracy result of {report.model} on {report.device} holds no tasks: nothing to plot")
    variants = list(report.params.get("variants") or report.tasks[0].metrics)
    width, height = ACCURACY_PANEL_SIZE
    fig, axes = plt.subplots(1, len(report.tasks), figsize=(width * len(report.tasks), height), squeeze=False,
                             constrained_layout=True)
    colours = plt.get_cmap("tab10")
    for ax, task in zip(axes[0], report.tasks):
        shown = [v for v in variants if v in task.metrics]
        losses = task.losses()
        bars = ax.bar(range(len(shown)), [100 * task.score(v) for v in shown],
                      color=[colours(variants.index(v) % 10) for v in shown], width=0.7)
        if BASELINE in task.metrics:
            ax.axhline(100 * task.score(BASELINE), color="grey", linestyle="--", linewidth=0.8)
        for bar, variant in zip(bars, shown):
            label = f"{bar.get_height():.1f}"
            if variant in losses:
                label += f"\n({-100 * losses[variant]:+.1f})"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), xytext=(0, 3),
                        textcoords="offset points", ha="center", va="bottom", fontsize="small",
                        bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none"))
        ticks = [v if AGREEMENT not in task.metrics[v] or v == BASELINE
                 else f"{v}\n{100 * task.metrics[v][AGREEMENT]:.0f}% same" for v in shown]
        ax.set_xticks(range(len(shown)), ticks, fontsize="small")
        ax.set_ylim(0, 118)
        ax.set_yticks(range(0, 101, 20))
        ax.set_ylabel(f"{task.primary} (%)")
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        recovery = task.recovery()
        ax.set_title(f"{task.task} ({task.primary}, n={task.examples})\n"
                     f"{MPFA} recovers {'n/a' if recovery is None else f'{100 * recovery:.1f}%'} of {DIRECT}'s loss", fontsize="medium")
    per_task = ", ".join(f"{t.task} {t.examples}" for t in report.tasks)
    fig.suptitle(f"Task accuracy per attention variant: {report.model} on {report.device} (n per task: {per_task})"
                 f"\nscore (loss vs {BASELINE}, dashed); \"same\": outputs identical to {BASELINE}'s", fontsize="medium")
    return save_figure(fig, figure_paths(out, fmt))

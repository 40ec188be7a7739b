"""The served-accuracy figure: per task (one panel each) every backend's score against the context length, the
reference's interval-free line and each other backend's paired 95% interval of the difference as an error bar."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import UserError
from ..reports.plot import ACCURACY_PANEL_SIZE, figure_paths, plot_task_accuracy, plt, save_figure
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

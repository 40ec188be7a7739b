"""Paper-style figures: serving (OTPS vs context length per backend, TTFT/TPOT speedup over a reference backend)
and task accuracy (`plot_task_accuracy`: per task, each attention variant's score, loss vs BF16 and recovery).

Serving: one colour per backend, one line style/marker per load point (concurrency or rate); points are means over
repeats, OTPS error bars their 95% CI. The title says SIMULATED when any run is; a backend whose runs carry a
caveat (numbers measured but not the backend's own) is marked † in the legend, the caveat printed as a footnote,
as is any configuration whose runs served different workloads (‡, `report.workload_notes`).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402  (after selecting the backend)

from mpfa.harness.errors import UserError  # noqa: E402
from mpfa.harness.run_tables import (  # noqa: E402
    CompareRow, Config, backend_label, caveat_notes, caveated_backends, compare_rows, context_label, mixed_workloads,
    workload_notes,
)
from mpfa.harness.store import StoredRun  # noqa: E402

if TYPE_CHECKING:  # importing mpfa.kernels loads torch: only the accuracy figure pays for it
    from mpfa.kernels.tasks.task_report import TaskAccuracyReport

PANELS = (
    ("otps", "OTPS (tok/s)"),
    ("ttft_ms_median", "TTFT speedup (median)"),
    ("tpot_ms_median", "TPOT speedup (median)"),
)
_LINE_STYLES = ("-", "--", ":", "-.")
DPI = 150
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot_runs(runs: Sequence[StoredRun], ref_backend: str, out_png: Path) -> Path:
    """Draw the figure for the runs that finished ok and write it to `out_png` (PNG); returns the path."""
    backends, rows = compare_rows(runs, ref_backend, [m for m, _ in PANELS])
    ok_runs = [r for r in runs if r.status == "ok"]
    caveated = caveated_backends(ok_runs)
    by_metric: dict[str, list[CompareRow]] = defaultdict(list)
    for row in rows:
        by_metric[row.metric].append(row)
    scenarios = sorted({row.config.scenario for row in rows})
    series_keys = sorted({_series_key(row.config, scenarios) for row in rows}, key=lambda k: k[1])

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.2), constrained_layout=True)
    colours = plt.get_cmap("tab10")
    contexts = sorted({row.config.input_len for row in rows})
    for ax, (metric, ylabel) in zip(axes, PANELS):
        is_speedup = metric != "otps"
        for b_index, backend in enumerate(backends):
            if is_speedup and backend == ref_backend:
                continue
            for s_index, (label, _) in enumerate(series_keys):
                points = sorted(
                    (row.config.input_len, row) for row in by_metric[metric]
                    if _series_key(row.config, scenarios)[0] == label
                    and (backend in row.speedups if is_speedup else backend in row.values)
                )
                if not points:
                    continue
                xs = [x for x, _ in points]
                style = dict(color=colours(b_index % 10), linestyle=_LINE_STYLES[s_index % len(_LINE_STYLES)],
                             marker=_MARKERS[s_index % len(_MARKERS)],
                             label=f"{backend_label(backend, backend in caveated)} {label}")
                if is_speedup:
                    ax.plot(xs, [row.speedups[backend] for _, row in points], **style)
                else:
                    ests = [row.values[backend] for _, row in points]
                    errors = [e.half_width or 0.0 for e in ests]
                    ax.errorbar(xs, [e.mean for e in ests], yerr=errors, capsize=3, **style)
        if is_speedup:
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ylabel = f"{ylabel} vs {ref_backend}"
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [context_label(c) for c in contexts])
        ax.set_xlabel("context length (input tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    title = f"Serving throughput and latency speedup vs {ref_backend}"
    meta = sorted({f"{r.model} on {r.gpu}" for r in ok_runs if r.model and r.gpu})
    if meta:
        title += f" — {', '.join(meta)}"
    if any(r.simulated for r in runs):
        title = f"SIMULATED (latency model, no GPU) — {title}"
    fig.suptitle(title)
    if notes := [*caveat_notes(ok_runs), *workload_notes(mixed_workloads(ok_runs))]:
        fig.supxlabel("\n".join(notes), x=0.01, ha="left", fontsize="small", color="darkorange")
    return _save(fig, out_png)


def _save(fig, out_png: Path) -> Path:
    """Write the figure as a PNG (creating its folder) and close it; a path that cannot be written is a UserError."""
    try:
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, format="png", dpi=DPI)
    except OSError as exc:
        raise UserError(f"cannot write plot {out_png}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out_png


def _series_key(config: Config, scenarios: list[str]) -> tuple[str, tuple]:
    """(legend label, sort key) of a load point; prefixed by the scenario when several are plotted."""
    label = config.load_label if len(scenarios) == 1 else f"{config.scenario} {config.load_label}"
    return label, (config.scenario, config.sort_key()[2:])


# The accuracy figure: one panel per task, this wide and tall (inches) at DPI.
ACCURACY_PANEL_SIZE = (4.8, 4.6)


def plot_task_accuracy(report: TaskAccuracyReport, out_png: Path) -> Path:
    """Grouped bars for one `mpfa accuracy task` result: per task (one panel each) every variant's primary score,
    annotated with its loss vs BF16 and, below its name, the share of outputs identical to BF16's; the panel title
    carries the recovery. Writes `out_png` and returns it."""
    from mpfa.kernels.tasks.task_report import AGREEMENT, BASELINE, DIRECT, MPFA

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
    return _save(fig, out_png)

"""Paper-style serving figures: OTPS vs context length per backend, TTFT/TPOT speedup over a reference backend (the
accuracy figures, `mpfa.mpfa_cli.accuracy.plot`, share `save_figure`).

One figure per scenario (PNG, SVG or both), one colour per backend, one line style/marker per load point
(concurrency or rate); points are means over repeats, error bars their 95% CI (a speed-up's from both sides' CIs),
every y axis from zero. The title names the scenario, model, GPU, engine and dates, and says SIMULATED when any run
is; a backend whose runs carry a
caveat (numbers measured but not the backend's own) is marked † in the legend, the caveat printed as a footnote,
as is any configuration whose runs served different workloads (‡, `report.workload_notes`).
"""
from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402  (after selecting the backend)
from matplotlib.figure import Figure  # noqa: E402

from ..errors import UserError  # noqa: E402
from ..harness.safe_files import replace_private  # noqa: E402
from .tables import (CompareRow, Config, backend_label, caveat_notes, caveated_backends, compare_rows, context_label,
                     engine_label, mixed_workloads, simulated_label, workload_notes)
from ..results.store import StoredRun  # noqa: E402

PANELS = (
    ("otps", "OTPS (tok/s)"),
    ("ttft_ms_median", "TTFT speedup (median)"),
    ("tpot_ms_median", "TPOT speedup (median)"),
)
PLOT_FORMATS = ("png", "svg", "both")
_LINE_STYLES = ("-", "--", ":", "-.")
DPI = 150
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def plot_runs(runs: Sequence[StoredRun], ref_backend: str, out: Path, fmt: str = "png") -> list[Path]:
    """One figure per scenario of the runs that finished ok, written as `fmt` (png, svg or both) beside `out`
    (named by the scenario when there are several); returns the paths written."""
    scenarios = figure_scenarios(runs)
    paths = []
    for scenario in scenarios:
        named = out if len(scenarios) == 1 else out.with_name(f"{out.stem}-{scenario}{out.suffix}")
        paths += save_figure(serving_figure(runs, ref_backend, scenario), figure_paths(named, fmt))
    return paths


def figure_scenarios(runs: Sequence[StoredRun]) -> list[str | None]:
    """The scenarios of the runs that finished ok, one figure each (None, one figure of all: none finished ok)."""
    return sorted({r.scenario for r in runs if r.status == "ok"}) or [None]


def serving_figure(runs: Sequence[StoredRun], ref_backend: str, scenario: str | None) -> Figure:
    """The figure of `scenario`'s runs (of all the runs when None)."""
    return _serving_figure([r for r in runs if scenario is None or r.scenario == scenario], ref_backend)


def figure_png(fig: Figure) -> bytes:
    """The figure as PNG bytes (at the DPI of the files); closes it."""
    stream = io.BytesIO()
    try:
        fig.savefig(stream, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    return stream.getvalue()


def check_figure_format(fmt: str) -> None:
    if fmt not in PLOT_FORMATS:
        raise UserError(f"--format: '{fmt}' is not one of {', '.join(PLOT_FORMATS)}")


def figure_paths(out: Path, fmt: str) -> list[Path]:
    """`out` with the suffix of each format `fmt` names (png, svg, or both)."""
    check_figure_format(fmt)
    return [out.with_suffix(f".{kind}") for kind in (("png", "svg") if fmt == "both" else (fmt,))]


def _serving_figure(runs: Sequence[StoredRun], ref_backend: str) -> Figure:
    """OTPS and TTFT/TPOT speed-up vs context length of one scenario: a colour per backend, a line style per load
    point, error bars the 95% CI over repeats; speed-up axes start at zero."""
    backends, rows = compare_rows(runs, ref_backend, [m for m, _ in PANELS])
    ok_runs = [r for r in runs if r.status == "ok"]
    caveated = caveated_backends(ok_runs)
    loads = sorted({row.config for row in rows}, key=Config.sort_key)
    load_labels = list(dict.fromkeys(c.load_label for c in loads))
    contexts = sorted({row.config.input_len for row in rows})
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6), constrained_layout=True)
    colours = plt.get_cmap("tab10")
    for ax, (metric, ylabel) in zip(axes, PANELS):
        is_speedup = metric != "otps"
        for b_index, backend in enumerate(backends):
            if is_speedup and backend == ref_backend:
                continue
            for s_index, load in enumerate(load_labels):
                points = sorted((row.config.input_len, row) for row in rows if row.metric == metric
                                and row.config.load_label == load
                                and (backend in row.speedups if is_speedup else backend in row.values))
                if not points:
                    continue
                ys, errors = zip(*(_speedup_point(row, backend, ref_backend) if is_speedup
                                   else (row.values[backend].mean, row.values[backend].half_width or 0.0)
                                   for _, row in points))
                ax.errorbar([x for x, _ in points], ys, yerr=errors, capsize=3, color=colours(b_index % 10),
                            linestyle=_LINE_STYLES[s_index % len(_LINE_STYLES)],
                            marker=_MARKERS[s_index % len(_MARKERS)],
                            label=f"{backend_label(backend, backend in caveated)} {load}")
        if is_speedup:
            ax.axhline(1.0, color="grey", linewidth=0.8)
            ylabel = f"{ylabel} vs {ref_backend}"
        ax.set_ylim(0, max(ax.get_ylim()[1], 1.0 if is_speedup else 0.0) * 1.1)  # room above the 1× line
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [context_label(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context length (input tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    fig.suptitle(_title(ok_runs or runs, ref_backend), fontsize="medium")
    if notes := [*caveat_notes(ok_runs), *workload_notes(mixed_workloads(ok_runs))]:
        fig.supxlabel("\n".join(notes), x=0.01, ha="left", fontsize="small", color="darkorange")
    return fig


def _speedup_point(row: CompareRow, backend: str, ref_backend: str) -> tuple[float, float]:
    """A speed-up and its error bar: the two 95% CIs' relative half-widths added in quadrature (0 without CIs)."""
    value, ref = row.values[backend], row.values[ref_backend]
    ratio = row.speedups[backend]
    if value.half_width is None or ref.half_width is None or not value.mean or not ref.mean:
        return ratio, 0.0
    return ratio, ratio * math.hypot(value.half_width / value.mean, ref.half_width / ref.mean)


def _title(runs: Sequence[StoredRun], ref_backend: str) -> str:
    """'<scenario>: throughput and speed-up vs <ref>' over '<model> on <GPU>, engine <engine>, <dates>'."""
    scenario = ", ".join(sorted({r.scenario for r in runs}))
    days = sorted({time.strftime("%Y-%m-%d", time.localtime(r.started_at)) for r in runs})
    setup = ", ".join([
        " / ".join(sorted({f"{r.model or 'unknown model'} on {r.gpu or 'unknown GPU'}" for r in runs})),
        "engine " + " / ".join(sorted({engine_label(r) for r in runs})),
        days[0] if len(days) == 1 else f"{days[0]} – {days[-1]}",
    ])
    title = f"{scenario}: serving throughput and speed-up vs {ref_backend}\n{setup}"
    return f"{label} (latency model, no GPU) — {title}" if (label := simulated_label(runs)) else title


def save_figure(fig: Figure, paths: Sequence[Path]) -> list[Path]:
    """Write the figure to each path in the format its suffix names (creating folders) and close it; a path that
    cannot be written is a UserError."""
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            with replace_private(path, "plot", binary=True) as stream:
                fig.savefig(stream, format=path.suffix.lstrip(".") or "png", dpi=DPI)
    except OSError as exc:
        raise UserError(f"cannot write plot {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return list(paths)

"""Paper-style figure: OTPS vs context length per backend, and TTFT/TPOT speedup over a reference backend.

One colour per backend, one line style/marker per load point (concurrency or rate); points are means over
repeats, OTPS error bars their 95% CI. The title says SIMULATED when any run is; a backend whose runs carry a
caveat (numbers measured but not the backend's own) is marked † in the legend, the caveat printed as a footnote,
as is any configuration whose runs served different workloads (‡, `report.workload_notes`).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a display
import matplotlib.pyplot as plt  # noqa: E402  (after selecting the backend)

from mpfa.cli.errors import UserError  # noqa: E402
from mpfa.cli.report import (  # noqa: E402
    CompareRow, Config, backend_label, caveat_notes, caveated_backends, compare_rows, context_label, mixed_workloads,
    workload_notes,
)
from mpfa.cli.store import StoredRun  # noqa: E402

PANELS = (
    ("otps", "OTPS (tok/s)"),
    ("ttft_ms_median", "TTFT speedup (median)"),
    ("tpot_ms_median", "TPOT speedup (median)"),
)
_LINE_STYLES = ("-", "--", ":", "-.")
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
    try:
        out_png.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_png, format="png", dpi=150)
    except OSError as exc:
        raise UserError(f"cannot write plot {out_png}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return out_png


def _series_key(config: Config, scenarios: list[str]) -> tuple[str, tuple]:
    """(legend label, sort key) of a load point; prefixed by the scenario when several are plotted."""
    label = config.load_label if len(scenarios) == 1 else f"{config.scenario} {config.load_label}"
    return label, (config.scenario, config.sort_key()[2:])

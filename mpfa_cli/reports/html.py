"""`mpfa report`: one self-contained HTML page of a comparison — compare's tables (`tables.compare_rows`: mean ± 95%
CI and speed-ups), plot's figures (embedded as base64 PNG), the runs with their provenance, the footnotes, and the
SIMULATED label where a run is simulated. Inline CSS, no script and no link out: the file opens offline, mailed or
archived as it is. Every string that comes from a run or the user is escaped (`html.escape`)."""
from __future__ import annotations

import base64
import time
from collections.abc import Iterable, Sequence
from html import escape

from rich.text import Text

from ..results.metrics import registry
from ..results.store import StoredRun
from ..harness.served_kernels import describe_kernels
from .plot import figure_png, figure_scenarios, serving_figure
from .tables import (CompareRow, backend_label, caveated_backends, compare_notes, compare_rows, context_label,
                     WORKLOAD_MARK, engine_label, mixed_workloads, runs_records, simulated_title,
                     speedup_text)

SIMULATED_NOTE = ("SIMULATED: every number in this report comes from mpfa's latency model (engine sim), not from a "
                  "GPU; it rehearses the workflow and says nothing about a backend's real speed.")
# speedup_text's Rich styles, as the page's CSS classes
_SPEEDUP_CLASS = {"green": "better", "red": "worse", "dim": "overlap"}
STYLE = """
body { font: 15px/1.45 system-ui, "DejaVu Sans", sans-serif; color: #1d1d1f; margin: 2em auto; max-width: 76em;
       padding: 0 1.5em; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { margin-top: 1.8em; border-bottom: 1px solid #ccc; }
.simulated { background: #fbe7f6; border-left: 6px solid #a0168a; padding: .6em 1em; font-weight: 600; }
table { border-collapse: collapse; margin: .4em 1.5em 1.2em 0; display: inline-table; vertical-align: top; }
caption { text-align: left; font-weight: 600; padding: .3em 0; }
th, td { border: 1px solid #d0d0d6; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f2f2f6; } table.runs td { white-space: nowrap; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.speedup { display: block; font-size: .9em; } .better { color: #137333; font-weight: 600; }
.worse { color: #c5221f; font-weight: 600; } .overlap { color: #777; }
ul.notes { color: #8a4b00; } code { background: #f2f2f6; padding: 0 .25em; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #e0e0e6; }
dl { display: grid; grid-template-columns: max-content auto; gap: .2em 1.2em; } dt { font-weight: 600; }
footer { margin-top: 2em; color: #777; font-size: .9em; }
"""


def render_report(runs: Sequence[StoredRun], ref_backend: str, used: str) -> str:
    """The page of `runs` compared against `ref_backend`; `used` says which runs (`selection.used_line`)."""
    backends, rows = compare_rows(runs, ref_backend)
    simulated = any(r.simulated for r in runs)
    scenarios = ", ".join(dict.fromkeys(r.scenario for r in runs))
    title = simulated_title(f"mpfa report: {scenarios} vs {ref_backend}", runs)
    parts = [f"<h1>{escape(title)}</h1>",
             *([f'<p class="simulated">{escape(SIMULATED_NOTE)}</p>'] if simulated else []),
             f"<p>{escape(used)}; reference backend <b>{escape(ref_backend)}</b>.</p>",
             "<h2>Backends side by side</h2>", _comparison(runs, backends, rows, ref_backend),
             "<h2>Figures</h2>", *_figures(runs, ref_backend),
             "<h2>Setup</h2>", _setup(runs),
             "<h2>Runs</h2>", _runs_table(runs), _backends_table(runs)]
    made = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
            f"<style>{STYLE}</style></head>\n<body>\n" + "\n".join(parts) +
            f"\n<footer>Made by <code>mpfa report</code> on {made}.</footer>\n</body></html>\n")


def _comparison(runs: Sequence[StoredRun], backends: list[str], rows: list[CompareRow], ref_backend: str) -> str:
    """One table per configuration (metrics as rows, a column per backend), then the footnotes."""
    marked = caveated_backends(r for r in runs if r.status == "ok")
    mixed = mixed_workloads(runs)
    parts = [f"<p>Mean ± 95% CI over repeats; under each value its speed-up vs {escape(ref_backend)} (&gt;1 is "
             'better), <span class="better">green</span> or <span class="worse">red</span> only where the CIs do '
             'not overlap, else <span class="overlap">≈</span>.</p>']
    header = "".join(f'<th>{escape(backend_label(b, b in marked))}</th>' for b in backends)
    for config in dict.fromkeys(row.config for row in rows):
        caption = (f"{config.scenario} · {context_label(config.input_len)} input · {config.load_label}"
                   + (f" {WORKLOAD_MARK}" if config in mixed else ""))
        body = "".join(f"<tr><th>{escape(registry.column(row.metric).label)}</th>"
                       + "".join(_cell(row, b, ref_backend) for b in backends) + "</tr>"
                       for row in rows if row.config == config)
        parts.append(f"<table><caption>{escape(caption)}</caption><tr><th>metric</th>{header}</tr>{body}</table>")
    parts.append(_notes(compare_notes(runs, rows, mixed)))
    return "\n".join(parts)


def _cell(row: CompareRow, backend: str, ref_backend: str) -> str:
    if backend not in row.values:
        return '<td class="num">—</td>'
    value = escape(row.values[backend].format())
    if backend == ref_backend or backend not in row.speedups:
        return f'<td class="num">{value}</td>'
    ratio: Text = speedup_text(row, backend, ref_backend)
    css = _SPEEDUP_CLASS.get(str(ratio.style), "")
    return f'<td class="num">{value}<span class="speedup {css}">{escape(ratio.plain)}</span></td>'


def _notes(lines: Iterable[str]) -> str:
    items = "".join(f"<li>{escape(line)}</li>" for line in lines)
    return f'<ul class="notes">{items}</ul>' if items else ""


def _figures(runs: Sequence[StoredRun], ref_backend: str) -> list[str]:
    """plot's figure of each scenario, as an embedded PNG."""
    figures = []
    for scenario in figure_scenarios(runs):
        png = base64.b64encode(figure_png(serving_figure(runs, ref_backend, scenario))).decode("ascii")
        alt = f"{scenario or 'serving'}: OTPS and TTFT/TPOT speed-up vs {ref_backend} by context length"
        figures.append(f'<figure><img alt="{escape(alt)}" src="data:image/png;base64,{png}"></figure>')
    return figures


def _setup(runs: Sequence[StoredRun]) -> str:
    """What the runs were measured on and with: model, GPU, engine, dates, mpfa revisions, driver, CUDA, packages."""
    def values(items: Iterable[object]) -> str:
        return ", ".join(dict.fromkeys(str(item) for item in items if item)) or "—"

    started = sorted(r.started_at for r in runs)
    environments = [r.environment for r in runs]
    packages = values(f"{name} {version}" for env in environments
                      for name, version in (env.get("packages") or {}).items() if version)
    fields = [("model", values(r.model for r in runs)), ("GPU", values(r.gpu for r in runs)),
              ("engine", values(engine_label(r) for r in runs)),
              ("dates", " – ".join(dict.fromkeys(time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
                                                 for t in (started[0], started[-1])))),
              ("mpfa revision", values(env.get("mpfa_revision") for env in environments)),
              ("driver, CUDA", values(f"{env.get('driver')}, CUDA {env.get('cuda')}" for env in environments
                                      if env.get("driver"))),
              ("packages", packages)]
    return "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in fields) + "</dl>"


def _runs_table(runs: Sequence[StoredRun]) -> str:
    """Every run (`mpfa runs`' records): its id, configuration, repeat (from 1, as `mpfa runs`), status, when, mpfa revision, time scale."""
    columns = ("id", "scenario", "backend", "engine", "point", "repeat", "status", "started", "revision", "time scale")
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = []
    ordered = sorted(runs, key=lambda r: r.id or 0)
    for run, record in zip(ordered, runs_records(ordered)):
        cells = (record["id"], record["scenario"], backend_label(run.backend, bool(run.caveat)), engine_label(run),
                 f"{context_label(run.input_len)} {record['load']}", record["repeat"] + 1, record["status"],
                 record["started_at"], run.environment.get("mpfa_revision"), record["time_scale"])
        body.append(f'<tr id="run-{run.id}">' + "".join(f"<td>{escape('—' if c is None else str(c))}</td>"
                                                        for c in cells) + "</tr>")
    return f'<table class="runs"><tr>{head}</tr>{"".join(body)}</table>'


def _backends_table(runs: Sequence[StoredRun]) -> str:
    """Per backend, the kernels its servers ran, their flags and its caveat (one line per distinct combination)."""
    served = dict.fromkeys((r.backend, describe_kernels(r.kernels), " ".join(r.backend_flags), r.caveat or "")
                           for r in runs)
    body = "".join("<tr>" + "".join(f"<td>{escape(c or '—')}</td>" for c in row) + "</tr>" for row in served)
    return ("<table><caption>Servers</caption><tr><th>backend</th><th>kernels</th><th>server flags</th>"
            f"<th>caveat</th></tr>{body}</table>")

"""Rich tables for stored runs (`mpfa runs`, `mpfa show`, `mpfa compare`) and the repeat aggregation behind them.

Runs are grouped into configurations — (scenario, context length, load point) — and, per backend, each
metric is averaged over the repeats that finished ok, with a 95% confidence interval (`repeats.mean_ci95`).
Which metrics each table shows, their labels, units and better directions come from the metric registry.
`gate` and `plot` build on the same grouping. A configuration's runs need not share a workload (output length,
request count, seed: the `workload_hash`); compare and plot mark one whose runs do not ‡ and say how in a footnote.
"""
from __future__ import annotations

import csv
import io
import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..results.metrics import registry
from ..results.metrics.repeats import mean_ci95
from ..results.metrics.summary import summarize
from ..errors import UserError
from ..harness.records import RunRecord
from ..results.export import csv_safe, kernels_text
from ..results.prefix_hits import hits_notes
from ..results.run_owner import status_label
from ..harness.sim_knobs import knobs_label
from ..results.store import StoredRun, load_key

_SHOWN_STATS = ("mean", "median", "p90", "p99")  # the stats of each distribution `mpfa show` prints
ROUNDING = 1e-9  # relative: a CI narrower than this is shown as ± 0
COMPARE_FORMATS = ("table", "json", "csv", "md")
_SIMULATED = "SIMULATED"
CAVEAT_MARK = "†"  # marks a backend whose runs carry a caveat; the caveat itself is printed once, as a footnote
WORKLOAD_MARK = "‡"  # marks a configuration whose runs served different workloads (output length, requests, seed)
APART_MARK = "§"  # marks a speed-up measured on different machines or revisions (machine starts, GPUs, mpfa revisions)
_STATUS_STYLE = {"ok": "green", "failed": "red", "interrupted": "yellow", "running": "cyan"}


def plain(value: str, style: str = "") -> Text:
    """A user string (a scenario, backend or model name, an error) as Rich shows it literally: never read as markup
    (`[/x]` in a name), control characters such as terminal escape sequences written out (`\\x1b`), not sent."""
    return Text("".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in value), style=style)


def speedup(metric: str, reference: float, value: float) -> float:
    """How many times better `value` is than `reference`: value/ref for throughput, ref/value for latency."""
    num, den = (value, reference) if registry.higher_is_better(metric) else (reference, value)
    return num / den if den > 0 else math.nan


# --- grouping and repeat aggregation ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """One measured configuration; `load` is the canonical JSON of the load point."""

    scenario: str
    input_len: int
    load: str

    @classmethod
    def of(cls, run: RunRecord) -> Config:
        return cls(run.scenario, run.input_len, load_key(run.load))

    @property
    def load_label(self) -> str:
        return load_label(json.loads(self.load))

    def sort_key(self) -> tuple[Any, ...]:
        """Scenario, context, then closed loops by concurrency before open loops by rate (numerically)."""
        load = json.loads(self.load)
        return (self.scenario, self.input_len, "concurrency" not in load, load.get("concurrency", 0),
                load.get("rate", 0.0), load.get("burstiness", 1.0))


def load_label(load: dict[str, Any]) -> str:
    """'c=8' for a closed loop, 'rate=2.0/s' for an open loop (with burstiness when it is not 1), 'trace NAME x2'
    for a trace replayed twice as fast as recorded."""
    if "trace" in load:
        return f"trace {load['trace']} x{load['speedup']:g}"
    if "concurrency" in load:
        return f"c={load['concurrency']}"
    label = f"rate={load['rate']}/s"
    burstiness = load.get("burstiness", 1.0)
    return label if burstiness == 1.0 else f"{label} b={burstiness}"


def context_label(input_len: int) -> str:
    return f"{input_len // 1024}K" if input_len >= 1024 and input_len % 1024 == 0 else str(input_len)


@dataclass(frozen=True)
class Estimate:
    """A metric across repeats: mean and 95% CI (None bounds with a single repeat)."""

    mean: float
    ci_low: float | None
    ci_high: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Estimate:
        ci = mean_ci95(values)
        if ci.half_width is None:
            return cls(ci.mean, None, None, ci.n)
        return cls(ci.mean, ci.mean - ci.half_width, ci.mean + ci.half_width, ci.n)

    @property
    def half_width(self) -> float | None:
        return None if self.ci_high is None else (self.ci_high - self.mean)

    def format(self) -> str:
        if self.half_width is None:
            return f"{format_number(self.mean)} (n=1)"
        # Repeats equal but for rounding (the simulator's) give a half-width of ~1e-15 of the mean: shown as 0.
        half_width = 0.0 if self.half_width <= ROUNDING * abs(self.mean) else self.half_width
        return f"{format_number(self.mean)} ± {format_number(half_width)}"


@dataclass
class BackendResult:
    """One backend at one configuration: its ok runs and per-metric estimates across their repeats."""

    config: Config
    backend: str
    runs: list[RunRecord]
    estimates: dict[str, Estimate]

    @property
    def simulated(self) -> bool:
        return self.runs[0].simulated

    @property
    def caveat(self) -> str | None:
        return next((r.caveat for r in self.runs if r.caveat), None)

    @property
    def workload(self) -> str | None:
        """The workload hash its runs share, or None when they served different workloads."""
        hashes = {r.workload_hash for r in self.runs}
        return hashes.pop() if len(hashes) == 1 else None


def aggregate(runs: Sequence[StoredRun], metric_names: Sequence[str]) -> dict[tuple[Config, str], BackendResult]:
    """Group runs that finished ok by (configuration, backend) and estimate each metric across repeats.

    A metric enters an estimate from every repeat that has it (finite); one missing from all is left out.
    Mixing simulated and measured runs of one backend and configuration is an error.
    """
    groups: dict[tuple[Config, str], list[StoredRun]] = defaultdict(list)
    for run in runs:
        if run.status == "ok":
            groups[(Config.of(run), run.backend)].append(run)
    results = {}
    for (config, backend), group in groups.items():
        if len({r.simulated for r in group}) > 1:
            raise UserError(
                f"runs {id_list(group)} of {backend} at {config.scenario} {context_label(config.input_len)} "
                f"{config.load_label} mix simulated and measured results; select one kind"
            )
        estimates = {}
        for name in metric_names:
            values = [v for v in (run_metric(r, name) for r in group) if math.isfinite(v)]
            if values:
                estimates[name] = Estimate.of(values)
        results[(config, backend)] = BackendResult(config, backend, group, estimates)
    return results


def run_metric(run: RunRecord, name: str) -> float:
    """A run's value of a metric (NaN when it has none): from its summary, or from its server's report."""
    return registry.column(name).read(run)


def id_list(runs: Sequence[RunRecord]) -> str:
    return ", ".join(str(r.id) for r in runs)


# --- compare -----------------------------------------------------------------------------------------------------


@dataclass
class CompareRow:
    config: Config
    metric: str
    values: dict[str, Estimate]  # by backend
    speedups: dict[str, float]  # by non-reference backend; absent where either side was not measured
    apart: dict[str, tuple[str, ...]]  # by non-reference backend: what its runs and the reference's do not share


# The baselines an inference engineer runs today, strongest first: the default reference of every speed-up (bench,
# compare, plot), so one backend's ratio reads the same in each.
REFERENCE_ORDER = ("fa3-fp8", "fa3-bf16", "flashinfer-fp8", "fa4-bf16")
REFERENCE_RULE = f"the first of {', '.join(REFERENCE_ORDER)} among the runs, else the first by name"


def default_reference(runs: Sequence[RunRecord]) -> str:
    """The strongest baseline of `REFERENCE_ORDER` with an ok run among `runs`; else the first backend by name."""
    measured = sorted({r.backend for r in runs if r.status == "ok"})
    if not measured:
        raise UserError("no run among these finished ok: nothing to compare")
    return next((name for name in REFERENCE_ORDER if name in measured), measured[0])


def reference_heading(ref_backend: str, runs: Sequence[RunRecord]) -> str:
    """'Backends vs fa3-fp8 (the reference: the strongest baseline measured; --ref to change)', or '(--ref)'."""
    chosen = ("the strongest baseline measured; --ref to change"
              if ref_backend == default_reference(runs) else "given by --ref")
    return f"Backends vs {ref_backend} ({chosen})"


def compare_rows(runs: Sequence[StoredRun], ref_backend: str,
                 metric_names: Sequence[str] | None = None) -> tuple[list[str], list[CompareRow]]:
    """The backends (reference first) and one row per (configuration, metric) with speedups vs the reference;
    the metrics default to those the registry shows in compare."""
    metric_names = registry.shown_in(registry.Report.COMPARE) if metric_names is None else metric_names
    for name in metric_names:
        registry.higher_is_better(name)  # rejects unknown names up front
    results = aggregate(runs, metric_names)
    backends = sorted({b for _, b in results})
    if ref_backend not in backends:
        measured = ", ".join(backends) or "none"
        raise UserError(f"reference backend '{ref_backend}' has no ok run among these (backends: {measured})")
    backends.remove(ref_backend)
    backends.insert(0, ref_backend)
    rows = []
    for config in sorted({c for c, _ in results}, key=Config.sort_key):
        ref_runs = results[(config, ref_backend)].runs if (config, ref_backend) in results else []
        apart_of = {b: differences([*ref_runs, *results[(config, b)].runs]) for b in backends[1:]
                    if ref_runs and (config, b) in results}  # per backend, whichever metric
        for name in metric_names:
            values = {b: results[(config, b)].estimates[name] for b in backends
                      if (config, b) in results and name in results[(config, b)].estimates}
            if not values:
                continue
            ref = values.get(ref_backend)
            speedups = {b: speedup(name, ref.mean, v.mean) for b, v in values.items()
                        if ref is not None and b != ref_backend}
            rows.append(CompareRow(config, name, values, speedups, {b: apart_of[b] for b in speedups}))
    return backends, rows


def differences(runs: Sequence[RunRecord]) -> tuple[str, ...]:
    """What the runs behind one ratio do not share: "machine" (the machine id `environment.machine`, of measured runs
    only: the simulator's numbers do not depend on the machine), "GPU", "revision" (`environment.mpfa_revision`,
    "-dirty" ignored). A value one run lacks and another has counts as different. Empty: measured together."""
    measured = [r for r in runs if not r.simulated]
    kinds = {
        "machine": {r.environment.get("machine") for r in measured},
        "GPU": {r.gpu for r in runs},
        "revision": {str(r.environment.get("mpfa_revision") or "").removesuffix("-dirty") for r in runs},
    }
    return tuple(kind for kind, values in kinds.items() if len(values) > 1)


def apart_notes(rows: Sequence[CompareRow]) -> list[str]:
    """One footnote per kind of difference of `CompareRow.apart`, naming the backends and points it marks."""
    marked: dict[tuple[str, ...], dict[str, None]] = defaultdict(dict)
    for row in rows:
        for backend, apart in row.apart.items():
            if apart:
                marked[apart][f"{backend} at {context_label(row.config.input_len)} {row.config.load_label}"] = None
    return [f"{APART_MARK} measured on different machines or revisions (different {', '.join(kinds)}), the ratio "
            f"mixes more than the backends: {', '.join(where)}" for kinds, where in marked.items()]


def compare_table(runs: Sequence[StoredRun], ref_backend: str,
                  metric_names: Sequence[str] | None = None) -> Table:
    """One value column per backend (mean ± 95% CI over repeats) and a speedup column per non-reference one."""
    backends, rows = compare_rows(runs, ref_backend, metric_names)
    title = f"{reference_heading(ref_backend, runs)}: mean ± 95% CI over repeats; speedup ×: >1 is better"
    table = Table(title=simulated_title(title, runs), title_justify="left")
    for column in ("scenario", "context", "load", "metric"):
        table.add_column(column)
    marked = caveated_backends(r for r in runs if r.status == "ok")
    for backend in backends:
        label = backend_label(backend, backend in marked)
        table.add_column(plain(label), justify="right")
        if backend != ref_backend:
            table.add_column(plain(f"{label} speedup"), justify="right")
    mixed = mixed_workloads(runs)
    for row in rows:
        load = f"{row.config.load_label} {WORKLOAD_MARK}" if row.config in mixed else row.config.load_label
        cells: list[RenderableType] = [plain(row.config.scenario), context_label(row.config.input_len), load,
                                       f"{row.metric} ({registry.column(row.metric).unit})"]
        for backend in backends:
            cells.append(row.values[backend].format() if backend in row.values else "—")
            if backend != ref_backend:
                cells.append(speedup_text(row, backend, ref_backend))
        table.add_row(*cells)
    add_footnotes(table, compare_notes(runs, rows, mixed))
    return folding(table)


def speedup_text(row: CompareRow, backend: str, ref_backend: str) -> Text:
    """The speed-up, green or red only where the two 95% CIs do not overlap; dim with '≈' where they do (or where
    a single repeat gives no CI)."""
    value = row.speedups.get(backend)
    if value is None or not math.isfinite(value):
        return Text("—")
    mark = f" {APART_MARK}" if row.apart.get(backend) else ""
    if not separated(row.values[ref_backend], row.values[backend]):
        return Text(f"≈{value:.2f}×{mark}", style="dim")
    return Text(f"{value:.2f}×{mark}", style="green" if value > 1 else "red" if value < 1 else "")


def separated(a: Estimate, b: Estimate) -> bool:
    """Whether two estimates' 95% CIs are disjoint (never, without a CI)."""
    if a.ci_low is None or b.ci_low is None:
        return False
    return a.ci_high < b.ci_low or b.ci_high < a.ci_low


# --- compare, one table per configuration: metrics as rows, backends as columns ------------------------------------


def compare_tables(runs: Sequence[StoredRun], ref_backend: str,
                   metric_names: Sequence[str] | None = None) -> Group:
    """`compare_rows` as one narrow table per configuration (metrics as rows, one column per backend, each
    non-reference value with its speed-up under it), a heading and the footnotes once."""
    backends, rows = compare_rows(runs, ref_backend, metric_names)
    marked = caveated_backends(r for r in runs if r.status == "ok")
    mixed = mixed_workloads(runs)
    heading = (f"{reference_heading(ref_backend, runs)}: mean ± 95% CI over repeats; under each value its speed-up "
               "(>1 is better), coloured only where the CIs do not overlap, else ≈")
    parts: list[RenderableType] = [Text(simulated_title(heading, runs), style="bold")]
    for config in dict.fromkeys(row.config for row in rows):
        mark = f" {WORKLOAD_MARK}" if config in mixed else ""
        title = f"{config.scenario} · {context_label(config.input_len)} input · {config.load_label}{mark}"
        table = Table(title=plain(title), title_justify="left")
        table.add_column("metric")
        for backend in backends:
            table.add_column(plain(backend_label(backend, backend in marked)), justify="right")
        for row in (r for r in rows if r.config == config):
            table.add_row(registry.column(row.metric).label, *(_cell(row, b, ref_backend) for b in backends))
        parts.append(folding(table))
    parts.extend(Text(line) for line in compare_notes(runs, rows, mixed))
    return Group(*parts)


def compare_notes(runs: Sequence[StoredRun], rows: Sequence[CompareRow],
                   mixed: dict[Config, dict[str, set[str]]]) -> list[str]:
    """A comparison's footnotes: runs left out, caveats (†), differing workloads (‡), ratios measured apart (§)."""
    left_out = sum(r.status != "ok" for r in runs)
    notes = [f"{left_out} run(s) that did not finish ok are left out"] if left_out else []
    return [*notes, *caveat_notes(r for r in runs if r.status == "ok"), *workload_notes(mixed), *apart_notes(rows),
            *hits_notes(list(runs))]


def compare_records(runs: Sequence[StoredRun], ref_backend: str,
                    metric_names: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """`compare_rows` flat, one record per (configuration, metric, backend), for JSON and CSV."""
    _, rows = compare_rows(runs, ref_backend, metric_names)
    simulated = any(r.simulated for r in runs if r.status == "ok")
    return [
        {"scenario": row.config.scenario, "input_len": row.config.input_len, "load": row.config.load_label,
         "metric": row.metric, "unit": registry.column(row.metric).unit, "backend": backend, "mean": value.mean,
         "ci95_half_width": value.half_width, "repeats": value.n, "reference": ref_backend,
         "speedup": row.speedups.get(backend),
         "cis_separate": separated(row.values[ref_backend], value) if backend in row.speedups else None,
         "apart": ",".join(row.apart.get(backend, ())), "simulated": simulated}
        for row in rows for backend, value in row.values.items()
    ]


def format_compare(runs: Sequence[StoredRun], ref_backend: str, fmt: str,
                   metric_names: Sequence[str] | None = None) -> str:
    """The comparison as JSON (records), CSV (the same, one per line) or Markdown (a table per configuration)."""
    check_format(fmt)
    if fmt in ("json", "csv"):
        return format_records(compare_records(runs, ref_backend, metric_names), fmt)
    backends, rows = compare_rows(runs, ref_backend, metric_names)
    heading = (f"{reference_heading(ref_backend, runs)}: mean ± 95% CI over repeats (speed-up: >1 is better, ≈ where "
               "CIs overlap)")
    lines = [f"**{simulated_title(heading, runs)}**"]
    for config in dict.fromkeys(row.config for row in rows):
        lines += ["", f"{config.scenario} · {context_label(config.input_len)} input · {config.load_label}", "",
                  "| metric | " + " | ".join(backends) + " |", "|---|" + "---:|" * len(backends)]
        for row in (r for r in rows if r.config == config):
            cells = (_cell(row, b, ref_backend).plain.replace("\n", " ") for b in backends)
            lines.append(f"| {registry.column(row.metric).label} | " + " | ".join(cells) + " |")
    if notes := apart_notes(rows):
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def check_format(fmt: str) -> None:
    """Refuse a --format that is not one of COMPARE_FORMATS."""
    if fmt not in COMPARE_FORMATS:
        raise UserError(f"--format: '{fmt}' is not one of {', '.join(COMPARE_FORMATS)}")


def format_records(records: Sequence[dict[str, Any]], fmt: str) -> str:
    """Flat records as JSON (a list), CSV (a header, then one line each) or Markdown (one table)."""
    if fmt == "json":
        return json.dumps(list(records), indent=1) + "\n"
    columns = list(records[0]) if records else []
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: csv_safe(v) for k, v in record.items()} for record in records)
        return out.getvalue()
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_md_cell(r[c]) for c in columns) + " |" for r in records]
    return "\n".join(lines) + "\n"


def _md_cell(value: Any) -> str:
    if isinstance(value, float):
        return format_number(value)
    return "—" if value is None else str(value).replace("|", "\\|")


def _cell(row: CompareRow, backend: str, ref_backend: str) -> Text:
    if backend not in row.values:
        return Text("—")
    value = Text(row.values[backend].format())
    if backend == ref_backend or backend not in row.speedups:
        return value
    return Text.assemble(value, "\n", speedup_text(row, backend, ref_backend))


def simulated_label(runs: Iterable[RunRecord]) -> str | None:
    """'SIMULATED', with the simulator's knobs where they were set ('SIMULATED, slowed 1.2x, noise 3% (seed 0)');
    None when no run is simulated."""
    simulated = [r for r in runs if r.simulated]
    if not simulated:
        return None
    knobs = [label for label in dict.fromkeys(knobs_label(r.server_info) for r in simulated) if label]
    return ", ".join([_SIMULATED, *knobs])


def simulated_title(title: str, runs: Sequence[RunRecord]) -> str:
    return f"{label} — {title}" if (label := simulated_label(runs)) else title


# --- workloads: runs of one configuration that did not serve the same requests -------------------------------------


def mixed_workloads(runs: Iterable[RunRecord]) -> dict[Config, dict[str, set[str]]]:
    """The configurations whose ok runs served more than one workload: for each, workload label -> backends."""
    backends: dict[Config, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for run in runs:
        if run.status == "ok":
            label = f"{run.output_len} output tokens × {run.num_requests} requests (workload {run.workload_hash[:8]})"
            backends[Config.of(run)][label].add(run.backend)
    return {config: dict(by_label) for config, by_label in backends.items() if len(by_label) > 1}


def workload_notes(mixed: dict[Config, dict[str, set[str]]]) -> list[str]:
    """One footnote per configuration of `mixed_workloads`: which backends served which workload."""
    return [
        f"{WORKLOAD_MARK} {c.scenario} {context_label(c.input_len)} {c.load_label}: workloads differ, not like for "
        "like — " + "; ".join(f"{', '.join(sorted(names))}: {label}" for label, names in sorted(mixed[c].items()))
        for c in sorted(mixed, key=Config.sort_key)
    ]


# --- caveats: numbers that are measured but not the backend's own -------------------------------------------------


def caveated_backends(runs: Iterable[RunRecord]) -> set[str]:
    """The backends of which at least one of these runs carries a caveat."""
    return {r.backend for r in runs if r.caveat}


def backend_label(backend: str, caveated: bool) -> str:
    return f"{backend} {CAVEAT_MARK}" if caveated else backend


def caveat_notes(runs: Iterable[Any]) -> list[str]:
    """One footnote per distinct caveat among the runs (or anything with `backend` and `caveat`, such as gate
    checks): '† mpfa, mpfa-direct: <caveat>'."""
    backends: dict[str, set[str]] = defaultdict(set)
    for run in runs:
        if run.caveat:
            backends[run.caveat].add(run.backend)
    return [f"{CAVEAT_MARK} {', '.join(sorted(names))}: {caveat}" for caveat, names in sorted(backends.items())]


def folding(table: Table) -> Table:
    """The table with every column folding what does not fit onto more lines, never cutting it short with '…'."""
    for column in table.columns:
        column.overflow = "fold"
    return table


def whole_words(table: Table) -> Table:
    """The table with no column narrower than its longest word, so that Rich wraps its cells between words rather
    than split a name such as 'serving-matrix' over two lines."""
    for column in table.columns:
        words = [word for cell in column.cells for word in (cell.plain if isinstance(cell, Text) else str(cell)).split()]
        column.min_width = max(map(len, words), default=None)
    return table


def add_footnotes(table: Table, lines: Sequence[str]) -> None:
    """Print `lines` under the table, left-aligned (nothing when there are none)."""
    if lines:
        table.caption = plain("\n".join(lines))
        table.caption_justify = "left"


# --- runs and show -----------------------------------------------------------------------------------------------


def time_scale(run: RunRecord) -> str | None:
    """A simulated run's pace and the clock its metrics are on ('x0.01, modelled clock'); None for a measured run."""
    if not run.simulated:
        return None
    info = run.server_info or {}
    return f"x{info.get('time_scale', 1.0):g}, {info.get('metrics_clock', 'wall')} clock"


def engine_label(run: RunRecord) -> str:
    return f"{run.engine} (simulated)" if run.simulated else run.engine


def _status_text(run: RunRecord) -> Text:
    """The run's status, coloured; a running run says whether it runs elsewhere or was killed."""
    return Text(status_label(run.status, run.environment), style=_STATUS_STYLE.get(run.status, ""))


def runs_table(runs: Sequence[StoredRun], more: int = 0) -> Table:
    """The `mpfa runs` listing: one row per run with its key metrics; `more`: how many older runs are not listed.

    It fits 80 columns without splitting a word: the scenario and its point share a column, as do the backend and
    its engine, each wrapping at its spaces; repeats count from 1, as the bench's progress does."""
    table = Table(title=simulated_title("Runs", runs), title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  padding=(0, 1), collapse_padding=True)
    for column in ("id", "when", "scenario point", "backend engine", "rep", "status"):
        table.add_column(column.replace(" ", "\n"), justify="right" if column in ("id", "rep") else "left")
    listed = registry.shown_in(registry.Report.RUNS)
    for metric in listed:
        table.add_column(registry.column(metric).label.replace(" ", "\n"), justify="right")  # "TTFT / p50 / (ms)"
    for run in runs:
        table.add_row(
            str(run.id), time.strftime("%m-%d %H:%M", time.localtime(run.started_at)),
            Text.assemble(plain(run.scenario), f" {context_label(run.input_len)} {load_label(run.load)}"),
            Text.assemble(plain(backend_label(run.backend, bool(run.caveat))), " ",
                          plain(run.engine, "magenta" if run.simulated else "")),
            str(run.repeat + 1), _status_text(run),
            *(format_number(run_metric(run, m)) for m in listed),
        )
    simulated = ["simulated runs come from the latency model (engine sim), not from a GPU"] if any(
        r.simulated for r in runs) else []
    older = [f"{more} older run(s) not listed: --all lists every run"] if more else []
    add_footnotes(table, [*simulated, *caveat_notes(runs), *older])
    return whole_words(folding(table))


def runs_records(runs: Sequence[StoredRun]) -> list[dict[str, Any]]:
    """The `mpfa runs` listing flat, one record per run, for --format json|csv|md."""
    return [
        {"id": run.id, "started_at": _when(run.started_at), "scenario": run.scenario, "backend": run.backend,
         "engine": run.engine, "simulated": run.simulated, "time_scale": time_scale(run),
         "input_len": run.input_len, "load": load_label(run.load), "repeat": run.repeat, "status": run.status,
         "caveat": run.caveat, **{m: _finite(run_metric(run, m)) for m in registry.shown_in(registry.Report.RUNS)}}
        for run in runs
    ]


def show_record(run: StoredRun) -> dict[str, Any]:
    """`mpfa show RUN` flat: its metadata and every summary metric, for --format json|csv|md."""
    summary, _ = _display_summary(run)
    return {"id": run.id, "scenario": run.scenario, "backend": run.backend, "engine": run.engine,
            "simulated": run.simulated, "time_scale": time_scale(run), "caveat": run.caveat,
            "input_len": run.input_len, "output_len": run.output_len, "load": load_label(run.load),
            "num_requests": run.num_requests, "repeat": run.repeat, "seed": run.seed,
            "workload_hash": run.workload_hash, "model": run.model, "gpu": run.gpu,
            "kernels": kernels_text(run.kernels), "started_at": _when(run.started_at),
            "finished_at": _when(run.finished_at) if run.finished_at else None, "status": run.status,
            "error": run.error, **{k: _finite(v) for k, v in sorted(summary.items())}}


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def show_run(run: StoredRun) -> RenderableType:
    """`mpfa show RUN`: the run's metadata (the kernels its server ran included), then its metrics
    (mean/median/p90/p99 per latency)."""
    meta = Table.grid(padding=(0, 2))
    meta.add_column(style="bold")
    meta.add_column()
    rows = [
        ("run", str(run.id)),
        ("scenario", run.scenario),
        ("backend", backend_label(run.backend, bool(run.caveat))),
        ("engine", engine_label(run)),
        ("load", f"{context_label(run.input_len)} input, {run.output_len} output, {load_label(run.load)}, "
                 f"{run.num_requests} requests, repeat {run.repeat + 1}, seed {run.seed}"),
        ("workload", run.workload_hash),
        ("model", run.model or "—"),
        ("gpu", run.gpu or "—"),
        *([("time scale", scale)] if (scale := time_scale(run)) else []),
        ("kernels", kernels_text(run.kernels)),
        ("started", _when(run.started_at)),
        ("finished", _when(run.finished_at) if run.finished_at else "—"),
        ("status", _status_text(run)),
    ]
    if run.error:
        rows.append(("error", plain(run.error, "red")))
    if run.backend_flags:
        rows.append(("server flags", " ".join(run.backend_flags)))
    for key, value in rows:
        meta.add_row(key, plain(value) if isinstance(value, str) else value)
    parts: list[RenderableType] = []
    if run.simulated:
        parts.append(Text(f"{simulated_label([run])}: every number below comes from the latency model, not a GPU",
                          style="bold magenta"))
    parts.append(folding(meta))
    summary, note = _display_summary(run)
    if summary:
        parts.extend(_summary_tables(summary))
    if note:
        parts.append(Text(note, style="yellow"))
    parts.extend(Text(line, style="yellow") for line in [*caveat_notes([run]), *hits_notes([run])])
    return Group(*parts)


def _display_summary(run: StoredRun) -> tuple[dict[str, float], str | None]:
    """The stored summary or, for a run that never finished, the metrics of the requests it recorded."""
    if run.summary:
        return run.summary, None
    if run.status == "running" and run.requests:
        return (summarize(run.requests),
                f"run never finished: metrics from the {len(run.requests)} request(s) it recorded")
    return {}, "no metrics recorded for this run"


def _summary_tables(summary: dict[str, float]) -> list[Table]:
    latencies = Table(title="Latency", title_justify="left")
    latencies.add_column("metric")
    for stat in _SHOWN_STATS:
        latencies.add_column(stat, justify="right")
    for metric in registry.METRICS.values():
        keys = {c.stat.name: c.key for c in metric.columns() if c.stat is not None}  # a distribution's, by stat
        if keys and any(keys[s] in summary for s in _SHOWN_STATS):
            latencies.add_row(f"{metric.header} ({metric.unit})",
                              *(format_number(summary.get(keys[s])) for s in _SHOWN_STATS))
    totals = Table(title="Throughput and counts", title_justify="left")
    totals.add_column("metric")
    totals.add_column("value", justify="right")
    for key in sorted(k for k in summary if (c := registry.find(k)) is None or c.stat is None):
        totals.add_row(key, format_number(summary[key]))
    return [folding(latencies), folding(totals)]


def format_number(value: float | None) -> str:
    """Fixed point with precision that shrinks as the magnitude grows ('—' for missing or non-finite)."""
    if value is None or not math.isfinite(value):
        return "—"
    if value == int(value) or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3g}"


def _when(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))

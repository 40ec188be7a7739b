"""Performance regression gate against a baseline JSON, and github-action-benchmark output.

Gated metrics: those the metric registry shows in the gate (`Report.GATE`): `otps` (throughput), `ttft_ms_median`
and `tpot_ms_median` (latency); `metrics.serving` says why medians.

A (scenario, context, load, backend, metric) entry regresses only when BOTH
  * it got worse than the baseline mean by more than the tolerance (relative), and
  * the 95% confidence intervals across repeats separate (current interval entirely on the worse side).
With a single repeat on either side no interval exists; that side counts as its point value, so the gate
then falls back to the tolerance alone, and its row says so ("decided by").

A baseline entry with no trustworthy current result fails the gate too, unless `allow_missing`: "missing" (no run
of that backend and point, or none of its workload), "failed" (any judged repeat of the point ended failed or
interrupted: the ok ones are not judged without it) and "not re-measured" (a judged run started no later than the
newest run the baseline was written from: the gate would judge the baseline's own runs). Unless runs are named,
only the newest pass of each (backend, point) counts (`newest_passes`): repeats of an older `mpfa bench` are not
pooled with the current ones.

Runs that carry a caveat (their numbers are measured but not the backend's own, see `BackendSpec.caveat`) are
refused, for a baseline and for judging alike, unless `allow_caveats` is set: a gate should not pass or fail on
numbers known not to be the backend's. When allowed, their entries and rows are marked † with the caveat.

github-action-benchmark takes one direction per file, so `write_github_benchmark` writes two:
throughputs in `customBiggerIsBetter` format and latencies, unconverted, in `customSmallerIsBetter` format.
"""
from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..errors import UserError
from ..results.export import dataclass_from_dict
from ..results.metrics import registry
from ..harness.records import RunRecord
from .tables import (CAVEAT_MARK, BackendResult, Config, Estimate, aggregate, backend_label,
                     caveat_notes, context_label, format_number, format_records, id_list, load_label, plain)
from ..harness.scenario import MAX_INPUT_LEN, MAX_REPEATS, load_problem
from ..harness.safe_files import write_private
from ..results.store import StoredRun, load_key

DEFAULT_TOLERANCE = 0.05


@dataclass
class BaselineEntry:
    scenario: str
    backend: str
    input_len: int
    load: dict[str, Any]
    metric: str
    higher_is_better: bool
    mean: float
    ci_low: float | None  # None with a single repeat
    ci_high: float | None
    n: int
    caveat: str | None = None  # the caveat of the runs it was measured from (only with allow_caveats)
    workload: str | None = None  # the workload hash of those runs (None: mixed, or a baseline older than the field)
    kernels: dict[str, str] | None = None  # the attention kernels their server ran (None: they differ, or unknown)
    revision: str | None = None  # their mpfa revision(s), comma-separated (None: not recorded)
    measured_until: float | None = None  # start (wall clock) of the newest of those runs (None: an older baseline)

    @property
    def key(self) -> tuple[Config, str, str]:
        return Config(self.scenario, self.input_len, load_key(self.load)), self.backend, self.metric

    @property
    def estimate(self) -> Estimate:
        return Estimate(self.mean, self.ci_low, self.ci_high, self.n)


@dataclass
class Baseline:
    gpu: str
    model: str
    simulated: bool
    created_at: float
    entries: list[BaselineEntry] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # the exports it was written from (`mpfa gate --from`)


# No trustworthy current result: these fail the gate unless allow_missing.
MISSING_STATUSES = ("missing", "failed", "other workload", "not re-measured")


@dataclass
class GateCheck:
    """One baseline entry judged against the current results; `current` is None when there is none."""

    entry: BaselineEntry
    current: Estimate | None
    worsening: float  # relative: +0.10 is 10% worse than the baseline mean, negative is better
    status: str  # regression | ok | within noise | improved | one of MISSING_STATUSES
    decided_by: str  # the rule that set the status: tolerance and CIs, tolerance alone (n=1), or why none
    caveat: str | None = None  # of the current results, else of the baseline entry

    @property
    def backend(self) -> str:
        return self.entry.backend


@dataclass
class GateResult:
    checks: list[GateCheck]
    tolerance: float
    allow_missing: bool = False
    simulated: bool = False  # judged simulated runs (the latency model's numbers, not a GPU's)

    @property
    def regressions(self) -> list[GateCheck]:
        return [c for c in self.checks if c.status == "regression"]

    @property
    def missing(self) -> list[GateCheck]:
        return [c for c in self.checks if c.status in MISSING_STATUSES]

    @property
    def ok(self) -> bool:
        return not self.regressions and (self.allow_missing or not self.missing)

    def failure(self) -> str:
        """Why the gate failed, in one line."""
        parts = [f"{len(self.regressions)} regression(s) beyond {self.tolerance:.1%}"] if self.regressions else []
        if self.missing and not self.allow_missing:
            parts.append(f"{len(self.missing)} baseline entr(y/ies) missing, failed or not re-measured "
                         "(--allow-missing accepts that)")
        return "; ".join(parts)


def parse_tolerance(text: str) -> float:
    """'5%' or '0.05' -> 0.05."""
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        raise UserError(
            f"--tolerance: expected a percentage such as 5% or a fraction such as 0.05, got '{text}'"
        ) from None
    if not 0 <= value < 1:
        raise UserError(f"--tolerance must be in [0%, 100%), got '{text}'")
    return value


# --- baselines ---------------------------------------------------------------------------------------------------


def baseline_from_runs(runs: Sequence[StoredRun], metric_names: Sequence[str] | None = None,
                       allow_caveats: bool = False) -> Baseline:
    """A baseline of every gated metric (default: the registry's) of every (configuration, backend) among the runs
    that finished ok."""
    gpu, model, simulated = _identity(runs)
    _refuse_caveats(runs, allow_caveats)
    entries = []
    for (config, backend), result in _sorted_results(runs, metric_names):
        kernels = _shared([json.dumps(r.kernels, sort_keys=True) for r in result.runs if r.kernels])
        revisions = sorted({str(r.environment["mpfa_revision"]) for r in result.runs
                            if r.environment.get("mpfa_revision")})
        for name, est in result.estimates.items():
            entries.append(BaselineEntry(
                scenario=config.scenario, backend=backend, input_len=config.input_len,
                load=json.loads(config.load), metric=name, higher_is_better=registry.higher_is_better(name),
                mean=est.mean, ci_low=est.ci_low, ci_high=est.ci_high, n=est.n, caveat=result.caveat,
                workload=result.workload, kernels=json.loads(kernels) if kernels else None,
                revision=", ".join(revisions) or None, measured_until=max(r.started_at for r in result.runs),
            ))
    if not entries:
        raise UserError("no run that finished ok with gated metrics: nothing to put in a baseline")
    return Baseline(gpu=gpu, model=model, simulated=simulated, created_at=time.time(), entries=entries)


def write_baseline(runs: Sequence[StoredRun], path: Path, allow_caveats: bool = False,
                   inputs: Sequence[str] = ()) -> Baseline:
    """The baseline of `runs`, written to `path`; `inputs`: the exports the runs were read from."""
    baseline = baseline_from_runs(runs, allow_caveats=allow_caveats)
    baseline.inputs = list(inputs)
    _write_json(path, asdict(baseline), "baseline")
    return baseline


def _shared(values: Sequence[str]) -> str | None:
    """The one value all share, else None."""
    return values[0] if values and len(set(values)) == 1 else None


def read_baseline(path: Path) -> Baseline:
    """A baseline JSON, validated field by field (types, ranges, consistent intervals); anything else is a
    one-line UserError naming the file and the field."""
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read baseline {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UserError(f"baseline {path} is not UTF-8 JSON: {str(exc).splitlines()[0]}") from None
    try:
        return _baseline_from_dict(doc)
    except ValueError as exc:
        raise UserError(f"baseline {path}: {exc} (`mpfa gate --write-baseline` writes one)") from None


def _baseline_from_dict(doc: Any) -> Baseline:
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list) or not doc["entries"]:
        raise ValueError('expected an object with a non-empty "entries" list')
    baseline = dataclass_from_dict(Baseline, {**doc, "entries": []}, "baseline", optional={"inputs"})
    baseline.entries = [_entry_from_dict(e, f"entries[{i}]") for i, e in enumerate(doc["entries"])]
    return baseline


def _entry_from_dict(data: Any, what: str) -> BaselineEntry:
    entry = dataclass_from_dict(BaselineEntry, data, what, optional={"caveat", "workload", "kernels", "revision", "measured_until"},
                                ranges={"n": (1, MAX_REPEATS), "input_len": (1, MAX_INPUT_LEN)})
    if entry.higher_is_better != registry.higher_is_better(entry.metric):
        raise ValueError(f"{what}: higher_is_better is {entry.higher_is_better} for {entry.metric}")
    if (entry.ci_low is None) != (entry.ci_high is None) or (entry.ci_low is None) != (entry.n == 1):
        raise ValueError(f"{what}: ci_low and ci_high must both be null exactly when n is 1 (n={entry.n})")
    if entry.ci_low is not None and not entry.ci_low <= entry.mean <= entry.ci_high:
        raise ValueError(f"{what}: mean {entry.mean} lies outside [ci_low, ci_high]")
    if (problem := load_problem(entry.load)) is not None:
        raise ValueError(f"{what}: {problem}")
    return entry


# --- which runs count --------------------------------------------------------------------------------------------


def newest_passes(runs: Sequence[StoredRun]) -> list[StoredRun]:
    """Per (scenario, backend, engine, point) the runs of its newest pass: the newest run that started a repeat
    sequence anew (a repeat no higher than the one before it) and the runs after it. Runs still `running` are
    left out. What an unnamed gate or baseline judges: an older bench's repeats never pool with the current ones."""
    groups: dict[tuple[Any, ...], list[StoredRun]] = {}
    for run in sorted((r for r in runs if r.status != "running"), key=lambda r: r.id or 0):
        group = groups.setdefault((Config.of(run), run.backend, run.engine), [])
        if group and run.repeat <= group[-1].repeat:
            group.clear()  # a new pass starts
        group.append(run)
    return [run for group in groups.values() for run in group]


# --- gating ------------------------------------------------------------------------------------------------------


def run_gate(baseline: Baseline, runs: Sequence[StoredRun], tolerance: float = DEFAULT_TOLERANCE,
             allow_caveats: bool = False, allow_missing: bool = False) -> GateResult:
    """Judge each baseline entry against the runs (of any status: failed ones mark their entries failed); refuses
    results from another GPU, model or engine kind, and (unless `allow_caveats`) caveated runs or baseline
    entries. The result fails on a regression, and on a missing or failed entry unless `allow_missing`."""
    gpu, model, simulated = _identity(runs)
    _refuse_caveats(runs, allow_caveats)
    if not allow_caveats:
        _refuse_caveated("baseline entries", [e for e in baseline.entries if e.caveat])
    for what, base, cur in (("GPU", baseline.gpu, gpu), ("model", baseline.model, model)):
        if base != cur:
            raise UserError(f"baseline was measured with {what} '{base}' but the results with '{cur}': "
                            "not comparable")
    if baseline.simulated != simulated:
        kinds = {True: "simulated", False: "measured"}
        raise UserError(f"baseline is {kinds[baseline.simulated]} but the results are {kinds[simulated]}: "
                        "not comparable")
    results = aggregate(runs, sorted({e.metric for e in baseline.entries}))
    unfinished = _unfinished(runs)
    checks = []
    for entry in baseline.entries:
        config, backend, metric = entry.key
        result = results.get((config, backend))
        current = result.estimates.get(metric) if result else None
        if failed := unfinished.get((config, backend)):
            check = _failed(entry, failed)
        elif current is None:
            check = GateCheck(entry, None, math.nan, "missing", "no run of this backend and point")
        elif entry.workload and result.workload != entry.workload:  # other output length / requests / seed
            check = GateCheck(entry, None, math.nan, "other workload", "its runs served another workload")
        elif stale := [r for r in result.runs if entry.measured_until is not None
                       and r.started_at <= entry.measured_until]:
            check = GateCheck(entry, None, math.nan, "not re-measured",
                              f"run(s) {id_list(stale)} started before the baseline's newest run: measure anew")
        else:
            check = _judge(entry, current, tolerance)
        check.caveat = (result.caveat if result else None) or entry.caveat
        checks.append(check)
    if all(c.status in ("missing", "other workload") for c in checks):
        raise UserError("none of the results match a baseline entry (scenario, context, load, backend, workload): "
                        "every baseline entry is missing", exit_code=1)
    return GateResult(checks, tolerance, allow_missing, simulated)


def _unfinished(runs: Sequence[StoredRun]) -> dict[tuple[Config, str], list[StoredRun]]:
    """The runs that did not finish ok, by (configuration, backend)."""
    by_key: dict[tuple[Config, str], list[StoredRun]] = {}
    for run in runs:
        if run.status != "ok":
            by_key.setdefault((Config.of(run), run.backend), []).append(run)
    return by_key


def _failed(entry: BaselineEntry, unfinished: Sequence[StoredRun]) -> GateCheck:
    reason = next((r.error for r in unfinished if r.error), None) or unfinished[0].status
    return GateCheck(entry, None, math.nan, "failed",
                     f"run(s) {id_list(unfinished)} {unfinished[0].status}: {reason.splitlines()[0]:.80}")


def _judge(entry: BaselineEntry, current: Estimate, tolerance: float) -> GateCheck:
    change = _relative_change(entry.mean, current.mean)
    worsening = -change if entry.higher_is_better else change
    base_low, base_high = _bounds(entry.estimate)
    cur_low, cur_high = _bounds(current)
    worse_apart = cur_high < base_low if entry.higher_is_better else cur_low > base_high
    better_apart = cur_low > base_high if entry.higher_is_better else cur_high < base_low
    if worsening > tolerance:
        status = "regression" if worse_apart else "within noise"
    elif -worsening > tolerance and better_apart:
        status = "improved"
    else:
        status = "ok"
    return GateCheck(entry, current, worsening, status, _rule(entry.estimate, current, tolerance))


def _rule(baseline: Estimate, current: Estimate, tolerance: float) -> str:
    """Which rule judged a row: the tolerance and the 95% CIs, or the tolerance alone where a side has n=1 (a
    single repeat has no interval: nothing is widened for it)."""
    single = [side for side, est in (("baseline", baseline), ("current", current)) if est.n == 1]
    if not single:
        return f"{tolerance:.1%} and 95% CIs"
    return f"{tolerance:.1%} alone: {' and '.join(single)} n=1"


def _refuse_caveats(runs: Sequence[StoredRun], allow: bool) -> None:
    if not allow and (caveated := [r for r in runs if r.status == "ok" and r.caveat]):
        _refuse_caveated(f"run(s) {id_list(caveated)}", caveated)


def _refuse_caveated(what: str, caveated: Sequence[RunRecord | BaselineEntry]) -> None:
    if caveated:
        raise UserError(
            f"{what} of {', '.join(sorted({c.backend for c in caveated}))} carry a caveat ({caveated[0].caveat}): "
            "a gate on numbers that are not the backend's own would pass or fail for the wrong reason; leave them "
            f"out (--results) or pass --allow-caveats to gate them anyway, marked {CAVEAT_MARK}"
        )


def _relative_change(base: float, current: float) -> float:
    if base == 0:
        return 0.0 if current == 0 else math.copysign(math.inf, current)
    return (current - base) / abs(base)


def _bounds(est: Estimate) -> tuple[float, float]:
    if est.ci_low is None or est.ci_high is None:
        return est.mean, est.mean
    return est.ci_low, est.ci_high


# --- the verdict: a summary line, then the rows that failed (all with verbose) ----------------------------------

GATE_FORMATS = ("table", "md", "json")
_STATUS_STYLE = {"regression": "bold red", "within noise": "yellow", "ok": "green", "improved": "cyan"}


def check_gate_format(fmt: str) -> None:
    if fmt not in GATE_FORMATS:
        raise UserError(f"--format: '{fmt}' is not one of {', '.join(GATE_FORMATS)}")


def gate_summary(result: GateResult) -> str:
    """The verdict in one line: 'Gate passed: 4 points ...' or 'Gate FAILED: 1 of 4 points: ...', SIMULATED where
    the runs are the latency model's."""
    points = {_point(c) for c in result.checks}
    if result.ok:
        line = (f"Gate passed: {len(points)} point(s), {len(result.checks)} metric(s) within "
                f"{result.tolerance:.1%} (95% CIs)")
        if result.missing:
            line += f"; {len(result.missing)} missing or failed, allowed by --allow-missing"
    else:
        failing = {_point(c) for c in result.checks if _fails(c, result)}
        line = f"Gate FAILED: {len(failing)} of {len(points)} point(s): {result.failure()}"
    return line + ("; SIMULATED" if result.simulated else "")


def _point(check: GateCheck) -> tuple[Config, str]:
    config, backend, _ = check.entry.key
    return config, backend


def _fails(check: GateCheck, result: GateResult) -> bool:
    return check.status == "regression" or (check.status in MISSING_STATUSES and not result.allow_missing)


def shown_checks(result: GateResult, verbose: bool = False) -> list[GateCheck]:
    """The rows a verdict lists: every one with `verbose`, else the regressions and missing points."""
    return [c for c in result.checks if verbose or c.status == "regression" or c.status in MISSING_STATUSES]


def gate_records(checks: Sequence[GateCheck]) -> list[dict[str, Any]]:
    """The rows flat, one record per check, for --format md|json."""
    return [{"scenario": c.entry.scenario, "context": context_label(c.entry.input_len),
             "load": load_label(c.entry.load), "backend": c.backend, "metric": c.entry.metric,
             "baseline": c.entry.estimate.format(), "current": c.current.format() if c.current else None,
             "change": _change(c), "status": c.status, "decided_by": c.decided_by, "caveat": c.caveat}
            for c in checks]


def format_gate(result: GateResult, fmt: str, verbose: bool = False) -> str:
    """The verdict as Markdown (the summary, then a table of the rows shown) or JSON (every row)."""
    if fmt == "json":
        return json.dumps({"passed": result.ok, "summary": gate_summary(result), "simulated": result.simulated,
                           "tolerance": result.tolerance, "checks": gate_records(result.checks)}, indent=1) + "\n"
    rows = shown_checks(result, verbose)
    return f"**{gate_summary(result)}**\n" + (f"\n{format_records(gate_records(rows), 'md')}" if rows else "")


_COLUMNS = ("metric", "baseline", "current", "change", "status", "why")


def gate_table(result: GateResult, verbose: bool = False) -> RenderableType | None:
    """The rows shown (`shown_checks`), under a heading line per point (scenario, context, load, backend), in columns
    of one width throughout; only "why" wraps, at its spaces, so no cell is cut at 80 columns (None: no rows)."""
    rows = shown_checks(result, verbose)
    if not rows:
        return None
    points: dict[tuple[Config, str], list[list[Text]]] = {}
    for check in rows:
        points.setdefault(_point(check), []).append(_row_cells(check, result))
    every_row = [cells for point in points.values() for cells in point]
    widths = [max(len(column), *(cells[i].cell_len for cells in every_row)) for i, column in enumerate(_COLUMNS[:-1])]
    parts: list[RenderableType] = []
    for n, ((config, backend), point_rows) in enumerate(points.items()):
        caveated = any(c.caveat for c in rows if _point(c) == (config, backend))
        parts.append(plain(f"{config.scenario} {context_label(config.input_len)} {config.load_label} · "
                           f"{backend_label(backend, caveated)}", "bold"))
        table = Table(box=None, show_header=n == 0, header_style="bold dim", pad_edge=False, padding=(0, 1))
        for column, width in zip(_COLUMNS, [*widths, None]):
            table.add_column(column, width=width, overflow="fold",
                             justify="right" if column in ("baseline", "current", "change") else "left")
        for cells in point_rows:
            table.add_row(*cells)
        parts.append(table)
    parts.extend(plain(line) for line in caveat_notes(rows))
    return Group(*parts)


def _row_cells(check: GateCheck, result: GateResult) -> list[Text]:
    missing_style = "dim" if result.allow_missing else "bold red"
    return [Text(registry.column(check.entry.metric).label), Text(check.entry.estimate.format()),
            Text(check.current.format() if check.current else "—"), Text(_change(check) or "—"),
            Text(check.status, style=_STATUS_STYLE.get(check.status, missing_style)), plain(check.decided_by)]


def _change(check: GateCheck) -> str | None:
    return None if check.current is None else f"{_relative_change(check.entry.mean, check.current.mean):+.1%}"


# --- github-action-benchmark -------------------------------------------------------------------------------------


def github_benchmark_entries(runs: Sequence[StoredRun],
                             metric_names: Sequence[str] | None = None) -> tuple[list[dict], list[dict]]:
    """(bigger-is-better entries, smaller-is-better entries) in github-action-benchmark's custom format, of the
    gated metrics (default: the registry's)."""
    bigger: list[dict] = []
    smaller: list[dict] = []
    for (config, backend), result in _sorted_results(runs, metric_names):
        for name, est in result.estimates.items():
            entry: dict[str, Any] = {
                "name": f"{config.scenario}/{context_label(config.input_len)}/{config.load_label}/{backend}/{name}",
                "unit": registry.column(name).unit,
                "value": est.mean,
                "extra": f"mean of {est.n} repeat(s)" + ("; SIMULATED" if result.simulated else "")
                         + (f"; {CAVEAT_MARK} {result.caveat}" if result.caveat else ""),
            }
            if est.half_width is not None:
                entry["range"] = f"± {format_number(est.half_width)}"
            (bigger if registry.higher_is_better(name) else smaller).append(entry)
    return bigger, smaller


def write_github_benchmark(runs: Sequence[StoredRun], bigger_path: Path, smaller_path: Path) -> None:
    """Throughputs to `bigger_path` (tool: customBiggerIsBetter), latencies to `smaller_path`
    (tool: customSmallerIsBetter), each a list of {name, unit, value, range?, extra}."""
    bigger, smaller = github_benchmark_entries(runs)
    _write_json(bigger_path, bigger, "benchmark")
    _write_json(smaller_path, smaller, "benchmark")


def _sorted_results(runs: Sequence[StoredRun],
                    metric_names: Sequence[str] | None) -> list[tuple[tuple[Config, str], BackendResult]]:
    """The results of the gated metrics (default: the registry's), by configuration then backend."""
    gated = registry.shown_in(registry.Report.GATE) if metric_names is None else metric_names
    results = aggregate(runs, gated)
    return sorted(results.items(), key=lambda kv: (kv[0][0].sort_key(), kv[0][1]))


def _identity(runs: Sequence[RunRecord]) -> tuple[str, str, bool]:
    """The GPU, model and simulated flag shared by all runs; differing ones cannot be gated together."""
    if not runs:
        raise UserError("no runs given")
    for what in ("gpu", "model", "simulated"):
        values = {getattr(r, what) for r in runs}
        if len(values) > 1:
            raise UserError(f"runs differ in {what} ({', '.join(sorted(map(str, values)))}): gate one kind at a time")
    first = runs[0]
    return first.gpu, first.model, first.simulated


def _write_json(path: Path, doc: Any, what: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode(), "baseline")
    except OSError as exc:
        raise UserError(f"cannot write {what} file {path}: {exc.strerror or exc}") from None

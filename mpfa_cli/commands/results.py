"""Stored runs: `mpfa runs`, `show`, `compare`, `export`, `import`, `plot`, `gate` and `report`."""
from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from .common import DbOption, cli_errors, console, err_console, number_list, open_store
from .selection import (AccuracyFlag, BackendFilter, FormatOption, RefOption, RunIds, ScenarioFilter, WideFlag,
                        accuracy_reports, compared_runs, distinct_ids, id_ranges, selected_runs, used_line)
from ..errors import UserError


RUNS_LISTED = 20  # `mpfa runs` lists the newest 20 unless --all or --limit
FromExports = Annotated[Optional[list[Path]], typer.Option("--from", help="Take the runs from these JSON exports (repeat the flag) instead of the database.")]


@cli_errors
def runs(
    scenario: ScenarioFilter = None, backend: BackendFilter = None,
    limit: Annotated[int, typer.Option(metavar="N", help="Newest N runs.")] = RUNS_LISTED,
    every_run: Annotated[bool, typer.Option("--all/--newest", help="Every run, not only the newest --limit.")] = False,
    output_format: FormatOption = "table", db: DbOption = None,
) -> None:
    """List stored runs, newest first (repeats count from 1)."""
    from ..reports.tables import check_format, format_records, runs_records, runs_table

    check_format(output_format)
    if limit < 1:
        raise UserError("--limit: expected a number of runs >= 1")
    with open_store(db) as store:
        listed = store.list_runs(scenario=scenario, backend=backend, limit=None if every_run else limit + 1)
        more = 0 if len(listed) <= limit or every_run else len(store.list_runs(scenario=scenario, backend=backend)) - limit
    listed = listed if every_run else listed[:limit]
    if output_format == "table":
        console.print(runs_table(listed, more))
    else:
        print(format_records(runs_records(listed), output_format), end="")


@cli_errors
def show(run_id: Annotated[int, typer.Argument(help="Run id (see `mpfa runs`).")],
         output_format: FormatOption = "table", db: DbOption = None) -> None:
    """One run: metadata, the kernels its server ran, server and environment, and its metrics."""
    from ..reports.tables import check_format, format_records, show_record, show_run

    check_format(output_format)
    with open_store(db) as store:
        run = store.get_run(run_id)
    if output_format == "table":
        console.print(show_run(run))
    elif output_format == "json":
        print(json.dumps(show_record(run), indent=1))
    else:
        print(format_records([show_record(run)], output_format), end="")


@cli_errors
def compare(
    run_ids: RunIds = None, ref: RefOption = None,
    scenario: ScenarioFilter = None, accuracy: AccuracyFlag = False, wide: WideFlag = False,
    output_format: FormatOption = "table", from_exports: FromExports = None, db: DbOption = None,
) -> None:
    """Backends side by side, one table per point: mean ± 95% CI across repeats and the speedup vs the reference
    backend (coloured only where the CIs separate). Default: the newest scenario's runs; runs of different engines,
    GPUs, models or time scales are refused; the first line names the runs used.

    With --accuracy: the task-accuracy table of each stored `mpfa accuracy task` result named (default: the newest).
    """
    if accuracy:
        from ..accuracy.served import ServedAccuracy, render
        from ..accuracy.tasks.task_report import render_task_accuracy

        for report in accuracy_reports(db, run_ids, scenario):
            (render if isinstance(report, ServedAccuracy) else render_task_accuracy)(report, console)
        return
    from ..reports.tables import check_format, compare_table, compare_tables, default_reference, format_compare

    check_format(output_format)
    with _runs_store(from_exports, db, run_ids, "the run ids") as store:
        runs = compared_runs(store, run_ids, scenario)
        used = used_line(runs, store, from_exports)
    (console if output_format == "table" else err_console).print(used, highlight=False, markup=False)
    ref = ref or default_reference(runs)
    if output_format != "table":
        print(format_compare(runs, ref, output_format), end="")
    else:
        console.print(compare_table(runs, ref) if wide else compare_tables(runs, ref))


@cli_errors
def export(
    run_ids: RunIds = None,
    fmt: Annotated[str, typer.Option("--format", help="json or csv.")] = "json",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: stdout).")] = None,
    requests: Annotated[bool, typer.Option("--requests/--no-requests", help="Include every request (json only).")] = False,
    scenario: ScenarioFilter = None, backend: BackendFilter = None, db: DbOption = None,
) -> None:
    """Export runs (with their `simulated` flag and kernels) as JSON or CSV."""
    from ..results.export import EXPORT_FORMATS, export_runs

    if fmt not in EXPORT_FORMATS:  # before the store opens
        raise UserError(f"unknown format '{fmt}'; valid: {', '.join(EXPORT_FORMATS)}")
    with open_store(db) as store:
        ids = distinct_ids(run_ids) or [r.id for r in selected_runs(store, None, scenario, backend)]
        export_runs(store.get_runs(ids, with_requests=requests), fmt, output or sys.stdout, include_requests=requests)


@cli_errors
def import_runs(
    files: Annotated[list[Path], typer.Argument(help="JSON exports (`mpfa export --format json [--requests]`) or recovery files (what a bench could not store).")],
    db: DbOption = None,
) -> None:
    """Load exported runs into the database (new ids); a run already there is skipped. All or nothing: every file
    is read and validated first, and the runs are stored in one transaction.

    A summary is never taken on trust: a run with requests gets the summary its requests give (a stale one in the
    file is replaced, and the line says so), and a run marked ok whose requests failed is stored as failed. A run
    exported without requests keeps its summary, reported as unverified.

    A run counts as already there when one of the same scenario, backend, engine, context, load, repeat and
    start time (wall clock, exact) is stored. Runs are stored in order of their start time, so the newest of a
    configuration gets the highest id (what compare/plot pick).
    """
    checked = _checked_exports(files)
    with open_store(db) as store:
        outcomes = store.import_runs(check.run for _, check in checked)
    for path in files:
        mine = [(check, outcome) for (p, check), outcome in zip(checked, outcomes) if p == path]
        console.print(f"{_import_line(path, mine)} — {store.path}", highlight=False, soft_wrap=True, markup=False)


def _checked_exports(files: list[Path]) -> list:
    """(file, `export.derive_summary` of each run) for every run of the exports, oldest start first."""
    from ..results.export import derive_summary
    from ..results.recovery import read_runs_file

    checked = [(path, derive_summary(run)) for path in files for run in read_runs_file(path)]
    checked.sort(key=lambda pc: pc[1].run.started_at)
    return checked


def _runs_store(from_exports: list[Path] | None, db: Path | None, named, what: str):
    """The runs' store: a throw-away one of the exports (`--from`), else the database."""
    if from_exports and (named or db):
        raise UserError(f"--from takes the runs from the exports: drop {what} and --db")
    return _exports_store(from_exports) if from_exports else open_store(db)


@contextmanager
def _exports_store(files: list[Path]) -> Iterator:
    """A throw-away database holding the runs of `files`, as `mpfa import` stores them."""
    checked = _checked_exports(files)
    if not checked:
        raise UserError(f"no runs in {', '.join(map(str, files))}")
    with tempfile.TemporaryDirectory(prefix="mpfa-exports-") as tmp, open_store(Path(tmp) / "exports.db") as store:
        store.import_runs(check.run for _, check in checked)
        yield store


def _import_line(path: Path, imported: list) -> str:
    """What became of one file's runs: ids added and skipped, summaries recomputed, unverified, failed."""
    added = [run_id for _, (run_id, new) in imported if new]
    skipped = [run_id for _, (run_id, new) in imported if not new]
    line = f"{path}: imported {len(added)} run(s)" + (f" as {id_ranges(added)}" if added else "")
    if skipped:
        line += f"; skipped {len(skipped)} already stored (as {id_ranges(skipped)})"
    for check, (run_id, _) in imported:
        if check.stale:
            line += (f"; run {check.run.id} (here {run_id}): stale summary ({', '.join(check.stale[:4])}"
                     f"{', ...' if len(check.stale) > 4 else ''}) replaced by the one its requests give")
    if unverified := [run_id for check, (run_id, _) in imported if check.unverified]:
        line += f"; {id_ranges(unverified)}: no requests in the file, summary unverified"
    if failed := [run_id for check, (run_id, _) in imported if check.run.status != "ok"]:
        line += f"; {id_ranges(failed)} did not finish ok (kept, never gated as ok)"
    return line


@cli_errors
def plot(
    run_ids: RunIds = None, ref: RefOption = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Figure file; its suffix follows --format, and with several scenarios each gets its name appended (default: mpfa-serving.png; with --accuracy mpfa-accuracy.png).")] = None,
    figure_format: Annotated[str, typer.Option("--format", help="png, svg or both.")] = "png",
    scenario: ScenarioFilter = None, accuracy: AccuracyFlag = False, from_exports: FromExports = None,
    db: DbOption = None,
) -> None:
    """Paper-style figures, one per scenario: OTPS and TTFT/TPOT speedup vs context length for every backend and
    load, error bars the 95% CI over repeats, the model, GPU, engine and dates in the title. Runs are selected as by
    `mpfa compare`.

    With --accuracy ID: one stored `mpfa accuracy task` result (default: the newest), per task each variant's
    score, its loss vs bf16 and MpFA's recovery.
    """
    from ..accuracy.plot import plot_accuracy
    from ..reports.plot import check_figure_format, plot_runs
    from ..reports.tables import default_reference

    check_figure_format(figure_format)
    if accuracy:
        if run_ids and len(run_ids) > 1:
            raise UserError(f"--accuracy plots one result at a time, got {len(run_ids)} ids")
        (report,) = accuracy_reports(db, run_ids, scenario)
        paths = plot_accuracy(report, output or Path("mpfa-accuracy.png"), figure_format)
    else:
        with _runs_store(from_exports, db, run_ids, "the run ids") as store:
            selected = compared_runs(store, run_ids, scenario)
            used = used_line(selected, store, from_exports)
        console.print(used, highlight=False, markup=False)
        paths = plot_runs(selected, ref or default_reference(selected), output or Path("mpfa-serving.png"), figure_format)
    console.print(f"wrote {', '.join(map(str, paths))}", highlight=False)


@cli_errors
def gate(
    baseline: Annotated[Path, typer.Option("--baseline", help="Baseline JSON (profiles/baselines/).")],
    results: Annotated[Optional[list[str]], typer.Option("--results", help="Run ids to judge: 1,2,3 or repeated (default: the newest pass of each backend and point).")] = None,
    tolerance: Annotated[str, typer.Option(help="Allowed drop, e.g. 5% or 0.05.")] = "5%",
    write_baseline: Annotated[bool, typer.Option("--write-baseline/--no-write-baseline", help="Write the baseline from the runs instead of judging.")] = False,
    benchmark_json: Annotated[Optional[Path], typer.Option(help="Also write PREFIX-bigger.json (throughputs) and PREFIX-smaller.json (latencies): the runs' gated metrics for github-action-benchmark's custom tools.", metavar="PREFIX")] = None,
    allow_caveats: Annotated[bool, typer.Option("--allow-caveats/--no-allow-caveats", help="Gate runs whose numbers carry a caveat (not the backend's own; refused otherwise).")] = False,
    allow_missing: Annotated[bool, typer.Option("--allow-missing/--no-allow-missing", help="Pass although baseline entries have no current result or only failed runs.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose/--no-verbose", help="List every row, not only the regressions and missing points.")] = False,
    output_format: Annotated[str, typer.Option("--format", help="table, md (Markdown) or json (every row).")] = "table",
    from_exports: FromExports = None, scenario: ScenarioFilter = None, db: DbOption = None,
) -> None:
    """Judge the newest pass of each point against a baseline: a regression is a drop beyond the tolerance with
    separated 95% CIs (the tolerance alone where a side has a single repeat; each row says which rule decided it).
    A point fails where any of its judged repeats failed, and where its runs are not newer than the baseline's.

    Prints the verdict in one line, then the regressions and missing points (every row with --verbose). A baseline
    written from exports (--write-baseline --from) lists them under its inputs.

    Exit codes: 0 passed; 1 a regression, or a baseline point missing, failed or not re-measured (unless
    --allow-missing); 2 bad usage or bad input (a malformed baseline, an unknown run id, incomparable runs).
    """
    from ..reports import gate as gating

    gating.check_gate_format(output_format)
    named = distinct_ids([i for text in results or [] for i in number_list(text, "--results")])
    with _runs_store(from_exports, db, named, "--results") as store:
        runs = store.get_runs(named) if named else gating.newest_passes(store.list_runs(scenario=scenario))
        if benchmark_json:
            gating.write_github_benchmark(
                runs, Path(f"{benchmark_json}-bigger.json"), Path(f"{benchmark_json}-smaller.json")
            )
        if write_baseline:
            written = gating.write_baseline(runs, baseline, allow_caveats, [str(p) for p in from_exports or []])
            console.print(f"wrote {len(written.entries)} baseline entries to {baseline}")
            return
        judged = gating.read_baseline(baseline)
        if scenario:
            judged.entries = [e for e in judged.entries if e.scenario == scenario]
        if not named:
            runs = [r for r in runs if (r.gpu, r.model, r.simulated) == (judged.gpu, judged.model, judged.simulated)]
        if not runs:
            where = "the exports" if from_exports else store.path
            raise UserError(f"no runs of {judged.gpu}, {judged.model} in {where}: every baseline entry is "
                            "missing", exit_code=1)
        result = gating.run_gate(judged, runs, gating.parse_tolerance(tolerance), allow_caveats, allow_missing)
    if output_format != "table":
        print(gating.format_gate(result, output_format, verbose), end="")
    else:
        console.print(escape(gating.gate_summary(result)), style="bold" if result.ok else "bold red", highlight=False)
        if (table := gating.gate_table(result, verbose)) is not None:
            console.print(table)
    if not result.ok:
        raise typer.Exit(1)



@cli_errors
def report(
    run_ids: RunIds = None, ref: RefOption = None, scenario: ScenarioFilter = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="HTML file to write.")] = Path("mpfa-report.html"),
    from_exports: FromExports = None, db: DbOption = None,
) -> None:
    """One self-contained HTML file (no network needed to view it): compare's tables with CIs and speed-ups, plot's
    figures, the runs' provenance, caveats and the SIMULATED label where it applies. Runs are selected as by
    `mpfa compare`."""
    from ..harness.safe_files import write_private
    from ..reports.html import render_report
    from ..reports.tables import default_reference

    with _runs_store(from_exports, db, run_ids, "the run ids") as store:
        runs = compared_runs(store, run_ids, scenario)
        used = used_line(runs, store, from_exports)
    console.print(used, highlight=False, markup=False)
    write_private(output, render_report(runs, ref or default_reference(runs), used).encode(), "report")
    console.print(f"wrote {output}", highlight=False)

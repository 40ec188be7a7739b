"""Stored runs: `mpfa runs`, `show`, `compare`, `export`, `import`, `plot` and `gate`."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from mpfa.cli.common import DbOption, cli_errors, console, open_store
from mpfa.cli.selection import (AccuracyFlag, BackendFilter, RunIds, ScenarioFilter, accuracy_reports,
                                selected_runs)
from mpfa.harness.errors import UserError


@cli_errors
def runs(
    scenario: ScenarioFilter = None, backend: BackendFilter = None,
    limit: Annotated[int, typer.Option(help="Newest N runs.")] = 50, db: DbOption = None,
) -> None:
    """List stored runs, newest first."""
    from mpfa.harness.run_tables import runs_table

    with open_store(db) as store:
        console.print(runs_table(store.list_runs(scenario=scenario, backend=backend, limit=limit)))


@cli_errors
def show(run_id: Annotated[int, typer.Argument(help="Run id (see `mpfa runs`).")], db: DbOption = None) -> None:
    """One run: metadata, the kernels its server ran, server and environment, and its metrics."""
    from mpfa.harness.run_tables import show_run

    with open_store(db) as store:
        console.print(show_run(store.get_run(run_id)))


@cli_errors
def compare(
    run_ids: RunIds = None, ref: Annotated[str, typer.Option("--ref", help="Reference backend.")] = "fa4-bf16",
    scenario: ScenarioFilter = None, accuracy: AccuracyFlag = False, db: DbOption = None,
) -> None:
    """Backends side by side: mean ± 95% CI across repeats and the speedup vs the reference backend.

    With --accuracy: the task-accuracy table of each stored `mpfa accuracy task` result named (default: the newest).
    """
    if accuracy:
        from mpfa.kernels.tasks.task_report import render_task_accuracy

        for report in accuracy_reports(db, run_ids, scenario):
            render_task_accuracy(report, console)
        return
    from mpfa.harness.run_tables import compare_table

    with open_store(db) as store:
        console.print(compare_table(selected_runs(store, run_ids, scenario, None), ref_backend=ref))


@cli_errors
def export(
    run_ids: RunIds = None,
    fmt: Annotated[str, typer.Option("--format", help="json or csv.")] = "json",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="File to write (default: stdout).")] = None,
    requests: Annotated[bool, typer.Option("--requests", help="Include every request (json only).")] = False,
    scenario: ScenarioFilter = None, backend: BackendFilter = None, db: DbOption = None,
) -> None:
    """Export runs (with their `simulated` flag and kernels) as JSON or CSV."""
    from mpfa.harness.export import export_runs

    if fmt not in ("json", "csv"):
        raise UserError(f"unknown format '{fmt}'; valid: json, csv")
    with open_store(db) as store:
        ids = run_ids or [r.id for r in selected_runs(store, None, scenario, backend)]
        export_runs(store.get_runs(ids, with_requests=requests), fmt, output or sys.stdout, include_requests=requests)


@cli_errors
def import_runs(
    files: Annotated[list[Path], typer.Argument(help="JSON exports (`mpfa export --format json [--requests]`).")],
    db: DbOption = None,
) -> None:
    """Load exported runs into the database as they were (new ids); a run already there is skipped.

    A run counts as already there when one of the same scenario, backend, engine, context, load, repeat and
    start time (wall clock, exact) is stored. Every file is read before any run is stored; runs are stored in
    order of their start time, so the newest of a configuration gets the highest id (what compare/plot pick).
    """
    from mpfa.harness.export import read_export

    exported = [(path, run) for path in files for run in read_export(path)]
    stored: dict[Path, tuple[list[int], list[int]]] = {path: ([], []) for path in files}
    with open_store(db) as store:
        for path, run in sorted(exported, key=lambda pr: pr[1].started_at):
            run_id, new = store.import_run(run)
            stored[path][0 if new else 1].append(run_id)
    for path, (added, skipped) in stored.items():
        line = f"{path}: imported {len(added)} run(s)" + (f" as {_id_ranges(added)}" if added else "")
        if skipped:
            line += f"; skipped {len(skipped)} already stored (as {_id_ranges(skipped)})"
        console.print(f"{line} — {store.path}", highlight=False, soft_wrap=True)


def _id_ranges(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> 'runs 1–3, 7'."""
    parts: list[list[int]] = []
    for i in sorted(ids):
        if parts and i == parts[-1][-1] + 1:
            parts[-1].append(i)
        else:
            parts.append([i])
    return "runs " + ", ".join(f"{p[0]}–{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)


@cli_errors
def plot(
    run_ids: RunIds = None, ref: Annotated[str, typer.Option("--ref", help="Reference backend.")] = "fa4-bf16",
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="PNG file (default: mpfa-serving.png; with --accuracy mpfa-accuracy.png).")] = None,
    scenario: ScenarioFilter = None, accuracy: AccuracyFlag = False, db: DbOption = None,
) -> None:
    """Paper-style PNG: OTPS and TTFT/TPOT speedup vs context length, per backend and load.

    With --accuracy ID: one stored `mpfa accuracy task` result (default: the newest), per task each variant's
    score, its loss vs bf16 and MpFA's recovery.
    """
    from mpfa.harness.plot import plot_runs, plot_task_accuracy

    if accuracy:
        if run_ids and len(run_ids) > 1:
            raise UserError(f"--accuracy plots one result at a time, got {len(run_ids)} ids")
        (report,) = accuracy_reports(db, run_ids, scenario)
        path = plot_task_accuracy(report, output or Path("mpfa-accuracy.png"))
    else:
        with open_store(db) as store:
            selected = selected_runs(store, run_ids, scenario, None)
            path = plot_runs(selected, ref_backend=ref, out_png=output or Path("mpfa-serving.png"))
    console.print(f"wrote {path}")


@cli_errors
def gate(
    baseline: Annotated[Path, typer.Option("--baseline", help="Baseline JSON (profiles/baselines/).")],
    results: Annotated[Optional[list[int]], typer.Option("--results", help="Run ids to judge (repeatable; default: newest runs).")] = None,
    tolerance: Annotated[str, typer.Option(help="Allowed drop, e.g. 5% or 0.05.")] = "5%",
    write_baseline: Annotated[bool, typer.Option("--write-baseline", help="Write the baseline from the runs instead of judging.")] = False,
    benchmark_json: Annotated[Optional[Path], typer.Option(help="Also write github-action-benchmark files with this prefix.")] = None,
    allow_caveats: Annotated[bool, typer.Option("--allow-caveats", help="Gate runs whose numbers carry a caveat (not the backend's own; refused otherwise).")] = False,
    scenario: ScenarioFilter = None, db: DbOption = None,
) -> None:
    """Fail (exit 1) when a metric dropped by more than the tolerance and the confidence intervals separate."""
    from mpfa.harness import gate as gating

    with open_store(db) as store:
        selected = selected_runs(store, results, scenario, None)
        if benchmark_json:
            gating.write_github_benchmark(
                selected, Path(f"{benchmark_json}-bigger.json"), Path(f"{benchmark_json}-smaller.json")
            )
        if write_baseline:
            written = gating.write_baseline(selected, baseline, allow_caveats)
            console.print(f"wrote {len(written.entries)} baseline entries to {baseline}")
            return
        result = gating.run_gate(gating.read_baseline(baseline), selected, gating.parse_tolerance(tolerance),
                                 allow_caveats)
    console.print(gating.gate_table(result))
    if not result.ok:
        raise UserError(f"{len(result.regressions)} regression(s) beyond {tolerance}", exit_code=1)

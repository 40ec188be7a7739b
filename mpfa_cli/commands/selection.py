"""What the ids a command is given select: stored runs (default: the newest of each configuration; for compare and
plot of one scenario and one setup) and stored `mpfa accuracy task` results (default: the newest)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from .common import open_store
from ..errors import UserError
from ..harness.sim_knobs import knobs_label
from ..reports.tables import REFERENCE_RULE, time_scale
from ..results.store import ResultStore, StoredProfile, StoredRun


def run_id(text: str) -> int:
    """A run id; a word there is most likely a value given to a flag (`--requests true`), so the message says so."""
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"'{text}' is not a run id (flags take no value: --flag or --no-flag, "
                                 f"not --flag {text})") from None


RunIds = Annotated[Optional[list[int]], typer.Argument(parser=run_id, help="Run ids (default: per backend and point, the runs of the newest bench that measured it).")]
ScenarioFilter = Annotated[Optional[str], typer.Option("--scenario", help="Only runs of this scenario (compare, plot: default the newest run's).")]
BackendFilter = Annotated[Optional[str], typer.Option("--backend", help="Only runs of this backend.")]
FormatOption = Annotated[str, typer.Option("--format", help="table, json, csv or md (Markdown).")]
WideFlag = Annotated[bool, typer.Option("--wide/--narrow", help="One flat table of every point (needs ~140+ columns) instead of one table per point.")]
REFERENCE_HELP = f"Reference backend of the speed-ups (default, as in bench, compare and plot: {REFERENCE_RULE})."
RefOption = Annotated[Optional[str], typer.Option("--ref", metavar="BACKEND", help=REFERENCE_HELP)]
AccuracyFlag = Annotated[bool, typer.Option("--accuracy/--no-accuracy", help="The ids are stored `mpfa accuracy task` results (default: the newest), not runs.")]


def distinct_ids(run_ids: list[int] | None) -> list[int] | None:
    """The ids as given; one named twice is refused (it would count as two repeats)."""
    if run_ids and (twice := sorted({i for i in run_ids if run_ids.count(i) > 1})):
        raise UserError(f"run {', '.join(map(str, twice))} named more than once: each run counts once")
    return run_ids


def selected_runs(store: ResultStore, run_ids: list[int] | None, scenario: str | None,
                  backend: str | None) -> list[StoredRun]:
    """The runs named, else per backend and point the successful runs of the newest bench that measured it
    (`ResultStore.latest_runs`; optionally filtered)."""
    runs = (store.get_runs(distinct_ids(run_ids)) if run_ids
            else store.latest_runs(scenario=scenario, backend=backend))
    if runs:
        return runs
    matching = "".join(f" {flag} {value}" for flag, value in (("--scenario", scenario), ("--backend", backend))
                       if value)
    unfinished = [] if run_ids else store.list_runs(scenario=scenario, backend=backend)
    if unfinished:  # interrupted or failed runs only: they are kept, but only named ids select them
        statuses = ", ".join(f"{run.id} ({run.status})" for run in unfinished[:5])
        raise UserError(f"no run{matching} finished ok in {store.path}; runs that did not: {statuses}; name them "
                        f"by id, e.g. `mpfa export {unfinished[0].id}` (their completed requests are kept)")
    raise UserError(f"no runs{matching} in {store.path}; run `mpfa bench` first")


# What runs must share to be compared or plotted together, by the name a refusal gives it.
SETUP: dict[str, Callable[[StoredRun], Any]] = {
    "engine": lambda run: run.engine,
    "GPU": lambda run: run.gpu or "unknown",
    "model": lambda run: run.model or "unknown",
    "time scale": lambda run: time_scale(run) or "real time",
    "simulator knobs": lambda run: knobs_label(run.server_info) or "none",
}


def compared_runs(store: ResultStore, run_ids: list[int] | None, scenario: str | None) -> list[StoredRun]:
    """`compare`/`plot`: the runs named, else the newest bench's of each point of `scenario` (default: the scenario
    of the newest run that finished ok). Runs of different engines, GPUs, models, time scales or simulator knobs are
    refused."""
    if not run_ids and scenario is None and (newest := store.list_runs(status="ok", limit=1)):
        scenario = newest[0].scenario
    runs = selected_runs(store, run_ids, scenario, None)
    refuse_mixed_setups(runs)
    return runs


def refuse_mixed_setups(runs: list[StoredRun]) -> None:
    """One line naming the first setup field (engine, GPU, model, time scale) in which the runs differ, with the
    ids of each value."""
    for name, value_of in SETUP.items():
        ids: dict[Any, list[int]] = {}
        for run in sorted(runs, key=lambda r: r.id):
            ids.setdefault(value_of(run), []).append(run.id)
        if len(ids) > 1:
            groups = "; ".join(f"{value} ({id_ranges(group)})" for value, group in ids.items())
            raise UserError(f"these runs differ in {name}: {groups}; name the runs of one {name} by id")


def used_line(runs: list[StoredRun], store: ResultStore, exports: list | None = None) -> str:
    """'using runs 1–4, 9 (scenario paper) from bench 3f2a9c01 (interrupted)': which runs a comparison or plot used,
    and which `mpfa bench` calls measured them; read from `exports` (paths), their ids are those of a throw-away
    database, so the line counts the runs instead."""
    scenarios = ", ".join(dict.fromkeys(run.scenario for run in runs))
    which = f"{len(runs)} runs of {len(exports)} export(s)" if exports else id_ranges([run.id for run in runs])
    return " ".join(filter(None, [f"using {which} (scenario {scenarios})", benches_phrase(runs, store)]))


SHOWN_BENCHES = 3  # a used-runs line names at most this many bench calls, the newest


def benches_phrase(runs: list[StoredRun], store: ResultStore) -> str:
    """'from benches 3f2a9c01 (interrupted), 0a1b2c3d': the bench calls (invocations) of `runs`, newest first, each
    marked if it was interrupted; runs stored before calls were recorded are 'unrecorded' ('' if all are)."""
    calls = list(dict.fromkeys(run.invocation for run in sorted(runs, key=lambda r: r.id, reverse=True)))
    if calls == [None]:
        return ""
    interrupted = store.interrupted_invocations(calls)
    names = [("unrecorded" if call is None else call) + (" (interrupted)" if call in interrupted else "")
             for call in calls[:SHOWN_BENCHES]]
    more = f" and {len(calls) - SHOWN_BENCHES} older" if len(calls) > SHOWN_BENCHES else ""
    return f"from bench{'es' if len(calls) > 1 else ''} {', '.join(names)}{more}"


def id_ranges(ids: list[int]) -> str:
    """[1, 2, 3, 7] -> 'runs 1–3, 7'."""
    parts: list[list[int]] = []
    for i in sorted(ids):
        if parts and i == parts[-1][-1] + 1:
            parts[-1].append(i)
        else:
            parts.append([i])
    return "runs " + ", ".join(f"{p[0]}–{p[-1]}" if len(p) > 1 else str(p[0]) for p in parts)


# Stored accuracy results: kind -> the command that makes them.
ACCURACY_COMMANDS = {"accuracy-task": "mpfa accuracy task", "accuracy-serve": "mpfa accuracy serve"}


def accuracy_results(store: ResultStore, ids: list[int] | None,
                     kinds: tuple[str, ...] = ("accuracy-task",)) -> list[StoredProfile]:
    """The stored accuracy results (`ACCURACY_COMMANDS`) of `kinds` named, else the newest one of them; ids of
    another kind are refused."""
    if not ids:
        newest = [p for kind in kinds for p in store.list_profiles(kind, limit=1)]
        if not newest:
            runs = " or ".join(f"`{ACCURACY_COMMANDS[kind]}`" for kind in kinds)
            raise UserError(f"no {' or '.join(kinds)} results in {store.path}; run {runs} first")
        return [max(newest, key=lambda p: p.id)]
    stored = [store.get_profile(i) for i in ids]
    if bad := [p for p in stored if p.kind not in kinds]:
        raise UserError(f"not {' or '.join(kinds)} results: " + ", ".join(f"{p.id} (a {p.kind} result)" for p in bad))
    return stored


def accuracy_reports(db: Path | None, ids: list[int] | None, scenario: str | None) -> list:
    """`compare`/`plot --accuracy`: the results named (default: the newest), each a `TaskAccuracyReport` (`mpfa
    accuracy task`) or a `ServedAccuracy` (`mpfa accuracy serve` / `emulate`)."""
    from ..accuracy.served import KIND as SERVED, ServedAccuracy
    from ..accuracy.tasks.task_report import TaskAccuracyReport

    if scenario is not None:
        raise UserError("--scenario selects serving runs; it does not apply with --accuracy")
    with open_store(db) as store:
        stored = accuracy_results(store, ids, tuple(ACCURACY_COMMANDS))
    return [(ServedAccuracy if p.kind == SERVED else TaskAccuracyReport).from_json(p.result) for p in stored]

"""Results of `mpfa accuracy serve`: per-question scores of every backend, their paired difference to the reference
backend with a 95% interval, as a table, JSON or CSV.

Stored in the results database as a profile of kind `accuracy-serve` (with the simulated flag of the servers), the
per-question scores and answers included, so the statistics can be recomputed from the database alone.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from .tasks.paired_stats import HALF_WIDTH, PairedDifference, paired_difference
from .tasks.task_sets import TASK_GROUPS, cell_key

KIND = "accuracy-serve"
INTERRUPTED = "interrupted"  # the error of the backend a Ctrl-C stopped


@dataclass
class CellInfo:
    """What a cell asked: its task, context length (None: natural), metric, question ids and needle depths, and the
    greedy tokens its answers could take where they differ from the result's `max_new_tokens` (None: those)."""

    task: str
    length: int | None
    metric: str
    ids: list[str]
    depths: list[float | None]
    max_new_tokens: int | None = None

    @property
    def key(self) -> str:
        return cell_key(self.task, self.length)


@dataclass
class SummaryRow:
    """One backend on one cell: mean score, and for a backend other than the reference the paired difference."""

    task: str
    length: int | None
    backend: str
    n: int
    score: float
    difference: PairedDifference | None


@dataclass
class ServedAccuracy:
    """One run (or several merged) of `mpfa accuracy serve` / `emulate`: the questions asked (`cells`) and, per backend
    or variant, every question's score and answer."""

    model: str
    tokenizer: str
    ref: str
    backends: list[str]
    cells: list[CellInfo]
    seed: int
    max_new_tokens: int  # the answer budget of every cell that records none
    simulated: bool = False
    scores: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # backend -> cell key -> per question
    answers: dict[str, dict[str, list[str | int]]] = field(default_factory=dict)  # answer text or chosen option
    server_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # backend -> the request error that stopped it
    # backend -> where and when it was scored: date (UTC), GPU, mpfa revision, the kernels its server ran
    provenance: dict[str, dict[str, Any]] = field(default_factory=dict)
    interrupted: bool = False  # stopped by Ctrl-C (SIGINT): the cells scored before it are kept

    @classmethod
    def empty(cls, model: str, tokenizer: str, ref: str, backends: list[str], cells: list, seed: int,
              max_new_tokens: int) -> ServedAccuracy:
        """A result with no scores yet for the `task_sets.Cell`s to be asked; a cell's answer budget is recorded where
        it differs from `max_new_tokens` (the tasks that declare their own, unless one budget was asked for all)."""
        infos = [CellInfo(c.task, c.length, c.items[0].metric, [i.id for i in c.items], [i.depth for i in c.items],
                          None if c.max_new_tokens == max_new_tokens else c.max_new_tokens) for c in cells]
        return cls(model, tokenizer, ref, backends, infos, seed, max_new_tokens)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServedAccuracy:
        cells = [CellInfo(**c) for c in doc["cells"]]
        return cls(**{**doc, "cells": cells})

    def ordered(self) -> list[str]:
        """The backends, the reference first (when it ran)."""
        return sorted(self.backends, key=lambda b: b != self.ref)

    def summary(self) -> list[SummaryRow]:
        """Every scored (cell, backend), cells in order, the reference first."""
        return [row for cell in self.cells for row in self._rows(cell.task, cell.length, [cell.key])]

    def pooled(self) -> list[SummaryRow]:
        """Per task asked at two or more lengths, every backend over all of them (length None), still paired
        question by question with the reference: a loss too small for any one cell's 40 questions shows here. Then
        per group of tasks (`task_sets.TASK_GROUPS`, as `ruler`) of which two or more were asked, the same over the
        group's cells at each length and, asked at two or more, over all its cells (length None)."""
        tasks = dict.fromkeys(c.task for c in self.cells)
        keyed = {task: [c.key for c in self.cells if c.task == task] for task in tasks}
        rows = [row for task, keys in keyed.items() if len(keys) > 1 for row in self._rows(task, None, keys)]
        for group, members in TASK_GROUPS.items():
            cells = [c for c in self.cells if c.task in members]
            if len({c.task for c in cells}) < 2:
                continue
            lengths = dict.fromkeys(c.length for c in cells)
            for length in lengths:
                if len(keys := [c.key for c in cells if c.length == length]) > 1:
                    rows += self._rows(group, length, keys)
            if len(lengths) > 1:
                rows += self._rows(group, None, [c.key for c in cells])
        return rows

    def _rows(self, task: str, length: int | None, keys: list[str]) -> list[SummaryRow]:
        """A row per backend scored on every cell of `keys` (their questions joined), the reference first."""
        def joined(backend: str) -> list[float] | None:
            per = self.scores.get(backend, {})
            return None if any(k not in per for k in keys) else [s for k in keys for s in per[k]]

        ref_scores, rows = joined(self.ref), []
        for backend in self.ordered():
            if (scores := joined(backend)) is None:
                continue
            diff = (paired_difference(scores, ref_scores, seed=self.seed)
                    if backend != self.ref and ref_scores is not None else None)
            rows.append(SummaryRow(task, length, backend, len(scores), sum(scores) / len(scores), diff))
        return rows

    def question_rows(self) -> list[dict[str, Any]]:
        """One row per backend and question: the CSV export."""
        rows = []
        for backend in self.backends:
            for cell in self.cells:
                scores = self.scores.get(backend, {}).get(cell.key)
                if scores is None:
                    continue
                said = self.answers[backend][cell.key]
                for qid, depth, score, answer in zip(cell.ids, cell.depths, scores, said):
                    rows.append({"backend": backend, "task": cell.task, "length": cell.length, "question": qid,
                                 "depth": depth, "metric": cell.metric, "score": score, "answer": answer,
                                 "simulated": self.simulated})
        return rows


def export_json(result: ServedAccuracy, stored_id: int | None = None, gpu: str | None = None,
                params: dict[str, Any] | None = None) -> dict[str, Any]:
    """The stored result with where it was stored from (`gpu`, `params`) and its summary (means and paired
    differences) added; `read_export` takes it back."""
    def rows(summary: list[SummaryRow]) -> list[dict[str, Any]]:
        return [{**asdict(r), "difference": r.difference.to_json() if r.difference else None} for r in summary]

    return {"id": stored_id, "gpu": gpu, "params": params or {}, **result.to_json(), "summary": rows(result.summary()),
            "pooled": rows(result.pooled())}


@dataclass
class ExportedResult:
    """One result of a JSON export, as `mpfa accuracy import` stores it."""

    result: ServedAccuracy
    gpu: str | None  # None: exported before exports named it
    params: dict[str, Any]


def read_export(doc: Any) -> list[ExportedResult]:
    """The results of a parsed `accuracy served --format json` export; the summary is recomputed from the scores,
    never read. A ValueError names what is wrong."""
    if not isinstance(doc, list) or not all(isinstance(entry, dict) for entry in doc):
        raise ValueError("not a list of results (`mpfa accuracy served IDS --format json` writes one)")
    results = []
    for number, entry in enumerate(doc, 1):
        fields = {k: v for k, v in entry.items() if k not in ("id", "gpu", "params", "summary", "pooled")}
        try:
            result = ServedAccuracy.from_json(fields)
        except (KeyError, TypeError) as exc:  # a field missing, unknown or of the wrong kind
            raise ValueError(f"result {number}: a field is missing or malformed ({exc})") from None
        keys = {c.key for c in result.cells}
        missing = [b for b in result.backends if set(result.scores.get(b, {})) != keys and b not in result.errors]
        if missing and not result.interrupted:
            raise ValueError(f"result {number}: backend {missing[0]} has no scores for some cells and no error "
                             "(nor was the run interrupted)")
        results.append(ExportedResult(result, entry.get("gpu"), entry.get("params") or {}))
    return results


def export_csv(results: list[tuple[int | None, ServedAccuracy]]) -> str:
    """One row per stored result, backend and question (`question_rows`), the result's id first."""
    rows = [{"result": result_id, **row} for result_id, result in results for row in result.question_rows()]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["result"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _points(value: float) -> str:
    return f"{100 * value:.1f}"


def _difference(row: SummaryRow) -> str:
    d = row.difference
    return f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]" if d else ""


def _backend_cells(rows: dict[str, SummaryRow], ordered: list[str]) -> list[str]:
    """A table row's cells after n: per backend its score and (not the reference) Δ with the 95% interval, then the
    questions a ±3-point interval needs at the spread seen (the largest over the backends)."""
    cells, needed = [], []
    for backend in ordered:
        row = rows.get(backend)
        if row is None:
            cells.append("–")
        elif row.difference is None:
            cells.append(_points(row.score))
        else:
            cells.append(f"{_points(row.score)} ({_difference(row)})")
            if row.difference.n_needed is not None:
                needed.append(row.difference.n_needed)
    return [*cells, str(max(needed)) if needed else "–"]


def _by_backend(rows: list[SummaryRow], key: Callable[[SummaryRow], str]) -> dict[str, dict[str, SummaryRow]]:
    """Summary rows grouped by `key` (a cell, a task or group at a length or all), each group by backend."""
    grouped: dict[str, dict[str, SummaryRow]] = {}
    for row in rows:
        grouped.setdefault(key(row), {})[row.backend] = row
    return grouped


Group = tuple[str, str, str, dict[str, SummaryRow], int]  # task, length label, metric, rows by backend, n
NEEDED_COLUMN = f"n for ±{100 * HALF_WIDTH:.0f}"  # questions a ±3-point interval needs


def _groups(result: ServedAccuracy) -> tuple[list[Group], list[Group]]:
    """The table's row groups: each cell, and each task over all its lengths, each group of tasks (`pooled`)."""
    by_cell = _by_backend(result.summary(), lambda row: cell_key(row.task, row.length))
    cells = []
    for cell in result.cells:
        rows = by_cell.get(cell.key, {})
        n = max((r.n for r in rows.values()), default=len(cell.ids))
        cells.append((cell.task, "natural" if cell.length is None else str(cell.length), cell.metric, rows, n))
    pooled = []
    for rows in _by_backend(result.pooled(), lambda r: cell_key(r.task, r.length)).values():
        first = next(iter(rows.values()))
        metric = next(c.metric for c in result.cells if c.task in TASK_GROUPS.get(first.task, (first.task,)))
        pooled.append((first.task, "all" if first.length is None else str(first.length), metric, rows,
                       max(r.n for r in rows.values())))
    return cells, pooled


def render(result: ServedAccuracy, console) -> None:
    """One table: a row per cell, then a row per task over all its lengths and per group of tasks (`pooled`); per
    backend its score and (not the reference) Δ with the 95% interval; the questions a ±3-point interval needs at
    the spread seen. Where a column per backend would not fit the console, a row per cell and backend instead."""
    from rich.measure import Measurement

    title = f"Task accuracy ({result.model}, tokenizer {result.tokenizer}; Δ vs {result.ref}, " \
            "paired bootstrap 95% interval, points)"
    if result.simulated:
        title = f"SIMULATED — {title} — the simulator echoes prompt spans: meaningless as accuracy"
    groups = _groups(result)  # the paired bootstraps: computed once for either layout
    table = _wide_table(result, title, groups)
    if Measurement.get(console, console.options.update_width(10**6), table).maximum > console.width:
        table = _long_table(result, title, groups)
    console.print(table)
    if note := provenance_note(result):
        console.print(note, highlight=False)
    for backend, error in result.errors.items():
        console.print(f"[red]{backend}: {error}[/]", highlight=False)


def _wide_table(result: ServedAccuracy, title: str, groups: tuple[list[Group], list[Group]]):
    """A column per backend."""
    from rich.table import Table

    ordered = result.ordered()
    table = Table(title=title, title_justify="left")
    for column in ("task", "length", "metric", "n", *ordered, NEEDED_COLUMN):
        table.add_column(column, justify="left" if column in ("task", "metric") else "right")
    cells, pooled = groups
    for task, length, metric, rows, n in cells:
        table.add_row(task, length, metric, str(n), *_backend_cells(rows, ordered))
    if pooled:
        table.add_section()  # below: each task over all its lengths
    for task, length, metric, rows, n in pooled:
        table.add_row(task, length, metric, str(n), *_backend_cells(rows, ordered))
    return table


def _long_table(result: ServedAccuracy, title: str, groups: tuple[list[Group], list[Group]]):
    """A row per cell and backend (many backends on a narrow console); the cell's metric under its task."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in ("task", "length", "n", "backend", "score", "Δ [95% interval]", NEEDED_COLUMN):
        table.add_column(column, justify="left" if column in ("task", "backend") else "right")
    for task, length, metric, rows, n in [group for part in groups for group in part]:
        present = [b for b in result.ordered() if b in rows]
        heads = [(task, length, str(n)), (metric, "", "")] if len(present) > 1 else [(f"{task} ({metric})", length,
                                                                                          str(n))]
        for index, backend in enumerate(present):
            row = rows[backend]
            needed = row.difference.n_needed if row.difference else None
            table.add_row(*(heads[index] if index < len(heads) else ("", "", "")), backend, _points(row.score),
                          _difference(row), "–" if needed is None else str(needed),
                          end_section=index == len(present) - 1)
    return table


def scored_at(gpu: str, environment: dict[str, Any]) -> dict[str, Any]:
    """A backend's provenance but its kernels: now (UTC), `gpu` and the mpfa revision of `environment`
    (`environment.collect_environment`)."""
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), "gpu": gpu,
            "mpfa_revision": environment.get("mpfa_revision")}


def provenance_note(result: ServedAccuracy) -> str:
    """One line naming the GPU and mpfa revision the backends were scored at; "§" and each backend's where they
    differ (a merge of runs of different revisions compares different code), or where some backends' were not
    recorded (results stored before provenance was, merged with later ones). Empty without any provenance."""
    if not result.provenance:
        return ""
    recorded = {b: result.provenance.get(b, {}) for b in result.ordered()}
    where = {b: (p.get("gpu") or "unknown GPU", p.get("mpfa_revision") or "unknown revision")
             for b, p in recorded.items()}
    if len(set(where.values())) == 1:
        gpu, revision = next(iter(where.values()))
        return f"scored on {gpu} at mpfa {revision}"
    return "§ measured on different machines or revisions: " + "; ".join(
        f"{b} {g} at {r}" for b, (g, r) in where.items())


# What results must share to be joined: the same model, tokenizer and settings (and, checked apart, questions); the
# first result's reference stays the reference.
_SAME_RUN = ("model", "tokenizer", "seed", "max_new_tokens")


def merge_served(parts: list[ServedAccuracy]) -> ServedAccuracy:
    """One result from several: runs of other backends on the same questions (e.g. the reference's and another's)
    join as columns; runs of the same backends on other questions (`--offset` shards, other cells) join question by
    question, a cell's questions of every part in one cell."""
    if len(parts) < 2:
        raise ValueError("--merge needs two or more results")
    first = parts[0]
    merged = ServedAccuracy.from_json(first.to_json())
    for part in parts[1:]:
        for key in _SAME_RUN:
            if getattr(part, key) != getattr(first, key):
                raise ValueError(f"cannot merge results with different {key}: {getattr(part, key)} and "
                                 f"{getattr(first, key)}")
        if part.cells == merged.cells:
            _join_backends(merged, part)
        elif sorted(part.backends) == sorted(merged.backends):
            _join_questions(merged, part)
        else:
            raise ValueError("cannot merge results that asked different questions (tasks, lengths, --limit, --offset) "
                             "of other backends: join runs of other backends on the same questions, or of the same "
                             "backends on other questions")
        merged.simulated = merged.simulated or part.simulated
        merged.interrupted = merged.interrupted or part.interrupted
    return merged


def _join_backends(merged: ServedAccuracy, part: ServedAccuracy) -> None:
    if twice := [b for b in part.backends if b in merged.backends]:
        raise ValueError(f"backend {twice[0]} is in more than one of the results")
    merged.backends += part.backends
    for mine, theirs in ((merged.scores, part.scores), (merged.answers, part.answers),
                         (merged.server_info, part.server_info), (merged.errors, part.errors),
                         (merged.provenance, part.provenance)):
        mine.update(theirs)


def _join_questions(merged: ServedAccuracy, part: ServedAccuracy) -> None:
    """`part`'s questions added to `merged`'s cells (new cells appended); every backend must be scored on every cell
    of both, on the same GPU and revision, so that each joined cell stays paired question by question."""
    for backend in merged.backends:
        unscored = any(c.key not in r.scores.get(backend, {}) for r in (merged, part) for c in r.cells)
        if unscored or backend in merged.errors or backend in part.errors:
            raise ValueError(f"cannot join other questions of {backend}: it was not scored on every cell of both")
        where = [tuple(r.provenance.get(backend, {}).get(k) for k in ("gpu", "mpfa_revision")) for r in (merged, part)]
        if where[0] != where[1]:
            raise ValueError(f"cannot join other questions of {backend}: scored on {where[0]} and on {where[1]}")
    cells = {c.key: c for c in merged.cells}
    for cell in part.cells:
        mine = cells.get(cell.key)
        if mine is None:  # a cell only `part` asked: an empty one to add to
            mine = cells[cell.key] = CellInfo(cell.task, cell.length, cell.metric, [], [], cell.max_new_tokens)
            merged.cells.append(mine)
            for backend in merged.backends:
                merged.scores[backend][cell.key], merged.answers[backend][cell.key] = [], []
        elif twice := set(mine.ids) & set(cell.ids):
            raise ValueError(f"cannot join {cell.key}: question {sorted(twice)[0]} is in more than one of the results")
        elif mine.max_new_tokens != cell.max_new_tokens:
            raise ValueError(f"cannot join {cell.key}: its answers had different budgets")
        mine.ids += cell.ids
        mine.depths += cell.depths
        for backend in merged.backends:
            merged.scores[backend][cell.key] += part.scores[backend][cell.key]
            merged.answers[backend][cell.key] += part.answers[backend][cell.key]


def render_by_depth(result: ServedAccuracy, console, bins: int = 10) -> None:
    """Per backend, the score of every cell whose questions have an evidence depth (needles, squad-long's passage) in
    `bins` bins from the context's start (0%) to its end (100%); the needle tasks' depths are the bins' centres."""
    from rich.table import Table

    deep = [c for c in result.cells if c.depths and all(d is not None for d in c.depths)]
    if not deep:
        console.print("no cell of this result has evidence depths")
        return
    for backend in result.ordered():
        title = f"{backend}: score by evidence depth (points; questions in brackets)"
        table = Table(title=f"SIMULATED — {title}" if result.simulated else title, title_justify="left")
        for column in ("task", "length", *(f"{100 * b / (bins - 1):.0f}%" for b in range(bins))):
            table.add_column(column, justify="left" if column == "task" else "right")
        for cell in deep:
            scores = result.scores.get(backend, {}).get(cell.key)
            if scores is None:
                continue
            by_bin: dict[int, list[float]] = {}
            for depth, score in zip(cell.depths, scores):
                by_bin.setdefault(round(depth * (bins - 1)), []).append(score)
            table.add_row(cell.task, str(cell.length), *(
                f"{100 * sum(v) / len(v):.0f} ({len(v)})" if (v := by_bin.get(b)) else "–" for b in range(bins)))
        console.print(table)

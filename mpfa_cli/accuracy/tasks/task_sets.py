"""Every question of a task list as ids, grouped into cells (task, context length): what a served run sends.

Tasks: `squad` and `social_iqa` at their natural length; `squad-long`, `niah-single`, `niah-multikey` and the
RULER-style tasks (`ruler`: every `ruler-*` task) at each of `lengths` (exact prompt tokens). `offset` / `limit`
select questions [offset, offset + limit) of each cell: in file order for the SQuAD and BIG-bench tasks, by index
for the generated ones (question i of a needle task has its needle at depth DEPTHS[i % 10]). A cell carries the
answer budget (max_new_tokens) of its task: a RULER-style task's own, DEFAULT_MAX_NEW_TOKENS for the others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from . import data
from .items import DEFAULT_MAX_NEW_TOKENS, ChoiceItem, GenerationItem, choice_items, squad_items
from .long_context import CONTEXT_LENGTHS, LONG_TASKS, NEEDLE_TASKS, Haystack, needle_items, squad_long_items
from .ruler import RULER_TASKS, RulerSource, ruler_items
from .tokens import TaskTokenizer

SHORT_TASKS = ("squad", *data.MULTIPLE_CHOICE_TASKS)
LENGTH_TASKS = (*LONG_TASKS, *RULER_TASKS)  # asked at each context length
SERVED_TASKS = (*NEEDLE_TASKS, "squad-long", *RULER_TASKS, *SHORT_TASKS)
TASK_GROUPS = {"ruler": tuple(RULER_TASKS)}  # a name that stands for several tasks
DEFAULT_LIMIT = 100


@dataclass(frozen=True)
class Cell:
    """One task at one context length (None: the task's natural length), its questions and the greedy tokens each
    answer may take."""

    task: str
    length: int | None
    items: tuple[GenerationItem | ChoiceItem, ...]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS

    @property
    def key(self) -> str:
        return cell_key(self.task, self.length)


def cell_key(task: str, length: int | None) -> str:
    return task if length is None else f"{task}@{length}"


def tasks_help() -> str:
    """The served tasks and groups, for a command's help."""
    groups = "; ".join(f"{name}: {', '.join(tasks)}" for name, tasks in TASK_GROUPS.items())
    budgets = ", ".join(f"{name} {task.answer_tokens}" for name, task in RULER_TASKS.items()
                        if task.answer_tokens != DEFAULT_MAX_NEW_TOKENS)
    return (f"{', '.join(LENGTH_TASKS)} (at every --lengths), {', '.join(SHORT_TASKS)}; {groups}. An answer takes "
            f"up to {DEFAULT_MAX_NEW_TOKENS} greedy tokens ({budgets})")


def _unknown(task: str) -> ValueError:
    return ValueError(f"unknown task {task}; choose from {', '.join((*SERVED_TASKS, *TASK_GROUPS))}")


def expand_groups(tasks: Sequence[str]) -> list[str]:
    """`tasks` with each group name replaced by its tasks."""
    return [t for name in tasks for t in TASK_GROUPS.get(name, (name,))]


def with_answer_tokens(cells: Sequence[Cell], max_new_tokens: int | None) -> list[Cell]:
    """`cells` with every answer budget `max_new_tokens` (None: each task's own)."""
    return list(cells) if max_new_tokens is None else [replace(c, max_new_tokens=max_new_tokens) for c in cells]


def check_selection(tasks: Sequence[str], lengths: Sequence[int], limit: int, offset: int) -> None:
    if not tasks:
        raise ValueError("pass at least one task")
    if bad := [t for t in tasks if t not in SERVED_TASKS]:
        raise _unknown(", ".join(bad))
    if len(set(tasks)) != len(tasks) or len(set(lengths)) != len(lengths):
        raise ValueError("tasks and lengths must not repeat")
    if any(t in LENGTH_TASKS for t in tasks) and (not lengths or min(lengths) < 256):
        raise ValueError("long-context tasks need lengths of at least 256 tokens")
    if limit < 1 or offset < 0:
        raise ValueError(f"--limit must be >= 1 and --offset >= 0, got {limit} and {offset}")


def build_cells(
    tok: TaskTokenizer, tasks: Sequence[str], lengths: Sequence[int] = CONTEXT_LENGTHS, *, limit: int = DEFAULT_LIMIT,
    offset: int = 0, seed: int = 0,
) -> list[Cell]:
    """The cells of `tasks` (a group: its tasks; long ones at every length), task data from the package cache
    (downloaded once)."""
    tasks = expand_groups(tasks)
    check_selection(tasks, lengths, limit, offset)
    picks = [(t, n, limit) for t in tasks for n in (lengths if t in LENGTH_TASKS else [None])]
    return build_picked_cells(tok, picks, offset=offset, seed=seed)


def parse_cells(spec: str) -> list[tuple[str, int | None, int]]:
    """`task@length=N,...` (`task=N` for squad and social_iqa; a group: each of its tasks) -> (task, length,
    questions) per cell, e.g. `niah-multikey@32736=523,niah-single@32736=107`: each cell with as many questions as
    its interval needs."""
    picks: list[tuple[str, int | None, int]] = []
    for entry in (e.strip() for e in spec.split(",") if e.strip()):
        key, _, count = entry.partition("=")
        task, at, length = key.partition("@")
        try:
            pick = (task, int(length) if at else None, int(count))
        except ValueError:
            raise ValueError(f"bad cell {entry!r}: write task@length=N (task=N for squad, social_iqa)") from None
        for name in expand_groups([task]):
            if name not in SERVED_TASKS:
                raise _unknown(name)
            if (pick[1] is None) != (name not in LENGTH_TASKS) or (pick[1] is not None and pick[1] < 256):
                raise ValueError(f"bad cell {entry!r}: {', '.join(LENGTH_TASKS)} take a length of at least 256 "
                                 "tokens (task@length=N), the others none")
            if pick[2] < 1:
                raise ValueError(f"bad cell {entry!r}: ask at least one question")
            picks.append((name, *pick[1:]))
    if not picks:
        raise ValueError("pass at least one cell")
    if len({cell_key(t, n) for t, n, _ in picks}) != len(picks):
        raise ValueError("cells must not repeat")
    return picks


def build_picked_cells(tok: TaskTokenizer, picks: Sequence[tuple[str, int | None, int]], *, offset: int = 0,
                       seed: int = 0) -> list[Cell]:
    """One cell per (task, length or None, questions): questions [offset, offset + questions) of it."""
    if offset < 0:
        raise ValueError(f"--offset must be >= 0, got {offset}")
    tasks = {t for t, _, _ in picks}
    squad = data.load_squad(data.task_file("squad")) if {"squad", "squad-long"} & tasks else []
    haystack = Haystack.from_text(tok, data.essay_text()) if {*NEEDLE_TASKS, *RULER_TASKS} & tasks else None
    ruler = RulerSource.from_essays(tok, haystack, data.essay_text()) if set(RULER_TASKS) & tasks else None
    cells: list[Cell] = []
    for task, n, limit in picks:
        if task in NEEDLE_TASKS:
            cells.append(Cell(task, n, tuple(needle_items(tok, task, haystack, n, limit, seed, offset))))
        elif task in RULER_TASKS:
            cells.append(Cell(task, n, tuple(ruler_items(ruler, task, n, limit, seed, offset)),
                              RULER_TASKS[task].answer_tokens))
        elif task == "squad-long":
            cells.append(Cell(task, n, tuple(squad_long_items(tok, select_examples(task, squad, offset, limit), squad,
                                                              n, seed))))
        elif task == "squad":
            cells.append(Cell(task, None, tuple(squad_items(tok, select_examples(task, squad, offset, limit)))))
        else:
            chosen = select_examples(task, data.load_multiple_choice(data.task_file(task)), offset, limit)
            cells.append(Cell(task, None, tuple(choice_items(tok, chosen, task, offset))))
    return cells


def select_examples(task: str, everything: Sequence, offset: int, limit: int | None) -> Sequence:
    """Examples [offset, offset + limit) of a task in file order (limit None: to the end)."""
    if offset >= len(everything):
        raise ValueError(f"{task} has {len(everything)} examples: --offset {offset} selects none")
    return everything[offset:] if limit is None else everything[offset : offset + limit]

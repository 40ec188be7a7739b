"""Task selection: the `ruler` group stands for its tasks in `--tasks` and `--cells`, each cell carries its task's
answer budget (or the one asked for all), and the help names every task, group and budget."""

from __future__ import annotations

import pytest

from mpfa.mpfa_cli.accuracy.tasks import data, task_sets
from mpfa.mpfa_cli.accuracy.tasks.items import DEFAULT_MAX_NEW_TOKENS
from mpfa.mpfa_cli.accuracy.tasks.long_context import Haystack
from mpfa.mpfa_cli.accuracy.tasks.ruler import RULER_TASKS, RulerSource, ruler_items
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer

TOK = ByteTokenizer()


@pytest.fixture
def essays(monkeypatch, essay_words) -> str:
    monkeypatch.setattr(data, "essay_text", lambda: essay_words)
    return essay_words


def test_the_ruler_group_builds_every_ruler_task_with_its_answer_budget(essays):
    cells = task_sets.build_cells(TOK, ["niah-single", "ruler"], [4096, 8192], limit=2, offset=1, seed=5)
    assert [c.key for c in cells] == ["niah-single@4096", "niah-single@8192",
                                      *(f"{t}@{n}" for t in RULER_TASKS for n in (4096, 8192))]
    assert cells[0].max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    src = RulerSource.from_essays(TOK, Haystack.from_text(TOK, essays), essays)
    for cell in cells[2:]:
        assert cell.max_new_tokens == RULER_TASKS[cell.task].answer_tokens
        assert list(cell.items) == ruler_items(src, cell.task, cell.length, 2, seed=5, first=1)
    assert {c.max_new_tokens for c in task_sets.with_answer_tokens(cells, 12)} == {12}
    assert task_sets.with_answer_tokens(cells, None) == cells


def test_cells_expand_a_group_and_keep_their_own_counts():
    picks = task_sets.parse_cells("ruler@4096=3,niah-single@4096=2,squad=4")
    assert picks == [*((t, 4096, 3) for t in RULER_TASKS), ("niah-single", 4096, 2), ("squad", None, 4)]
    for spec, message in [("ruler=3", "take a length of at least 256 tokens"),
                          ("ruler@4096=3,ruler-mk@4096=2", "cells must not repeat"),
                          ("ruler-xx@4096=3", "unknown task ruler-xx; choose from niah-single, .*ruler-fwe, squad, "
                                              "social_iqa, ruler$")]:
        with pytest.raises(ValueError, match=message):
            task_sets.parse_cells(spec)
    with pytest.raises(ValueError, match="unknown task rulers"):
        task_sets.build_cells(TOK, ["rulers"], [4096])
    with pytest.raises(ValueError, match="must not repeat"):
        task_sets.build_cells(TOK, ["ruler", "ruler-cwe"], [4096])


def test_the_help_names_every_task_group_and_budget():
    text = task_sets.tasks_help()
    assert all(task in text for task in (*task_sets.SERVED_TASKS, *task_sets.TASK_GROUPS))
    assert all(f"{name} {task.answer_tokens}" in text for name, task in RULER_TASKS.items()
               if task.answer_tokens != DEFAULT_MAX_NEW_TOKENS)
    assert f"up to {DEFAULT_MAX_NEW_TOKENS} greedy tokens" in text

"""The existing served tasks' prompts, pinned: the first question of each (the long ones at 4096 tokens) built from
fixed data with the byte tokenizer hashes to what it did before the RULER-style tasks were added, so adding tasks
(or per-task answer budgets) leaves their token ids, answers, metrics and answer budget, hence their scores, as they
were."""

from __future__ import annotations

import hashlib
import json

from mpfa.mpfa_cli.accuracy.tasks import data, task_sets
from mpfa.mpfa_cli.accuracy.tasks.data import ChoiceExample, SquadExample
from mpfa.mpfa_cli.accuracy.tasks.items import ChoiceItem
from mpfa.mpfa_cli.accuracy.tasks.tokens import ByteTokenizer

EXISTING = ("niah-single", "niah-multikey", "squad-long", "squad", "social_iqa")
PINNED = "f73a45fa62651dc6d9364280b31d2108f76b19b4443446a80fc01d867dd9c095"


def _fixed_data(monkeypatch) -> None:
    essay = " ".join(f"Essay sentence {i} weighs startups, painters and {i % 7} hackers." for i in range(900))
    squad = [SquadExample(f"q{a}-{i}", f"article {a}", f"Article {a} passage {i} says the river bends {i} times. " * 4,
                          f"How often does river {a} bend?", (f"{i} times",)) for a in range(40) for i in range(3)]
    choices = [ChoiceExample(f"Question {i}?", ("yes", "no", "maybe"), frozenset({i % 3})) for i in range(5)]
    monkeypatch.setattr(data, "essay_text", lambda: essay)
    monkeypatch.setattr(data, "task_file", lambda task: task)
    monkeypatch.setattr(data, "load_squad", lambda path: squad)
    monkeypatch.setattr(data, "load_multiple_choice", lambda path: choices)


def test_the_existing_tasks_first_questions_are_unchanged(monkeypatch):
    _fixed_data(monkeypatch)
    cells = task_sets.build_cells(ByteTokenizer(), EXISTING, [4096], limit=1, seed=0)
    digest = hashlib.sha256()
    for cell in cells:
        (item,) = cell.items
        asked = ([item.context, item.choices, sorted(item.correct)] if isinstance(item, ChoiceItem)
                 else [item.prompt, item.answers, item.metric, item.depth])
        digest.update(json.dumps([cell.key, item.id, *asked]).encode())
    assert digest.hexdigest() == PINNED
    assert {cell.max_new_tokens for cell in cells} == {32}  # the answer budget they have always been scored with

"""Task questions as token ids, the same for every attention variant and every served backend.

A `GenerationItem` is answered by greedy decoding and scored on the answer text (`metric`: "f1", SQuAD's F1 against
the best reference answer; "contains": 1 when a reference answer appears in the answer, the needle tasks' string
match; "share": the share of the reference strings found, RULER's string_match_all), the first line of it or,
for "share", all of it; a `ChoiceItem` by the summed log-likelihood of each choice after its context (BIG-bench
multiple_choice_grade). SQuAD and multiple-choice prompts at their natural length are built here; the long-context
ones in `long_context` and `ruler`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .data import ChoiceExample, SquadExample
from .scoring import normalize_answer, share_found, squad_f1
from .tokens import TaskTokenizer

SQUAD_INSTRUCTION = (
    "Answer the question with a short span copied from the passage. "
    "Reply with the answer only, in at most five words."
)
METRICS = ("f1", "contains", "share")
DEFAULT_MAX_NEW_TOKENS = 32  # a 7-digit needle after a model restates the question (one token per digit)


@dataclass(frozen=True)
class GenerationItem:
    """One question answered by greedy decoding. `length`: the prompt's exact token count when the task fixes it
    (long context), else None; `depth`: where the evidence sits in the context (0 start, 1 end), when known."""

    task: str
    id: str
    prompt: tuple[int, ...]
    answers: tuple[str, ...]
    metric: str
    length: int | None = None
    depth: float | None = None

    @property
    def first_line(self) -> bool:
        """Whether the answer scored is its first line (SQuAD, the needles) or all of it ("share": a list may take
        several lines, and RULER scores the whole output)."""
        return self.metric != "share"

    def score(self, answer: str) -> float:
        """The answer's score in [0, 1]."""
        if self.metric == "f1":
            return squad_f1(answer, self.answers)
        if self.metric == "contains":
            said = normalize_answer(answer)
            return float(any(normalize_answer(truth) in said for truth in self.answers))
        if self.metric == "share":
            return share_found(answer, self.answers)
        raise ValueError(f"unknown metric {self.metric!r}; known: {', '.join(METRICS)}")


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: context ids, the ids of each choice, the indices of the correct ones."""

    task: str
    id: str
    context: tuple[int, ...]
    choices: tuple[tuple[int, ...], ...]
    correct: frozenset[int]
    metric = "grade"  # BIG-bench multiple_choice_grade
    depth = None  # no evidence position


def squad_question(question: str) -> str:
    return f"\n\nQuestion: {question}"


def squad_items(tok: TaskTokenizer, examples: Sequence[SquadExample], task: str = "squad") -> list[GenerationItem]:
    """SQuAD at its natural length: instruction, passage, question in one user turn."""
    return [
        GenerationItem(task, ex.id, tuple(tok.chat_ids(
            f"{SQUAD_INSTRUCTION}\n\nPassage: {ex.context}{squad_question(ex.question)}")), ex.answers, "f1")
        for ex in examples
    ]


def choice_items(
    tok: TaskTokenizer, examples: Sequence[ChoiceExample], task: str, first: int = 0
) -> list[ChoiceItem]:
    """`question / Options: a; b; c / Answer:` then ` option` per choice (BIG-bench style); ids number the examples
    in file order from `first` (their index in the task file)."""
    return [
        ChoiceItem(task, f"{task}-{first + index}",
                   tuple(tok.plain_ids(f"{ex.question}\nOptions: {'; '.join(ex.choices)}\nAnswer:")),
                   tuple(tuple(tok.encode(" " + c)) for c in ex.choices), ex.correct)
        for index, ex in enumerate(examples)
    ]

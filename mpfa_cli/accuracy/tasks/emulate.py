"""The cells of `mpfa accuracy serve` answered by the numerics reference instead of a server.

Cell by cell, the shortest first, each attention variant is swapped into the model in turn (`runner.installer`)
and answers the cell's questions: greedy answers in padded batches (`generation.greedy_answers`, within the cell's
answer budget, the first line of the answer or all of it as the served path scores it), choices by their summed
log-likelihood (`generation.batch_choice_logprobs`). The per-question scores and answers come out in the served
path's layout, so an emulated variant and a served backend compare question by question on the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .generation import LoadedModel, batch_choice_logprobs, greedy_answers
from .items import ChoiceItem, GenerationItem
from .runner import in_order, length_batches
from .scoring import best_choice
from .task_sets import Cell

# (variant, cell key, questions done, questions in the cell) -> None
Progress = Callable[[str, str, int, int], None]


def emulate_cells(
    lm: LoadedModel, cells: Sequence[Cell], variants: Sequence[str], attach: Callable, *, batch_size: int,
    progress: Progress, batch_tokens: int | None = None,
) -> Iterator[tuple[str, str, list[float], list[str | int]]]:
    """Every variant on every cell, as (variant, cell key, scores, answers) once each is done: the shortest cells
    first, all variants of a cell before the next, so a run stopped early keeps whole cells of the most questions.
    `attach(variant)` installs a variant and returns its attention function. A forward call takes at most
    `batch_size` questions and, with `batch_tokens`, at most that many prompt tokens (but one question at least)."""
    longest_first = [(max(len(_tokens(it)) for it in cell.items), cell) for cell in cells]
    for longest, cell in sorted(longest_first, key=lambda pair: pair[0]):
        size = batch_size if batch_tokens is None else max(1, min(batch_size, batch_tokens // longest))
        for variant in variants:
            attention = attach(variant)

            def done(count: int, key: str = cell.key, total: int = len(cell.items), name: str = variant) -> None:
                progress(name, key, count, total)

            items = cell.items
            if isinstance(items[0], ChoiceItem):
                questions = [(list(it.context), [list(c) for c in it.choices]) for it in items]
                logprobs = in_order(length_batches([len(c) for c, _ in questions], size),
                                    lambda batch: batch_choice_logprobs(lm, [questions[i] for i in batch], attention),
                                    done)
                picks = [best_choice(scores) for scores in logprobs]
                yield variant, cell.key, [float(pick in it.correct) for pick, it in zip(picks, items)], picks
            else:
                prompts = [list(it.prompt) for it in items]
                answers = in_order(length_batches([len(p) for p in prompts], size),
                                   lambda batch: greedy_answers(lm, [prompts[i] for i in batch], attention,
                                                                cell.max_new_tokens, items[0].first_line),
                                   done)
                yield variant, cell.key, [it.score(a) for a, it in zip(answers, items)], answers


def _tokens(item: GenerationItem | ChoiceItem) -> tuple[int, ...]:
    return item.context if isinstance(item, ChoiceItem) else item.prompt

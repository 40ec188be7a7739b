"""The cells of `mpfa accuracy serve` answered by the numerics reference instead of a server.

Each attention variant is swapped into the model in turn (`runner.installer`) and answers every question of every
cell: greedy answers in padded batches (`generation.greedy_answers`, the first line of the answer, as the served
path scores it), choices by their summed log-likelihood (`generation.batch_choice_logprobs`). The per-question
scores and answers come out in the served path's layout, so an emulated variant and a served backend compare
question by question on the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mpfa.kernels.tasks.generation import LoadedModel, batch_choice_logprobs, greedy_answers
from mpfa.kernels.tasks.items import ChoiceItem
from mpfa.kernels.tasks.runner import in_order, length_batches
from mpfa.kernels.tasks.scoring import best_choice
from mpfa.kernels.tasks.task_sets import Cell

# (variant, cell key, questions done, questions in the cell) -> None
Progress = Callable[[str, str, int, int], None]
# variant -> cell key -> (per-question scores, answers: text or chosen option)
Answers = dict[str, dict[str, tuple[list[float], list[str | int]]]]


def emulate_cells(
    lm: LoadedModel, cells: Sequence[Cell], variants: Sequence[str], attach: Callable, *, max_new_tokens: int,
    batch_size: int, progress: Progress,
) -> Answers:
    """Every variant on every cell; `attach(variant)` installs a variant and returns its attention function."""
    out: Answers = {}
    for variant in variants:
        attention = attach(variant)
        for cell in cells:
            def done(count: int, key: str = cell.key, total: int = len(cell.items)) -> None:
                progress(variant, key, count, total)

            items = cell.items
            if isinstance(items[0], ChoiceItem):
                questions = [(list(it.context), [list(c) for c in it.choices]) for it in items]
                logprobs = in_order(length_batches([len(c) for c, _ in questions], batch_size),
                                    lambda batch: batch_choice_logprobs(lm, [questions[i] for i in batch], attention),
                                    done)
                picks = [best_choice(scores) for scores in logprobs]
                scores = [float(pick in it.correct) for pick, it in zip(picks, items)]
                out.setdefault(variant, {})[cell.key] = (scores, picks)
            else:
                prompts = [list(it.prompt) for it in items]
                answers = in_order(length_batches([len(p) for p in prompts], batch_size),
                                   lambda batch: greedy_answers(lm, [prompts[i] for i in batch], attention,
                                                                max_new_tokens),
                                   done)
                out.setdefault(variant, {})[cell.key] = ([it.score(a) for a, it in zip(answers, items)], answers)
    return out

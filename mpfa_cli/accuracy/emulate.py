"""`mpfa accuracy emulate`: the questions of `accuracy serve` answered by the numerics reference, as a served result.

Each variant stands where a served backend would (`bf16` for `fa3-bf16`, `mpfa-qk8tile-psum` for `mpfa`'s `fp8`
prefill kernel), with where and when it was computed; a Ctrl-C keeps the cells done so far (`interrupted`), so a run
that cannot finish its longest cells still stores and merges like a whole one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..harness.engines import gpu_label, model_name
from ..harness.environment import collect_environment
from .served import ServedAccuracy, scored_at
from .tasks.emulate import Progress, emulate_cells
from .tasks.generation import LoadedModel
from .tasks.task_sets import Cell


def run_emulated_accuracy(
    lm: LoadedModel, tokenizer_name: str, model: str, cells: Sequence[Cell], variants: Sequence[str], ref: str,
    attach: Callable, *, device: str, seed: int, max_new_tokens: int, batch_size: int, batch_tokens: int,
    progress: Progress, on_cell: Callable[[str, str, list[float]], None],
) -> ServedAccuracy:
    """Every variant on every cell (`emulate_cells`); `on_cell(variant, key, scores)` as each is done;
    `max_new_tokens`: the result's answer budget (`ServedAccuracy.empty`), each cell answered within its own."""
    result = ServedAccuracy.empty(model_name(model), tokenizer_name, ref, list(variants), list(cells), seed,
                                  max_new_tokens)
    environment = collect_environment()
    where = scored_at(gpu_label(False, environment["gpus"]) if device.startswith("cuda") else "cpu", environment)
    for variant in variants:
        result.server_info[variant] = {"engine": "emulate", "variant": variant}
        result.provenance[variant] = {**where, "kernels": {"emulated": variant}}
    try:
        for variant, key, scores, said in emulate_cells(lm, cells, variants, attach, batch_size=batch_size,
                                                        batch_tokens=batch_tokens, progress=progress):
            result.scores.setdefault(variant, {})[key] = scores
            result.answers.setdefault(variant, {})[key] = said
            on_cell(variant, key, scores)
    except KeyboardInterrupt:
        result.interrupted = True
    return result


def cells_done(result: ServedAccuracy) -> int:
    """(cell, variant) pairs scored."""
    return sum(len(by_cell) for by_cell in result.scores.values())

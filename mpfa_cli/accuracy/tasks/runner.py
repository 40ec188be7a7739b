"""`mpfa accuracy task`: run a real LM on QA / multiple-choice tasks once per attention variant.

Prompts are built once per task and reused verbatim for every variant; only the attention computation changes
(see attention_swap). SQuAD (and its long-context form `squad-long`) is scored by greedy answers (F1 / EM),
multiple-choice tasks by the log-likelihood of each choice. Questions run `batch_size` per forward call (padded
batches, longest prompts first; each question gets the numerics of running alone up to FP32 summation order, see
generation).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from . import data
from ....kernels.reference import CALIBRATED
from .attention_swap import SWAP_VARIANTS, KVScales, VariantAttention, calibrate_kv_scales, install
from .generation import LoadedModel, batch_choice_logprobs, greedy_answers, load_model
from .items import choice_items, squad_items
from .long_context import squad_long_items
from .task_sets import select_examples
from .task_report import AGREEMENT, BASELINE, TaskAccuracyReport, TaskScores
from .scoring import best_choice, choice_grade, squad_exact_match, squad_f1
from .tokens import HFTokenizer

TASKS = ("squad", "squad-long", *data.MULTIPLE_CHOICE_TASKS)
DEFAULT_TASKS = ("squad", "social_iqa")
DEFAULT_VARIANTS = ("bf16", "fp8", "qk4-pv8-direct", "mpfa")
DEFAULT_CONTEXT_PAD = 1024
DEFAULT_MAX_NEW_TOKENS = 16
DEFAULT_BATCH_SIZE = 16
CALIBRATION_TOKENS = 2048  # of the essays: the text the FP8 K/V scales of `fp8-calibrated` are calibrated on

# (task, variant, examples done, examples total) -> None
ProgressFn = Callable[[str, str, int, int], None]


def _check_request(
    tasks: Sequence[str], variants: Sequence[str], limit: int | None, offset: int, context_pad: int,
    max_new_tokens: int, batch_size: int,
) -> None:
    if not tasks or not variants:
        raise ValueError("pass at least one task and one variant")
    if bad := [t for t in tasks if t not in TASKS]:
        raise ValueError(f"unknown task {', '.join(bad)}; choose from {', '.join(TASKS)}")
    if bad := [v for v in variants if v not in SWAP_VARIANTS]:
        raise ValueError(f"unknown variant {', '.join(bad)}; choose from {', '.join(SWAP_VARIANTS)}")
    if len(set(tasks)) != len(tasks) or len(set(variants)) != len(variants):
        raise ValueError("tasks and variants must not repeat")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    if offset < 0:
        raise ValueError(f"--offset must not be negative, got {offset}")
    if context_pad < 1:
        raise ValueError(f"--context-pad must be a positive number of tokens, got {context_pad}")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")


def _add_agreement(result: TaskScores, outputs: dict[str, list]) -> None:
    """Share of examples whose output (answer text, or chosen option) equals BF16's; far less noisy than the
    score difference on a few examples."""
    if BASELINE in outputs:
        for variant, outs in outputs.items():
            result.metrics[variant][AGREEMENT] = statistics.fmean(a == b for a, b in zip(outs, outputs[BASELINE]))


def length_batches(sizes: Sequence[int], batch_size: int) -> list[list[int]]:
    """Example indices in batches of `batch_size`, longest first (less padding; results do not depend on it)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def in_order(batches: Sequence[list[int]], run: Callable[[list[int]], Sequence], done: Callable[[int], None]) -> list:
    """``run(batch)`` (the outputs of those examples) over every batch, reporting the count done after each; the
    outputs in example order."""
    found: dict[int, object] = {}
    for batch in batches:
        found.update(zip(batch, run(batch)))
        done(len(found))
    return [found[i] for i in range(len(found))]


def installer(lm: LoadedModel, tok: HFTokenizer, variants: Sequence[str]) -> Callable[[str], VariantAttention]:
    """`install(variant)` on the run's model; the scales of calibrated variants (`fp8-calibrated`) are calibrated
    once, on the first CALIBRATION_TOKENS tokens of the essays."""
    kv_scales: KVScales | None = None
    if any(v in CALIBRATED for v in variants):
        kv_scales = calibrate_kv_scales(lm.model, tok.encode(data.essay_text())[:CALIBRATION_TOKENS])
    return lambda variant: install(lm.model, variant, kv_scales if variant in CALIBRATED else None)


def _run_squad(lm, task, examples, prompts, variants, max_new_tokens, batch_size, progress, attach) -> TaskScores:
    result, answers = TaskScores(task, "f1", len(examples)), {}
    batches = length_batches([len(p) for p in prompts], batch_size)
    for variant in variants:
        attention, start = attach(variant), time.perf_counter()
        answers[variant] = in_order(
            batches, lambda batch: greedy_answers(lm, [prompts[i] for i in batch], attention, max_new_tokens),
            lambda done: progress(task, variant, done, len(examples)))
        result.seconds[variant] = time.perf_counter() - start
        result.metrics[variant] = {
            "f1": statistics.fmean(squad_f1(a, ex.answers) for a, ex in zip(answers[variant], examples)),
            "em": statistics.fmean(squad_exact_match(a, ex.answers) for a, ex in zip(answers[variant], examples)),
        }
    _add_agreement(result, answers)
    return result


def _run_choice(lm, task, examples, prompts, variants, batch_size, progress, attach) -> TaskScores:
    result, picks = TaskScores(task, "grade", len(examples)), {}
    batches = length_batches([len(context) for context, _ in prompts], batch_size)
    for variant in variants:
        attention, start = attach(variant), time.perf_counter()
        logprobs = in_order(
            batches, lambda batch: batch_choice_logprobs(lm, [prompts[i] for i in batch], attention),
            lambda done: progress(task, variant, done, len(examples)))
        picks[variant] = [best_choice(scores) for scores in logprobs]
        result.seconds[variant] = time.perf_counter() - start
        result.metrics[variant] = {
            "grade": statistics.fmean(choice_grade(scores, ex.correct) for scores, ex in zip(logprobs, examples))}
    _add_agreement(result, picks)
    return result


def run_task_accuracy(
    model: str,
    tasks: Sequence[str] = DEFAULT_TASKS,
    variants: Sequence[str] = DEFAULT_VARIANTS,
    *,
    limit: int | None = None,
    offset: int = 0,
    context_pad: int = DEFAULT_CONTEXT_PAD,
    device: str = "cpu",
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: ProgressFn | None = None,
) -> TaskAccuracyReport:
    """Score every variant on every task with the same prompts; `offset` and `limit` select examples
    [offset, offset + limit) of each task in file order (shards of one run, see `report.merge_reports`);
    `context_pad` is the exact token length of a `squad-long` prompt; `batch_size` questions run per forward
    call (1: one at a time; the scores do not depend on it beyond FP32 summation order)."""
    tasks, variants = list(tasks), list(variants)
    _check_request(tasks, variants, limit, offset, context_pad, max_new_tokens, batch_size)
    lm = load_model(model, device)
    report_progress = progress or (lambda *_: None)
    results = []
    tok = HFTokenizer(lm.tokenizer, lm.name)
    attach = installer(lm, tok, variants)
    for task in tasks:
        if task in ("squad", "squad-long"):
            everything = data.load_squad(data.task_file("squad"))
            examples = select_examples(task, everything, offset, limit)
            items = (squad_long_items(tok, examples, everything, context_pad) if task == "squad-long"
                     else squad_items(tok, examples))
            prompts = [list(item.prompt) for item in items]
            results.append(_run_squad(lm, task, examples, prompts, variants, max_new_tokens, batch_size,
                                      report_progress, attach))
        else:
            examples = select_examples(task, data.load_multiple_choice(data.task_file(task)), offset, limit)
            prompts = [(list(item.context), [list(c) for c in item.choices])
                       for item in choice_items(tok, examples, task, offset)]
            results.append(_run_choice(lm, task, examples, prompts, variants, batch_size, report_progress, attach))
    params = {"tasks": tasks, "variants": variants, "offset": offset, "limit": limit, "context_pad": context_pad,
              "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    if any(v in CALIBRATED for v in variants):
        params["kv_calibration"] = f"first {CALIBRATION_TOKENS} tokens of {data.ESSAYS_SOURCE}"
    return TaskAccuracyReport(lm.name, str(lm.device), params, results)


def print_task_accuracy(model: str, console, **kwargs) -> TaskAccuracyReport:
    """`run_task_accuracy` with a rich progress bar over examples (per task and variant), then the table."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .task_report import render_task_accuracy

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        bars: dict[tuple[str, str], int] = {}

        def advance(task: str, variant: str, done: int, total: int) -> None:
            if (task, variant) not in bars:
                bars[(task, variant)] = bar.add_task(f"{task} {variant}", total=total)
            bar.update(bars[(task, variant)], completed=done)

        report = run_task_accuracy(model, progress=advance, **kwargs)
    render_task_accuracy(report, console)
    return report

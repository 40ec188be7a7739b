"""`mpfa accuracy serve`: task questions through a backend's server, scored on the client.

Every backend's server gets the same prompts as token ids on SGLang's native `/generate` (`--skip-tokenizer-init`:
ids in, ids out), so the prompt lengths are exact and the answers are decoded by the model's tokenizer here:

* a question answered by greedy decoding (`GenerationItem`):
  `{"input_ids": [...], "sampling_params": {"max_new_tokens": N, "temperature": 0, "stop_token_ids": [...]}}`
  with N its cell's answer budget (`Cell.max_new_tokens`); the output ids up to the first stop id, decoded, first
  line (all of it for the metric "share"), are the answer (`tokens.answer_text`);
* a multiple-choice question (`ChoiceItem`): one request per choice, context + choice ids with
  `"return_logprob": true, "logprob_start_len": len(context) - 1` and one new token; the choice's log-likelihood
  is the sum of the `input_token_logprobs` of its tokens (the last len(choice) entries, checked against the ids).

A server that counts another prompt length than was sent, or whose logprob entries are not for the ids sent, fails
the backend (`ResponseError`). Requests go `concurrency` at a time (SGLang batches them; 1 makes every request run
alone). The simulator answers with a span of the prompt (`sim_server.echoed_ids`): its scores are SIMULATED.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..harness.engines import gpu_label
from ..harness.latency_model import ModelShape
from .logits import SERVER_KEYS, ResponseError, post_generate, response_meta
from .served import INTERRUPTED, ServedAccuracy, scored_at
from ..harness.scenario import is_bundled_model, load_model_shape, model_dir
from ..harness.served_kernels import launch_page_size, runs_mpfa_kernels, served_kernels
from .tasks.items import ChoiceItem, GenerationItem
from .tasks.scoring import best_choice
from .tasks.task_sets import Cell
from .tasks.tokens import TaskTokenizer, answer_text

DEFAULT_CONCURRENCY = 8


def generation_body(item: GenerationItem, max_new_tokens: int, stop_ids: Sequence[int]) -> dict[str, Any]:
    return {"input_ids": list(item.prompt), "stream": False,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                "stop_token_ids": sorted(stop_ids)}}


def choice_body(context: Sequence[int], choice: Sequence[int]) -> dict[str, Any]:
    return {"input_ids": [*context, *choice], "stream": False, "return_logprob": True,
            "logprob_start_len": len(context) - 1, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}


def answer(url: str, item: GenerationItem, tok: TaskTokenizer, max_new_tokens: int) -> tuple[float, str]:
    """(score, answer text) of one greedy answer from the server."""
    score, text, _ = answered(url, item, tok, max_new_tokens)
    return score, text


def answered(url: str, item: GenerationItem, tok: TaskTokenizer, max_new_tokens: int
             ) -> tuple[float, str, dict[str, Any]]:
    """(score, answer text, the response's `meta_info`) of one greedy answer from the server."""
    body = post_generate(url, generation_body(item, max_new_tokens, tok.stop_ids()))
    meta = response_meta(body, len(item.prompt))
    ids = body.get("output_ids")
    if not isinstance(ids, list) or len(ids) > max_new_tokens:
        raise ResponseError(f"response carries output_ids {ids!r:.80} for at most {max_new_tokens} new tokens")
    text = answer_text(tok, ids, item.first_line)
    return item.score(text), text, meta


def choice_logprob(url: str, context: Sequence[int], choice: Sequence[int]) -> float:
    """Summed log-likelihood of `choice` after `context`, from the server's prompt logprobs."""
    meta = response_meta(post_generate(url, choice_body(context, choice)), len(context) + len(choice))
    entries = meta.get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) < len(choice):
        raise ResponseError("response has too few input_token_logprobs (did the server ignore return_logprob?)")
    total = 0.0
    for entry, token in zip(entries[-len(choice):], choice):
        if not isinstance(entry, (list, tuple)) or len(entry) < 2 or int(entry[1]) != token:
            raise ResponseError(f"input_token_logprobs entry {entry!r} is not for choice token {token}")
        if not isinstance(entry[0], (int, float)) or not math.isfinite(entry[0]):
            raise ResponseError(f"input_token_logprobs entry {entry!r} has no finite logprob")
        total += float(entry[0])
    return total


def choose(url: str, item: ChoiceItem) -> tuple[float, int]:
    """(grade, index of the chosen option) of one multiple-choice question."""
    picked = best_choice([choice_logprob(url, item.context, choice) for choice in item.choices])
    return float(picked in item.correct), picked


def score_cell(
    url: str, cell: Cell, tok: TaskTokenizer, concurrency: int, on_done: Callable[[], None]
) -> tuple[list[float], list[str | int]]:
    """Per-question scores and answers (text, or chosen option) of one cell, in question order."""
    def one(item: GenerationItem | ChoiceItem) -> tuple[float, str | int]:
        try:
            result = choose(url, item) if isinstance(item, ChoiceItem) else answer(url, item, tok, cell.max_new_tokens)
        except ResponseError as exc:
            raise ResponseError(f"{cell.key} question {item.id}: {exc}") from None
        on_done()
        return result

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, cell.items))
    return [score for score, _ in results], [said for _, said in results]


def context_length(cells: Sequence[Cell]) -> int:
    """The server context the longest request needs: its prompt and every token its cell lets it generate."""
    return max(len(item.prompt) + cell.max_new_tokens if isinstance(item, GenerationItem)
               else len(item.context) + max(len(c) for c in item.choices) + 1
               for cell in cells for item in cell.items)


def workload(cells: Sequence[Cell]) -> tuple[int, int]:
    """(requests, prompt tokens) one backend is sent: a request per question, one per choice."""
    requests = tokens = 0
    for cell in cells:
        for item in cell.items:
            if isinstance(item, ChoiceItem):
                requests += len(item.choices)
                tokens += sum(len(item.context) + len(c) for c in item.choices)
            else:
                requests += 1
                tokens += len(item.prompt)
    return requests, tokens


def trained_window(model: str) -> int | None:
    """The positions a model directory's weights were trained for (its config.json's `max_position_embeddings`);
    None for a bundled config (dummy weights) or a config that names none."""
    if is_bundled_model(model):
        return None
    window = json.loads((model_dir(model) / "config.json").read_text()).get("max_position_embeddings")
    return int(window) if window else None


def check_window(cells: Sequence[Cell], window: int) -> None:
    """Refuse requests longer than the model's trained window (positions past it are extrapolated RoPE)."""
    for cell in cells:
        if (needed := context_length([cell])) > window:
            raise ValueError(f"{cell.key}: its longest prompt with {cell.max_new_tokens} new tokens needs {needed} "
                             f"positions, the model's window is {window}: use lengths of at most "
                             f"{window - cell.max_new_tokens} tokens for {cell.task}")


def run_served_accuracy(
    specs: list, ref: str, cells: list[Cell], tok: TaskTokenizer, model: str, options_for: Callable[[Any], Any],
    console, *, seed: int, max_new_tokens: int, concurrency: int = DEFAULT_CONCURRENCY,
) -> ServedAccuracy:
    """Serve each backend in turn (`bench.served`; `model`: a bundled config or a model directory) and score every
    cell on it, each answer within its cell's budget (`max_new_tokens`: the result's, `ServedAccuracy.empty`); a
    backend whose server fails a request keeps the error and the cells scored before it. The result names the model
    as bench does (a directory by its name)."""
    from ..bench.runner import _find_key, progress_bar, served, verify_server
    from ..harness.engines import model_name
    from ..harness.environment import collect_environment

    environment, shape = collect_environment(), load_model_shape(model)
    options = [options_for(spec) for spec in specs]
    names = [served_name(spec, opts.prefill_kernel) for spec, opts in zip(specs, options)]
    result = ServedAccuracy.empty(model_name(model), tok.name, ref, names, cells, seed, max_new_tokens)
    for spec, opts, name in zip(specs, options, names):
        try:
            with progress_bar(console) as progress, \
                    served(spec, model, context_length(cells), opts, progress) as (url, info, _):
                if opts.engine == "url":
                    verify_server(info, spec)  # `served` checks the servers it launches itself
                result.simulated = result.simulated or opts.engine == "sim" or info.get("simulated") is True
                result.server_info[name] = {k: v for k in SERVER_KEYS if (v := _find_key(info, k)) is not None}
                result.provenance[name] = provenance(spec, opts, shape, environment)
                for cell in cells:
                    bar = progress.add_task(f"{name} {cell.key}", total=len(cell.items))
                    try:
                        scores, answers = score_cell(url, cell, tok, concurrency, lambda: progress.advance(bar))
                    except ResponseError as exc:
                        result.errors[name] = str(exc)
                        break
                    result.scores.setdefault(name, {})[cell.key] = scores
                    result.answers.setdefault(name, {})[cell.key] = answers
        except KeyboardInterrupt:  # the server is stopped; the cells scored so far are kept
            result.errors[name] = INTERRUPTED
            result.interrupted = True
            break
    return result


def provenance(spec, opts, shape: ModelShape, environment: dict[str, Any]) -> dict[str, Any]:
    """Where and when a backend was scored: the date (UTC), the GPU and mpfa revision of `environment`
    (`environment.collect_environment`), and the kernels its server runs for the model's heads (`shape`)."""
    simulated = opts.engine == "sim"
    return {**scored_at(gpu_label(simulated, environment["gpus"]), environment),
            "kernels": served_kernels(spec, shape.q_heads, shape.kv_heads, launch_page_size(spec), opts.prefill_kernel,
                                      source="simulated" if simulated else "dispatch")}


def served_name(spec, prefill_kernel: str | None) -> str:
    """The backend's name in results: with the prefill kernel asked for where it applies (`mpfa+exact`), so that
    runs of one backend with different kernels can be joined and compared."""
    return f"{spec.name}+{prefill_kernel}" if prefill_kernel and runs_mpfa_kernels(spec) else spec.name

"""`mpfa logits`: do two backends compute the same model? Logprobs of the same prompts, compared to a reference.

Each backend's server gets the same deterministic token-id prompts (`serving_workload.make_prompts`) on SGLang's native
`/generate`, one request at a time (every backend sees batch size 1, so batch composition cannot explain a
difference), with greedy sampling and logprobs on:

    {"input_ids": [...], "return_logprob": true, "logprob_start_len": 0, "top_logprobs_num": 1,
     "sampling_params": {"max_new_tokens": N, "ignore_eos": true, "temperature": 0}}

SGLang 0.5.15 (`--skip-tokenizer-init`, `return_text_in_logprobs` false) answers with, in `meta_info`:

- `input_token_logprobs`: one `[logprob, token_id, null]` per prompt token; the first token's logprob is null
  (nothing predicts it). This is the prefill path: the logprob of prompt token i given tokens < i.
- `input_top_logprobs`: per prompt position `null` (the first) or a list of `top_logprobs_num` entries
  `[logprob, token_id, null]`: the model's top-1 prediction for that position.
- `output_token_logprobs` / `output_top_logprobs`: the same for each generated token (the decode path; the first
  output token comes from the prefill's last position).
- `prompt_tokens`, `completion_tokens`; the body's `output_ids` are the generated ids.

Compared to the reference backend, per input length:

- prefill: mean / p99 / max of |Δ logprob| over prompt positions 1..L-1 of every prompt, and the share of those
  positions whose top-1 token agrees;
- decode: the share of prompts whose greedy output ids are identical, each prompt's first divergence position,
  and mean / max |Δ logprob| of output tokens before the first divergence (same context, same token).

Dummy weights: SGLang 0.5.15's `DummyModelLoader.load_model` (model_loader/loader.py) calls
`initialize_dummy_weights(model)` (model_loader/weight_utils.py) with its default `seed=1234`: every floating
parameter gets its own `torch.Generator` seeded 1234 and `uniform_(-1e-3, 1e-3)`. The seed is not taken from the
server args (`--random-seed` seeds sampling and the like), so every backend's server holds the same weights as long
as the model config and dtype are the same; we still pass one `--random-seed` to all. With those weights the
logits are near-uniform and attention cannot reach them (see NEAR_UNIFORM_STD): the table then checks that every
backend serves without NaN and with exact token counts, and says so; real weights (`--model DIR`) test accuracy.

A response with a wrong prompt or output token count, or whose logprob entries do not match the ids sent, makes
the row an error. No pass/fail threshold is built in: `--max-mean-abs-dlogprob` makes one for scripted checks.
"""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from ..harness import serving_workload

# Below this spread of the reference's prompt logprobs (nats) the model is near-uniform. SGLang's dummy weights
# (every float parameter ~ U(-1e-3, 1e-3), norm weights included) give a std of ~4e-6 nats: attention outputs are
# ~2e-8 against a ~6e-4 residual stream, below BF16's rounding of it, so they cannot move the logits.
NEAR_UNIFORM_STD = 1e-2
REQUEST_TIMEOUT_S = 1800.0


class ResponseError(ValueError):
    """A `/generate` response that cannot be compared (wrong counts, malformed logprobs, HTTP error)."""


def request_body(prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    """The `/generate` request for one prompt: greedy, exact length, every prompt and output logprob, top-1."""
    return {
        "input_ids": prompt,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 1,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0},
        "stream": False,
    }


@dataclass
class Sample:
    """One prompt's answer from one backend."""

    prompt_logprobs: list[float]  # positions 1..L-1: logprob of prompt token i given tokens < i
    prompt_top_ids: list[int] | None  # positions 1..L-1: the top-1 token, when the server returned top logprobs
    output_ids: list[int]
    output_logprobs: list[float]


def _entry(item: Any, where: str) -> tuple[float | None, int]:
    if not isinstance(item, (list, tuple)) or len(item) < 2:
        raise ResponseError(f"{where}: expected [logprob, token_id, text], got {item!r}")
    value, token = item[0], item[1]
    if value is not None and not isinstance(value, (int, float)):
        raise ResponseError(f"{where}: logprob {value!r} is not a number")
    return (None if value is None else float(value)), int(token)


def response_meta(body: dict[str, Any], sent: int) -> dict[str, Any]:
    """The `meta_info` of one non-streamed `/generate` response, after its error and its prompt-token count (against
    the `sent` ids) are checked."""
    if "error" in body:
        err = body["error"]
        raise ResponseError(f"server error: {err.get('message', err) if isinstance(err, dict) else err}")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ResponseError("response has no meta_info")
    if meta.get("prompt_tokens") is not None and int(meta["prompt_tokens"]) != sent:
        raise ResponseError(f"server counted {meta['prompt_tokens']} prompt tokens, {sent} were sent")
    return meta


def parse_response(body: dict[str, Any], prompt: list[int], max_new_tokens: int) -> Sample:
    """Check one `/generate` response's counts and ids against the request and pull out its logprobs."""
    meta = response_meta(body, len(prompt))
    output_ids = list(body.get("output_ids") or [])
    n_prompt, n_out = len(prompt), max_new_tokens
    if meta.get("completion_tokens") is not None and int(meta["completion_tokens"]) != n_out:
        raise ResponseError(f"server generated {meta['completion_tokens']} tokens, {n_out} were requested")
    if len(output_ids) != n_out:
        raise ResponseError(f"response carries {len(output_ids)} output ids, {n_out} were requested")
    inputs = meta.get("input_token_logprobs")
    outputs = meta.get("output_token_logprobs")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ResponseError("response has no input/output_token_logprobs (did the server ignore return_logprob?)")
    if len(inputs) != n_prompt:
        raise ResponseError(f"{len(inputs)} input_token_logprobs for a prompt of {n_prompt} tokens")
    if len(outputs) != n_out:
        raise ResponseError(f"{len(outputs)} output_token_logprobs for {n_out} output tokens")
    prompt_logprobs = []
    for i, item in enumerate(inputs):
        value, token = _entry(item, f"input_token_logprobs[{i}]")
        if token != prompt[i]:
            raise ResponseError(f"input_token_logprobs[{i}] is for token {token}, the prompt has {prompt[i]}")
        if i > 0:
            if value is None or not math.isfinite(value):
                raise ResponseError(f"input_token_logprobs[{i}] is {value!r}, not a finite logprob")
            prompt_logprobs.append(value)
    output_logprobs = []
    for i, item in enumerate(outputs):
        value, token = _entry(item, f"output_token_logprobs[{i}]")
        if token != output_ids[i]:
            raise ResponseError(f"output_token_logprobs[{i}] is for token {token}, output_ids has {output_ids[i]}")
        if value is None or not math.isfinite(value):
            raise ResponseError(f"output_token_logprobs[{i}] is {value!r}, not a finite logprob")
        output_logprobs.append(value)
    return Sample(prompt_logprobs, _top_ids(meta.get("input_top_logprobs"), n_prompt), output_ids, output_logprobs)


def _top_ids(tops: Any, n_prompt: int) -> list[int] | None:
    """Top-1 token per prompt position 1..L-1, or None when the server returned no (complete) top logprobs."""
    if not isinstance(tops, list) or len(tops) != n_prompt:
        return None
    ids = []
    for i, position in enumerate(tops[1:], start=1):
        if not position:
            return None
        ids.append(_entry(position[0], f"input_top_logprobs[{i}][0]")[1])
    return ids


# --- talking to a server ---------------------------------------------------------------------------------------


def generate(url: str, prompt: list[int], max_new_tokens: int, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """POST one logprob request to `url`/generate; the JSON answer (an HTTP error becomes ResponseError)."""
    return post_generate(url, request_body(prompt, max_new_tokens), timeout)


def post_generate(url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """POST `body` to `url`/generate; the JSON answer (an HTTP error becomes ResponseError)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(f"{url.rstrip('/')}/generate", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        text = exc.read()[:300].decode(errors="replace")
        raise ResponseError(f"HTTP {exc.code} from {url}/generate: {text}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ResponseError(f"request to {url}/generate failed: {exc}") from None


def collect(
    url: str, prompts: list[list[int]], max_new_tokens: int, on_done: Callable[[], None] | None = None
) -> tuple[list[Sample], str | None]:
    """Send the prompts one at a time; the samples, or the first error (and the samples before it)."""
    samples: list[Sample] = []
    for index, prompt in enumerate(prompts):
        try:
            samples.append(parse_response(generate(url, prompt, max_new_tokens), prompt, max_new_tokens))
        except ResponseError as exc:
            return samples, f"prompt {index} ({len(prompt)} tokens): {exc}"
        if on_done:
            on_done()
    return samples, None


# --- comparison --------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One backend at one input length, compared to the reference backend."""

    backend: str
    input_len: int
    prompts: int
    error: str | None = None
    prefill_positions: int = 0
    prefill_mean_abs: float | None = None
    prefill_p99_abs: float | None = None
    prefill_max_abs: float | None = None
    prefill_top1_agree: float | None = None  # share of positions; None without top logprobs
    decode_identical: float | None = None  # share of prompts whose greedy output ids equal the reference's
    first_divergence: list[int | None] = field(default_factory=list)  # per prompt; None: identical
    decode_compared: int = 0  # output positions before the first divergence, over all prompts
    decode_mean_abs: float | None = None
    decode_max_abs: float | None = None

    @property
    def earliest_divergence(self) -> int | None:
        found = [d for d in self.first_divergence if d is not None]
        return min(found) if found else None


def first_divergence(ref: list[int], other: list[int]) -> int | None:
    """Index of the first differing output id; None when identical."""
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return i
    return None if len(ref) == len(other) else min(len(ref), len(other))


def compare(backend: str, input_len: int, ref: list[Sample], other: list[Sample]) -> Row:
    """`other`'s samples vs the reference's, prompt by prompt (same prompts, same order)."""
    row = Row(backend=backend, input_len=input_len, prompts=len(other))
    if len(ref) != len(other):
        row.error = f"{len(other)} samples vs the reference's {len(ref)}"
        return row
    prefill: list[np.ndarray] = []
    agree = positions_with_top = 0
    have_top = True
    decode: list[np.ndarray] = []
    identical = 0
    for index, (r, o) in enumerate(zip(ref, other)):
        if len(r.prompt_logprobs) != len(o.prompt_logprobs) or len(r.output_ids) != len(o.output_ids):
            row.error = f"prompt {index}: token counts differ from the reference's"
            return row
        prefill.append(np.abs(np.asarray(o.prompt_logprobs) - np.asarray(r.prompt_logprobs)))
        if r.prompt_top_ids is None or o.prompt_top_ids is None:
            have_top = False
        else:
            agree += sum(a == b for a, b in zip(r.prompt_top_ids, o.prompt_top_ids))
            positions_with_top += len(r.prompt_top_ids)
        split = first_divergence(r.output_ids, o.output_ids)
        row.first_divergence.append(split)
        identical += split is None
        upto = len(r.output_ids) if split is None else split
        decode.append(np.abs(np.asarray(o.output_logprobs[:upto]) - np.asarray(r.output_logprobs[:upto])))
    deltas = np.concatenate(prefill) if prefill else np.zeros(0)
    row.prefill_positions = int(deltas.size)
    if deltas.size:
        row.prefill_mean_abs = float(deltas.mean())
        row.prefill_p99_abs = float(np.percentile(deltas, 99))
        row.prefill_max_abs = float(deltas.max())
    if have_top and positions_with_top:
        row.prefill_top1_agree = agree / positions_with_top
    row.decode_identical = identical / len(other) if other else None
    matched = np.concatenate(decode) if decode else np.zeros(0)
    row.decode_compared = int(matched.size)
    if matched.size:
        row.decode_mean_abs = float(matched.mean())
        row.decode_max_abs = float(matched.max())
    return row


def reference_stats(samples: list[Sample]) -> dict[str, float | None]:
    """Spread of the reference's own prompt logprobs: with near-uniform logits (SGLang's dummy weights) every
    |Δ logprob| is tiny whatever the attention does, so read the deltas against this."""
    values = np.concatenate([np.asarray(s.prompt_logprobs) for s in samples]) if samples else np.zeros(0)
    if not values.size:
        return {"prompt_logprob_mean": None, "prompt_logprob_std": None}
    return {"prompt_logprob_mean": float(values.mean()), "prompt_logprob_std": float(values.std())}


@dataclass
class LogitsResult:
    ref: str
    model: str
    simulated: bool
    output_len: int
    seed: int
    rows: list[Row]
    reference: dict[int, dict[str, float | None]]  # input_len -> reference_stats
    server_info: dict[str, dict[str, Any]] = field(default_factory=dict)  # backend -> the keys that define it

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reference"] = {str(k): v for k, v in self.reference.items()}
        return out

    def over_threshold(self, limit: float) -> list[Row]:
        """Rows (other than the reference's) whose prefill or decode mean |Δ logprob| exceeds `limit`."""
        return [r for r in self.rows if r.backend != self.ref and r.error is None and any(
            v is not None and v > limit for v in (r.prefill_mean_abs, r.decode_mean_abs))]


def prompts_for(seed: int, count: int, input_len: int) -> list[list[int]]:
    """The prompts every backend gets at one input length (the bench workload's generator)."""
    return serving_workload.make_prompts(seed, count, input_len)


def workload_params(seed: int, count: int, input_lens: list[int], output_len: int) -> dict[str, Any]:
    return {"seed": seed, "prompts": count, "input_len": input_lens, "output_len": output_len,
            "prompt_scheme": serving_workload.PROMPT_SCHEME}


def render(result: LogitsResult, console) -> None:
    """The comparison as a rich table, one row per backend x input length."""
    from rich.table import Table

    title = f"Logprobs vs {result.ref} ({result.model}, {result.output_len} output tokens, greedy)"
    if result.simulated:
        title = f"SIMULATED — {title} — the simulator's logprobs are hash values, meaningless as accuracy"
    table = Table(title=title, title_justify="left")
    for column in ("backend", "input", "prompts", "prefill mean |Δlp|", "prefill p99 |Δlp|", "prefill max |Δlp|",
                   "top-1 agree", "decode identical", "first divergence", "decode mean |Δlp|", "status"):
        table.add_column(column, justify="left" if column in ("backend", "status") else "right")
    for row in result.rows:
        ref_mark = " (ref)" if row.backend == result.ref else ""
        if row.error:
            table.add_row(row.backend + ref_mark, str(row.input_len), str(row.prompts), *["–"] * 7,
                          f"[red]error: {row.error}[/]")
            continue
        divergences = ",".join("–" if d is None else str(d) for d in row.first_divergence)
        table.add_row(
            row.backend + ref_mark, str(row.input_len), str(row.prompts), format_number(row.prefill_mean_abs),
            format_number(row.prefill_p99_abs), format_number(row.prefill_max_abs),
            format_share(row.prefill_top1_agree), format_share(row.decode_identical), divergences,
            format_number(row.decode_mean_abs), "[green]ok[/]",
        )
    console.print(table)
    for input_len, stats in result.reference.items():
        if stats.get("prompt_logprob_mean") is None:
            continue
        console.print(f"{result.ref} at {input_len}: prompt logprobs mean {stats['prompt_logprob_mean']:.4f}, "
                      f"std {stats['prompt_logprob_std']:.3g}", highlight=False)
        if stats["prompt_logprob_std"] < NEAR_UNIFORM_STD:
            console.print(f"[yellow]the reference's logits are near-uniform (std < {NEAR_UNIFORM_STD}): with SGLang's "
                          "dummy weights attention barely reaches the logits, so agreement here checks the plumbing "
                          "(no NaN, exact counts), not attention accuracy; use real weights (--model DIR) for that[/]")
    console.print("first divergence: per prompt, the first output position whose greedy token differs from the "
                  "reference's (– identical); decode |Δlp| is over the positions before it.", highlight=False)


def format_number(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


def format_share(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


# --- the run ---------------------------------------------------------------------------------------------------

SERVER_KEYS = ("attention_backend", "kv_cache_dtype", "page_size", "random_seed", "load_format", "model_path",
               "version", "simulated")


def run_logits(
    specs: list, ref: str, input_lens: list[int], count: int, output_len: int, seed: int, model: str,
    options_for: Callable[[Any], Any], console,
) -> LogitsResult:
    """Serve each backend in turn (`bench.served`), send every prompt, compare each backend to `ref`.

    `specs` must start with the reference; `options_for(spec)` gives the `BenchOptions` to serve it with."""
    from ..bench.runner import _find_key, progress_bar, served, verify_server

    context_len = max(input_lens) + output_len + 64
    prompts = {n: prompts_for(seed, count, n) for n in input_lens}
    answers: dict[str, dict[int, tuple[list[Sample], str | None]]] = {}
    simulated = False
    server_info: dict[str, dict[str, Any]] = {}
    for spec in specs:
        opts = options_for(spec)
        with progress_bar(console) as progress, served(spec, model, context_len, opts, progress) as (url, info, _):
            if opts.engine == "url":
                verify_server(info, spec)  # `served` checks the servers it launches itself
            simulated = simulated or opts.engine == "sim" or info.get("simulated") is True
            server_info[spec.name] = {k: v for k in SERVER_KEYS if (v := _find_key(info, k)) is not None}
            answers[spec.name] = {}
            for n in input_lens:
                task = progress.add_task(f"{spec.name} {n} tokens", total=count)
                answers[spec.name][n] = collect(url, prompts[n], output_len, lambda: progress.advance(task))
    rows: list[Row] = []
    reference: dict[int, dict[str, float | None]] = {}
    for n in input_lens:
        ref_samples, ref_error = answers[ref][n]
        reference[n] = reference_stats(ref_samples if ref_error is None else [])
        for spec in specs:
            samples, error = answers[spec.name][n]
            if error is not None:
                rows.append(Row(backend=spec.name, input_len=n, prompts=count, error=error))
            elif ref_error is not None:
                rows.append(Row(backend=spec.name, input_len=n, prompts=count,
                                error=f"no reference to compare with ({ref} failed)"))
            else:
                rows.append(compare(spec.name, n, ref_samples, samples))
    return LogitsResult(ref=ref, model=model, simulated=simulated, output_len=output_len, seed=seed, rows=rows,
                        reference=reference, server_info=server_info)

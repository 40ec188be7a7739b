"""MpFA's prefix cache served by SGLang with a real model: a request that reuses cached pages answers as it does
cold (the issue's acceptance, on a GPU).

One SGLang server for backend `mpfa`, started as `mpfa bench` starts it (`bench.runner.served`, the prefix cache
on) for the checkpoint `MPFA_TEST_MODEL` names: Qwen2.5-Coder-1.5B-Instruct in BF16, as `mpfa accuracy convert
qwen2.5-coder-1.5b DIR` writes it. Prompts go as token ids to `/generate`, one at a time, as `mpfa accuracy serve`
sends them, greedy.

Hits. SGLang 0.5.15 matches a prompt against its radix cache page by page (`RadixKey.page_aligned`; pages of 128
for mpfa), up to all but the prompt's last token: a prompt whose first c tokens are those of a prompt served since
the last `/flush_cache` finds floor(min(c, len - 1) / 128) * 128 of them cached (`meta_info.cached_tokens`,
`page_hit` here). Every hit is checked against that: never more (tokens that differ would be shared), at most one
page less (the issue's bound). After `/flush_cache` (sent only while no request runs: SGLang refuses it then) a
prompt finds none.

Means. A sequence's centering means are those of its first prefill chunk (`kv_store`), and the server prefills in
chunks of CHUNK tokens, fewer than any two prompts here that share a prefix share: a prompt served cold takes the
means the writer of its cached pages took, so hits and cold runs are compared on the same means.

(a) Greedy equality, for PREFIXES prompt pairs: A and B share their first SHARED tokens (chat opening, instruction,
essay text), then each has a few hundred essay tokens and a question of its own. A, then B (a hit on A's pages),
then B again after a flush (cold): B's output ids must be equal. SHARED is a whole number of chunks, so B's extend
after its hit is exactly B's last chunk served cold, with the same context: both runs do the same work.
(b) Needles over shared documents (`shared_needle_documents`, the 32K `niah-multikey` cell's prompts and scoring):
each document's four questions in turn (the first writes the document's pages, the others hit them), then every
question again after a flush. Paired by question, the warm score must be within the paired noise of the cold one.

Sizes: `MPFA_TEST_NEEDLE_DOCS` documents (NEEDLE_DOCUMENTS by default). With `MPFA_TEST_OUT` set, the results,
with the GPU, date and revision, are written there as OUT_NAME. Run with `-s` to see the summaries.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rich.console import Console

from mpfa.backends.specs import backend_spec
from mpfa.mpfa_cli.accuracy.logits import post_generate, response_meta
from mpfa.mpfa_cli.accuracy.serve import answered, trained_window
from mpfa.mpfa_cli.accuracy.tasks.items import DEFAULT_MAX_NEW_TOKENS
from mpfa.mpfa_cli.accuracy.served import scored_at
from mpfa.mpfa_cli.accuracy.tasks.data import essay_text
from mpfa.mpfa_cli.accuracy.tasks.long_context import CONTEXT_LENGTHS, Haystack, shared_needle_documents
from mpfa.mpfa_cli.accuracy.tasks.paired_stats import mcnemar_exact_p, paired_difference
from mpfa.mpfa_cli.accuracy.tasks.tokens import TaskTokenizer, load_tokenizer
from mpfa.mpfa_cli.bench.progress import ServerBar
from mpfa.mpfa_cli.bench.runner import BenchOptions, served
from mpfa.mpfa_cli.harness.engines import gpu_label, model_name
from mpfa.mpfa_cli.harness.environment import collect_environment
from mpfa.mpfa_cli.harness.safe_files import private_dir, write_private
from mpfa.mpfa_cli.harness.served_kernels import launch_page_size

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = backend_spec("mpfa")
PAGE = launch_page_size(SPEC)
CHUNK = 32 * PAGE  # --chunked-prefill-size: below every shared prefix here, whatever SGLang's default on the GPU
SERVER_ARGS = ["--mem-fraction-static", "0.6", "--chunked-prefill-size", str(CHUNK)]  # 0.6: as docs/accuracy.md
SHARED = 2 * CHUNK  # (a): tokens A and B share, ~8K
OWN = 300  # (a): essay tokens of A's and of B's own before their questions: a few hundred, not whole pages
PREFIXES = 3
GREEDY_TOKENS = 64
INSTRUCTION = "Read the following essay excerpts.\n\n"
QUESTIONS = ("\n\nSummarize the text above in three sentences.",
             "\n\nWhat is the main argument of the text above? Answer in three sentences.")
NEEDLE_DOCUMENTS = 10  # four questions each
ALPHA = 0.05  # the McNemar p-value below which warm and cold scores differ
MOST_DIFFERING = (2, 10)  # questions that may differ in outcome: max(2, 10% of n)
OUT_NAME = "prefix-cache-served-qwen2.5-coder-1.5b.json"


@pytest.fixture(scope="module")
def model() -> str:
    if missing := SPEC.missing():
        pytest.skip(f"backend mpfa cannot be served here: {', '.join(missing)} not importable "
                    "(pip install -e '.[serve,kernels]')")
    path = os.environ.get("MPFA_TEST_MODEL")
    if not path:
        pytest.skip("MPFA_TEST_MODEL is not set: name a BF16 Qwen2.5-Coder-1.5B-Instruct checkpoint directory "
                    "(mpfa accuracy convert qwen2.5-coder-1.5b DIR)")
    if not (Path(path) / "config.json").is_file():
        pytest.skip(f"MPFA_TEST_MODEL={path} is not a checkpoint directory: it has no config.json")
    return path


@pytest.fixture(scope="module")
def window(model: str) -> int:
    if (trained := trained_window(model)) is None:
        pytest.fail(f"{model}: its config.json names no max_position_embeddings", pytrace=False)
    return trained


@pytest.fixture(scope="module")
def tok(model: str) -> TaskTokenizer:
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def haystack(tok: TaskTokenizer) -> Haystack:
    return Haystack.from_text(tok, essay_text())


@pytest.fixture(scope="module")
def server(model: str, window: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The server's URL; its log is in the test's temporary folder."""
    opts = BenchOptions(engine="sglang", run_dir=tmp_path_factory.mktemp("sglang"), server_args=SERVER_ARGS)
    with ServerBar(Console(stderr=True)) as progress, \
            served(SPEC, model, window, opts, progress, radix_cache=True) as (url, info, _):
        settings = {key: info.get(key) for key in ("disable_radix_cache", "page_size", "chunked_prefill_size")}
        assert settings == {"disable_radix_cache": False, "page_size": PAGE, "chunked_prefill_size": CHUNK}, \
            f"the server does not run with the prefix cache on, pages of {PAGE} and chunks of {CHUNK}: {settings}"
        yield url


@pytest.fixture(scope="module")
def report(model: str) -> Iterator[dict[str, Any]]:
    """What the tests found, written to `MPFA_TEST_OUT` (if set) once they have run, passed or not."""
    found: dict[str, Any] = {"model": model_name(model), "backend": SPEC.name, "page_size": PAGE,
                             "chunked_prefill_size": CHUNK}
    yield found
    if out := os.environ.get("MPFA_TEST_OUT"):
        environment = collect_environment()
        found.update(scored_at(gpu_label(False, environment["gpus"]), environment))
        write_private(private_dir(Path(out), "test results") / OUT_NAME,
                      (json.dumps(found, indent=1) + "\n").encode(), "test results")


def flush(url: str) -> None:
    """Empty the server's prefix cache (SGLang answers 200 when it did)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/flush_cache", method="POST"), timeout=60):
            return
    except urllib.error.HTTPError as exc:
        pytest.fail(f"/flush_cache answered HTTP {exc.code}: {exc.read()[:200].decode(errors='replace')}")


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def page_hit(prompt: Sequence[int], earlier: Sequence[Sequence[int]]) -> int:
    """Tokens of `prompt` SGLang's radix cache holds after `earlier` prompts (see the module's docstring)."""
    longest = max((shared_len(prompt, e) for e in earlier), default=0)
    return min(longest, len(prompt) - 1) // PAGE * PAGE


def cached(meta: dict[str, Any]) -> int:
    value = meta.get("cached_tokens")
    assert isinstance(value, int), f"the server reports no cached_tokens (meta_info: {sorted(meta)})"
    return value


def greedy(url: str, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """GREEDY_TOKENS greedy ids (no stop), their logprobs, and the prompt tokens served from the cache."""
    body = post_generate(url, {"input_ids": prompt, "stream": False, "return_logprob": True, "sampling_params": {
        "max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}})
    meta = response_meta(body, len(prompt))
    ids = body.get("output_ids")
    assert isinstance(ids, list) and len(ids) == GREEDY_TOKENS, f"{GREEDY_TOKENS} output ids asked, got {ids!r:.80}"
    return ids, [float(entry[0]) for entry in meta["output_token_logprobs"]], cached(meta)


def chat_opening(tok: TaskTokenizer, before: str) -> int:
    """Tokens of a chat turn before its body (two bodies that differ in their first token share exactly these)."""
    first, second = tok.encode("a")[0], tok.encode("b")[0]
    return shared_len(tok.chat_ids(before, (first,)), tok.chat_ids(before, (second,)))


def essay_ids(haystack: Haystack, start: int, count: int) -> list[int]:
    return [t for sentence in haystack.take(start, count) for t in sentence]


def test_greedy_outputs_with_a_cache_hit_equal_those_served_cold(
    server: str, tok: TaskTokenizer, haystack: Haystack, report: dict[str, Any]
) -> None:
    sentences = len(haystack.sentences)
    runs = []
    for index in range(PREFIXES):
        start = index * sentences // PREFIXES
        own = start + sentences // (2 * PREFIXES)  # A's own text there, B's a sentence later
        shared = essay_ids(haystack, start, SHARED - chat_opening(tok, INSTRUCTION))
        a, b = (tok.chat_ids(INSTRUCTION, shared + essay_ids(haystack, own + k, OWN), QUESTIONS[k]) for k in (0, 1))
        assert page_hit(b, [a]) == SHARED and len(b) - SHARED <= CHUNK, "B is not SHARED tokens of A and one chunk"
        flush(server)
        _, _, a_cached = greedy(server, a)
        hit_ids, hit_logprobs, hit = greedy(server, b)
        flush(server)
        cold_ids, cold_logprobs, cold = greedy(server, b)
        runs.append({"prompt_tokens": len(b), "shared_tokens": shared_len(a, b), "a_cached_tokens": a_cached,
                     "cached_tokens": hit, "cold_cached_tokens": cold, "equal": hit_ids == cold_ids,
                     "first_difference": shared_len(hit_ids, cold_ids) if hit_ids != cold_ids else None,
                     "max_abs_dlogprob": max(abs(x - y) for x, y in zip(hit_logprobs, cold_logprobs)),
                     "hit_ids": hit_ids, "cold_ids": cold_ids})
    report["greedy"] = runs
    print(f"\ngreedy: {sum(r['equal'] for r in runs)} of {len(runs)} prompts of {[r['prompt_tokens'] for r in runs]} "
          f"tokens gave the same {GREEDY_TOKENS} ids with a hit on {[r['cached_tokens'] for r in runs]} tokens as "
          f"cold; the greatest |Δ logprob| {max(r['max_abs_dlogprob'] for r in runs):.3g}")
    for run in runs:
        assert run["a_cached_tokens"] == 0 and run["cold_cached_tokens"] == 0, "a prompt after a flush found a hit"
        assert SHARED - PAGE <= run["cached_tokens"] <= SHARED, f"B found {run['cached_tokens']} tokens cached"
        assert run["equal"], f"B's greedy ids differ from position {run['first_difference']} on (hit vs cold)"


def needle_documents() -> int:
    given = os.environ.get("MPFA_TEST_NEEDLE_DOCS", str(NEEDLE_DOCUMENTS))
    if not given.isdigit() or int(given) < 1:
        pytest.fail(f"MPFA_TEST_NEEDLE_DOCS={given!r}: give a whole number of documents, at least 1", pytrace=False)
    return int(given)


def test_needles_over_a_shared_document_score_as_asked_cold(
    server: str, tok: TaskTokenizer, haystack: Haystack, window: int, report: dict[str, Any]
) -> None:
    length = min(CONTEXT_LENGTHS[-1], window - DEFAULT_MAX_NEW_TOKENS)  # the task's 32K cell, inside the window
    documents = shared_needle_documents(tok, haystack, length, needle_documents())
    questions = []
    flush(server)
    sent: list[tuple[int, ...]] = []
    for doc in documents:  # warm: the first question writes the document's pages, the others hit them
        document = min(shared_len(doc[0].prompt, item.prompt) for item in doc[1:])
        for j, item in enumerate(doc):
            score, text, meta = answered(server, item, tok, DEFAULT_MAX_NEW_TOKENS)
            questions.append({"id": item.id, "depth": item.depth, "answer": item.answers[0], "warm": score,
                              "warm_said": text, "cached_tokens": cached(meta), "most": page_hit(item.prompt, sent),
                              "least": document - PAGE if j else 0})
            sent.append(item.prompt)
    for row, item in zip(questions, [item for doc in documents for item in doc]):  # cold: each alone
        flush(server)
        row["cold"], row["cold_said"], meta = answered(server, item, tok, DEFAULT_MAX_NEW_TOKENS)
        row["cold_cached_tokens"] = cached(meta)

    warm, cold = [q["warm"] for q in questions], [q["cold"] for q in questions]
    difference, p = paired_difference(warm, cold), mcnemar_exact_p(warm, cold)
    hits = sum(q["cached_tokens"] for q in questions)
    report["needles"] = {"documents": len(documents), "length": length, "n": len(questions),
                         "warm_score": float(np.mean(warm)), "cold_score": float(np.mean(cold)),
                         "discordant": difference.differ, "mcnemar_p": p, "difference": difference.to_json(),
                         "warm_cached_tokens": hits, "warm_prompt_tokens": len(questions) * length,
                         "questions": questions}
    print(f"\nneedles: n = {len(questions)} questions, four on each of {len(documents)} documents of {length} tokens; "
          f"warm (a document's later questions hit its pages) {np.mean(warm):.1%}, cold (the cache flushed) "
          f"{np.mean(cold):.1%}; "
          f"{difference.differ} questions differ in outcome, exact McNemar p = {p:.3g}; the warm pass found "
          f"{hits:,} of its {len(questions) * length:,} prompt tokens cached")

    assert [q["id"] for q in questions if not q["least"] <= q["cached_tokens"] <= q["most"]] == [], \
        "warm questions whose hit is not the document's pages"
    assert {q["cold_cached_tokens"] for q in questions} == {0}, "a question asked after a flush found a hit"
    assert [q["id"] for q in questions for run in ("warm", "cold") if q[run] and not q[f"{run}_said"]] == [], \
        "questions whose empty answer passed"
    assert sum(cold) > 0, "no question answered cold: the server answers nothing a comparison could tell apart"
    least, percent = MOST_DIFFERING
    assert difference.differ <= max(least, len(questions) * percent // 100), \
        f"warm and cold differ on {difference.differ} of {len(questions)} questions"
    assert p >= ALPHA, f"warm and cold scores differ (exact McNemar p = {p:.3g})"

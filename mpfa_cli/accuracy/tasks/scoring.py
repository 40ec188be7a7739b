"""Task metrics: SQuAD v1.1 F1 / exact match (the official evaluation script's normalisation), the share of
expected strings an answer names (RULER's string_match_all) and the multiple-choice grade from per-choice
log-likelihoods."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where logits are scored, so that text scoring does not load it
    import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD v1.1 evaluation)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _f1(prediction: str, truth: str) -> float:
    pred_tokens, true_tokens = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((Counter(pred_tokens) & Counter(true_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(true_tokens)
    return 2 * precision * recall / (precision + recall)


def _require_truths(truths: Sequence[str]) -> None:
    if not truths:
        raise ValueError("a SQuAD question needs at least one reference answer")


def squad_f1(prediction: str, truths: Sequence[str]) -> float:
    """Token-level F1 against the best-matching reference answer, in [0, 1]."""
    _require_truths(truths)
    return max(_f1(prediction, t) for t in truths)


def squad_exact_match(prediction: str, truths: Sequence[str]) -> float:
    """1.0 when the normalised prediction equals a normalised reference answer, else 0.0."""
    _require_truths(truths)
    return float(any(normalize_answer(prediction) == normalize_answer(t) for t in truths))


def share_found(answer: str, expected: Sequence[str]) -> float:
    """RULER's string_match_all for one answer: the share of `expected` found in it, case-insensitive, each as a whole
    word (RULER takes any substring; here a value inside a longer number or a word inside a longer one, e.g. "form"
    in "information", is not found)."""
    if not expected:
        raise ValueError("a question scored by the share found needs at least one expected string")
    found = sum(bool(re.search(rf"(?<!\w){re.escape(e)}(?!\w)", answer, re.IGNORECASE)) for e in expected)
    return found / len(expected)


def continuation_logprobs(logits: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> list[float]:
    """Per row, the sum of log p(tokens[b, i]) under logits[b, i] (B right-padded rows: logits [B, n, vocab]
    predicting tokens [B, n]) over the positions where ``valid`` [B, n] is True (None: all), in float64."""
    import torch

    logprobs = torch.log_softmax(logits.double(), dim=-1).gather(2, tokens.long()[..., None])[..., 0]
    if valid is not None:
        logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    return logprobs.sum(1).tolist()


def best_choice(choice_logprobs: Sequence[float]) -> int:
    """Index of the most likely choice, the first one on ties."""
    if not choice_logprobs or not all(math.isfinite(x) for x in choice_logprobs):
        raise ValueError(f"choice log-likelihoods must be finite and not empty, got {list(choice_logprobs)}")
    return max(range(len(choice_logprobs)), key=lambda i: (choice_logprobs[i], -i))


def choice_grade(choice_logprobs: Sequence[float], correct: Collection[int]) -> float:
    """BIG-bench multiple_choice_grade: 1.0 when the most likely choice (first on ties) is a correct one."""
    return float(best_choice(choice_logprobs) in correct)

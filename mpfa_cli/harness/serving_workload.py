"""Deterministic benchmark workloads: prompts as token ids, arrival schedules, and a hash that names them.

Token ids come from SHAKE-256 (an extendable-output hash) keyed by what defines them, so the same
(seed, index, length) gives the same prompt on every machine and Python/NumPy version. Arrival gaps come from
NumPy's seeded PCG64 generator.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

VOCAB_RANGE = (1000, 30000)  # [low, high): ids every bundled model's vocabulary contains, clear of special tokens
PROMPT_SCHEME = "shake256-u32-mod-v1"  # part of the workload hash: changing how ids are drawn changes the hash


def hashed_token_ids(key: bytes, count: int, vocab: tuple[int, int] = VOCAB_RANGE) -> list[int]:
    """`count` token ids in [vocab[0], vocab[1]) drawn from SHAKE-256(key)."""
    low, high = vocab
    if count < 0:
        raise ValueError(f"token count must be >= 0, got {count}")
    if not 0 <= low < high:
        raise ValueError(f"vocab range must satisfy 0 <= low < high, got [{low}, {high})")
    words = np.frombuffer(hashlib.shake_256(key).digest(4 * count), dtype="<u4")
    return (low + words % (high - low)).tolist()


DISTINCT_FIRST_TOKENS = VOCAB_RANGE[1] - VOCAB_RANGE[0]


def slot_token(slot: int) -> int:
    """The first token of prompt part number `slot`: parts of different slots (below DISTINCT_FIRST_TOKENS apart)
    start differently, so a prefix cache matches none of them by chance, even with pages of one token."""
    return VOCAB_RANGE[0] + slot % DISTINCT_FIRST_TOKENS


def make_prompt(seed: int, index: int, input_len: int, vocab: tuple[int, int] = VOCAB_RANGE) -> list[int]:
    """Prompt number `index` of the workload `seed`: exactly `input_len` token ids."""
    if input_len < 1:
        raise ValueError(f"input_len must be >= 1, got {input_len}")
    return hashed_token_ids(f"mpfa-prompt:{seed}:{index}:{input_len}".encode(), input_len, vocab)


def make_prompts(
    seed: int, num_requests: int, input_len: int, vocab: tuple[int, int] = VOCAB_RANGE
) -> list[list[int]]:
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    return [make_prompt(seed, i, input_len, vocab) for i in range(num_requests)]


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Dispatch offsets in seconds from the start, the first at 0.

    Inter-arrival gaps are gamma distributed with shape `burstiness` and mean 1/rate: burstiness 1 is a
    Poisson process, below 1 burstier, above 1 more regular.
    """
    if rate <= 0 or not np.isfinite(rate):
        raise ValueError(f"rate must be a finite number > 0 requests/s, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests < 1:
        return []
    rng = np.random.default_rng([seed, 0x6172726976])  # a stream separate from anything else seeded by `seed`
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def workload_hash(**params: Any) -> str:
    """sha256 of the parameters that define a workload (JSON with sorted keys) plus the prompt scheme."""
    canonical = json.dumps({"prompt_scheme": PROMPT_SCHEME, **params}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()

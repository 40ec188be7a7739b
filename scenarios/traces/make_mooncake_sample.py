"""Writes mooncake-sample.jsonl, the small synthetic trace `mpfa bench --scenario mooncake-sample` replays.

Seeded, so a rerun writes the same file: 120 requests arriving as a Poisson process at ~2 requests/s. Two in three
open with one of 6 shared documents (2 to 16 blocks of 512 tokens: a system prompt or a RAG context); every
request then has 1 to 8 blocks of its own, so no two prompts are equal. Run it as
`python -m mpfa.scenarios.traces.make_mooncake_sample`.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

BLOCK_TOKENS = 512
REQUESTS = 120
RATE = 2.0  # requests per second
DOCUMENTS = 6


def main() -> None:
    rng = np.random.default_rng(44)
    next_id = 0

    def new_blocks(count: int) -> list[int]:
        nonlocal next_id
        next_id += count
        return list(range(next_id - count, next_id))

    documents = [new_blocks(int(rng.integers(2, 17))) for _ in range(DOCUMENTS)]
    timestamp_ms = 0.0
    lines = []
    for _ in range(REQUESTS):
        shared = documents[int(rng.integers(DOCUMENTS))] if rng.random() < 2 / 3 else []
        hash_ids = shared + new_blocks(int(rng.integers(1, 9)))
        input_length = (len(hash_ids) - 1) * BLOCK_TOKENS + int(rng.integers(1, BLOCK_TOKENS + 1))
        lines.append(json.dumps({"timestamp": round(timestamp_ms), "input_length": input_length,
                                 "output_length": int(rng.integers(16, 257)), "hash_ids": hash_ids}))
        timestamp_ms += rng.exponential(1000.0 / RATE)
    Path(__file__).with_name("mooncake-sample.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

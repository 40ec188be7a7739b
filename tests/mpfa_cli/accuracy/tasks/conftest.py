"""Task data shared by the task tests."""

from __future__ import annotations

import random

import pytest


@pytest.fixture(scope="session")
def essay_words() -> str:
    """Sentences of 1,500 made-up lowercase words, each used twice (the RULER-style tasks list essay words used twice
    or more): enough distinct words to fill 32K byte tokens."""
    rng = random.Random(1)
    vocab = list(dict.fromkeys("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(4, 8)))
                                for _ in range(1500)))
    words = vocab * 2
    rng.shuffle(words)
    return " ".join(" ".join(words[i:i + 8]).capitalize() + "." for i in range(0, len(words), 8))

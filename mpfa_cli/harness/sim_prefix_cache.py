"""The simulator's prefix cache: what SGLang's radix cache would hold, so the simulator can model prefix hits.

It keeps token sequences (a prompt once prefilled; a finished request's prompt and output but the last token, whose
KV was never computed, as SGLang caches it), least recently used first. A prompt's hit is its longest common
prefix with any of them, in whole pages, and never the whole prompt (SGLang computes at least its last token).
Its size is the tokens a radix tree would add for each sequence (those past its longest match at insertion);
`evict_to` drops the least recently used sequences until it fits what the KV cache leaves free.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._entries: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()  # id -> (tokens, tokens it adds)
        self._next_id = 0
        self.tokens = 0

    def _longest(self, ids: np.ndarray) -> tuple[int, int | None]:
        best, best_id = 0, None
        for entry_id, (tokens, _) in self._entries.items():
            if (n := common_prefix(ids, tokens)) > best:
                best, best_id = n, entry_id
        return best, best_id

    def match(self, ids: np.ndarray) -> int:
        """Prompt tokens a request for `ids` finds cached (whole pages, at most all but the last); marks the
        sequence it matched as just used."""
        n, entry_id = self._longest(ids[:-1])
        if entry_id is not None:
            self._entries.move_to_end(entry_id)
        return n // self.page_size * self.page_size

    def insert(self, ids: np.ndarray) -> None:
        """Cache the whole pages of `ids`; a sequence it extends is replaced."""
        ids = ids[:ids.size // self.page_size * self.page_size]
        n, entry_id = self._longest(ids)
        if n == ids.size:  # already held
            if entry_id is not None:
                self._entries.move_to_end(entry_id)
            return
        if entry_id is not None and n == self._entries[entry_id][0].size:  # extends it
            _, added = self._entries.pop(entry_id)
            self.tokens -= added
            n_added = added + ids.size - n
        else:
            n_added = ids.size - n
        self._entries[self._next_id] = (ids.copy(), n_added)
        self._next_id += 1
        self.tokens += n_added

    def evict_to(self, capacity: int) -> None:
        """Drop least recently used sequences until the cache holds at most `capacity` tokens."""
        while self.tokens > capacity and self._entries:
            _, (_, added) = self._entries.popitem(last=False)
            self.tokens -= added

"""Workloads whose prompts share prefixes on purpose: shared-prefix groups and multi-turn conversations.

Token ids are drawn as for every other workload (`serving_workload.hashed_token_ids`), keyed by the seed, the run's
place in the bench's plan (`run`: so no run hits the prefix cache another run filled) and the group or
conversation. What is shared is exactly what the workload declares, nothing by chance: the first token of each
group's prefix (of each conversation's first message) is distinct within a run and across the runs of a plan, and
so is the first token of each suffix within a group, so even a radix cache of page 1 matches no more than declared.

* shared prefix: G groups of Q requests; a request is its group's P prefix tokens and its own S suffix tokens.
  Requests go round-robin over the groups (every group's first request before any group's second), warmup
  requests in groups of their own, after the measured ones.
* multi-turn: conversations of T turns; turn 1 is U user tokens, turn t + 1 is turn t's prompt, the answer the
  server returned for it (its output ids), and U new user tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .serving_workload import hashed_token_ids, slot_token

MAX_HISTORY_TOKENS = 128 * 1024  # the longest conversation (last prompt + its answer) a multi-turn workload makes


def _drawn(first_slot: int, key: str, count: int) -> list[int]:
    """`count` ids keyed by `key`, the first one `slot_token(first_slot)`."""
    return [slot_token(first_slot), *hashed_token_ids(key.encode(), count - 1)]


@dataclass(frozen=True)
class SharedPrefix:
    """`groups` x `per_group` requests, each `prefix_len` shared tokens then `suffix_len` of its own."""

    groups: int
    prefix_len: int
    suffix_len: int
    per_group: int

    kind = "shared-prefix"

    @property
    def input_len(self) -> int:
        return self.prefix_len + self.suffix_len

    @property
    def num_requests(self) -> int:
        return self.groups * self.per_group

    def expected_cached_tokens(self, page_size: int) -> int:
        """Prompt tokens a prefix cache of `page_size` holds for the measured requests when each group's first
        request is prefilled before the others arrive: whole pages of the prefix, for all but the first."""
        return self.groups * (self.per_group - 1) * (self.prefix_len // page_size * page_size)

    def prompts(self, seed: int, run: int, warmup: int, max_warmup: int) -> tuple[list[list[int]], list[list[int]]]:
        """(measured, warmup) prompts of run `run` of the plan, `warmup` of them warmup; `max_warmup` (the most
        warmup requests any run of the plan has) keeps the first tokens of every run's groups apart."""
        slots = self.groups + math.ceil(max_warmup / self.per_group)

        def prompt(group: int, member: int) -> list[int]:
            prefix = _drawn(run * slots + group, f"mpfa-prefix:{seed}:{run}:{group}", self.prefix_len)
            return prefix + _drawn(member, f"mpfa-suffix:{seed}:{run}:{group}:{member}", self.suffix_len)

        measured = [prompt(i % self.groups, i // self.groups) for i in range(self.num_requests)]
        warm = [prompt(self.groups + i // self.per_group, i % self.per_group) for i in range(warmup)]
        return measured, warm


@dataclass(frozen=True)
class MultiTurn:
    """`conversations` of `turns` turns, each adding `user_len` user tokens to the history; `think_time_s` between
    an answer and the next turn."""

    conversations: int
    turns: int
    user_len: int
    think_time_s: float = 0.0

    kind = "multi-turn"

    def prompt_len(self, turn: int, output_len: int) -> int:
        """Tokens of turn `turn`'s prompt (from 1): every user message so far and every answer before it."""
        return turn * self.user_len + (turn - 1) * output_len

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns

    def expected_cached_tokens(self, page_size: int, output_len: int) -> int:
        """Prompt tokens a prefix cache of `page_size` holds for the measured requests: from turn 2 on, whole
        pages of the previous turn's prompt and answer but its last token (SGLang caches a finished request's
        tokens but the last, whose KV was never computed)."""
        per_conversation = sum((self.prompt_len(t, output_len) + output_len - 1) // page_size * page_size
                               for t in range(1, self.turns))
        return self.conversations * per_conversation

    def user_tokens(self, seed: int, run: int, conversation: int, turn: int, max_warmup: int) -> list[int]:
        """Conversation `conversation`'s user message of turn `turn` (from 1) in run `run` of the plan;
        conversations from `self.conversations` on are warmup ones (one turn each, at most `max_warmup`)."""
        key = f"mpfa-turn:{seed}:{run}:{conversation}:{turn}"
        if turn > 1:
            return hashed_token_ids(key.encode(), self.user_len)
        return _drawn(run * (self.conversations + max_warmup) + conversation, key, self.user_len)

"""The HTTP APIs the load client speaks: each one's endpoint, request body, and how its streamed events count tokens.

- `sglang`: SGLang's native `/generate`, the prompt as `input_ids`.
- `openai`: `/v1/completions`, the prompt as a list of token ids.
- `openai-chat`: `/v1/chat/completions`. A chat message is text, never token ids, so the prompt goes as one user
  message holding its ids in decimal, one per word (`chat_text`). The simulator reads them back as the ids; a real
  server tokenizes that text itself and adds its chat template, so its prompt differs from the ids in length:
  the record keeps the server's own count (`prompt_tokens`), and only there is no prompt count to check.

Tokens per chunk come from the server's running count (`meta_info.completion_tokens` on `/generate`,
`usage.completion_tokens` with continuous usage stats on the OpenAI APIs), which is right whether the server
streams cumulative or incremental output and when it coalesces several steps into one chunk. Without per-chunk
usage, an OpenAI chunk that carries output is taken as one token, and the final usage chunk checks that.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .records import RequestRecord
from .sse import StreamError

MAX_COUNT = 2**31  # token counts at or above this in an event make it unreadable


class StreamCounts:
    """What a stream's events have said so far about its tokens."""

    __slots__ = ("counted", "server_total", "prompt_tokens", "cached_tokens", "output_ids", "finished", "error")

    def __init__(self) -> None:
        self.counted = 0  # tokens attributed to chunks
        self.server_total: int | None = None  # the server's latest count of all output tokens
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None  # prompt tokens served from the server's prefix cache
        self.output_ids: list[int] = []  # `/generate`: the output ids so far (cumulative or incremental chunks)
        self.finished = False  # a finish reason arrived
        self.error: str | None = None  # the server aborted the request

    def set_total(self, total: int) -> None:
        """The server's new count of all output tokens, which can only grow."""
        if self.server_total is not None and total < self.server_total:
            raise StreamError(f"token count went backwards: {total} after {self.server_total}")
        self.server_total = total


def _count(value: Any) -> int:
    """A token count from an event: a non-negative integer that fits the store's 64-bit columns."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_COUNT:
        raise ValueError(f"token count {value!r} is not an integer in [0, {MAX_COUNT})")
    return value


def error_message(event: dict[str, Any]) -> str | None:
    """The message of an error event (SGLang: `{"error": {...}}`; OpenAI: `{"object": "error", ...}`)."""
    if "error" in event:
        err = event["error"]
        return str(err.get("message", err) if isinstance(err, dict) else err)
    if event.get("object") == "error":
        return str(event.get("message", event))
    return None


def chat_text(prompt: list[int]) -> str:
    """A prompt's token ids as the text of a chat message: in decimal, one per word."""
    return " ".join(map(str, prompt))


def _sglang_payload(prompt: list[int], output_len: int, model: str | None) -> dict[str, Any]:
    return {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0},
        "stream": True,
    }


def _openai_payload(prompt_field: dict[str, Any], output_len: int, model: str | None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        **prompt_field, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if model:
        payload["model"] = model
    return payload


def _completions_payload(prompt: list[int], output_len: int, model: str | None) -> dict[str, Any]:
    return _openai_payload({"prompt": prompt}, output_len, model)


def _chat_payload(prompt: list[int], output_len: int, model: str | None) -> dict[str, Any]:
    return _openai_payload({"messages": [{"role": "user", "content": chat_text(prompt)}]}, output_len, model)


def _sglang_event(event: dict[str, Any], counts: StreamCounts) -> int:
    """Update `counts` from one `/generate` chunk; returns the new tokens it carries."""
    meta = event["meta_info"]
    counts.set_total(_count(meta["completion_tokens"]))
    if (prompt := meta.get("prompt_tokens")) is not None:
        counts.prompt_tokens = _count(prompt)
    if (cached := meta.get("cached_tokens")) is not None:
        counts.cached_tokens = _count(cached)
    if isinstance(ids := event.get("output_ids"), list):
        # cumulative chunks repeat every id so far, incremental ones (--incremental-streaming-output) carry the new
        counts.output_ids = ids if len(ids) == counts.server_total else counts.output_ids + ids
    finish = meta.get("finish_reason")
    if finish is not None:
        counts.finished = True
        if isinstance(finish, dict) and finish.get("type") == "abort":
            counts.error = f"server aborted the request: {finish.get('message', finish)}"
    return counts.server_total - counts.counted  # type: ignore[operator]


def _carries_text(choice: dict[str, Any]) -> bool:
    """A chat chunk's choice with output in its delta (not the opening one that only names the role)."""
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


def _openai_event(event: dict[str, Any], counts: StreamCounts, *,
                  carries_output: Callable[[dict[str, Any]], bool]) -> int:
    """Update `counts` from one OpenAI chunk; returns the new tokens it carries."""
    usage = event.get("usage")
    if usage:
        counts.set_total(_count(usage["completion_tokens"]))
        if (prompt := usage.get("prompt_tokens")) is not None:
            counts.prompt_tokens = _count(prompt)
        if (cached := (usage.get("prompt_tokens_details") or {}).get("cached_tokens")) is not None:
            counts.cached_tokens = _count(cached)
    choices = event.get("choices") or []
    if not choices:
        return 0
    if choices[0].get("finish_reason") is not None:
        counts.finished = True
    if usage:
        return counts.server_total - counts.counted  # type: ignore[operator]
    return 1 if carries_output(choices[0]) else 0


@dataclass(frozen=True)
class Api:
    """One API: where requests go, what they hold, and how its events count tokens."""

    path: str
    payload: Callable[[list[int], int, str | None], dict[str, Any]]
    read_event: Callable[[dict[str, Any], StreamCounts], int]  # updates the counts; returns the event's new tokens
    counts_prompt_ids: bool  # the server's prompt count must equal the ids sent (not so for chat's text)


APIS = {
    "sglang": Api("/generate", _sglang_payload, _sglang_event, True),
    "openai": Api("/v1/completions", _completions_payload,
                  functools.partial(_openai_event, carries_output=lambda choice: True), True),
    "openai-chat": Api("/v1/chat/completions", _chat_payload,
                       functools.partial(_openai_event, carries_output=_carries_text), False),
}


def check_counts(record: RequestRecord, counts: StreamCounts, api: Api) -> str | None:
    """Why a finished stream's token counts cannot be trusted, if they cannot."""
    if not counts.finished:
        return "stream ended before the server finished the request"
    if counts.server_total is None:
        return "server reported no completion token count"
    if counts.counted != counts.server_total:
        return f"chunks carried {counts.counted} tokens but the server reports {counts.server_total}"
    if counts.server_total != record.max_new_tokens:
        return f"server generated {counts.server_total} tokens, {record.max_new_tokens} were requested"
    if api.counts_prompt_ids and counts.prompt_tokens is not None and counts.prompt_tokens != record.input_len:
        return f"server counted {counts.prompt_tokens} prompt tokens, {record.input_len} were sent"
    return None

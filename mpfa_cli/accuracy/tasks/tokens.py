"""Tokenizers the task builders work with: a model's own (transformers) or a byte-level one for tests and the
simulator.

Prompts are built as token ids, so their length is exact: `chat_ids(before, body, after)` renders one user turn
(with the assistant prompt after it) whose text is `before`, then the ids `body`, then `after`. The text around
`body` is tokenized on its own, so `body` (a haystack of many thousand tokens) is tokenized once, not per prompt,
and the prompt has exactly len(prefix) + len(body) + len(suffix) tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

# Stands for the body ids in the rendered chat text; split out before tokenizing.
_BODY_MARK = "\x00mpfa-body\x00"


class TaskTokenizer(Protocol):
    """What the task builders and the scoring need of a tokenizer."""

    name: str

    def encode(self, text: str) -> list[int]:
        """Ids of `text` without special tokens."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens dropped."""

    def plain_ids(self, text: str) -> list[int]:
        """Ids of `text` as a document start (with the tokenizer's BOS, if it adds one)."""

    def chat_ids(self, before: str, body: Sequence[int] = (), after: str = "") -> list[int]:
        """A user turn `before` + `body` (ids) + `after`, followed by the assistant prompt."""

    def stop_ids(self) -> frozenset[int]:
        """Ids that end an answer (end of sequence, end of turn)."""


class ByteTokenizer:
    """One token per UTF-8 byte (id = byte + 3; 0 padding, 1 begin, 2 end of sequence) and a plain-text chat turn.

    A model-free tokenizer: the simulator echoes prompt ids back, which any id of this tokenizer decodes, and tests
    build prompts whose every token is known. Every model vocabulary holds ids 0-258, so it also drives a dummy-weight
    server (meaningless answers, working plumbing)."""

    name = "bytes"
    BOS, EOS, OFFSET = 1, 2, 3

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(t - self.OFFSET for t in ids if self.OFFSET <= t < 256 + self.OFFSET).decode("utf-8", "replace")

    def plain_ids(self, text: str) -> list[int]:
        return [self.BOS, *self.encode(text)]

    def chat_ids(self, before: str, body: Sequence[int] = (), after: str = "") -> list[int]:
        return [self.BOS, *self.encode(f"User: {before}"), *body, *self.encode(f"{after}\nAssistant:")]

    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.EOS})


class HFTokenizer:
    """A transformers tokenizer; its chat template when it has one, else `text` then "\\nAnswer:"."""

    def __init__(self, tokenizer: object, name: str) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self._stop_ids = self._find_stop_ids()

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def plain_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def chat_ids(self, before: str, body: Sequence[int] = (), after: str = "") -> list[int]:
        if self.tokenizer.chat_template:
            chat = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": before + _BODY_MARK + after}], add_generation_prompt=True, tokenize=False)
            prefix, suffix = chat.split(_BODY_MARK)
            if not body:
                return self.encode(prefix + suffix)
            return [*self.encode(prefix), *body, *self.encode(suffix)]
        if not body:
            return self.plain_ids(before + after + "\nAnswer:")
        return [*self.plain_ids(before), *body, *self.encode(after + "\nAnswer:")]

    def stop_ids(self) -> frozenset[int]:
        return self._stop_ids

    def _find_stop_ids(self) -> frozenset[int]:
        """Looked up once: `get_vocab()` builds the whole vocabulary (151K entries for Qwen2.5, ~0.3 s holding the
        GIL), which per request serialized `accuracy serve`'s client threads and left the server idle."""
        vocab = self.tokenizer.get_vocab()
        ids = {self.tokenizer.eos_token_id}
        for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):  # end-of-turn tokens of common templates
            if token in vocab:
                ids.add(vocab[token])
        return frozenset(i for i in ids if i is not None)


def load_tokenizer(source: str) -> TaskTokenizer:
    """"bytes", or the transformers tokenizer of a model directory (needs transformers)."""
    if source == ByteTokenizer.name:
        return ByteTokenizer()
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ValueError(f"tokenizer {source!r}: neither 'bytes' nor a model directory")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError("a model's tokenizer needs transformers: pip install -e '.[accuracy]'") from None
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(path), path.name)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: no tokenizer found ({exc})") from None


def answer_text(tokenizer: TaskTokenizer, ids: Sequence[int], first_line: bool = True) -> str:
    """A greedy answer's text: the ids up to the first stop id, decoded, stripped; its first line unless not
    `first_line`."""
    stops = tokenizer.stop_ids()
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    text = tokenizer.decode(ids[:end]).strip()
    return text.split("\n")[0].strip() if first_line else text

"""Request traces in the public Mooncake layout, and the exact workload they replay.

A trace is JSONL, one request per line: `timestamp` (ms from the trace's start), `input_length`, `output_length`
and `hash_ids`, the ids of the prompt's 512-token blocks: equal ids mean equal blocks, so requests whose leading
hash_ids agree share that prompt prefix (what a prefix cache can reuse). Blank lines are skipped.

A block's token ids are drawn from SHAKE-256 keyed by the seed, the run's place in the bench's plan (so no repeat
hits the prefix cache an earlier one filled) and its id (`block_token_ids`); a prompt is its blocks in order, the
last cut to `input_length`. Each distinct id's block starts with its own token (`slot_token`), so prompts share
exactly the leading blocks whose ids agree, never a token more by chance.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UserError
from .serving_workload import hashed_token_ids, slot_token

BLOCK_TOKENS = 512  # tokens per hash id, as in the Mooncake traces
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")

# Bounds of a trace: beyond them a replay would not fit in memory or end in a working day.
MAX_TRACE_BYTES = 256 * 1024 * 1024
MAX_LINE_CHARS = 256 * 1024  # a 2M-token prompt's 4096 hash ids take ~50K characters
MAX_TRACE_REQUESTS = 1_000_000
MAX_INPUT_LENGTH = 4 * 1024 * 1024
MAX_OUTPUT_LENGTH = 1024 * 1024
MAX_HASH_ID = 2**63 - 1
MAX_SPEEDUP = 1e6


@dataclass(frozen=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, eq=False)  # one object per file read: compared and hashed by identity, not request by request
class Trace:
    """A parsed trace: its name (the file's stem), its requests in order, and the sha256 of its bytes."""

    name: str
    requests: tuple[TraceRequest, ...]
    sha256: str

    def prompts(self, seed: int = 0, run: int = 0) -> list[list[int]]:
        """Each request's exact token ids, built from its hash ids, for run `run` of a plan of seed `seed`."""
        slots = {block_id: slot for slot, block_id in enumerate(sorted(self.block_ids))}
        first_slot = run * len(slots)
        blocks = {block_id: block_token_ids(block_id, seed, run, first_slot + slot) for block_id, slot in slots.items()}
        return [[t for block_id in r.hash_ids for t in blocks[block_id]][:r.input_length] for r in self.requests]

    @functools.cached_property
    def block_ids(self) -> frozenset[int]:
        return frozenset(block_id for r in self.requests for block_id in r.hash_ids)

    @property
    def shares_prefixes(self) -> bool:
        """Whether some request opens with the same block as an earlier one (served with the prefix cache on)."""
        return len({r.hash_ids[0] for r in self.requests}) < len(self.requests)

    def most_cached_tokens(self, page_size: int) -> int:
        """The prompt tokens a prefix cache of `page_size` can hold for the replay: each request's longest prefix
        that an earlier request's prompt holds, in whole pages and but its last token (SGLang computes at least one).
        A request sent before the one that shares its blocks has been prefilled finds fewer."""
        root: dict[int, tuple[int, dict]] = {}  # block id -> (tokens of it earlier prompts held, its children)
        total = 0
        for r in self.requests:
            node, held = root, 0
            for block_id in r.hash_ids:
                if block_id not in node:
                    break
                held, node = node[block_id]
            total += min(held, r.input_length - 1) // page_size * page_size
            node = root
            for k, block_id in enumerate(r.hash_ids, start=1):
                tokens = min(r.input_length, k * BLOCK_TOKENS)
                seen, children = node.get(block_id, (0, {}))
                node[block_id] = (max(seen, tokens), children)
                node = children
        return total

    def output_lengths(self) -> list[int]:
        return [r.output_length for r in self.requests]

    def send_times(self, speedup: float) -> list[float]:
        """Each request's send time in seconds from the first's: its timestamp's offset divided by `speedup`."""
        if not (0 < speedup <= MAX_SPEEDUP):
            raise ValueError(f"speedup must be in (0, {MAX_SPEEDUP:g}], got {speedup}")
        start = self.requests[0].timestamp_ms
        return [(r.timestamp_ms - start) / 1000.0 / speedup for r in self.requests]


def block_token_ids(block_id: int, seed: int, run: int, slot: int) -> list[int]:
    """The 512 token ids of hash id `block_id` in run `run` of seed `seed`, the first one `slot_token(slot)`."""
    return [slot_token(slot), *hashed_token_ids(f"mpfa-trace-block:{seed}:{run}:{block_id}".encode(), BLOCK_TOKENS - 1)]


def load_trace(path: Path) -> Trace:
    """Read and check a trace file; a malformed line raises one UserError naming the file and the line."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_TRACE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"cannot read trace file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_TRACE_BYTES:
        raise UserError(f"{path}: a trace is at most {MAX_TRACE_BYTES // 2**20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not a UTF-8 text file (byte {exc.start}); a trace is JSONL") from None
    requests: list[TraceRequest] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if len(requests) == MAX_TRACE_REQUESTS:
            raise UserError(f"{path}:{number}: a trace holds at most {MAX_TRACE_REQUESTS} requests")
        try:
            request = _parse_line(line)
        except ValueError as exc:
            raise UserError(f"{path}:{number}: {exc}") from None
        if requests and request.timestamp_ms < requests[-1].timestamp_ms:
            raise UserError(f"{path}:{number}: timestamp {request.timestamp_ms:g} is before the previous line's "
                            f"{requests[-1].timestamp_ms:g}; a trace is in time order")
        requests.append(request)
    if not requests:
        raise UserError(f"{path}: the trace holds no request")
    return Trace(path.stem, tuple(requests), hashlib.sha256(data).hexdigest())


def _parse_line(line: str) -> TraceRequest:
    if len(line) > MAX_LINE_CHARS:
        raise ValueError(f"line longer than {MAX_LINE_CHARS} characters")
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    missing = [key for key in FIELDS if key not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    timestamp = row["timestamp"]
    if not _is_number(timestamp) or not 0 <= timestamp < math.inf:
        raise ValueError(f"timestamp: expected a finite number of ms >= 0, got {timestamp!r:.40}")
    input_length = _int_in(row, "input_length", 1, MAX_INPUT_LENGTH)
    output_length = _int_in(row, "output_length", 1, MAX_OUTPUT_LENGTH)
    hash_ids = row["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) and 0 <= h <= MAX_HASH_ID for h in hash_ids):
        raise ValueError(f"hash_ids: expected a list of integers in [0, 2^63), got {hash_ids!r:.60}")
    blocks = -(-input_length // BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise ValueError(f"input_length {input_length} takes {blocks} block(s) of {BLOCK_TOKENS} tokens, but "
                         f"hash_ids lists {len(hash_ids)}")
    return TraceRequest(float(timestamp), input_length, output_length, tuple(hash_ids))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_in(row: dict[str, Any], key: str, low: int, high: int) -> int:
    value = row[key]
    if not _is_int(value) or not low <= value <= high:
        raise ValueError(f"{key}: expected an integer in [{low}, {high}], got {value!r:.40}")
    return value

"""What a benchmark run produces: per-request timing records and the run they belong to.

Times are seconds on the client's monotonic clock (`time.perf_counter()`), so they can be subtracted
from each other but not compared with wall-clock timestamps; `RunRecord.started_at` is the wall clock.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request as the client saw it."""

    index: int
    input_len: int
    max_new_tokens: int
    dispatch_s: float
    warmup: bool = False
    chunk_s: list[float] = field(default_factory=list)  # arrival time of each streamed chunk with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # new output tokens carried by each chunk
    completion_s: float | None = None
    output_tokens: int = 0  # as counted by the server (meta_info.completion_tokens)
    prompt_tokens: int | None = None  # as counted by the server (meta_info.prompt_tokens)
    cached_tokens: int | None = None  # prompt tokens the server's prefix cache held (meta_info.cached_tokens)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.completion_s is not None

    @property
    def first_token_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None


@dataclass
class RunRecord:
    """One measured pass of a scenario at one load point (concurrency or rate) against one backend."""

    scenario: str
    backend: str
    engine: str  # "sim", "sglang" or "url"
    simulated: bool
    load: dict[str, Any]  # {"concurrency": 8} or {"rate": 2.0, "burstiness": 1.0}
    repeat: int
    input_len: int
    output_len: int
    num_requests: int
    seed: int
    workload_hash: str
    started_at: float  # wall clock, seconds since the epoch
    status: str = "running"  # running | ok | failed | interrupted
    error: str | None = None
    caveat: str | None = None  # the backend's caveat on measured numbers (BackendSpec.caveat), if any
    model: str = ""
    gpu: str = ""
    server_info: dict[str, Any] = field(default_factory=dict)
    backend_flags: list[str] = field(default_factory=list)
    # The attention kernels the server ran (`served_kernels`): {"prefill", "decode", ["prefill_override"], "source"}
    # for MpFA, {"attention_backend", "source"} for the others; {} for runs stored before kernels were recorded.
    kernels: dict[str, str] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    # The `mpfa bench` call that measured the run (one id per call), so that a comparison takes one call's runs of
    # a point rather than mixing an interrupted call's with an older one's; None for runs stored before it was.
    invocation: str | None = None
    requests: list[RequestRecord] = field(default_factory=list)
    id: int | None = None  # assigned by the store

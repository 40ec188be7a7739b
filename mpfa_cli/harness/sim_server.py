"""A simulated SGLang server: the HTTP API subset the client uses, on a continuous-batching latency model.

Every latency it produces is SIMULATED (see `latency_model`); `/get_server_info` says so with
`"simulated": true`, and names the kernels the backend would run (`kernels`, `served_kernels` with source
"simulated": no kernel runs). What it does reproduce faithfully is the protocol: SGLang's native `/generate`
(non-streaming JSON, or SSE `data: {json}` chunks ending with `data: [DONE]`), and OpenAI-style
`/v1/completions` and `/v1/chat/completions` streams. Like SGLang without `--incremental-streaming-output`, each
`/generate` chunk carries the cumulative `output_ids`; `meta_info.completion_tokens` always counts all tokens so far.

With `return_logprob` set, `/generate` answers with SGLang's logprob fields (`input_token_logprobs`,
`output_token_logprobs`, and with `top_logprobs_num` > 0 `input_top_logprobs` / `output_top_logprobs`) in
SGLang's layout. Their values are SIMULATED and meaningless as accuracy: a hash of the prompt and the position,
plus a small hash-based perturbation whose size the backend's spec sets (`SimulatedCosts.logprob_perturbation`),
so that `mpfa logits` has deterministic, backend-dependent numbers to compare on a machine without a GPU.

One scheduler task runs the batch: it admits waiting requests while the KV cache has room for their prompt
plus `max_new_tokens`, runs a prefill step for newly admitted requests (which yields their first token),
and otherwise runs a decode step that yields one token for every running request. Output tokens are a
deterministic function of the prompt (`echoed_ids`): a span of the prompt's own ids, so that they are ids of
whatever tokenizer built the prompt and decode to deterministic text (`mpfa accuracy serve` scores it; the scores
are SIMULATED, meaningless as accuracy).

With `radix_cache` (SGLang's default; `--disable-radix-cache` turns it off, as there) it models SGLang's prefix
cache (`sim_prefix_cache`), on pages of the backend's page size: a request's prompt tokens found cached are not
prefilled again (the new ones still attend to the whole context), its `meta_info.cached_tokens` (OpenAI:
`usage.prompt_tokens_details.cached_tokens`) says how many, and the cache gives way to running requests' KV.

Two endpoints of its own let `mpfa bench` run it faster than modelled with unchanged numbers: `POST /sim_load`
takes a `LoadHint` (how the next requests arrive), and `GET /sim_clock/{prompt digest}` answers a finished
request's arrival and token times on the latency model's clock (see `BatchScheduler`). For CI rehearsals its step
times can be slowed and made noisy, seeded (`sim_knobs`); the server info reports both.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import time
from collections import deque
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np
import orjson
from aiohttp import web

from ...backends.specs import BackendSpec, backend_spec
from .client import new_event_loop
from .client_apis import chat_text
from .latency_model import LatencyModel, ModelShape
from .scenario import load_model_shape
from .served_kernels import launch_page_size, served_kernels
from .sim_knobs import SimKnobs, StepFactors, knobs_label
from .serving_workload import hashed_token_ids
from .sim_prefix_cache import PrefixCache

MAX_RUNNING_REQUESTS = 1024
LATE_TOLERANCE_S = 2e-3  # a step that starts later than this behind schedule starts from now (no catch-up burst)
DIE_EXIT_CODE = 3
# With a load hint (wall seconds): how long a phase's first burst of requests, or a closed loop's replacement of a
# finished request, may take to arrive; longer gaps end the wait (the load sent nothing more).
SETTLE_S = 0.2
REPLACE_WAIT_S = 0.5
YIELD_EVERY_S = 0.005


@dataclass(frozen=True)
class LoadHint:
    """How the benchmark's load arrives, so the modelled clock need not follow the wall clock.

    expected: how many requests a phase sends at once (a closed loop's concurrency); requests: how many it sends in
    all, warmup included (0: not said), so that nothing is waited for once all have come; arrivals: an open loop's
    requests by prompt digest, each at its offset in modelled seconds from the first of them to arrive.
    """

    expected: int = 1
    requests: int = 0
    arrivals: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Any) -> "LoadHint":
        try:
            hint = cls(int(body.get("expected", 1)), int(body.get("requests", 0)),
                       {str(k): float(v) for k, v in body.get("arrivals", {}).items()})
        except (AttributeError, TypeError, ValueError):
            raise BadRequest("a load hint is {\"expected\": int, \"requests\": int, "
                             "\"arrivals\": {digest: seconds}}") from None
        if hint.expected < 1 or hint.requests < 0:
            raise BadRequest(f"'expected' must be >= 1 and 'requests' >= 0, got {hint.expected}, {hint.requests}")
        return hint


def reported_server_args(spec: BackendSpec) -> dict[str, Any]:
    """attention_backend, kv_cache_dtype and page_size as SGLang would report them for this backend, all from its
    spec: what `expect` says SGLang reports, the `--page-size` it launches with, else SGLang's defaults."""
    return {"kv_cache_dtype": "auto", "page_size": launch_page_size(spec), **spec.expect}


class BadRequest(ValueError):
    """The request cannot be served; answered with HTTP 400 and SGLang's `{"error": {"message": ...}}`."""


def prompt_digest(input_ids: list[int] | np.ndarray) -> str:
    """sha256 of a prompt's token ids (little-endian int64): the key of its deterministic output and trace."""
    return hashlib.sha256(np.asarray(input_ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(eq=False)
class SimRequest:
    rid: str
    input_len: int
    output_ids: list[int]
    received_s: float  # time.perf_counter() when the handler started
    digest: str  # of the prompt (`prompt_digest`)
    emitted: int = 0
    aborted: bool = False
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    # When tracing, per chunk: (perf_counter before its write, after it, tokens so far). On asyncio's own loop
    # a write is the send() itself, so on loopback the bytes are in the client's socket by the second stamp.
    sent: list[tuple[float, float, int]] | None = None
    logprobs: "SimLogprobs | None" = None  # when the request set return_logprob
    input_ids: np.ndarray | None = None  # the prompt, for the prefix cache
    cached_tokens: int = 0  # of the prompt, found in the prefix cache when it was admitted
    arrival_v: float = 0.0  # modelled time it arrived
    token_v: list[float] = field(default_factory=list)  # modelled time each output token was made

    @property
    def finished(self) -> bool:
        return self.emitted >= len(self.output_ids)

    @property
    def kv_tokens(self) -> int:
        """KV-cache tokens reserved for the whole life of the request."""
        return self.input_len + len(self.output_ids)


class BatchScheduler:
    """Continuous batching: prefill newly admitted requests first, else decode every running request.

    Besides pacing its steps on the wall clock (`time_scale` wall seconds per modelled second), it keeps the
    modelled clock (`clock`): every step advances it by the step's modelled time, and each request notes when it
    arrived and when each of its tokens was made on that clock (`arrival_v`, `token_v`). Those times do not
    depend on the pacing once a `LoadHint` says how the load arrives: the scheduler then waits (on the wall
    clock) for a closed loop's replacements before the next step, and holds an open loop's requests until their
    modelled arrival, so each request joins the same step at any speed-up. Without a hint it runs as SGLang
    does: whatever has arrived joins the next step.
    """

    def __init__(self, latency: LatencyModel, time_scale: float, max_running: int = MAX_RUNNING_REQUESTS,
                 factors: StepFactors | None = None, prefix_cache: PrefixCache | None = None) -> None:
        self.latency = latency
        self.factors = factors  # the CI-rehearsal knobs (`sim_knobs`): every step time is multiplied by its factor
        self.prefix_cache = prefix_cache
        self.time_scale = time_scale
        self.max_running = max_running
        self.kv_capacity = latency.kv_capacity_tokens
        self.kv_used = 0
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.scheduled: list[SimRequest] = []  # open loop: received, sorted by modelled arrival, not yet due
        self.clock = 0.0  # modelled seconds
        self.hint: LoadHint | None = None
        self._owed = 0  # closed loop: requests finished whose replacements have not arrived
        self._arrived_count = 0  # since the hint
        self._phase_start: float | None = None  # open loop: the modelled time its arrival offsets count from
        self._idle_since = time.perf_counter()
        self._wakeup = asyncio.Event()
        self._arrived = asyncio.Event()

    def check_fits(self, input_len: int, max_new_tokens: int) -> None:
        if input_len + max_new_tokens > self.kv_capacity:
            raise BadRequest(
                f"prompt ({input_len}) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"simulated KV cache capacity of {self.kv_capacity} tokens"
            )

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.scheduled)

    def set_hint(self, hint: LoadHint | None) -> None:
        """Take a load hint; the modelled clock restarts at 0 with one, so that repeats time alike."""
        self.hint, self._owed, self._phase_start, self._arrived_count = hint, 0, None, 0
        if hint is not None:
            self.clock = 0.0
            if self.factors is not None:
                self.factors.next_phase()

    def submit(self, request: SimRequest) -> None:
        self.check_fits(request.input_len, len(request.output_ids))
        if self.hint is None and self.idle:  # without a hint, idle wall time passes on the modelled clock too
            self.clock += (time.perf_counter() - self._idle_since) / self.time_scale
        offset = self.hint.arrivals.get(request.digest) if self.hint is not None else None
        if offset is None:
            request.arrival_v = self.clock
            self.waiting.append(request)
        else:
            if self._phase_start is None:
                self._phase_start = self.clock
            request.arrival_v = self._phase_start + offset
            self.scheduled.append(request)
            self.scheduled.sort(key=lambda r: r.arrival_v)
        self._owed = max(0, self._owed - 1)
        self._arrived_count += 1
        self._arrived.set()
        self._wakeup.set()

    async def _quiet(self, done: Callable[[], bool], quiet_s: float) -> None:
        """Wait until `done()` or no request arrived for `quiet_s` (wall)."""
        while not done():
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), quiet_s)
            except TimeoutError:
                return

    def _all_arrived(self) -> bool:
        return self.hint is not None and 0 < self.hint.requests <= self._arrived_count

    async def _settle(self) -> None:
        """With a hint, before stepping: let the requests the load sends at this point arrive."""
        hint = self.hint
        if hint is None:
            return
        if not self.running:  # a phase starts: its first requests come as a burst
            await self._quiet(lambda: self._all_arrived() or len(self.waiting) + len(self.scheduled) >= hint.expected,
                              SETTLE_S)
        await self._quiet(lambda: self._all_arrived() or self._owed == 0, REPLACE_WAIT_S)
        self._owed = 0
        while self.scheduled and self.scheduled[0].arrival_v <= self.clock:
            self.waiting.append(self.scheduled.pop(0))
        if not self.waiting and not self.running and self.scheduled:  # nothing to do until the next arrival
            self.clock = self.scheduled[0].arrival_v
            self.waiting.append(self.scheduled.pop(0))

    def _order_waiting(self) -> None:
        """Waiting requests in order of modelled arrival, those of one instant by prompt digest: requests sent at
        once reach the server in either order, which must not decide who joins a step first, nor the order in
        which a step's times are summed (the stored numbers would differ in the last bit between identical runs)."""
        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda r: (r.arrival_v, r.digest)))

    def _admit(self) -> list[SimRequest]:
        self._order_waiting()
        admitted = []
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting[0]
            if request.aborted:
                self.waiting.popleft()
                continue
            if self.kv_used + request.kv_tokens > self.kv_capacity:
                break
            self.waiting.popleft()
            self.kv_used += request.kv_tokens
            self.running.append(request)
            admitted.append(request)
            if self.prefix_cache is not None and request.input_ids is not None:
                request.cached_tokens = self.prefix_cache.match(request.input_ids)
        return admitted

    def _cache(self, ids: np.ndarray | None) -> None:
        """Put `ids` in the prefix cache, within what the running requests leave of the KV cache."""
        if self.prefix_cache is not None and ids is not None:
            self.prefix_cache.insert(ids)
            self.prefix_cache.evict_to(self.kv_capacity - self.kv_used)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = yielded = loop.time()
        while True:
            if self.idle:
                self._idle_since = time.perf_counter()
                self._wakeup.clear()
                await self._wakeup.wait()
                deadline = loop.time()
            await self._settle()
            admitted = self._admit()
            if admitted:
                stepped = admitted
                seconds = self.latency.prefill_seconds([r.input_len for r in admitted],
                                                       [r.cached_tokens for r in admitted])
                for request in admitted:
                    self._cache(request.input_ids)
            elif self.running:
                stepped = self.running
                seconds = self.latency.decode_step_seconds([r.input_len + r.emitted for r in self.running])
            else:  # only aborted requests were waiting
                continue
            if self.factors is not None:
                seconds *= self.factors.factor
            self.clock += seconds
            now = loop.time()
            deadline = (deadline if now - deadline < LATE_TOLERANCE_S else now) + seconds * self.time_scale
            for request in stepped:
                request.token_v.append(self.clock)
            # With a hint the modelled times do not depend on when the streams run: yield only to pace, when a
            # request finishes, or every YIELD_EVERY_S so the server stays responsive.
            finishing = any(len(r.token_v) == len(r.output_ids) for r in stepped)
            if self.hint is None or finishing or deadline - now > YIELD_EVERY_S or now - yielded > YIELD_EVERY_S:
                await asyncio.sleep(deadline - now)
                yielded = loop.time()
            for request in stepped:
                request.emitted = len(request.token_v)
                request.progress.set()
            self._owed += self._retire()

    def _retire(self) -> int:
        """Release finished and aborted requests; returns how many finished."""
        keep, finished = [], 0
        for request in self.running:
            if request.finished or request.aborted:
                self.kv_used -= request.kv_tokens
                finished += request.finished
                if request.finished and request.input_ids is not None:  # SGLang caches all but the last token
                    self._cache(np.concatenate([request.input_ids, request.output_ids[:-1]]))
            else:
                keep.append(request)
        self.running = keep
        return finished


@dataclass(frozen=True)
class _Parsed:
    input_ids: np.ndarray
    max_new_tokens: int
    stream: bool
    include_usage: bool = False  # OpenAI: final usage chunk
    continuous_usage: bool = False  # OpenAI: usage on every chunk
    return_logprob: bool = False  # /generate: SGLang's logprob fields
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


def _token_ids(value: Any, name: str) -> np.ndarray:
    try:
        ids = np.asarray(value)
    except (ValueError, TypeError):
        ids = None
    if ids is None or ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu" or ids.min() < 0:
        raise BadRequest(f"'{name}' must be a non-empty list of non-negative integer token ids")
    return ids


def _positive_int(value: Any, name: str) -> int:
    if type(value) is not int or value < 1:
        raise BadRequest(f"'{name}' must be an integer >= 1, got {value!r}")
    return value


def _parse_generate(body: dict[str, Any]) -> _Parsed:
    if "input_ids" not in body:
        raise BadRequest("'input_ids' is required (the simulator has no tokenizer, like --skip-tokenizer-init)")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise BadRequest("'sampling_params' must be an object")
    return _Parsed(
        input_ids=_token_ids(body["input_ids"], "input_ids"),
        max_new_tokens=_positive_int(sampling.get("max_new_tokens", 128), "sampling_params.max_new_tokens"),
        stream=bool(body.get("stream", False)),
        return_logprob=bool(body.get("return_logprob", False)),
        logprob_start_len=_int_at_least(body.get("logprob_start_len", -1), -1, "logprob_start_len"),
        top_logprobs_num=_int_at_least(body.get("top_logprobs_num", 0), 0, "top_logprobs_num"),
    )


def _int_at_least(value: Any, low: int, name: str) -> int:
    if type(value) is not int or value < low:
        raise BadRequest(f"'{name}' must be an integer >= {low}, got {value!r}")
    return value


def _parse_completions(body: dict[str, Any]) -> _Parsed:
    if "prompt" not in body:
        raise BadRequest("'prompt' is required (a list of token ids)")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    return _Parsed(
        input_ids=_token_ids(body["prompt"], "prompt"),
        max_new_tokens=_positive_int(body.get("max_tokens", 16), "max_tokens"),
        stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)),
        continuous_usage=bool(options.get("continuous_usage_stats", False)),
    )


def _parse_chat(body: dict[str, Any]) -> _Parsed:
    """A chat request as `client_apis` sends one: a single user message whose text is the prompt's token ids in
    decimal, one per word (the simulator has no tokenizer); the rest as on `/v1/completions`."""
    messages = body.get("messages")
    if not (isinstance(messages, list) and len(messages) == 1 and isinstance(messages[0], dict)
            and messages[0].get("role") == "user" and isinstance(messages[0].get("content"), str)):
        raise BadRequest("'messages' must be one user message whose content is text")
    words = messages[0]["content"].split()
    if not all(word.isascii() and word.isdigit() for word in words):
        raise BadRequest("the message must be token ids in decimal, one per word (the simulator has no tokenizer)")
    return _parse_completions({**body, "prompt": [int(word) for word in words]})


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class SimServer:
    """The simulator's state and HTTP handlers."""

    def __init__(
        self, backend: str, model: ModelShape, *, time_scale: float, startup_delay: float,
        die_after_requests: int | None, incremental_streaming_output: bool, trace_chunks: bool,
        prefill_kernel: str | None = None, knobs: SimKnobs = SimKnobs(), radix_cache: bool = False,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        if startup_delay < 0:
            raise ValueError(f"startup_delay must be >= 0, got {startup_delay}")
        if die_after_requests is not None and die_after_requests < 1:
            raise ValueError(f"die_after_requests must be >= 1, got {die_after_requests}")
        self.spec = spec = backend_spec(backend)
        self.latency = LatencyModel(spec.sim, model)
        self.kernels = served_kernels(spec, model.q_heads, model.kv_heads, launch_page_size(spec), prefill_kernel,
                                      source="simulated")
        self.time_scale = time_scale
        self.knobs = knobs
        self.radix_cache = radix_cache
        self.startup_delay = startup_delay
        self.die_after_requests = die_after_requests
        self.incremental = incremental_streaming_output
        self.trace: dict[str, dict[str, Any]] | None = {} if trace_chunks else None
        self.scheduler: BatchScheduler | None = None
        self.clocks: dict[str, SimRequest] = {}  # under a load hint: requests by prompt digest, until read
        self.ready_at = 0.0
        self.completed = 0
        self._next_rid = 0

    # --- lifecycle -------------------------------------------------------------------------------------------

    async def scheduler_context(self, app: web.Application) -> AsyncIterator[None]:
        cache = PrefixCache(launch_page_size(self.spec)) if self.radix_cache else None
        self.scheduler = BatchScheduler(self.latency, self.time_scale, factors=self.knobs.phases(self.spec.name),
                                        prefix_cache=cache)
        self.ready_at = time.monotonic() + self.startup_delay
        task = asyncio.create_task(self.scheduler.run())
        task.add_done_callback(_exit_if_crashed)
        yield
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    # --- info endpoints --------------------------------------------------------------------------------------

    async def flush_cache(self, request: web.Request) -> web.Response:
        """SGLang's /flush_cache: empty the prefix cache, refused (400) while a request is queued or running."""
        if self.scheduler is None or not self.scheduler.idle:
            return _error(400, "Cache not flushed: requests are running or waiting")
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.evict_to(0)
        return web.Response(text="Cache flushed.")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def health_generate(self, request: web.Request) -> web.Response:
        return web.Response(text="ok") if self.ready else _error(503, "server is starting")

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "simulated": True,
            "sim_backend": self.spec.name,
            **reported_server_args(self.spec),
            "kernels": self.kernels,
            "max_total_num_tokens": self.latency.kv_capacity_tokens,
            "max_running_requests": MAX_RUNNING_REQUESTS,
            "model_path": self.latency.model.name,
            "skip_tokenizer_init": True,
            "incremental_streaming_output": self.incremental,
            "disable_radix_cache": not self.radix_cache,
            "time_scale": self.time_scale,
            **self.knobs.server_info(),
            "version": "mpfa-sim",
        })

    async def profile(self, request: web.Request) -> web.Response:
        return web.json_response({"message": "simulated server: nothing to profile"})

    async def sim_trace(self, request: web.Request) -> web.Response:
        return web.json_response(self.trace)

    async def load_hint(self, request: web.Request) -> web.Response:
        """POST /sim_load: a `LoadHint` for the requests that follow (an empty body clears it)."""
        try:
            body = await request.json(loads=orjson.loads)
            self.scheduler.set_hint(LoadHint.from_json(body) if body else None)
        except (ValueError, BadRequest) as exc:
            return _error(400, str(exc) if isinstance(exc, BadRequest) else "request body is not valid JSON")
        self.clocks.clear()
        return web.json_response({"hint": body or None})

    async def modelled_times(self, request: web.Request) -> web.Response:
        """GET /sim_clock/{digest}: the modelled arrival and token times of a finished request (once)."""
        sim = self.clocks.get(request.match_info["digest"])
        if sim is None or not sim.finished:
            return _error(404, "no finished request with that prompt since the load hint")
        del self.clocks[sim.digest]
        return web.json_response({"arrival_s": sim.arrival_v, "token_s": sim.token_v})

    # --- generation ------------------------------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, _parse_generate, _SglangFormat(self.incremental))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, _parse_completions, _OpenAIFormat(self.latency.model.name))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, _parse_chat, _OpenAIChatFormat(self.latency.model.name))

    async def _serve(
        self, request: web.Request, parse: Callable[[dict[str, Any]], _Parsed], fmt: "_SglangFormat | _OpenAIFormat"
    ) -> web.StreamResponse:
        received = time.perf_counter()
        if not self.ready:
            return _error(503, "server is starting")
        try:
            body = await request.json(loads=orjson.loads)
        except ValueError:
            return _error(400, "request body is not valid JSON")
        try:
            if not isinstance(body, dict):
                raise BadRequest("request body must be a JSON object")
            parsed = parse(body)
            sim = self._new_request(parsed, received)
            self.scheduler.submit(sim)
            if self.scheduler.hint is not None:
                self.clocks[sim.digest] = sim
        except BadRequest as exc:
            return _error(400, str(exc))
        try:
            if parsed.stream:
                response = await self._stream(request, sim, parsed, fmt)
            else:
                while not sim.finished:
                    await sim.progress.wait()
                    sim.progress.clear()
                response = web.json_response(fmt.result(sim, time.perf_counter() - received))
                await response.prepare(request)
                await response.write_eof()
        finally:
            if not sim.finished:
                sim.aborted = True
        await self._count_completed(request, sim.digest)
        return response

    def _new_request(self, parsed: _Parsed, received: float) -> SimRequest:
        self.scheduler.check_fits(int(parsed.input_ids.size), parsed.max_new_tokens)
        self._next_rid += 1
        digest = prompt_digest(parsed.input_ids)
        output_ids = echoed_ids(parsed.input_ids.tolist(), digest, parsed.max_new_tokens)
        sim = SimRequest(f"sim-{self._next_rid}", int(parsed.input_ids.size), output_ids, received, digest,
                         input_ids=parsed.input_ids if self.radix_cache else None)
        if parsed.return_logprob:
            if parsed.logprob_start_len >= parsed.input_ids.size:
                raise BadRequest(f"logprob_start_len ({parsed.logprob_start_len}) must be < the prompt length "
                                 f"({parsed.input_ids.size})")
            sim.logprobs = SimLogprobs(self.spec, digest, parsed.input_ids.tolist(), output_ids,
                                       parsed.logprob_start_len, parsed.top_logprobs_num)
        if self.trace is not None:
            sim.sent = []
            self.trace[digest] = {"received_s": received, "sent": sim.sent}
        return sim

    async def _stream(
        self, request: web.Request, sim: SimRequest, parsed: _Parsed, fmt: "_SglangFormat | _OpenAIFormat"
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0
        while not sim.finished or sent < sim.emitted:
            await sim.progress.wait()
            sim.progress.clear()
            emitted = sim.emitted
            chunk = fmt.chunk(sim, sent, emitted, parsed, time.perf_counter() - sim.received_s)
            data = b"data: " + orjson.dumps(chunk) + b"\n\n"
            if sim.sent is None:
                await response.write(data)
            else:
                before = time.perf_counter()
                await response.write(data)
                sim.sent.append((before, time.perf_counter(), emitted))
            sent = emitted
        for chunk in fmt.trailer(sim, parsed):
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _count_completed(self, request: web.Request, digest: str) -> None:
        """Count a completed request; with --die-after-requests, exit abruptly once enough have completed (and
        the last one's response, and under a load hint its modelled times, have left)."""
        self.completed += 1
        if self.die_after_requests is None or self.completed < self.die_after_requests:
            return
        transport = request.transport
        for _ in range(1000):  # at most ~1 s
            if (transport is None or transport.get_write_buffer_size() == 0) and digest not in self.clocks:
                break
            await asyncio.sleep(0.001)
        print(f"sim server: exiting abruptly after {self.completed} completed requests "
              "(--die-after-requests)", file=sys.stderr, flush=True)
        os._exit(DIE_EXIT_CODE)


class _SglangFormat:
    """SGLang's native `/generate` bodies."""

    def __init__(self, incremental: bool) -> None:
        self.incremental = incremental

    @staticmethod
    def _meta(sim: SimRequest, tokens: int, elapsed_s: float) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": sim.rid, "prompt_tokens": sim.input_len, "completion_tokens": tokens,
            "cached_tokens": sim.cached_tokens,
            "finish_reason": None,
        }
        if tokens == len(sim.output_ids):
            meta["finish_reason"] = {"type": "length", "length": tokens}
            meta["e2e_latency"] = elapsed_s
        return meta

    def chunk(self, sim: SimRequest, sent: int, emitted: int, parsed: _Parsed, elapsed_s: float) -> dict[str, Any]:
        ids = sim.output_ids[sent:emitted] if self.incremental else sim.output_ids[:emitted]
        meta = self._meta(sim, emitted, elapsed_s)
        if sim.logprobs is not None:  # cumulative, like SGLang's meta_info
            meta.update(sim.logprobs.meta(emitted))
        return {"output_ids": ids, "meta_info": meta}

    def trailer(self, sim: SimRequest, parsed: _Parsed) -> list[dict[str, Any]]:
        return []

    def result(self, sim: SimRequest, elapsed_s: float) -> dict[str, Any]:
        meta = self._meta(sim, len(sim.output_ids), elapsed_s)
        if sim.logprobs is not None:
            meta.update(sim.logprobs.meta(len(sim.output_ids)))
        return {"output_ids": sim.output_ids, "meta_info": meta}


def _hash_unit(key: bytes, count: int) -> np.ndarray:
    """`count` floats in [0, 1) from SHAKE-256(key)."""
    return np.frombuffer(hashlib.shake_256(key).digest(4 * count), dtype="<u4") / 2.0**32


def echoed_ids(prompt: list[int], digest: str, count: int) -> list[int]:
    """`count` of the prompt's ids, from a position drawn from its digest on, wrapping around."""
    start = int(digest[:16], 16) % len(prompt)
    return [prompt[(start + i) % len(prompt)] for i in range(count)]


class SimLogprobs:
    """SIMULATED logprobs in SGLang 0.5.15's layout (`[logprob, token_id, null]` entries, null for prompt
    position 0, which nothing predicts). Meaningless as accuracy: position p of the sequence prompt + output gets
    -(0.05 + 12 u) with u a hash of (prompt, p), plus a perturbation hashed from (backend, prompt, p) whose
    half-width is the backend's `SimulatedCosts.logprob_perturbation`. The top-1 prediction is a hashed token at
    -0.01 for prompt positions, the generated token itself for output positions (greedy)."""

    def __init__(self, backend: BackendSpec, digest: str, input_ids: list[int], output_ids: list[int], start: int,
                 top_n: int) -> None:
        total = len(input_ids) + len(output_ids)
        base = -(0.05 + 12.0 * _hash_unit(f"mpfa-sim-logprob:{digest}".encode(), total))
        noise = (2.0 * _hash_unit(f"mpfa-sim-logprob:{backend.name}:{digest}".encode(), total) - 1.0)
        self.values = (base + backend.sim.logprob_perturbation * noise).tolist()
        self.input_ids, self.output_ids = input_ids, output_ids
        self.start, self.top_n = start, top_n
        self.top_ids = hashed_token_ids(f"mpfa-sim-top:{digest}".encode(), total)

    def _top(self, first: tuple[float, int], p: int) -> list[list[Any]]:
        return [[first[0] - k, first[1] if k == 0 else self.top_ids[(p + k) % len(self.top_ids)], None]
                for k in range(self.top_n)]

    def meta(self, emitted: int) -> dict[str, Any]:
        n_in = len(self.input_ids)
        meta: dict[str, Any] = {"input_token_logprobs": [], "output_token_logprobs": []}
        if self.start >= 0:
            meta["input_token_logprobs"] = [[None if p == 0 else self.values[p], self.input_ids[p], None]
                                            for p in range(self.start, n_in)]
        meta["output_token_logprobs"] = [[self.values[n_in + i], self.output_ids[i], None] for i in range(emitted)]
        meta["output_token_logprobs_length"] = emitted
        if self.top_n > 0:
            meta["input_top_logprobs"] = [None if p == 0 else self._top((-0.01, self.top_ids[p]), p)
                                          for p in range(self.start, n_in)] if self.start >= 0 else []
            meta["output_top_logprobs"] = [self._top((self.values[n_in + i], self.output_ids[i]), n_in + i)
                                           for i in range(emitted)]
        return meta


class _OpenAIFormat:
    """OpenAI `/v1/completions` bodies; `text` is empty (no tokenizer), `token_ids` carries the new ids."""

    def __init__(self, model: str) -> None:
        self.model = model

    @staticmethod
    def _usage(sim: SimRequest, tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": sim.input_len, "completion_tokens": tokens, "total_tokens": sim.input_len + tokens,
                "prompt_tokens_details": {"cached_tokens": sim.cached_tokens}}

    def _body(self, sim: SimRequest, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": sim.rid, "object": "text_completion", "created": int(time.time()), "model": self.model,
                "choices": choices}

    def chunk(self, sim: SimRequest, sent: int, emitted: int, parsed: _Parsed, elapsed_s: float) -> dict[str, Any]:
        finish = "length" if emitted == len(sim.output_ids) else None
        body = self._body(sim, [{"index": 0, "text": "", "token_ids": sim.output_ids[sent:emitted],
                                 "logprobs": None, "finish_reason": finish}])
        if parsed.continuous_usage:
            body["usage"] = self._usage(sim, emitted)
        return body

    def trailer(self, sim: SimRequest, parsed: _Parsed) -> list[dict[str, Any]]:
        if not parsed.include_usage:
            return []
        return [{**self._body(sim, []), "usage": self._usage(sim, len(sim.output_ids))}]

    def result(self, sim: SimRequest, elapsed_s: float) -> dict[str, Any]:
        choice = {"index": 0, "text": "", "token_ids": sim.output_ids, "logprobs": None, "finish_reason": "length"}
        return {**self._body(sim, [choice]), "usage": self._usage(sim, len(sim.output_ids))}


class _OpenAIChatFormat(_OpenAIFormat):
    """OpenAI `/v1/chat/completions` bodies: the new ids as text in `delta.content`, in decimal as the prompt was
    sent (the first chunk's delta names the role too); usage as on `/v1/completions`."""

    def _body(self, sim: SimRequest, choices: list[dict[str, Any]],
              kind: str = "chat.completion.chunk") -> dict[str, Any]:
        return {**super()._body(sim, choices), "object": kind}

    def chunk(self, sim: SimRequest, sent: int, emitted: int, parsed: _Parsed, elapsed_s: float) -> dict[str, Any]:
        delta = {"role": "assistant"} if sent == 0 else {}
        delta["content"] = " " + chat_text(sim.output_ids[sent:emitted])
        finish = "length" if emitted == len(sim.output_ids) else None
        body = self._body(sim, [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}])
        if parsed.continuous_usage:
            body["usage"] = self._usage(sim, emitted)
        return body

    def result(self, sim: SimRequest, elapsed_s: float) -> dict[str, Any]:
        message = {"role": "assistant", "content": chat_text(sim.output_ids)}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": "length"}
        return {**self._body(sim, [choice], "chat.completion"), "usage": self._usage(sim, len(sim.output_ids))}


def _exit_if_crashed(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        print(f"sim server: scheduler crashed: {task.exception()!r}", file=sys.stderr, flush=True)
        os._exit(1)


def build_app(
    backend: str, *, model: str | ModelShape = "llama-3.1-8b", time_scale: float = 1.0,
    startup_delay: float = 0.0, die_after_requests: int | None = None,
    incremental_streaming_output: bool = False, trace_chunks: bool = False, prefill_kernel: str | None = None,
    knobs: SimKnobs = SimKnobs(),
    radix_cache: bool = False,
) -> web.Application:
    """The simulator as an aiohttp application (the scheduler starts with the app). ``prefill_kernel``: the MpFA
    prefill kernel it says it simulates (`served_kernels`; the latency model does not depend on it)."""
    shape = model if isinstance(model, ModelShape) else load_model_shape(model)
    sim = SimServer(
        backend, shape, time_scale=time_scale, startup_delay=startup_delay, die_after_requests=die_after_requests,
        incremental_streaming_output=incremental_streaming_output, trace_chunks=trace_chunks,
        prefill_kernel=prefill_kernel, knobs=knobs, radix_cache=radix_cache,
    )
    app = web.Application(client_max_size=256 * 1024**2)  # 128K-token prompts as JSON are a few MB
    app.cleanup_ctx.append(sim.scheduler_context)
    app.add_routes([
        web.get("/health", sim.health),
        web.get("/health_generate", sim.health_generate),
        web.get("/get_server_info", sim.server_info),
        web.route("*", "/flush_cache", sim.flush_cache),
        web.post("/generate", sim.generate),
        web.post("/v1/completions", sim.completions),
        web.post("/v1/chat/completions", sim.chat_completions),
        web.post("/start_profile", sim.profile),
        web.post("/stop_profile", sim.profile),
        web.post("/sim_load", sim.load_hint),
        web.get("/sim_clock/{digest}", sim.modelled_times),
    ])
    if trace_chunks:
        app.add_routes([web.get("/sim_trace", sim.sim_trace)])
    return app


def run_sim_server(
    host: str, port: int, backend: str, *, model: str | ModelShape = "llama-3.1-8b", time_scale: float = 1.0,
    startup_delay: float = 0.0, die_after_requests: int | None = None,
    incremental_streaming_output: bool = False, trace_chunks: bool = False, prefill_kernel: str | None = None,
    knobs: SimKnobs = SimKnobs(),
    radix_cache: bool = False,
) -> None:
    """Serve until SIGINT/SIGTERM (blocking)."""
    app = build_app(
        backend, model=model, time_scale=time_scale, startup_delay=startup_delay,
        die_after_requests=die_after_requests, incremental_streaming_output=incremental_streaming_output,
        trace_chunks=trace_chunks, prefill_kernel=prefill_kernel, knobs=knobs, radix_cache=radix_cache,
    )
    name = model.name if isinstance(model, ModelShape) else model
    print(f"mpfa serve-sim: SIMULATED '{backend}' serving {name} on http://{host}:{port} "
          f"(time scale {time_scale}{', ' + label if (label := knobs_label(knobs.server_info())) else ''})", flush=True)
    web.run_app(app, host=host, port=port, print=None, access_log=None, shutdown_timeout=1.0,
                loop=new_event_loop())

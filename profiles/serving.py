"""`mpfa profile serving`: where a live SGLang server's GPU time goes in prefill and in decode (paper Fig. 1).

SGLang (0.5.15, `ProfileReq` in sglang/srt/managers/io_struct.py) records torch.profiler windows on request:
`POST /start_profile` with an output directory, a step bound and a profile id, and its scheduler writes
`<output_dir>/<profile_id>-TP-<rank>[-<STAGE>].trace.json.gz`. This module runs two bounded windows:

1. prefill: flush the radix cache (so every prompt token is computed), open a window of at most `steps` forward
   steps, send `batch` prompts of `input_len` tokens with max_new_tokens=1 (the first token comes out of the
   prefill step, so no decode step runs), then `POST /stop_profile`.
2. decode: open a window with `profile_by_stage`, which puts the prefill steps in an `-EXTEND` trace and the
   first `steps` decode steps in a `-DECODE` trace, and send the same prompts with `steps` + a margin output
   tokens. Phase 1 left their prompts in the radix cache, so their prefill is short and over before decoding
   starts. Only the `-DECODE` trace is read.

The server must write to a directory this process can read (the same machine). Rank 0's trace stands for the
step: tensor-parallel ranks run the same kernels.

    mpfa profile serving --backend fa3-fp8 --url http://127.0.0.1:30000 --seq 8192 --batch 4 --steps 8 --out DIR
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ..mpfa_cli.harness import client
from ..mpfa_cli.errors import ServingProfileError
from ..mpfa_cli.harness.serving_workload import make_prompts
from .breakdown import StageBreakdown, stage_breakdown
from .torch_trace import Trace, load_trace, trim_trace

PREFILL, DECODE = "prefill", "decode"
ACTIVITIES = ("CPU", "GPU")
DECODE_MARGIN = 4  # output tokens beyond `steps`: the decode window closes on decode step steps + 1, which must run
PROMPT_SEED = 0
CONTROL_TIMEOUT_S = 900.0  # /stop_profile answers once the trace is written, which takes a while for a big one
TRACE_WAIT_S = 60.0  # for a trace file to appear and be complete after its window closed
POLL_S = 0.2
ERROR_BODY_CHARS = 300
SERVER_INFO_KEYS = ("model_path", "attention_backend", "prefill_attention_backend", "decode_attention_backend",
                    "kv_cache_dtype", "page_size", "tp_size", "chunked_prefill_size", "disable_cuda_graph",
                    "version")

Progress = Callable[[str], None]


@dataclass
class ServingProfile:
    url: str
    input_len: int
    batch: int
    steps: int
    server: dict[str, Any]  # SERVER_INFO_KEYS from the server's /get_server_info
    prefill: StageBreakdown
    decode: StageBreakdown
    json_path: str | None = None

    def stages(self) -> list[StageBreakdown]:
        return [self.prefill, self.decode]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, out_dir: Path) -> Path:
        path = out_dir / f"serving-profile-in{self.input_len}-b{self.batch}-s{self.steps}.json"
        self.json_path = str(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def profile_serving(url: str, input_len: int, batch: int, steps: int, out_dir: Path,
                    activities: Sequence[str] = ACTIVITIES, progress: Progress | None = None) -> ServingProfile:
    """Profile a prefill window and a decode window of the server at `url`; traces and JSON go to `out_dir`.

    Raises ValueError for bad arguments and ServingProfileError when the server refuses, a request fails or no
    trace arrives.
    """
    for name, value, least in (("input_len", input_len, 1), ("batch", batch, 1), ("steps", steps, 2)):
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    out_dir = out_dir.resolve()  # the server resolves relative paths against its own working directory
    out_dir.mkdir(parents=True, exist_ok=True)
    profile = client.run(_profile(url.rstrip("/"), input_len, batch, steps, out_dir, list(activities),
                                  progress or (lambda _message: None)))
    profile.write_json(out_dir)
    return profile


async def _profile(url: str, input_len: int, batch: int, steps: int, out_dir: Path, activities: list[str],
                   say: Progress) -> ServingProfile:
    prompts = make_prompts(PROMPT_SEED, batch, input_len)
    run_id = f"mpfa-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    timeout = aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        control = _Control(session, url)
        server = await control.server_info()

        say(f"prefill window: {batch} prompt(s) of {input_len} tokens, max_new_tokens=1, at most {steps} steps")
        await control.post("/flush_cache")  # a cached prefix would skip the very work being measured
        await control.start(out_dir, f"{run_id}-{PREFILL}", steps, activities, by_stage=False)
        async with control.closed_on_error():
            await _send(url, prompts, 1)
        answer = await control.stop()
        prefill_path, prefill_trace = await _wait_for_trace(out_dir, f"{run_id}-{PREFILL}", "", answer)

        say(f"decode window: {steps} decode steps of a batch of {batch} at {input_len} tokens of context")
        await control.start(out_dir, f"{run_id}-{DECODE}", steps, activities, by_stage=True)
        async with control.closed_on_error():
            await _send(url, prompts, steps + DECODE_MARGIN)
            decode_path, decode_trace = await _wait_for_trace(out_dir, f"{run_id}-{DECODE}", "-DECODE", "")
    return ServingProfile(url, input_len, batch, steps, server,
                          stage_breakdown(prefill_trace, PREFILL, str(prefill_path)),
                          stage_breakdown(decode_trace, DECODE, str(decode_path)))


class _Control:
    """SGLang's control endpoints; any answer but 200 is a ServingProfileError, except where noted."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
        try:
            async with self.session.request(method, self.url + path, json=body) as response:
                return response.status, await response.text(errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as exc:
            raise ServingProfileError(f"cannot reach the server at {self.url}: "
                                      f"{type(exc).__name__}: {exc}") from None

    def _refused(self, method: str, path: str, status: int, text: str) -> ServingProfileError:
        return ServingProfileError(f"{method} {self.url}{path} answered HTTP {status}: "
                                   f"{text.strip()[:ERROR_BODY_CHARS]}")

    async def post(self, path: str, body: dict[str, Any] | None = None) -> None:
        status, text = await self._request("POST", path, body)
        if status != 200:
            raise self._refused("POST", path, status, text)

    async def server_info(self) -> dict[str, Any]:
        status, text = await self._request("GET", "/get_server_info")
        if status != 200:
            raise self._refused("GET", "/get_server_info", status, text)
        try:
            info = json.loads(text)
        except ValueError:
            raise ServingProfileError(f"{self.url}/get_server_info did not answer JSON: "
                                      f"{text.strip()[:ERROR_BODY_CHARS]}") from None
        if info.get("simulated"):
            raise ServingProfileError(f"the server at {self.url} is simulated (mpfa serve-sim): it runs no GPU "
                                      f"kernels to profile")
        return {key: info[key] for key in SERVER_INFO_KEYS if key in info}

    async def start(self, out_dir: Path, profile_id: str, steps: int, activities: list[str], by_stage: bool) -> None:
        await self.post("/start_profile", {
            "output_dir": str(out_dir), "num_steps": steps, "activities": activities,
            "profile_by_stage": by_stage, "with_stack": False, "record_shapes": False, "profile_id": profile_id,
        })

    @asynccontextmanager
    async def closed_on_error(self) -> AsyncIterator[None]:
        """On any failure inside, close the open window so the server is not left profiling."""
        try:
            yield
        except BaseException:
            with suppress(ServingProfileError):
                await self.stop()
            raise

    async def stop(self) -> str:
        """Close the open window. A window that closed itself after its steps makes SGLang answer an error,
        which is expected; the answer is returned to explain a missing trace."""
        status, text = await self._request("POST", "/stop_profile")
        return "" if status == 200 else f" ({self._refused('POST', '/stop_profile', status, text)})"


async def _send(url: str, prompts: list[list[int]], output_len: int) -> None:
    records = await client.run_load(url, prompts, output_len, concurrency=len(prompts))
    failed = [record for record in records if record.error]
    if failed:
        raise ServingProfileError(f"{len(failed)} of {len(records)} request(s) failed: {failed[0].error}")


async def _wait_for_trace(out_dir: Path, profile_id: str, stage_suffix: str, hint: str) -> tuple[Path, Trace]:
    """Rank 0's trace of a window, once it is complete (a file still being written does not parse yet)."""
    pattern = f"{profile_id}-TP-0*{stage_suffix}.trace.json.gz"
    deadline = time.monotonic() + TRACE_WAIT_S
    while True:
        found = sorted(out_dir.glob(pattern))
        if found:
            try:
                return found[0], load_trace(found[0])
            except (EOFError, OSError, ValueError) as exc:
                if time.monotonic() > deadline:
                    raise ServingProfileError(f"unreadable trace {found[0]}: {type(exc).__name__}: {exc}") from None
        elif time.monotonic() > deadline:
            raise ServingProfileError(f"the server wrote no trace {out_dir / pattern} within {TRACE_WAIT_S:.0f} s"
                                      f"{hint} (is it running on this machine?)")
        await asyncio.sleep(POLL_S)


def trim_for_fixture(profile: ServingProfile, max_events: int) -> list[Path]:
    """Write a trimmed copy (`*.trimmed.json.gz`) of each stage's trace next to it, small enough to commit."""
    written = []
    for stage in profile.stages():
        source = Path(stage.trace_path)
        target = source.with_name(source.name.replace(".trace.json.gz", ".trimmed.json.gz"))
        trim_trace(source, target, max_events)
        written.append(target)
    return written

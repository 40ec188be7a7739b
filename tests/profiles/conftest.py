"""Fixtures for the serving-profile tests: synthetic Kineto traces, and an SGLang server that speaks the profile
protocol as SGLang 0.5.15 implements it (scheduler_components/profiler_manager.py), serving canned traces.

Test modules cannot import a conftest by name (pytest runs with --import-mode=importlib), hence fixtures."""
from __future__ import annotations

import asyncio
import gzip
import json
import random
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from mpfa.profiles import ncu
from mpfa.profiles.kernel_categories import ATTENTION, COMMUNICATION, GEMM, OTHER
from mpfa.profiles.ncu import parse_raw_csv

FIXTURES = Path(__file__).parents[1] / "fixtures" / "profiles"
# A real H200 capture (`--set full`, then its details and source pages): a producer-warpgroup prefill at 16K.
SHARED_FIXTURES = Path(__file__).parents[1] / "fixtures"
PRODUCER_DETAILS = SHARED_FIXTURES / "ncu-details-prefill-16k-mpfa-producer-warpgroup-h200.csv"
PRODUCER_SOURCE = SHARED_FIXTURES / "ncu-source-prefill-16k-mpfa-producer-warpgroup-h200.csv.gz"


def _captured_name(fixture: str) -> str:
    return parse_raw_csv((FIXTURES / fixture).read_text())[0].name


# Kernel names as they appear in traces (the first two captured by ncu on the H200) and their category.
KERNEL_CATEGORIES = {
    _captured_name("ncu_h200_prefill64k_fa4.csv"): ATTENTION,
    _captured_name("ncu_h200_prefill64k_flashinfer_fp8.csv"): ATTENTION,
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
    "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
    "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, false, false, false, true, true> > > >(...)": ATTENTION,
    "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 4u, 8u, 16u, 1u, 8u, "
    "flashinfer::DefaultAttention<false, false, false, false>>(flashinfer::BatchDecodeParams)": ATTENTION,
    "void flashinfer::MergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16, __nv_bfloat16>(...)": ATTENTION,
    # FlashInfer 0.6.12's sm90 templates (BF16 and FP8) and its XQA decode, as their sources name them
    "void flashinfer::PrefillWithKVCacheKernel<flashinfer::KernelTraits<...>>(...)": ATTENTION,
    "void flashinfer::FP8PrefillWithKVCacheKernel<flashinfer::FP8KernelTraits<...>>(...)": ATTENTION,
    "kernel_mha": ATTENTION,
    "_fwd_kernel": ATTENTION,
    "_fwd_kernel_stage1": ATTENTION,
    "_fwd_grouped_kernel_stage1": ATTENTION,
    "_fwd_kernel_stage2": ATTENTION,
    "kernel_cutlass_kernel_mpfakernelssm90decodeSplitKVDecodeSm90_object_at__tensor0001": ATTENTION,
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_NNT": GEMM,
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": GEMM,
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(...)": GEMM,
    "fused_moe_kernel": GEMM,
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": COMMUNICATION,
    "void cross_device_reduce_1stage<__nv_bfloat16, 8>(RankData*, RankSignals, Signal*, __nv_bfloat16*, int, int)":
        COMMUNICATION,
    "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(...)": OTHER,
    "void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &silu>(...)": OTHER,
    "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 128u, 8u, 16u, __nv_bfloat16, long>(...)": OTHER,
    "kernel_cutlass_kernel_quackrmsnormRMSNorm_object_at__tensor000o1": OTHER,
    "void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u, (cub::BlockScanAlgorithm)2>(...)": OTHER,
    "triton_poi_fused_add_mul_0": OTHER,
    "Memcpy HtoD (Pinned -> Device)": OTHER,
}


def synthetic_trace(rng: random.Random, names: list[str], count: int) -> tuple[dict[str, Any], dict[str, float]]:
    """A Kineto-style trace of `count` device events drawn from `names` (host events and flow arrows around
    them, in shuffled order), and the GPU microseconds per category that went into it."""
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "python"}}]
    expected = dict.fromkeys((ATTENTION, GEMM, COMMUNICATION, OTHER), 0.0)
    clock = rng.uniform(1e6, 2e6)
    for index in range(count):
        name = rng.choice(names)
        duration = round(rng.uniform(1.0, 500.0), 3)
        category = "gpu_memcpy" if name.startswith("Memcpy") else "kernel"
        events.append({"ph": "X", "cat": category, "name": name, "pid": 0, "tid": 7, "ts": clock, "dur": duration,
                       "args": {"correlation": index, "grid": [132, 1, 1], "block": [128, 1, 1]}})
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                       "ts": clock - 5.0, "dur": 3.0, "args": {"correlation": index}})
        events.append({"ph": "f", "cat": "ac2g", "name": "ac2g", "id": index, "pid": 0, "tid": 7, "ts": clock})
        expected[KERNEL_CATEGORIES[name]] += duration
        clock += duration + rng.uniform(0.0, 20.0)
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1.0, "dur": 9e6})
    rng.shuffle(events)
    return {"schemaVersion": 1, "deviceProperties": [{"name": "NVIDIA H200"}], "traceEvents": events}, expected


def write_gz_trace(trace: dict[str, Any], path: Path) -> None:
    with gzip.open(path, "wt", encoding="utf-8") as stream:
        json.dump(trace, stream)


class FakeSglang:
    """/get_server_info, /flush_cache, /start_profile, /stop_profile and a streaming /generate.

    Like SGLang: a plain window writes `<id>-TP-0.trace.json.gz` when it closes (on /stop_profile, or by itself
    when `prefill_closes_itself`, after which /stop_profile answers 500); a `profile_by_stage` window writes
    `<id>-TP-0-EXTEND` and `-DECODE` traces once decode step num_steps + 1 runs (a request with at least
    num_steps + 2 output tokens), and /stop_profile on it while still open writes `<id>-TP-0.trace.json.gz`.
    """

    def __init__(self, prefill_trace: dict[str, Any], decode_trace: dict[str, Any],
                 prefill_closes_itself: bool = False, generate_error: str | None = None) -> None:
        self.traces = {"prefill": prefill_trace, "decode": decode_trace}
        self.prefill_closes_itself = prefill_closes_itself
        self.generate_error = generate_error  # /generate answers HTTP 400 with this text
        self.calls: list[tuple[str, dict[str, Any] | None]] = []
        self.window: dict[str, Any] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024**2)
        app.add_routes([web.get("/get_server_info", self.server_info), web.post("/flush_cache", self.flush_cache),
                        web.post("/start_profile", self.start_profile), web.post("/stop_profile", self.stop_profile),
                        web.post("/generate", self.generate)])
        return app

    def _write(self, window: dict[str, Any], suffix: str, stage: str) -> None:
        path = Path(window["output_dir"]) / f"{window['profile_id']}-TP-0{suffix}.trace.json.gz"
        write_gz_trace(self.traces[stage], path)

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "models/llama-3.1-8b", "attention_backend": "fa3",
                                  "tp_size": 1, "max_total_num_tokens": 500000})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.calls.append(("/flush_cache", None))
        return web.Response(text="Cache flushed.\n")

    async def start_profile(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/start_profile", body))
        if self.window is not None:
            return web.Response(status=500, text="Internal Server Error")
        self.window = body
        return web.Response(text="Start profiling.\n")

    async def stop_profile(self, request: web.Request) -> web.Response:
        self.calls.append(("/stop_profile", None))
        if self.window is None:  # SGLang: "Profiling is not in progress", raised as a RuntimeError
            return web.Response(status=500, text="Internal Server Error")
        self._write(self.window, "", "prefill")
        self.window = None
        return web.Response(text="Stop profiling. This will take some time.\n")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        new_tokens = body["sampling_params"]["max_new_tokens"]
        self.calls.append(("/generate", {"prompt_tokens": len(body["input_ids"]), "max_new_tokens": new_tokens}))
        if self.generate_error is not None:
            return web.Response(status=400, text=self.generate_error)
        window = self.window
        if window is not None and not window["profile_by_stage"] and self.prefill_closes_itself:
            self._write(window, "", "prefill")
            self.window = None
        if window is not None and window["profile_by_stage"] and new_tokens >= window["num_steps"] + 2:
            self._write(window, "-EXTEND", "prefill")
            self._write(window, "-DECODE", "decode")
            self.window = None
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for count in range(1, new_tokens + 1):
            finish = {"type": "length", "length": new_tokens} if count == new_tokens else None
            chunk = {"text": "", "output_ids": list(range(count)),
                     "meta_info": {"prompt_tokens": len(body["input_ids"]), "completion_tokens": count,
                                   "finish_reason": finish}}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response


@contextmanager
def serve(app: web.Application) -> Iterator[str]:
    """Run `app` on a free local port in a background thread; yields its URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    host, port = runner.addresses[0][:2]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _backend_of(command: list[str]) -> str:
    """The backend an ncu command is about: the profiled launch's `--backend`, or the report an import reads."""
    if "--import" in command:
        report = Path(command[command.index("--import") + 1]).name
        return report.removeprefix("ncu-full-").removesuffix(ncu.REPORT_SUFFIX)
    return command[command.index("--backend") + 1]


def install_fake_ncu_full(monkeypatch: pytest.MonkeyPatch,
                          answers: dict[str, dict[str, str]]) -> list[list[str]]:
    """Make ncu 'found' and answer `--ncu-full`'s runs per backend from answers[backend]: "export" is what the
    profiling run prints (it writes the report unless that holds "==ERROR=="), "details" and "source" what
    printing that page of the report prints; a page left out fails with exit status 1. Returns the commands run."""
    calls: list[list[str]] = []
    monkeypatch.setattr(ncu, "find_tool", lambda name: f"/fake/{name}")

    def run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        answer = answers[_backend_of(command)]
        if "--export" in command:
            stdout = answer["export"]
            if "==ERROR==" in stdout:
                return subprocess.CompletedProcess(command, 1, stdout, "")
            Path(command[command.index("--export") + 1] + ncu.REPORT_SUFFIX).write_bytes(b"fake report")
            return subprocess.CompletedProcess(command, 0, stdout, "")
        page = command[command.index("--page") + 1]
        if page not in answer:
            return subprocess.CompletedProcess(command, 1, "", f"==ERROR== the fake report has no {page} page")
        return subprocess.CompletedProcess(command, 0, answer[page], "")

    monkeypatch.setattr(ncu, "run_tool", run)
    return calls


@pytest.fixture
def fake_ncu_full(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, dict[str, str]]], list[list[str]]]:
    """`fake_ncu_full(answers)`: see install_fake_ncu_full."""
    return lambda answers: install_fake_ncu_full(monkeypatch, answers)


@pytest.fixture
def producer_pages() -> dict[str, str]:
    """The details and source pages of one producer-warpgroup prefill launch (H200), as fake_ncu_full answers."""
    with gzip.open(PRODUCER_SOURCE, "rt") as stream:
        return {"details": PRODUCER_DETAILS.read_text(), "source": stream.read()}


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """Seeded per test (by its name): fresh inputs across tests, reproducible within one."""
    return random.Random(request.node.name)


@pytest.fixture
def kernel_categories() -> dict[str, str]:
    return dict(KERNEL_CATEGORIES)


@pytest.fixture
def make_trace(rng: random.Random):
    """`make_trace(names, count)` -> (trace, GPU microseconds per category), drawn from this test's generator."""
    return lambda names, count: synthetic_trace(rng, list(names), count)


@pytest.fixture
def fake_sglang():
    return FakeSglang


@pytest.fixture
def serve_app():
    return serve


@pytest.fixture
def gz_trace_writer():
    return write_gz_trace


@pytest.fixture(scope="session")
def float64_reference() -> Callable[[Any, Any, int], Any]:
    """``float64_reference(prepared, workload, index)``: causal attention in float64 of input set ``index`` of a
    prepared kernel (`PreparedKernel.dense_inputs`, exact for its FP8 and BF16 values), packed as its output."""
    import torch

    from mpfa.kernels.reference import attention_float64

    def reference(prepared: Any, workload: Any, index: int) -> torch.Tensor:
        q, k, v = (x.float() for x in prepared.dense_inputs(index))
        cu_q = torch.arange(0, (workload.batch + 1) * workload.q_len, workload.q_len, dtype=torch.int32,
                            device=q.device)
        cu_k = torch.arange(0, (workload.batch + 1) * workload.seq, workload.seq, dtype=torch.int32, device=q.device)
        return attention_float64(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)

    return reference

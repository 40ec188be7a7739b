"""run_profile's orchestration on the CPU, with torch.cuda faked: one row per backend, a failing backend
becomes an error row and the others still run, and the raw JSON is written; `ncu_full` with ncu faked."""
import io
import json
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from mpfa.profiles import microbench, registry
from mpfa.profiles.attention_workload import BF16
from mpfa.profiles.kernel_adapter import PreparedKernel
from mpfa.profiles.profile_sections import LOG_WIDTH, render_profile
from mpfa.profiles.profile_result import ERROR, OK, Peaks


class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


class _SleepyAdapter:
    """Runs a CPU stand-in whose duration scales with the work: 2 ms."""

    name, tensor_format, math_dtype, kernel_regex = "fa4-bf16", BF16, "bf16", "sleepy"

    def __init__(self):
        self.prepared_sets = []

    def set_bytes(self, workload):
        return 100 * 1024 * 1024

    def prepare(self, workload, num_sets, device, seed):
        self.prepared_sets.append(num_sets)

        def run(index):
            time.sleep(0.002)
            return torch.zeros(1)

        return PreparedKernel(run, lambda index: (None, None, None), num_sets, "sleeps 2 ms")


class _BrokenAdapter(_SleepyAdapter):
    name = "flashinfer-fp8"

    def prepare(self, workload, num_sets, device, seed):
        raise ImportError("libcuda.so.1: cannot open shared object file")


class _SleepyMpfa(_SleepyAdapter):
    name = "mpfa"


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 2**30, 16 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: type("P", (), {})())
    monkeypatch.setattr(microbench, "measure_peaks", lambda device: Peaks(4000.0, 700.0, 1400.0))
    adapters = {"fa4-bf16": _SleepyAdapter(), "flashinfer-fp8": _BrokenAdapter(), "mpfa": _SleepyMpfa()}
    monkeypatch.setattr(microbench, "adapter_for", adapters.__getitem__)
    return adapters


def test_every_backend_gets_a_row_and_failures_do_not_stop_the_others(fake_cuda, tmp_path):
    messages = []
    result = microbench.run_profile("prefill", 4096, 1, (32, 8), 128, ["flashinfer-fp8", "mpfa", "fa4-bf16"],
                                    ncu=False, nsys=False, out_dir=tmp_path / "out", progress=messages.append)
    assert [row.backend for row in result.backends] == ["flashinfer-fp8", "mpfa", "fa4-bf16"]
    broken, after, timed = result.backends
    assert broken.status == ERROR and broken.error == "ImportError: libcuda.so.1: cannot open shared object file"
    assert "Traceback" in broken.error_detail and broken.timing is None
    assert after.status == OK and after.timing is not None  # the backend after the failure still runs
    assert timed.status == OK and timed.timing.samples == len(timed.times_ms) >= 10
    assert 1.5 < timed.timing.median_ms < 50  # the 2 ms stand-in, timed through the (fake) events
    # 100 MiB sets: 4 x the 50 MB default L2 needs 2 of them; both were built and rotated.
    assert timed.num_sets == 2 and fake_cuda["fa4-bf16"].prepared_sets == [2]
    assert result.derived(timed).speedup == 1.0 and result.reference == registry.REFERENCE_BACKEND["prefill"]
    data = json.loads((tmp_path / "out" / "profile-prefill-s4096-b1-h32x8-d128.json").read_text())
    assert [row["status"] for row in data["backends"]] == [ERROR, OK, OK]
    assert data["device"] == "Fake GPU"
    assert any("flashinfer-fp8: ImportError" in message for message in messages)


def test_ncu_full_profiles_each_timed_backend_and_keeps_a_failure_in_its_column(fake_cuda, fake_ncu_full,
                                                                                producer_pages, tmp_path):
    """fa4-bf16's ncu may not read the counters, mpfa's answers with a real H200 capture (details and source)."""
    fake_ncu_full({"fa4-bf16": {"export": "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission"},
                   "mpfa": {"export": "", **producer_pages}})
    messages = []
    result = microbench.run_profile("prefill", 4096, 1, (32, 8), 128, ["fa4-bf16", "flashinfer-fp8", "mpfa"],
                                    ncu=False, nsys=False, out_dir=tmp_path, progress=messages.append,
                                    ncu_full=True)
    assert result.ncu == [] and [full.backend for full in result.ncu_full] == ["fa4-bf16", "mpfa"]
    assert any(message.startswith("mpfa: Nsight Compute --set full") for message in messages)
    assert (tmp_path / "ncu-full-mpfa.csv").read_text() == producer_pages["details"]
    assert (tmp_path / "ncu-source-mpfa.csv").read_text() == producer_pages["source"]
    stored = json.loads(Path(result.json_path).read_text())["ncu_full"]
    assert "ERR_NVGPUCTRPERM" in stored[0]["error"] and stored[0]["kernels"] == stored[0]["loops"] == []
    assert stored[1]["error"] is None and ["issue slots busy", "58.77%"] in stored[1]["kernels"][0]["rows"]
    [kernel] = stored[1]["loops"]
    assert [loop["rows"] for loop in kernel["loops"]] == [[1439, 1872], [2955, 3366]]
    assert kernel["rest"]["rows"] is None and kernel["samples"] == 552_379

    console = Console(record=True, width=LOG_WIDTH, file=io.StringIO())
    render_profile(result, console)
    text = console.export_text()
    assert text.index("Nsight Compute --set full") > text.index("prefill")  # after the timing table
    assert "ERR_NVGPUCTRPERM" in text and "14.4-way" in text and "registers and shared memory: 1 blocks" in text
    assert text.index("where each kernel's warps wait") > text.index("Nsight Compute --set full")
    assert "rows 2955-3366" in text

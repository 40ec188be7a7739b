"""A server's runs are stored under its label only when it confirms it: backend, KV-cache dtype and model, from a
`/get_server_info` that answers itself (no redirect), `simulated` only when it says a JSON true, kernels only as
names; what is stored of its flags and its report holds no secret."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.bench import runner as bench
from mpfa.mpfa_cli.bench.runner import BenchOptions, run_bench, verify_model, verify_server
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.harness.engines import sim_launch
from mpfa.mpfa_cli.harness.scenario import Scenario
from mpfa.mpfa_cli.results.export import export_runs
from mpfa.mpfa_cli.results.store import ResultStore

SCENARIO = Scenario(name="tiny", description="", model="llama-3.1-8b", input_len=[64], output_len=2, num_requests=2,
                    warmup_requests=0, repeats=1, seed=1, concurrency=[1])


def _bench_url(url: str, backend: str, db: Path, **options) -> list[int]:
    with ResultStore(db) as store:
        return run_bench(SCENARIO, [BACKENDS[backend]], BenchOptions(engine="url", url=url, run_dir=db.parent,
                                                                      **options), store, Console(quiet=True))


def _stored(db: Path) -> list:
    with ResultStore(db) as store:
        return store.list_runs(with_requests=True)


def _reporting(monkeypatch, **changes) -> None:
    """The server's `/get_server_info` with `changes` (None drops a key), as run_bench reads it."""
    fetch_json = bench.fetch_json

    def fetch(url: str, body=None):
        info = fetch_json(url, body)
        if url.endswith("/get_server_info"):
            info = {k: v for k, v in {**info, **changes}.items() if v is not None}
        return info

    monkeypatch.setattr(bench, "fetch_json", fetch)


@pytest.mark.parametrize(("backend", "reported", "accepted"), [
    ("fa3-bf16", {"attention_backend": "fa3", "kv_cache_dtype": "fp8_e4m3"}, False),
    ("fa3-bf16", {"attention_backend": "fa3", "kv_cache_dtype": "auto"}, True),
    ("fa3-bf16", {"attention_backend": "fa3", "kv_cache_dtype": "bfloat16"}, True),
    ("fa3-fp8", {"attention_backend": "fa3", "kv_cache_dtype": "fp8_e4m3"}, True),
    ("fa3-fp8", {"attention_backend": "fa3", "kv_cache_dtype": "auto"}, False),
    ("flashinfer-fp8", {"attention_backend": "flashinfer", "kv_cache_dtype": "fp8_e5m2"}, False),
    ("mpfa", {"attention_backend": "mpfa", "kv_cache_dtype": "fp8_e4m3"}, False),
])
def test_the_kv_cache_dtype_is_checked_for_every_backend(backend, reported, accepted):
    if accepted:
        verify_server(reported, BACKENDS[backend], must_report=True)
        return
    with pytest.raises(UserError, match=f"server reports kv_cache_dtype={reported['kv_cache_dtype']}, but backend "
                                        f"'{backend}' asks for"):
        verify_server(reported, BACKENDS[backend], must_report=True)


def test_a_url_server_with_an_fp8_cache_is_not_stored_as_bf16(start_sim, tmp_path):
    server = start_sim("fa3-fp8")
    with pytest.raises(UserError, match="kv_cache_dtype=fp8_e4m3, but backend 'fa3-bf16' asks for auto"):
        _bench_url(server.url, "fa3-bf16", tmp_path / "r.db")
    assert not _stored(tmp_path / "r.db")
    _bench_url(server.url, "fa3-fp8", tmp_path / "r.db")
    assert [(r.backend, r.status) for r in _stored(tmp_path / "r.db")] == [("fa3-fp8", "ok")]


@pytest.mark.parametrize(("info", "refused"), [
    ({"model_path": "/models/scenarios/models/llama-3.1-8b"}, None),
    ({"model_path": "llama-3.1-8b/"}, None),
    ({"model_path": "Llama-3.1-8B"}, None),
    ({"model_path": "/x/qwen3-14b", "served_model_name": "llama-3.1-8b"}, None),
    ({"model_path": "meta-llama/Llama-3.1-8B-Instruct"}, "serves model 'meta-llama/Llama-3.1-8B-Instruct', but"),
    ({"model_path": "/models/qwen3-14b"}, "serves model '/models/qwen3-14b', but the scenario's model is"),
    ({"version": "0.5"}, None),  # names no model: nothing to contradict
])
def test_the_model_a_server_reports_must_be_the_scenarios(info, refused):
    if refused is None:
        verify_model(info, "llama-3.1-8b")
        return
    with pytest.raises(UserError, match=refused):
        verify_model(info, "llama-3.1-8b")


def test_a_url_server_serving_another_model_is_refused(start_sim, tmp_path):
    server = start_sim("fa4-bf16", model="qwen3-14b")
    with pytest.raises(UserError, match="server serves model 'qwen3-14b', but the scenario's model is 'llama-3.1-8b'"):
        _bench_url(server.url, "fa4-bf16", tmp_path / "r.db")
    assert not _stored(tmp_path / "r.db")


def test_a_labelled_url_server_that_names_no_model_is_measured_but_one_naming_another_is_not(sim, tmp_path,
                                                                                           monkeypatch):
    _reporting(monkeypatch, model_path=None, attention_backend=None)
    _bench_url(sim.url, "fa4-bf16", tmp_path / "r.db", labelled=True)
    assert [r.status for r in _stored(tmp_path / "r.db")] == ["ok"]
    _reporting(monkeypatch, model_path="qwen3-14b")
    with pytest.raises(UserError, match="serves model 'qwen3-14b'"):
        _bench_url(sim.url, "fa4-bf16", tmp_path / "r.db", labelled=True)


class _Redirect(BaseHTTPRequestHandler):
    """Answers every GET with a redirect to `target` + the path."""

    target = ""

    def do_GET(self) -> None:
        self.send_response(307)
        self.send_header("Location", self.target + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_a_redirect_from_get_server_info_is_refused_naming_its_location(sim, tmp_path):
    handler = type("ToSim", (_Redirect,), {"target": sim.url})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(UserError, match=f"HTTP 307, a redirect to {sim.url}/get_server_info: not followed"):
            _bench_url(f"http://127.0.0.1:{server.server_address[1]}", "fa4-bf16", tmp_path / "r.db")
    finally:
        server.shutdown()
        server.server_close()
    assert not _stored(tmp_path / "r.db")


@pytest.mark.parametrize(("reported", "simulated"), [("false", False), (1, False), ("true", False), (True, True)])
def test_only_a_json_true_marks_a_url_servers_runs_simulated(sim, tmp_path, monkeypatch, reported, simulated):
    _reporting(monkeypatch, simulated=reported)
    _bench_url(sim.url, "fa4-bf16", tmp_path / "r.db")
    assert [r.simulated for r in _stored(tmp_path / "r.db")] == [simulated]


@pytest.mark.parametrize("kernels", ["fp8", ["fp8"], {"prefill": 8}])
def test_reported_kernels_that_are_not_names_are_refused(sim, tmp_path, monkeypatch, kernels):
    _reporting(monkeypatch, kernels=kernels)
    with pytest.raises(UserError, match="server reports kernels=.*, not an object of kernel names"):
        _bench_url(sim.url, "fa4-bf16", tmp_path / "r.db")
    assert not _stored(tmp_path / "r.db")


def test_secrets_in_server_flags_and_server_info_are_stored_and_exported_redacted(sim, tmp_path, monkeypatch):
    _reporting(monkeypatch, api_key="s3cret-info", admin_api_key=None, enable_api_key=True)
    args = ["--api-key=s3cret-flag", "--hf-token", "hf_s3cret", "--max-total-tokens", "4096"]
    _bench_url(sim.url, "fa4-bf16", tmp_path / "r.db", server_args=args)
    (run,) = _stored(tmp_path / "r.db")
    assert run.backend_flags[-5:] == ["--api-key=<redacted>", "--hf-token", "<redacted>", "--max-total-tokens", "4096"]
    assert run.server_info["api_key"] == "<redacted>" and run.server_info["enable_api_key"] is True
    export = tmp_path / "e.json"
    export_runs([run], "json", export, include_requests=True)
    assert "s3cret" not in export.read_text()
    # the server itself is launched with the real values
    opts = BenchOptions(engine="sim", run_dir=tmp_path, server_args=args)
    command = sim_launch(BACKENDS["fa4-bf16"], 30000, 1.0, "llama-3.1-8b", opts.server_args_for(BACKENDS["fa4-bf16"]))
    assert command.command[-5:] == args


def test_non_finite_numbers_in_server_info_are_stored_as_null(sim, tmp_path, monkeypatch):
    _reporting(monkeypatch, mem_fraction=float("nan"), ratio=float("inf"))
    _bench_url(sim.url, "fa4-bf16", tmp_path / "r.db")
    (run,) = _stored(tmp_path / "r.db")
    assert run.server_info["mem_fraction"] is None and run.server_info["ratio"] is None
    export = tmp_path / "e.json"
    export_runs([run], "json", export)
    assert json.loads(export.read_text())["runs"][0]["server_info"]["ratio"] is None

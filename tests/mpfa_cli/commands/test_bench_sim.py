"""`mpfa bench` end to end against the simulator: a real subprocess serving real HTTP, and the faults."""
from __future__ import annotations

import json
import signal
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import socket
import sqlite3
import time

import psutil
import pytest

from mpfa.backends.specs import BACKENDS

FAST = ["--time-scale", "0.02"]


def _runs(db) -> list[sqlite3.Row]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute("SELECT * FROM runs ORDER BY id").fetchall()
    finally:
        conn.close()


def _requests(db, run_id: int, warmup: bool = False) -> list[sqlite3.Row]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute("SELECT * FROM requests WHERE run_id = ? AND warmup = ?", (run_id, int(warmup))).fetchall()
    finally:
        conn.close()


def _sim_servers(db) -> list[psutil.Process]:
    """Simulator processes started by this test's `mpfa` (they inherit its MPFA_DB)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "serve-sim" in (proc.info["cmdline"] or []) and proc.environ().get("MPFA_DB") == str(db):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def test_bench_two_backends_stores_simulated_runs(mpfa, scenario_file) -> None:
    path = scenario_file(concurrency=[1, 3], repeats=2)
    result = mpfa("bench", "--scenario", str(path), "--backend", "fa4-bf16,mpfa", *FAST)
    assert result.returncode == 0, result.stderr
    assert "SIMULATED" in result.stdout and "estimated duration" in result.stdout
    # In a pipe the progress is plain text, one line per step with the requests done so far.
    assert "[1/8] fa4-bf16 256 c=1 #1: ok; requests 7/" in result.stdout and "[8/8] mpfa 256 c=3 #2" in result.stdout
    assert "\x1b" not in result.stdout
    runs = _runs(mpfa.db)
    assert len(runs) == 2 * 2 * 2  # backends x loads x repeats
    for run in runs:
        assert run["status"] == "ok" and run["simulated"] == 1 and run["engine"] == "sim"
        requests = _requests(mpfa.db, run["id"])
        assert len(requests) == 6
        assert all(r["output_tokens"] == 8 and r["prompt_tokens"] == 256 and r["error"] is None for r in requests)
        info = json.loads(run["server_info"])
        assert info["attention_backend"] == BACKENDS[run["backend"]].expect["attention_backend"]
        assert json.loads(run["kernels"]) == info["kernels"]  # what the simulator says it simulates
    warm = [len(_requests(mpfa.db, run["id"], warmup=True)) for run in runs]
    assert sum(warm) == 2  # one warmup request per backend and input length
    assert not _sim_servers(mpfa.db)


def test_warmup_requests_and_slo_flags_override_the_scenario(mpfa, scenario_file) -> None:
    """`--warmup-requests` replaces the scenario's warmup count; `--slo` sets the goodput SLO: a TTFT bound no
    request meets gives goodput 0, one every request meets gives goodput = req/s."""
    path = scenario_file(warmup_requests=1)
    for slo in ("ttft=0.001", "ttft=1000000,tpot=1000000"):
        result = mpfa("bench", "--scenario", str(path), "--backend", "fa4-bf16", "--warmup-requests", "3",
                      "--slo", slo, *FAST)
        assert result.returncode == 0, result.stderr
    runs = _runs(mpfa.db)
    assert [len(_requests(mpfa.db, run["id"], warmup=True)) for run in runs] == [3, 3]
    tight, loose = (json.loads(run["summary"]) for run in runs)
    assert tight["goodput_req_per_s"] == 0 and loose["goodput_req_per_s"] == pytest.approx(loose["req_per_s"])
    assert loose["req_per_s"] > 0


@pytest.mark.parametrize("load", ["concurrency = [3]", "rate = [40.0]"], ids=["closed-loop", "open-loop"])
def test_modelled_metrics_do_not_depend_on_the_speed_up(mpfa, tmp_path, load) -> None:
    """The simulator times requests on the latency model's clock: the same point at two speed-ups stores the
    same TTFT, TPOT and OTPS, to the last bit."""
    path = tmp_path / "point.toml"
    path.write_text(f'model = "llama-3.1-8b"\ninput_len = 256\noutput_len = 8\nnum_requests = 7\n{load}\n')
    for scale in ("0.0005", "0.02"):
        result = mpfa("bench", "--scenario", str(path), "--backend", "mpfa", "--time-scale", scale)
        assert result.returncode == 0, result.stderr
    slow, fast = (json.loads(run["summary"]) for run in _runs(mpfa.db))
    for name in ("ttft_ms_median", "ttft_ms_p99", "tpot_ms_median", "itl_ms_p99", "otps"):
        assert slow[name] == fast[name] > 0, name
    assert all(json.loads(run["server_info"])["metrics_clock"] == "modelled" for run in _runs(mpfa.db))


def test_warmup_requests_and_slo_flags_reach_the_runs(mpfa, scenario_file) -> None:
    """`--warmup-requests` replaces the scenario's count (sent before the first repeat only); `--slo` adds goodput to
    every run's summary: none of the requests meets a 0.001 ms TTFT."""
    path = scenario_file(warmup_requests=1, concurrency=[2], repeats=2)
    result = mpfa("bench", "--scenario", str(path), "--backend", "mpfa", "--warmup-requests", "3", "--slo",
                  "ttft=0.001,tpot=100000", *FAST)
    assert result.returncode == 0, result.stderr
    runs = _runs(mpfa.db)
    assert [len(_requests(mpfa.db, run["id"], warmup=True)) for run in runs] == [3, 0]
    assert [len(_requests(mpfa.db, run["id"])) for run in runs] == [6, 6]
    assert [json.loads(run["summary"])["goodput_req_per_s"] for run in runs] == [0.0, 0.0]


@pytest.mark.parametrize("slo", ["ttft=fast", "ttfb=100", "tpot=0"])
def test_a_bad_slo_is_one_line(mpfa, slo) -> None:
    result = mpfa.invoke("bench", "--slo", slo)
    assert result.returncode == 2 and result.stderr.startswith("error: --slo: ") and "Traceback" not in result.stderr


def test_unknown_backend_and_scenario_exit_2(mpfa) -> None:
    result = mpfa("bench", "--backend", "fa9")
    assert result.returncode == 2 and "unknown backend 'fa9'; valid: fa4-bf16" in result.stderr
    assert "Traceback" not in result.stderr
    result = mpfa("bench", "--scenario", "huge")
    assert result.returncode == 2 and "unknown scenario 'huge'; valid:" in result.stderr


def test_a_kernel_bench_variant_is_refused_with_how_to_serve_its_kernels(mpfa) -> None:
    result = mpfa.invoke("bench", "--backend", "mpfa-exact")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "'mpfa-exact' is a kernel-bench variant" in result.stderr
    assert "serve its kernels with `mpfa bench --backend mpfa --prefill-kernel exact`" in " ".join(result.stderr.split())


def test_unknown_api_is_one_line(mpfa) -> None:
    result = mpfa.invoke("bench", "--api", "nope")
    assert result.returncode == 2 and "--api: 'nope' is not one of sglang, openai" in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_scenario_one_line_error(mpfa, tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("input_len = [1,\n")
    result = mpfa.invoke("bench", "--scenario", str(bad))
    assert result.returncode == 2 and f"{bad}:" in result.stderr and "Traceback" not in result.stderr


def test_zero_requests_rejected(mpfa) -> None:
    result = mpfa.invoke("bench", "--num-requests", "0")
    assert result.returncode == 2 and "num_requests must be" in result.stderr
    result = mpfa.invoke("bench", "--output-len", "0")
    assert result.returncode == 2 and "output_len must be" in result.stderr


def test_port_in_use_picks_another(mpfa, scenario_file) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = mpfa("bench", "--scenario", str(scenario_file()), "--backend", "fa4-bf16", "--port", str(port), *FAST)
    assert result.returncode == 0, result.stderr
    assert [r["status"] for r in _runs(mpfa.db)] == ["ok"]


def test_server_never_ready_times_out_without_orphans(mpfa, scenario_file) -> None:
    result = mpfa(
        "bench", "--scenario", str(scenario_file()), "--backend", "fa4-bf16", "--ready-timeout", "3",
        "--server-arg=--startup-delay=60", *FAST,
    )
    assert result.returncode == 1
    assert "not ready after 3 s" in result.stderr and "last log lines" in result.stderr
    assert not _sim_servers(mpfa.db)


@pytest.mark.parametrize("flag", ["--connect-timeout", "--first-token-timeout", "--chunk-timeout", "--request-timeout"])
def test_a_timeout_that_is_not_positive_is_one_line(mpfa, flag) -> None:
    result = mpfa.invoke("bench", flag, "0")
    assert result.returncode == 2 and f"{flag}: expected a positive number of seconds" in result.stderr
    assert "Traceback" not in result.stderr


def test_requests_over_the_request_timeout_fail_with_the_reason(mpfa, scenario_file) -> None:
    path = scenario_file(num_requests=3, concurrency=[1], warmup_requests=0, output_len=16)
    result = mpfa("bench", "--scenario", str(path), "--backend", "fa4-bf16", "--time-scale", "1",
                  "--request-timeout", "0.001")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (run,) = _runs(mpfa.db)
    assert run["status"] == "failed" and "request not done after 0.001 s" in run["error"]
    assert [r["error"] for r in _requests(mpfa.db, run["id"])] == ["request not done after 0.001 s"] * 3
    assert not _sim_servers(mpfa.db)


def test_url_refuses_a_backend_the_server_contradicts(mpfa, scenario_file) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = mpfa.popen("serve-sim", "--port", str(port), "--backend", "fa4-bf16", "--time-scale", "0.01")
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while time.time() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        path = scenario_file(num_requests=2, concurrency=[1], warmup_requests=0)
        result = mpfa("bench", "--scenario", str(path), "--url", url, "--backend", "fa4-bf16,flashinfer-fp8")
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert "server reports attention_backend=fa4, but backend 'flashinfer-fp8' asks for flashinfer" in result.stderr
        assert [(r["backend"], r["status"]) for r in _runs(mpfa.db)] == [("fa4-bf16", "ok")]
    finally:
        server.terminate()
        server.communicate(timeout=10)


class _ReportsNothing(BaseHTTPRequestHandler):
    """A server whose /get_server_info is `{}` and which serves nothing else."""

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/get_server_info" else 404, b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(404, b"not here")

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_url_of_a_server_that_reports_nothing_needs_a_backend_label(mpfa, scenario_file) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ReportsNothing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    path = scenario_file(num_requests=2, concurrency=[1], warmup_requests=0)
    try:
        refused = mpfa("bench", "--scenario", str(path), "--url", url, "--backend", "fa4-bf16")
        assert refused.returncode == 1 and "--backend-label fa4-bf16" in refused.stderr and not _runs(mpfa.db)
        labelled = mpfa("bench", "--scenario", str(path), "--url", url, "--backend-label", "fa4-bf16")
        assert labelled.returncode == 1 and "Traceback" not in labelled.stderr  # stored; its requests got 404s
        assert [(r["backend"], r["status"]) for r in _runs(mpfa.db)] == [("fa4-bf16", "failed")]
        both = mpfa("bench", "--url", url, "--backend", "fa4-bf16", "--backend-label", "fa4-bf16")
        assert both.returncode == 2 and "instead of --backend" in both.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_server_death_mid_run_keeps_completed_requests(mpfa, scenario_file) -> None:
    path = scenario_file(num_requests=12, concurrency=[1], warmup_requests=0)
    result = mpfa("bench", "--scenario", str(path), "--backend", "fa4-bf16", "--server-arg=--die-after-requests=5", *FAST)
    assert result.returncode == 1 and "server died" in result.stderr
    (run,) = _runs(mpfa.db)
    assert run["status"] == "failed"
    requests = _requests(mpfa.db, run["id"])
    ok = [r for r in requests if r["error"] is None]
    assert len(ok) == 5 and all(r["output_tokens"] == 8 for r in ok)
    assert not _sim_servers(mpfa.db)


def _wait_for_requests(db, count: int, proc) -> None:
    """Until the first run has `count` requests stored (the bench is killed and the test fails after 60 s)."""
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            runs = _runs(db) if db.exists() else []
        except sqlite3.OperationalError:  # the schema is being created
            runs = []
        if runs and len(_requests(db, runs[0]["id"])) >= count:
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"{count} requests not completed within 60 s")


def _interrupted_bench(mpfa, scenario_file, sig: signal.Signals) -> sqlite3.Row:
    """A bench stopped by `sig` after 3 requests: exit 130, its run interrupted with the requests kept."""
    path = scenario_file(num_requests=200, concurrency=[1], warmup_requests=0, output_len=16)
    proc = mpfa.popen("bench", "--scenario", str(path), "--backend", "fa4-bf16", "--time-scale", "0.2")
    _wait_for_requests(mpfa.db, 3, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "partial results saved" in stderr and "Traceback" not in stderr
    (run,) = _runs(mpfa.db)
    assert run["status"] == "interrupted"
    assert 3 <= len(_requests(mpfa.db, run["id"])) < 200
    assert not _sim_servers(mpfa.db)
    return run


@pytest.mark.parametrize("sig, reason", [(signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP")])
def test_sigterm_and_sighup_interrupt_like_ctrl_c(mpfa, scenario_file, sig, reason) -> None:
    assert _interrupted_bench(mpfa, scenario_file, sig)["error"] == reason


@pytest.mark.parametrize("gap_s", [0.0, 0.05, 0.3])
def test_two_quick_ctrl_cs_leave_no_server_and_no_running_run(mpfa, scenario_file, gap_s) -> None:
    path = scenario_file(num_requests=200, concurrency=[1], warmup_requests=0, output_len=16)
    proc = mpfa.popen("bench", "--scenario", str(path), "--backend", "fa4-bf16", "--time-scale", "0.2")
    _wait_for_requests(mpfa.db, 2, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(gap_s)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert [run["status"] for run in _runs(mpfa.db)] == ["interrupted"]
    assert not _sim_servers(mpfa.db)


def test_a_killed_bench_takes_its_server_and_its_run_is_closed_later(mpfa, scenario_file) -> None:
    path = scenario_file(num_requests=200, concurrency=[1], warmup_requests=0, output_len=16)
    proc = mpfa.popen("bench", "--scenario", str(path), "--backend", "fa4-bf16", "--time-scale", "0.2")
    _wait_for_requests(mpfa.db, 1, proc)
    (server,) = _sim_servers(mpfa.db)
    proc.kill()
    proc.communicate(timeout=10)
    try:
        server.wait(timeout=10)
    except psutil.TimeoutExpired:
        server.kill()
        pytest.fail("the server outlived the bench")
    assert [run["status"] for run in _runs(mpfa.db)] == ["running"]  # nothing ran in the killed bench
    listed = json.loads(mpfa("runs", "--format", "json").stdout)  # opens the store: the run is closed
    assert [run["status"] for run in listed] == ["interrupted"]
    (run,) = _runs(mpfa.db)
    assert run["error"] == "bench process ended without closing the run (killed)"
    assert json.loads(run["summary"])["n_ok"] >= 1  # the requests it stored


def test_ctrl_c_saves_partial_results_and_kills_server(mpfa, scenario_file) -> None:
    run = _interrupted_bench(mpfa, scenario_file, signal.SIGINT)
    assert run["error"] == "Ctrl-C"
    # the default selection (runs that finished ok) is empty: the error names the partial run and how to export it
    result = mpfa("export", "--backend", "fa4-bf16", "--requests")
    assert result.returncode != 0 and f"{run['id']} (interrupted)" in result.stderr, result.stderr
    assert f"mpfa export {run['id']}" in result.stderr and "Traceback" not in result.stderr
    exported = json.loads(mpfa("export", str(run["id"]), "--requests").stdout)["runs"]
    assert exported[0]["status"] == "interrupted" and len(exported[0]["requests"]) >= 3


def test_unwritable_database_is_a_clear_error(mpfa, tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = mpfa("runs", "--db", str(blocker / "results.db"))
    assert result.returncode != 0 and "results database" in result.stderr and "Traceback" not in result.stderr

"""Serving profile: kernel classification, trace reading and trimming, the per-stage breakdown, and the SGLang
profile protocol against a fake server (and the simulator, which has nothing to profile)."""
import gzip
import json
import socket
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.errors import ProfileError, ServingProfileError
from mpfa.mpfa_cli.harness.sim_server import build_app
from mpfa.mpfa_cli.results.store import ResultStore
from mpfa.profiles import serving
from mpfa.profiles.breakdown import TOP_KERNELS, stage_breakdown
from mpfa.profiles.kernel_categories import ATTENTION, CATEGORIES, classify
from mpfa.profiles.profile_sections import format_sections
from mpfa.profiles.serving_report import render_serving, serving_sections
from mpfa.profiles.torch_trace import gpu_events, kernel_totals, load_trace, trim_trace, write_trace

STEPS = 3


def test_every_kernel_lands_in_its_category(kernel_categories):
    wrong = {name: classify(name) for name, category in kernel_categories.items() if classify(name) != category}
    assert wrong == {}
    assert {classify(name) for name in kernel_categories} == set(CATEGORIES)


def test_trace_files_read_plain_and_gzipped(tmp_path, make_trace, kernel_categories):
    trace, _ = make_trace(kernel_categories, 50)
    for name in ("t.json", "t.trace.json.gz"):
        write_trace(trace, tmp_path / name)
        assert load_trace(tmp_path / name) == trace
    with gzip.open(tmp_path / "t.trace.json.gz", "rt") as stream:  # really gzip, not JSON with a .gz name
        assert json.load(stream) == trace


def test_device_events_include_copies_and_skip_host_events(make_trace, kernel_categories):
    trace, expected = make_trace(kernel_categories, 200)
    events = gpu_events(trace)
    assert len(events) == 200 and [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    assert {e["cat"] for e in events} == {"kernel", "gpu_memcpy"}
    everything = kernel_totals(trace, ("kernel", "gpu_memcpy", "gpu_memset"))
    assert sum(k.total_us for k in everything) == pytest.approx(sum(expected.values()))
    kernels_only = kernel_totals(trace)
    assert all(not k.name.startswith("Memcpy") for k in kernels_only)


def test_stage_breakdown_totals_each_category(make_trace, kernel_categories):
    trace, expected = make_trace(kernel_categories, 400)
    stage = stage_breakdown(trace, "decode", "x.trace.json.gz")
    assert [total.category for total in stage.categories] == list(CATEGORIES)
    for category in CATEGORIES:
        assert stage.total_us(category) == pytest.approx(expected[category])
    assert stage.gpu_us == pytest.approx(sum(expected.values()))
    assert sum(stage.share(c) for c in CATEGORIES) == pytest.approx(1.0)
    assert sum(total.launches for total in stage.categories) == 400
    events = gpu_events(trace)
    assert stage.window_us == pytest.approx(max(e["ts"] + e["dur"] for e in events) - events[0]["ts"])
    assert stage.window_us >= stage.gpu_us  # one stream: the kernels do not overlap
    assert len(stage.top_kernels) == TOP_KERNELS
    assert stage.top_kernels == sorted(stage.top_kernels, key=lambda k: k.total_us, reverse=True)


def test_a_trace_without_gpu_activity_is_an_error(make_trace, kernel_categories):
    trace, _ = make_trace(kernel_categories, 20)
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") not in ("kernel", "gpu_memcpy")]
    with pytest.raises(ServingProfileError, match="holds no GPU activity"):
        stage_breakdown(trace, "prefill", "p.trace.json.gz")


def test_trim_keeps_the_first_device_events_and_the_metadata(tmp_path, make_trace, kernel_categories):
    trace, _ = make_trace(kernel_categories, 3000)
    source, target = tmp_path / "full.trace.json.gz", tmp_path / "small.trimmed.json.gz"
    write_trace(trace, source)
    assert trim_trace(source, target, 100) == 100
    small = load_trace(target)
    assert small["deviceProperties"] == trace["deviceProperties"]
    assert [e for e in small["traceEvents"] if e["ph"] == "M"] == [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert gpu_events(small) == gpu_events(trace)[:100]
    assert all(e["ph"] == "M" or e["cat"] in ("kernel", "gpu_memcpy") for e in small["traceEvents"])
    assert target.stat().st_size < source.stat().st_size / 10
    assert trim_trace(source, tmp_path / "all.json.gz", 10**6) == 3000
    with pytest.raises(ValueError, match="max_events must be >= 1"):
        trim_trace(source, target, 0)


def _fake(fake_sglang, make_trace, kernel_categories, **options):
    prefill, prefill_expected = make_trace(kernel_categories, 300)
    decode, decode_expected = make_trace(kernel_categories, 500)
    return fake_sglang(prefill, decode, **options), prefill_expected, decode_expected


@pytest.mark.parametrize("prefill_closes_itself", [False, True])
def test_profile_serving_runs_both_windows(tmp_path, monkeypatch, fake_sglang, serve_app, make_trace,
                                           kernel_categories, prefill_closes_itself):
    fake, prefill_expected, decode_expected = _fake(fake_sglang, make_trace, kernel_categories,
                                                    prefill_closes_itself=prefill_closes_itself)
    monkeypatch.chdir(tmp_path)
    with serve_app(fake.app()) as url:
        profile = serving.profile_serving(url + "/", 64, 2, STEPS, Path("out"))  # relative to this process
    out = (tmp_path / "out").resolve()
    paths = [path for path, _ in fake.calls]
    assert paths == ["/flush_cache", "/start_profile", "/generate", "/generate", "/stop_profile",
                     "/start_profile", "/generate", "/generate"]
    prefill_start, decode_start = [body for path, body in fake.calls if path == "/start_profile"]
    for body in (prefill_start, decode_start):
        assert body["output_dir"] == str(out)  # absolute: the server has its own working directory
        assert body["num_steps"] == STEPS and body["activities"] == ["CPU", "GPU"]
        assert body["with_stack"] is False and body["record_shapes"] is False
    assert prefill_start["profile_by_stage"] is False and decode_start["profile_by_stage"] is True
    assert prefill_start["profile_id"] != decode_start["profile_id"]
    generated = [body for path, body in fake.calls if path == "/generate"]
    assert [g["max_new_tokens"] for g in generated[:2]] == [1, 1]
    assert [g["max_new_tokens"] for g in generated[2:]] == [STEPS + serving.DECODE_MARGIN] * 2
    assert all(g["prompt_tokens"] == 64 for g in generated)

    assert profile.server == {"model_path": "models/llama-3.1-8b", "attention_backend": "fa3",
                              "tp_size": 1}
    assert profile.decode.trace_path.endswith("-TP-0-DECODE.trace.json.gz")
    for stage, expected in ((profile.prefill, prefill_expected), (profile.decode, decode_expected)):
        assert {c: stage.total_us(c) for c in CATEGORIES} == pytest.approx(expected)
    stored = json.loads((out / f"serving-profile-in64-b2-s{STEPS}.json").read_text())
    assert profile.json_path == str(out / f"serving-profile-in64-b2-s{STEPS}.json")
    assert stored["decode"]["categories"][0]["total_us"] == pytest.approx(decode_expected[ATTENTION])


def test_missing_decode_trace_closes_the_window_and_says_which_file(tmp_path, monkeypatch, fake_sglang, serve_app,
                                                                   make_trace, kernel_categories):
    fake, _, _ = _fake(fake_sglang, make_trace, kernel_categories)
    monkeypatch.setattr(serving, "DECODE_MARGIN", 0)  # too few tokens: decode step STEPS + 1 never runs
    monkeypatch.setattr(serving, "TRACE_WAIT_S", 0.5)
    with serve_app(fake.app()) as url, pytest.raises(ServingProfileError) as caught:
        serving.profile_serving(url, 64, 2, STEPS, tmp_path)
    assert "wrote no trace" in str(caught.value) and "-DECODE.trace.json.gz" in str(caught.value)
    assert fake.calls[-1][0] == "/stop_profile" and fake.window is None


def test_failed_requests_close_the_window(tmp_path, fake_sglang, serve_app, make_trace, kernel_categories):
    fake, _, _ = _fake(fake_sglang, make_trace, kernel_categories, generate_error="The input is too long")
    with serve_app(fake.app()) as url, pytest.raises(ServingProfileError) as caught:
        serving.profile_serving(url, 64, 2, STEPS, tmp_path)
    assert str(caught.value) == "2 of 2 request(s) failed: HTTP 400: The input is too long"
    assert [path for path, _ in fake.calls][-1] == "/stop_profile" and fake.window is None


def test_a_refused_start_is_an_error(tmp_path, fake_sglang, serve_app, make_trace, kernel_categories):
    fake, _, _ = _fake(fake_sglang, make_trace, kernel_categories)
    fake.window = {"profile_id": "someone-else"}  # a window is already open
    with serve_app(fake.app()) as url, pytest.raises(ServingProfileError, match=r"/start_profile answered HTTP 500"):
        serving.profile_serving(url, 64, 2, STEPS, tmp_path)


def test_the_simulator_is_refused(tmp_path, serve_app):
    with serve_app(build_app("fa4-bf16", time_scale=0.001)) as url:
        with pytest.raises(ServingProfileError, match="simulated"):
            serving.profile_serving(url, 64, 2, STEPS, tmp_path)


def test_unreachable_server_and_bad_arguments(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ServingProfileError, match="cannot reach the server"):
        serving.profile_serving(f"http://127.0.0.1:{port}", 64, 2, STEPS, tmp_path)
    assert issubclass(ServingProfileError, ProfileError)  # the CLI's `except ProfileError` turns it into one line
    for arguments, message in (((0, 2, 8), "input_len must be >= 1"), ((64, 0, 8), "batch must be >= 1"),
                               ((64, 2, 1), "steps must be >= 2")):
        with pytest.raises(ValueError, match=message):
            serving.profile_serving("http://127.0.0.1:1", *arguments, tmp_path)


def test_report_shows_each_stage_and_its_largest_kernels(tmp_path, fake_sglang, serve_app, make_trace,
                                                         kernel_categories):
    fake, prefill_expected, _ = _fake(fake_sglang, make_trace, kernel_categories)
    with serve_app(fake.app()) as url:
        profile = serving.profile_serving(url, 64, 2, STEPS, tmp_path)
    categories, kernels = serving_sections(profile)
    assert "llama-3.1-8b" in categories.title and "(fa3)" in categories.title
    prefill_row = categories.rows[0]
    assert prefill_row[0] == "prefill"
    assert prefill_row[1] == f"{sum(prefill_expected.values()) / 1e3:,.2f}"
    assert prefill_row[3] == f"{prefill_expected[ATTENTION] / 1e3:,.2f}"
    shares = [float(cell) for cell in prefill_row[4:]]
    total = sum(prefill_expected.values())
    assert shares == pytest.approx([100 * prefill_expected[c] / total for c in CATEGORIES], abs=0.05)
    assert [row[0] for row in kernels.rows] == ["prefill"] * TOP_KERNELS + ["decode"] * TOP_KERNELS
    assert all(row[1] == classify(kernel.name) for row, kernel in
               zip(kernels.rows, profile.prefill.top_kernels + profile.decode.top_kernels))
    console = Console(record=True, width=250)
    render_serving(profile, console)
    text = console.export_text()
    assert "GPU time by kernel category" in text and "% of stage" in text
    assert format_sections(serving_sections(profile)).splitlines()[0] == categories.title


def test_the_cli_profiles_a_url_server_stores_the_breakdown_and_trims(tmp_path, fake_sglang, serve_app, make_trace,
                                                                     kernel_categories):
    """`mpfa profile serving --url ... --trim-events N`: the report, a trimmed copy of each stage's trace with N GPU
    events, the profile stored; a bad argument is one line."""
    fake, _, _ = _fake(fake_sglang, make_trace, kernel_categories)
    db = tmp_path / "results.db"
    args = ["profile", "serving", "--backend", "fa3-bf16", "--seq", "64", "--batch", "2", "--out", str(tmp_path),
            "--db", str(db)]
    with serve_app(fake.app()) as url:
        done = CliRunner().invoke(app, [*args, "--url", url, "--steps", str(STEPS), "--trim-events", "40"],
                                  env={"COLUMNS": "200"})
        bad = CliRunner().invoke(app, [*args, "--url", url, "--steps", "1"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    trimmed = sorted(tmp_path.glob("*.trimmed.json.gz"))
    assert len(trimmed) == 2 and all(f"trimmed trace: {path}" in done.stdout for path in trimmed)
    assert all(len(gpu_events(load_trace(path))) == 40 for path in trimmed)
    assert "GPU time by kernel category" in done.stdout and "stored profile 1" in done.stdout
    with ResultStore(db) as store:
        [stored] = store.list_profiles("serving")
    assert stored.params["backend"] == "fa3-bf16" and stored.params["steps"] == STEPS
    assert bad.exit_code == 2 and bad.stderr == "error: steps must be >= 2, got 1\n"

"""Bad files and ids: a baseline, an import or a scenario that is malformed, binary, mistyped or out of range, a
foreign SQLite file, an id beyond 64 bits: one line naming the file and field, exit 2, no traceback, nothing half
stored and nothing modified (docs/reliability.md)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.results.export import run_to_dict
from mpfa.mpfa_cli.reports.gate import write_baseline
from mpfa.mpfa_cli.results.store import ResultStore

BINARY = b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 8


def mpfa(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def one_line_error(result, *words: str) -> str:
    """The single stderr line of a command that failed with exit 2 on bad input, holding every one of `words`."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    line = result.stderr.strip()
    assert line.count("\n") == 0 and all(w in line for w in words), line
    return line


def write(path: Path, content: Any) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


# --- baseline JSON -----------------------------------------------------------------------------------------------


@pytest.fixture
def baseline_doc(tmp_path, make_run) -> dict:
    write_baseline([make_run("mpfa", i, {"otps": 1000.0 + i}) for i in range(3)], tmp_path / "good.json")
    return json.loads((tmp_path / "good.json").read_text())


def entry_with(doc: dict, **fields: Any) -> dict:
    return {**doc, "entries": [{**doc["entries"][0], **fields}]}


@pytest.mark.parametrize("change, words", [
    (lambda d: BINARY, ["not UTF-8 JSON"]),
    (lambda d: "{", ["not UTF-8 JSON"]),
    (lambda d: [], ['non-empty "entries"']),
    (lambda d: {**d, "gpu": 3}, ["gpu is 3, not str"]),
    (lambda d: {**d, "simulated": "no"}, ["simulated"]),
    (lambda d: entry_with(d, mean="fast"), ["entries[0]'s mean is 'fast'"]),
    (lambda d: entry_with(d, n=0), ["entries[0]'s n is 0, not in [1, 1000]"]),
    (lambda d: entry_with(d, n=10**30), ["entries[0]'s n"]),
    (lambda d: entry_with(d, n=1), ["ci_low and ci_high must both be null exactly when n is 1"]),
    (lambda d: entry_with(d, ci_low=2e9), ["outside [ci_low, ci_high]"]),
    (lambda d: entry_with(d, load={"threads": 2}), ["entries[0]: load"]),
    (lambda d: entry_with(d, higher_is_better=False), ["higher_is_better is False for otps"]),
    (lambda d: {**d, "entries": [{k: v for k, v in d["entries"][0].items() if k != "metric"}]}, ["lacks", "metric"]),
])
def test_a_bad_baseline_is_one_line_naming_file_and_field(tmp_path, baseline_doc, make_run, change, words):
    with ResultStore(tmp_path / "r.db") as store:
        store.import_runs([make_run("mpfa", 0, {"otps": 1000.0})])
    bad = write(tmp_path / "bad-baseline.json", change(baseline_doc))
    one_line_error(mpfa("gate", "--baseline", bad, "--db", tmp_path / "r.db"), "bad-baseline.json", *words)


# --- import JSON -------------------------------------------------------------------------------------------------


@pytest.fixture
def export_run(make_run, random_requests) -> dict:
    requests = random_requests(5)
    return run_to_dict(make_run("mpfa", 0, summarize(requests), id=3, requests=requests, status="failed"),
                       include_requests=True)


def with_request(run: dict, **fields: Any) -> dict:
    return {**run, "requests": [{**run["requests"][1], **fields}, *run["requests"][1:]]}


@pytest.mark.parametrize("change, words", [
    (lambda r: {**r, "summary": {"otps": "fast"}}, ["summary is"]),
    (lambda r: {**r, "repeat": 10**12}, ["repeat is 1000000000000, not in [0, 999]"]),
    (lambda r: {**r, "seed": 2**70}, ["seed"]),
    (lambda r: {**r, "started_at": "yesterday"}, ["started_at"]),
    (lambda r: {**r, "kernels": {"prefill": 8}}, ["kernels"]),
    (lambda r: {**r, "requests": r["requests"] + r["requests"][-1:]}, ["run 3 lists request index", "twice"]),
    (lambda r: with_request(r, chunk_tokens=[1]), ["chunk_s but 1 chunk_tokens"]),
    (lambda r: with_request(r, chunk_tokens=[0] * len(r["requests"][1]["chunk_s"])), ["chunk_tokens must each be"]),
    (lambda r: with_request(r, chunk_s=[], chunk_tokens=[], error=None), ["completed without an error but has no"]),
    (lambda r: with_request(r, dispatch_s=None), ["dispatch_s is None"]),
    (lambda r: {**r, "load": {}}, ["run 3: load {} is neither {concurrency}, {rate, burstiness} nor {trace, speedup}"]),
    (lambda r: {**r, "load": {"rate": 0}}, ["run 3: load rate 0 is not a number in (0, 1e+06]"]),
    (lambda r: {**r, "a\nb": 1}, ["unknown field(s) 'a\\nb'"]),
])
def test_a_bad_export_is_one_line_and_nothing_is_imported(tmp_path, export_run, change, words):
    """The bad run comes second in its file, after a good one, and after a good file: none of them is stored."""
    good = write(tmp_path / "good.json", {"runs": [{**export_run, "id": 1, "started_at": 1.0}]})
    bad = write(tmp_path / "bad.json", {"runs": [{**export_run, "id": 2, "started_at": 2.0}, change(export_run)]})
    one_line_error(mpfa("import", good, bad, "--db", tmp_path / "r.db"), "bad.json", *words)
    with ResultStore(tmp_path / "r.db") as store:
        assert store.list_runs() == []


def test_a_binary_file_is_not_an_export(tmp_path):
    bad = write(tmp_path / "bad.bin", BINARY)
    one_line_error(mpfa("import", bad, "--db", tmp_path / "r.db"), "bad.bin", "not UTF-8 JSON")


def test_a_stale_summary_is_replaced_by_its_requests_and_said_so(tmp_path, export_run):
    stale = {**export_run, "summary": {**export_run["summary"], "otps": export_run["summary"]["otps"] * 1.25}}
    result = mpfa("import", write(tmp_path / "e.json", {"runs": [stale]}), "--db", tmp_path / "r.db")
    assert result.exit_code == 0, result.output
    assert "e.json" in result.stdout and "run 3 (here 1): stale summary (otps)" in " ".join(result.stdout.split())
    with ResultStore(tmp_path / "r.db") as store:
        assert store.get_run(1).summary["otps"] == pytest.approx(export_run["summary"]["otps"])


def test_an_ok_run_with_failed_requests_is_stored_failed(tmp_path, export_run):
    result = mpfa("import", write(tmp_path / "e.json", {"runs": [{**export_run, "status": "ok", "num_requests": 4}]}),
                  "--db", tmp_path / "r.db")
    assert result.exit_code == 0 and "did not finish ok" in result.stdout
    with ResultStore(tmp_path / "r.db") as store:
        run = store.get_run(1)
    assert run.status == "failed" and run.error.startswith("1 request(s) failed: HTTP 500")


# --- scenario TOML -----------------------------------------------------------------------------------------------

GOOD_SCENARIO = 'model = "llama-3.1-8b"\ninput_len = 64\noutput_len = 4\nnum_requests = 2\nconcurrency = [1]\n'


@pytest.mark.parametrize("body, words", [
    (BINARY, ["not a UTF-8 text file"]),
    (GOOD_SCENARIO + "burstiness = \"bursty\"\n", ["burstiness: expected a number"]),
    (GOOD_SCENARIO + "burstiness = 0\n", ["burstiness must be a finite number > 0"]),
    (GOOD_SCENARIO + "burstiness = inf\n", ["burstiness must be a finite number > 0"]),
    (GOOD_SCENARIO + "burstiness = nan\n", ["burstiness must be a finite number > 0"]),
    (GOOD_SCENARIO + "repeats = 1_000_000_000_000\n", ["repeats must be in [1, 1000]"]),
    (GOOD_SCENARIO + "seed = -1\n", ["seed must be in [0, "]),
    (GOOD_SCENARIO + "warmup_requests = \"2\"\n", ["warmup_requests: expected an integer"]),
    (GOOD_SCENARIO.replace("output_len = 4", 'output_len = "4"'), ["output_len: expected an integer"]),
    (GOOD_SCENARIO.replace("num_requests = 2", "num_requests = 1_000_000_000"), ["num_requests must be in [1, "]),
    (GOOD_SCENARIO.replace("input_len = 64", "input_len = 1_000_000_000"), ["input_len must be in [1, "]),
    (GOOD_SCENARIO.replace('"llama-3.1-8b"', "5"), ["model: expected a string"]),
    (GOOD_SCENARIO.replace("concurrency = [1]", "rate = [inf]"), ["rate must be in (0, "]),
    (GOOD_SCENARIO.replace("concurrency = [1]", 'rate = ["fast"]'), ["rate: expected a number"]),
])
def test_a_bad_scenario_is_one_line_naming_file_and_field(tmp_path, body, words):
    path = write(tmp_path / "bad.toml", body)
    one_line_error(mpfa("bench", "--scenario", path, "--engine", "sim", "--db", tmp_path / "r.db"), "bad.toml", *words)


# --- databases and ids -------------------------------------------------------------------------------------------


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("command", [("runs",), ("show", "1"), ("compare",), ("export",), ("import", "x.json")])
def test_a_foreign_sqlite_file_is_refused_and_left_as_it_was(tmp_path, command):
    import sqlite3

    foreign = tmp_path / "other.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE notes (text)")
    write(tmp_path / "x.json", {"runs": []})
    before, files = digest(foreign), sorted(tmp_path.iterdir())
    args = [tmp_path / a if a.endswith(".json") else a for a in command]
    one_line_error(mpfa(*args, "--db", foreign), "other.db is not an mpfa results database")
    assert digest(foreign) == before and sorted(tmp_path.iterdir()) == files  # no -wal or -shm file either


def test_a_file_that_is_not_sqlite_is_refused(tmp_path):
    one_line_error(mpfa("runs", "--db", write(tmp_path / "notes.db", "just text\n" * 100)), "notes.db")


def test_a_read_only_database_is_readable(tmp_path, make_run, monkeypatch):
    db = tmp_path / "r.db"
    with ResultStore(db) as store:
        store.import_runs([make_run("mpfa", i, {"otps": 1000.0 + i}) for i in range(2)])
    monkeypatch.setattr("mpfa.mpfa_cli.results.store._may_write", lambda path: False)  # as a user who may not write
    before = digest(db)
    for command in (("runs",), ("show", "1"), ("compare", "--ref", "mpfa")):
        result = mpfa(*command, "--db", db)
        assert result.exit_code == 0, result.output
    one_line_error(mpfa("import", tmp_path / "missing.json", "--db", db), "missing.json")
    assert digest(db) == before


@pytest.mark.parametrize("run_id", ["99999999999999999999", "9223372036854775808"])
def test_an_id_beyond_64_bits_is_no_run(tmp_path, run_id):
    ResultStore(tmp_path / "r.db").close()
    one_line_error(mpfa("show", run_id, "--db", tmp_path / "r.db"), f"no run with id {run_id}")
    one_line_error(mpfa("compare", run_id, "--db", tmp_path / "r.db"), "no run with id")

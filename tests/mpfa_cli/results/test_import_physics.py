"""Impossible runs are not imported: times out of order, a negative TTFT, more tokens than asked, an index out of
range, an `ok` run without all its requests; oversized exports (a gzip bomb) and strings are refused in bounded
memory. Each refusal is one line naming the file, the run and the request; nothing is stored."""
from __future__ import annotations

import dataclasses
import gzip
import json
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.results.export import MAX_EXPORT_BYTES, read_export, run_to_dict
from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.results.recovery import RecoveryFile
from mpfa.mpfa_cli.results.store import ResultStore


def mpfa(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


@pytest.fixture
def good_run(make_run, random_requests) -> dict:
    """An ok run holding all of its 4 measured requests (and a warmup), with every field an export has."""
    requests = [r for r in random_requests(6) if r.ok]  # the warmup and 0..3
    return run_to_dict(make_run("mpfa", 0, summarize(requests), id=3, requests=requests, num_requests=4),
                       include_requests=True)


def first_measured(run: dict, **fields: Any) -> dict:
    """`run` with request 0 changed."""
    return {**run, "requests": [{**r, **fields} if r["index"] == 0 else r for r in run["requests"]]}


def request0(run: dict) -> dict:
    return next(r for r in run["requests"] if r["index"] == 0)


IMPOSSIBLE: list[tuple[Callable[[dict], dict], str]] = [
    (lambda r: first_measured(r, dispatch_s=request0(r)["chunk_s"][0] + 0.5),
     "run 3 request 0: first token at"),  # negative TTFT: it would show as "improved"
    (lambda r: first_measured(r, completion_s=request0(r)["chunk_s"][-1] - 0.01),
     "run 3 request 0: completion at"),
    (lambda r: first_measured(r, chunk_s=request0(r)["chunk_s"][::-1]), "run 3 request 0: chunk times run backwards"),
    (lambda r: first_measured(r, chunk_tokens=[*request0(r)["chunk_tokens"][:-1], 2_000]),
     "tokens for a request of at most 16"),
    (lambda r: first_measured(r, output_tokens=17), "run 3 request 0: 17 tokens for a request of at most 16"),
    (lambda r: first_measured(r, index=999_999), "run 3 request 999999: index out of range"),
    (lambda r: {**r, "num_requests": 16}, "run 3 is marked ok but holds 4 of its 16 requests"),
    (lambda r: {**r, "finished_at": r["started_at"] - 1}, "run 3 finished at"),
]


@pytest.mark.parametrize("change, words", IMPOSSIBLE)
def test_an_impossible_run_is_refused_in_one_line_naming_it(tmp_path, good_run, change, words):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"runs": [{**good_run, "id": 1, "started_at": 1.0}]}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [change(good_run)]}))
    assert mpfa("import", good, "--db", tmp_path / "ok.db").exit_code == 0  # the unchanged run is possible
    result = mpfa("import", good, bad, "--db", tmp_path / "r.db")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {bad}: run 3") and line.endswith(": not imported"), line
    assert words in line, line
    with ResultStore(tmp_path / "r.db") as store:
        assert store.list_runs() == []


def test_a_failed_run_may_hold_fewer_requests_than_it_planned(tmp_path, good_run):
    """Only `ok` claims completeness: a failed or interrupted run keeps the requests it finished."""
    partial = {**good_run, "status": "interrupted", "num_requests": 16}
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"runs": [partial]}))
    assert mpfa("import", path, "--db", tmp_path / "r.db").exit_code == 0


def test_a_gzip_bomb_is_refused_in_bounded_memory(tmp_path):
    """A 130 KB gzip that decompresses to 128 MiB (the issue's 2.1 MB one, 1.1 GB, peaked at 4.15 GB) is cut off at
    `MAX_EXPORT_BYTES` (64 MiB): refused in one line, the memory the read holds bounded by that."""
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b'{"runs": [' + b"0," * (64 * 2**20), 9))
    tracemalloc.start()
    try:
        with pytest.raises(UserError, match=r"holds more than 64 MiB of JSON once decompressed: refused"):
            read_export(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_EXPORT_BYTES + 32 * 2**20, peak / 2**20
    result = mpfa("import", bomb, "--db", tmp_path / "r.db")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.output


def test_a_plain_file_past_the_limit_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    monkeypatch.setattr("mpfa.mpfa_cli.results.export.MAX_EXPORT_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"runs": [], "pad": "x" * 1000}))
    with pytest.raises(UserError, match=r"big.json holds more than 0 MiB of JSON: refused"):
        read_export(big)


@pytest.mark.parametrize("field, limit", [("scenario", 256), ("error", 65536)])
def test_an_oversized_string_is_refused(tmp_path, good_run, field, limit):
    """The issue's 10 MB scenario name made `mpfa runs` take over a minute: names are bounded at 256 characters,
    any other string at 64 Ki."""
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"runs": [{**good_run, field: "n" * (limit + 1)}]}))
    result = mpfa("import", path, "--db", tmp_path / "r.db")
    assert result.exit_code == 2, result.output
    assert f"{field} holds a string of {limit + 1} characters (at most {limit})" in result.stderr
    path.write_text(json.dumps({"runs": [{**good_run, "scenario": "x" * 10_000_000}]}))
    assert mpfa("import", path, "--db", tmp_path / "r.db").exit_code == 2


def test_a_recovery_file_holding_an_impossible_request_is_refused(tmp_path, make_run, random_requests):
    """Recovery files are read through the same checks: a request whose first token precedes its dispatch."""
    requests = [r for r in random_requests(6) if r.ok]
    requests[1] = dataclasses.replace(requests[1], dispatch_s=requests[1].chunk_s[0] + 1.0)
    recovery = RecoveryFile([tmp_path], "results")
    recovery.add_run(make_run("mpfa", 0, id=5, num_requests=4, status="running"))
    recovery.add_requests(5, requests)
    recovery.end_run(5, "ok", None, summarize(requests))
    recovery.close()
    result = mpfa("import", recovery.path, "--db", tmp_path / "r.db")
    assert result.exit_code == 2 and "run 5 request 0: first token at" in result.stderr, result.output
    with ResultStore(tmp_path / "r.db") as store:
        assert store.list_runs() == []

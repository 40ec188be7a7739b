"""`mpfa import`: exported runs back into a database as they were, once; anything but an export is refused."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.results.export import export_runs, run_to_dict
from mpfa.mpfa_cli.results.store import ResultStore

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
OLD_EXPORT = FIXTURES / "serve-long32k-c1-fa4-bf16-flashinfer-fp8-h200.json"  # fa4-bf16, flashinfer-fp8: no `caveat`, no requests
NEW_EXPORT = FIXTURES / "serve-long32k-c1-mixed-mpfa-mpfa-direct-h200.json"  # mpfa, mpfa-direct: with requests


def mpfa(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def exported(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def without_ids(runs: list[dict]) -> list[dict]:
    """The runs in start order (an export lists them newest first, or in the order their ids were given) less ids."""
    return [{k: v for k, v in r.items() if k != "id"} for r in sorted(runs, key=lambda r: r["started_at"])]


def test_round_trip_export_import_export_is_equal_apart_from_ids(tmp_path):
    db = tmp_path / "r.db"
    result = mpfa("import", NEW_EXPORT, "--db", db)
    assert result.exit_code == 0, result.output
    assert "imported 8 run(s) as runs 1–8" in result.output
    out = tmp_path / "again.json"
    assert mpfa("export", "--requests", "-o", out, "--db", db).exit_code == 0
    # The export predates runs' kernel records, bench calls and requests' cached tokens: its runs import with none.
    assert without_ids(exported(out)) == [
        {**r, "kernels": {}, "invocation": None, "requests": [{**q, "cached_tokens": None} for q in r["requests"]]}
        for r in without_ids(exported(NEW_EXPORT))]


def test_a_gz_export_is_compressed_reproducible_and_imports_as_the_plain_one(tmp_path):
    db = tmp_path / "r.db"
    assert mpfa("import", NEW_EXPORT, "--db", db).exit_code == 0
    plain, packed = tmp_path / "e.json", tmp_path / "e.json.gz"
    for dest in (plain, packed):
        assert mpfa("export", "--requests", "-o", dest, "--db", db).exit_code == 0
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert packed.stat().st_size < plain.stat().st_size / 4
    first = packed.read_bytes()
    assert mpfa("export", "--requests", "-o", packed, "--db", db).exit_code == 0
    assert packed.read_bytes() == first  # no timestamp in the gzip header: a re-export does not change the file
    result = mpfa("import", packed, "--db", tmp_path / "other.db")
    assert result.exit_code == 0 and "imported 8 run(s)" in result.output
    again = tmp_path / "again.json"
    assert mpfa("export", "--requests", "-o", again, "--db", tmp_path / "other.db").exit_code == 0
    assert without_ids(exported(again)) == without_ids(exported(plain))


def test_a_truncated_gz_export_is_one_line_error(tmp_path):
    packed = tmp_path / "e.json.gz"
    packed.write_bytes(gzip.compress(NEW_EXPORT.read_bytes())[:2000])
    result = mpfa("import", packed, "--db", tmp_path / "r.db")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().count("\n") == 0 and "e.json.gz is not an mpfa JSON export" in result.stderr


def test_an_old_export_imports_with_no_caveat_and_no_kernels(tmp_path):
    db = tmp_path / "r.db"
    assert mpfa("import", OLD_EXPORT, "--db", db).exit_code == 0
    out = tmp_path / "again.json"
    assert mpfa("export", "-o", out, "--db", db).exit_code == 0
    again = exported(out)
    assert [r["caveat"] for r in again] == [None] * 6
    assert without_ids(again) == [{**r, "caveat": None, "kernels": {}, "invocation": None}
                                  for r in without_ids(exported(OLD_EXPORT))]


def test_every_field_survives_including_nan_unfinished_failed_and_simulated(tmp_path, make_run, random_requests):
    requests = random_requests(5)
    runs = [
        make_run("mpfa", 0, summarize(requests), id=7, requests=requests, caveat="reference prefill",
                 status="failed", error="1 request(s) failed",
                 server_info={"attention_backend": "mpfa"}, environment={"torch": "2.13.0"},
                 backend_flags=["--kv-cache-dtype", "fp8_e4m3"],
                 kernels={"prefill": "fp8", "decode": "split-kv", "source": "dispatch"}),
        make_run("fa4-bf16", 1, {"otps": 512.5, "ttft_ms_median": math.nan}, id=9, engine="sim", simulated=True),
        make_run("fa4-bf16", 2, {}, id=11, status="failed", error="server died", finished_at=None),
        make_run("fa4-bf16", 3, {}, id=12, status="running", finished_at=None, requests=random_requests(2)),
    ]
    export_runs(runs, "json", tmp_path / "e.json", include_requests=True)
    assert mpfa("import", tmp_path / "e.json", "--db", tmp_path / "r.db").exit_code == 0
    with ResultStore(tmp_path / "r.db") as store:
        back = store.get_runs([1, 2, 3, 4], with_requests=True)
    expected = [{**run_to_dict(r, True), "id": None} for r in runs]
    assert [{**run_to_dict(r, True), "id": None} for r in back] == expected


def test_importing_a_run_twice_skips_it_and_says_so(tmp_path):
    db = tmp_path / "r.db"
    assert mpfa("import", OLD_EXPORT, "--db", db).exit_code == 0
    result = mpfa("import", NEW_EXPORT, OLD_EXPORT, "--db", db)
    assert result.exit_code == 0, result.output
    assert "serve-long32k-c1-mixed-mpfa-mpfa-direct-h200.json: imported 8 run(s) as runs 7–14" in result.output
    assert "serve-long32k-c1-fa4-bf16-flashinfer-fp8-h200.json: imported 0 run(s); skipped 6 already stored (as runs 1–6)" in result.output
    with ResultStore(db) as store:
        assert len(store.list_runs()) == 14


@pytest.mark.parametrize("content, reason", [
    ("id,scenario,backend\n1,long32k,mpfa\n", "not UTF-8 JSON"),
    ('[{"scenario": "long32k"}]', 'no top-level "runs" list'),
    ('{"runs": [{"scenario": "long32k"}]}', "a run lacks field(s) backend"),
    ('{"runs": [42]}', "a run is int, not an object"),
])
def test_a_file_that_is_not_an_export_is_one_line_error_and_imports_nothing(tmp_path, content, reason):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    db = tmp_path / "r.db"
    result = mpfa("import", OLD_EXPORT, bad, "--db", db)
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.output
    assert "bad.json is not an mpfa JSON export" in result.stderr and reason in result.stderr
    with ResultStore(db) as store:
        assert store.list_runs() == []  # every file is read before any run is stored


def test_mistyped_field_unknown_status_and_unknown_field_are_refused(tmp_path):
    run = exported(OLD_EXPORT)[0]
    for changed, reason in (({**run, "repeat": "0"}, "repeat is '0'"), ({**run, "status": "done"}, "status 'done'"),
                            ({**run, "colour": 1}, "unknown field(s) colour")):
        (tmp_path / "x.json").write_text(json.dumps({"runs": [changed]}))
        result = mpfa("import", tmp_path / "x.json", "--db", tmp_path / "r.db")
        assert result.exit_code == 2 and reason in result.stderr


def test_compare_over_both_exports_shows_every_backend_and_marks_the_mismatched_workloads(tmp_path):
    db = tmp_path / "r.db"
    assert mpfa("import", OLD_EXPORT, NEW_EXPORT, "--db", db).exit_code == 0
    result = mpfa("compare", "--scenario", "long32k", "--ref", "fa4-bf16", "--db", db)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if "metric" in line)
    assert [b for b in ("fa4-bf16", "flashinfer-fp8", "mpfa", "mpfa-direct") if b in header] == [
        "fa4-bf16", "flashinfer-fp8", "mpfa", "mpfa-direct"]
    assert "c=1 ‡" in result.output
    note = " ".join(result.output.split())
    assert ("‡ long32k 32K c=1: workloads differ, not like for like — fa4-bf16, flashinfer-fp8: 1024 output tokens "
            "× 4 requests") in note
    assert "mpfa, mpfa-direct: 256 output tokens × 3 requests" in note

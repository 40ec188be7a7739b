"""The gate cannot pass a regression: a failed backend, a missing point and superseded repeats fail it or are left
out; each row says which rule decided it; baselines record n, GPU, kernels and revision (docs/reliability.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.reports.gate import baseline_from_runs, newest_passes, read_baseline, run_gate, write_baseline
from mpfa.mpfa_cli.results.store import ResultStore

KERNELS = {"prefill": "fp8", "decode": "split-kv", "source": "dispatch"}


def mpfa(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def stored(db: Path, runs: list) -> list[int]:
    """The runs stored in `db` as they are (summaries as set), in order; their ids."""
    with ResultStore(db) as store:
        return [run_id for run_id, _ in store.import_runs(runs)]


def otps_runs(make_run, backend: str, values: list[float], offset: float = 0, **overrides) -> list:
    """One pass: a run per repeat with these OTPS values, started `offset` seconds after the first pass."""
    return [make_run(backend, i, {"otps": v}, kernels=KERNELS, environment={"mpfa_revision": "abc123"},
                     started_at=1_700_000_000.0 + offset + i, **overrides)
            for i, v in enumerate(values)]


@pytest.fixture
def gated(tmp_path, make_run):
    """A database holding a baseline pass of mpfa and fa4-bf16 (3 repeats each) and the baseline written from it."""
    db, baseline = tmp_path / "r.db", tmp_path / "baseline.json"
    stored(db, otps_runs(make_run, "mpfa", [1000, 1002, 998]) + otps_runs(make_run, "fa4-bf16", [500, 501, 499]))
    assert mpfa("gate", "--write-baseline", "--baseline", baseline, "--db", db).exit_code == 0
    return db, baseline


def remeasure(db: Path, make_run) -> None:
    """A new pass of both backends with the baseline's numbers, started after it."""
    stored(db, otps_runs(make_run, "mpfa", [1000, 1002, 998], offset=100)
           + otps_runs(make_run, "fa4-bf16", [500, 501, 499], offset=100))


def test_baseline_records_n_gpu_kernels_and_revision(gated):
    _, path = gated
    baseline = read_baseline(path)
    assert baseline.gpu == "NVIDIA H200"
    entry = next(e for e in baseline.entries if e.backend == "mpfa")
    assert (entry.n, entry.kernels, entry.revision) == (3, KERNELS, "abc123")


def test_a_backend_whose_newest_runs_all_failed_fails_the_gate(gated, make_run):
    db, baseline = gated
    stored(db, otps_runs(make_run, "mpfa", [1000, 1001, 999], offset=100)
           + [make_run("fa4-bf16", i, {}, status="failed", error="server died", started_at=1_700_000_100.0 + i)
              for i in range(3)])
    result = mpfa("gate", "--baseline", baseline, "--db", db)
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("Gate FAILED: 1 of 2 point(s): 1 baseline entr(y/ies) missing, failed or not "
                                    "re-measured")
    assert "failed" in result.stdout and "server died" in result.stdout
    assert mpfa("gate", "--baseline", baseline, "--db", db, "--allow-missing").exit_code == 0


def test_a_baseline_point_with_no_run_fails_unless_allowed(gated, make_run):
    db, baseline = gated
    stored(db, otps_runs(make_run, "mpfa", [1000, 1001, 999], offset=100))
    result = mpfa("gate", "--baseline", baseline, "--results", "7,8", "--results", "9", "--db", db)
    assert result.exit_code == 1 and "missing" in result.stdout and "no run of this backend" in result.stdout
    assert "Traceback" not in result.output
    assert mpfa("gate", "--baseline", baseline, "--results", "7,8,9", "--db", db, "--allow-missing").exit_code == 0
    other_point = otps_runs(make_run, "mpfa", [1000], offset=200, load={"concurrency": 1})
    result = mpfa("gate", "--baseline", baseline, "--results", str(stored(db, other_point)[0]), "--db", db,
                  "--allow-missing")
    assert result.exit_code == 1 and "every baseline entry is missing" in result.stderr


def test_only_the_newest_pass_counts_unless_runs_are_named(gated, make_run):
    """An older pass's good repeats do not pool with (and dilute) a newer, 20% slower pass."""
    db, baseline = gated
    stored(db, otps_runs(make_run, "mpfa", [800, 801], offset=100) + otps_runs(make_run, "fa4-bf16", [500, 501],
                                                                               offset=100))
    with ResultStore(db) as store:
        current = newest_passes(store.list_runs())
    assert sorted(r.id for r in current) == [7, 8, 9, 10]
    result = mpfa("gate", "--baseline", baseline, "--db", db)
    assert result.exit_code == 1 and "1 regression(s) beyond 5.0%" in result.stdout
    # Named, the runs are judged as given: here the old pass alone, the baseline's own runs, not a re-measurement.
    result = mpfa("gate", "--baseline", baseline, "--results", "1,2,3,4,5,6", "--db", db)
    assert result.exit_code == 1 and result.stdout.count("not re-measured  run(s)") == 2, result.output


def test_each_row_says_which_rule_decided_it(make_run, runs_with):
    single = baseline_from_runs(runs_with("otps", {"mpfa": [1000.0]}))
    (check,) = run_gate(single, runs_with("otps", {"mpfa": [1000.0, 1001.0]})).checks
    assert check.decided_by == "5.0% alone: baseline n=1"
    pooled = baseline_from_runs(runs_with("otps", {"mpfa": [1000.0, 1001.0]}))
    (check,) = run_gate(pooled, runs_with("otps", {"mpfa": [1000.0, 1001.0]})).checks
    assert check.decided_by == "5.0% and 95% CIs"


def test_benchmark_json_writes_github_benchmark_files_beside_the_verdict(gated, tmp_path, make_run):
    """`--benchmark-json PREFIX` also writes PREFIX-bigger.json and PREFIX-smaller.json (github-action-benchmark) of
    the runs judged; the verdict is unchanged."""
    db, baseline = gated
    remeasure(db, make_run)
    result = mpfa("gate", "--baseline", baseline, "--db", db, "--benchmark-json", tmp_path / "bench")
    assert result.exit_code == 0 and "Gate passed" in result.output
    bigger = json.loads((tmp_path / "bench-bigger.json").read_text())
    assert sorted(entry["name"].split("/")[-2] for entry in bigger) == ["fa4-bf16", "mpfa"]
    assert all(entry["name"].endswith("/otps") for entry in bigger)
    assert json.loads((tmp_path / "bench-smaller.json").read_text()) == []  # these runs hold no latency


def test_one_run_named_twice_is_refused(gated):
    db, baseline = gated
    for args in (("compare", "1", "1"), ("gate", "--baseline", baseline, "--results", "1,1"), ("export", "2", "2")):
        result = mpfa(*args, "--db", db)
        assert result.exit_code == 2 and "named more than once" in result.stderr, result.output


def test_gate_from_exports_uses_only_them_and_refuses_results_or_db(gated, tmp_path, make_run):
    """--from gates the runs of the exports named (the database is not read or written); with --results or --db, or
    an export that is not there, it says so in one line."""
    db, baseline = gated
    remeasure(db, make_run)
    export = tmp_path / "runs.json"
    assert mpfa("export", "--requests", "-o", export, "--db", db).exit_code == 0
    before = db.read_bytes()
    result = mpfa("gate", "--baseline", baseline, "--from", export)
    assert result.exit_code == 0 and "Gate passed" in result.output, result.output
    assert db.read_bytes() == before
    for extra in (("--results", "1"), ("--db", str(db))):
        result = mpfa("gate", "--baseline", baseline, "--from", export, *extra)
        assert result.exit_code == 2 and result.stderr.strip() == \
            "error: --from takes the runs from the exports: drop --results and --db", result.output
    result = mpfa("gate", "--baseline", baseline, "--from", tmp_path / "missing.json")
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output
    empty = tmp_path / "empty.json"
    empty.write_text('{"runs": []}')
    for command in (("gate", "--baseline", baseline), ("compare",), ("plot",)):
        result = mpfa(*command, "--from", empty)
        assert result.exit_code == 2 and result.stderr.strip() == f"error: no runs in {empty}", result.output


def test_compare_and_plot_from_exports_match_the_database(gated, tmp_path):
    """compare and plot --from read the same runs as from the database they were exported from; the line above the
    tables counts the runs of the exports (their ids there are a throw-away database's)."""
    db, _ = gated
    export = tmp_path / "runs.json"
    assert mpfa("export", "--requests", "-o", export, "--db", db).exit_code == 0
    stored_table, exported_table = mpfa("compare", "--db", db), mpfa("compare", "--from", export)
    assert stored_table.exit_code == exported_table.exit_code == 0, exported_table.output
    assert exported_table.output.splitlines()[0] == "using 6 runs of 1 export(s) (scenario paper)"
    assert exported_table.output.splitlines()[1:] == stored_table.output.splitlines()[1:]
    plot = mpfa("plot", "--from", export, "-o", tmp_path / "fig.png")
    assert plot.exit_code == 0 and (tmp_path / "fig.png").stat().st_size > 0, plot.output
    refused = mpfa("compare", "1", "--from", export)
    assert refused.exit_code == 2 and refused.stderr.strip() == \
        "error: --from takes the runs from the exports: drop the run ids and --db", refused.output


def test_a_point_whose_newest_pass_has_a_failed_repeat_fails(gated, make_run):
    """The issue's case: the newest pass's repeat 1 failed for every backend, its other repeats are fine."""
    db, baseline = gated
    for backend, values in (("mpfa", [1000, 1001, 999]), ("fa4-bf16", [500, 501, 499])):
        runs = otps_runs(make_run, backend, values, offset=100)
        runs[1] = make_run(backend, 1, {}, status="failed", error="HTTP 500", started_at=1_700_000_101.0)
        stored(db, runs)
    result = mpfa("gate", "--baseline", baseline, "--db", db)
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("Gate FAILED: 2 of 2 point(s)")
    assert result.stdout.count("HTTP 500") == 2


def test_a_baseline_point_that_was_not_re_measured_fails(tmp_path, make_run):
    """The issue's case: after the README recipe only one of two points is measured anew; the other's newest pass is
    the very runs the baseline was written from, and fails, naming them."""
    db, baseline = tmp_path / "r.db", tmp_path / "baseline.json"
    one, eight = {"concurrency": 1}, {"concurrency": 8}
    stored(db, otps_runs(make_run, "mpfa", [1000, 1002], load=one) + otps_runs(make_run, "mpfa", [900, 902], load=eight))
    assert mpfa("gate", "--write-baseline", "--baseline", baseline, "--db", db).exit_code == 0
    stored(db, otps_runs(make_run, "mpfa", [1001, 1003], offset=100, load=one))
    result = mpfa("gate", "--baseline", baseline, "--db", db)
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith("Gate FAILED: 1 of 2 point(s)")
    assert "c=8" in result.stdout and "not re-measured" in result.stdout and "c=1 " not in result.stdout
    # Once that point is measured anew too, the gate passes.
    stored(db, otps_runs(make_run, "mpfa", [901, 903], offset=200, load=eight))
    assert mpfa("gate", "--baseline", baseline, "--db", db).exit_code == 0


def test_a_baseline_without_its_runs_start_times_is_judged_as_before(gated, tmp_path):
    """A baseline written before `measured_until` existed cannot tell its own runs: it judges them as it did."""
    db, path = gated
    doc = json.loads(path.read_text())
    for entry in doc["entries"]:
        del entry["measured_until"]
    older = tmp_path / "older.json"
    older.write_text(json.dumps(doc))
    assert mpfa("gate", "--baseline", older, "--db", db).exit_code == 0

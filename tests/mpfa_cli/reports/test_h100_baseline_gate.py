"""The committed H100 baseline (profiles/baselines/h100.json) gated through the CLI against the committed exports it
was written from (each point's backends side by side on one GPU; four machine starts: 32K and 128K at c=1, 16K and
64K (c=1) with 16K c=8, 32K and 64K at c=8, 128K at c=8):
a re-measurement of them passes (copies started later), the very runs it was written from are not one and fail, and
a re-measured copy with one backend's requests degraded fails whatever its stale summary says. A change to the
gate's logic, its aggregation or the baseline format that breaks either fails here, on CPU, without a GPU.

The baseline is written (docs/performance.md, "The CI gate's baseline") by
    mpfa gate --write-baseline --baseline profiles/baselines/h100.json \
        --from profiles/results/serve-serving-matrix-32k-128k-c1-fa3-bf16-fa3-fp8-mpfa-h100.json.gz \
        --from profiles/results/serve-serving-matrix-16k-64k-fa3-bf16-fa3-fp8-mpfa-h100.json.gz \
        --from profiles/results/serve-serving-matrix-32k-64k-c8-fa3-bf16-fa3-fp8-mpfa-h100.json.gz \
        --from profiles/results/serve-serving-matrix-128k-c8-fa3-fp8-mpfa-h100.json.gz
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.reports.gate import baseline_from_runs, newest_passes, read_baseline
from mpfa.mpfa_cli.results.metrics import registry
from mpfa.mpfa_cli.results.store import ResultStore

ROOT = Path(__file__).resolve().parents[3]
PROFILES = ROOT / "profiles"
BASELINE = PROFILES / "baselines" / "h100.json"
EXPORTS = tuple(PROFILES / "results" / f"serve-serving-matrix-{name}-h100.json.gz" for name in (
    "32k-128k-c1-fa3-bf16-fa3-fp8-mpfa", "16k-64k-fa3-bf16-fa3-fp8-mpfa", "32k-64k-c8-fa3-bf16-fa3-fp8-mpfa",
    "128k-c8-fa3-fp8-mpfa"))
DEGRADED = ("serving-matrix", "mpfa")  # scenario and backend made worse in the degraded copies
POINTS = 8  # mpfa's points in the exports: 16K, 32K, 64K and 128K at c=1 and at c=8
GATED = registry.shown_in(registry.Report.GATE)


def mpfa(*args: str | Path):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "250"})


def imported(db: Path, *exports: Path) -> list[str]:
    """Import the exports into `db`; the ids of the runs stored, as `--results` arguments."""
    result = mpfa("import", *exports, "--db", db)
    assert result.exit_code == 0, result.output
    with ResultStore(db) as store:
        return [arg for run in store.list_runs() for arg in ("--results", str(run.id))]


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The very runs the baseline was written from, imported once for the tests that only read them: the database
    and its runs as `--results` arguments."""
    db = tmp_path_factory.mktemp("own") / "own.db"
    return db, imported(db, *EXPORTS)


LATER = 86_400.0  # seconds a copy's runs are moved later: a re-measurement, after the baseline's runs


def degraded_copies(dest: Path, factor: float = 0.7) -> list[Path]:
    """Every export re-measured (started a day later) with DEGRADED's runs slowed down by `factor`
    (`degraded_copy`), in `dest`."""
    return [degraded_copy(path, dest / f"degraded-{path.stem}", factor) for path in EXPORTS]  # plain .json


def degraded_copy(path: Path, dest: Path, factor: float = 0.7) -> Path:
    """`path` with DEGRADED's runs slowed down in their requests (every time stretched by 1 / `factor` from the
    first dispatch: OTPS times `factor`, TTFT and TPOT divided by it) and their summaries left as they were: a
    stale summary that import must not trust."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    hit = 0
    for run in doc["runs"]:
        run["started_at"] += LATER
        run["finished_at"] = run["finished_at"] and run["finished_at"] + LATER
        if (run["scenario"], run["backend"]) == DEGRADED:
            start = min(r["dispatch_s"] for r in run["requests"])
            stretch = lambda t: start + (t - start) / factor  # noqa: E731
            for request in run["requests"]:
                request["dispatch_s"] = stretch(request["dispatch_s"])
                request["chunk_s"] = [stretch(t) for t in request["chunk_s"]]
                request["completion_s"] = stretch(request["completion_s"])
            hit += 1
    assert hit, f"no {DEGRADED} run with requests in {path}"
    dest.write_text(json.dumps(doc))
    return dest


def regression_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if " regression " in line]


def test_baseline_passes_a_re_measurement_and_fails_the_runs_it_was_written_from(tmp_path, own):
    results = imported(tmp_path / "r.db", *degraded_copies(tmp_path, factor=1.0))
    result = mpfa("gate", "--baseline", BASELINE, *results, "--db", tmp_path / "r.db")
    assert result.exit_code == 0, result.output
    assert result.output == "Gate passed: 23 point(s), 69 metric(s) within 5.0% (95% CIs)\n"
    own_db, own_results = own
    result = mpfa("gate", "--baseline", BASELINE, *own_results, "--db", own_db)
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Gate FAILED: 23 of 23 point(s): 69 baseline entr(y/ies) missing, failed or not "
                                    "re-measured")


def test_a_later_rerun_reproduces_the_baseline(tmp_path):
    """The 128K c=1 point re-run side by side on another machine (one repeat: judged by the tolerance alone) passes
    the baseline: fa3-fp8 and mpfa within 0.5% of their earlier means."""
    rerun = PROFILES / "results" / "serve-serving-matrix-128k-c1-fa3-fp8-mpfa-h100.json.gz"
    results = imported(tmp_path / "r.db", rerun)
    result = mpfa("gate", "--baseline", BASELINE, *results, "--db", tmp_path / "r.db", "--allow-missing",
                  "--verbose")
    assert result.exit_code == 0, result.output
    assert result.output.count("current n=1") == 6 and "regression" not in result.output


def test_baseline_is_what_write_baseline_makes_of_those_runs(own):
    """Regenerate with the commands in this module's docstring when the gate's metrics or aggregation change."""
    committed = read_baseline(BASELINE)
    with ResultStore(own[0]) as store:
        fresh = baseline_from_runs(newest_passes(store.list_runs()))  # what `mpfa gate --write-baseline` judges
    assert (committed.gpu, committed.model, committed.simulated) == ("NVIDIA H100 80GB HBM3", "llama-3.1-8b", False)
    assert [(e.scenario, e.backend, e.input_len, e.load, e.metric, e.n, e.workload) for e in committed.entries] == [
        (e.scenario, e.backend, e.input_len, e.load, e.metric, e.n, e.workload) for e in fresh.entries]
    assert all(e.workload for e in committed.entries)
    for old, new in zip(committed.entries, fresh.entries):
        stored, fresh_values = (old.mean, old.ci_low, old.ci_high), (new.mean, new.ci_low, new.ci_high)
        assert [v is None for v in stored] == [v is None for v in fresh_values]  # no CI with a single repeat
        assert [v for v in stored if v is not None] == pytest.approx([v for v in fresh_values if v is not None],
                                                                     rel=1e-12)
    gated = {(e.backend, e.input_len, e.load["concurrency"], e.metric) for e in committed.entries}
    every = ("fa3-bf16", "fa3-fp8", "mpfa")
    c1 = {(b, n, 1, m) for b in every for n in (16384, 32768, 65536, 131072) for m in GATED}
    c8 = {(b, n, 8, m) for b in every for n in (16384, 32768, 65536, 131072) for m in GATED
          if b != "fa3-bf16" or n != 131072}
    assert gated == c1 | c8
    for e in committed.entries:  # every point measured twice: each entry has a CI
        assert (e.n, e.ci_low is None, e.ci_high is None) == (2, False, False), e


def test_write_baseline_from_the_exports_rewrites_the_committed_one(tmp_path, monkeypatch):
    """The command in this module's docstring, run from the repository root, writes the committed baseline again
    (all but its date), the exports listed under its inputs as they were named; gating them with --from passes."""
    monkeypatch.chdir(ROOT)
    named = [str(path.relative_to(ROOT)) for path in EXPORTS]
    written = tmp_path / "h100.json"
    result = mpfa("gate", "--write-baseline", "--baseline", written, *[a for n in named for a in ("--from", n)])
    assert result.exit_code == 0, result.output
    fresh, committed = json.loads(written.read_text()), json.loads(BASELINE.read_text())
    assert fresh["inputs"] == committed["inputs"] == named
    assert {k: v for k, v in fresh.items() if k != "created_at"} == \
        {k: v for k, v in committed.items() if k != "created_at"}
    result = mpfa("gate", "--baseline", BASELINE, *[a for n in named for a in ("--from", n)])
    assert result.exit_code == 1 and "23 of 23 point(s)" in result.output, result.output  # not re-measured


def test_gate_fails_on_a_drop_hidden_behind_a_stale_summary(tmp_path):
    results = imported(tmp_path / "r.db", *degraded_copies(tmp_path))
    result = mpfa("gate", "--baseline", BASELINE, *results, "--db", tmp_path / "r.db")
    assert result.exit_code == 1, result.output
    assert result.stdout.startswith(f"Gate FAILED: {POINTS} of 23 point(s): {3 * POINTS} regression(s) beyond 5.0%")
    regressions = regression_lines(result.stdout)
    assert len(regressions) == 3 * POINTS
    assert result.stdout.count(" · mpfa\n") == POINTS and " · fa3" not in result.stdout
    assert any("OTPS" in line and "-30.0%" in line for line in regressions)
    assert any("TPOT p50" in line and "+42.9%" in line for line in regressions)
    assert any("TTFT p50" in line and "+42.9%" in line for line in regressions)


@pytest.mark.parametrize("factor, exit_code", [(0.8, 1), (0.99, 0)])
def test_a_20_percent_drop_fails_and_a_1_percent_drop_passes(tmp_path, factor, exit_code):
    results = imported(tmp_path / "r.db", *degraded_copies(tmp_path, factor))
    result = mpfa("gate", "--baseline", BASELINE, *results, "--db", tmp_path / "r.db")
    assert result.exit_code == exit_code, result.output
    assert len(regression_lines(result.stdout)) == (3 * POINTS if exit_code else 0)


def test_runs_of_another_workload_are_not_judged(tmp_path):
    """The same configuration measured with another output length / request count (another workload hash), even
    30% worse, is reported as "other workload", not judged against the baseline's numbers: it fails the gate as
    a missing entry unless --allow-missing."""
    worse = degraded_copies(tmp_path)
    for path in worse:
        doc = json.loads(path.read_text())
        for run in doc["runs"]:
            if (run["scenario"], run["backend"]) == DEGRADED:
                run["workload_hash"] = "0" * len(run["workload_hash"])
        path.write_text(json.dumps(doc))
    results = imported(tmp_path / "r.db", *worse)
    result = mpfa("gate", "--baseline", BASELINE, *results, "--db", tmp_path / "r.db")
    assert result.exit_code == 1, result.output  # no comparable result for mpfa
    assert "other workload" in result.stdout and "missing, failed or not re-measured" in result.stdout
    result = mpfa("gate", "--baseline", BASELINE, *results, "--db", tmp_path / "r.db", "--allow-missing")
    assert result.exit_code == 0, result.output
    other = [line for line in result.stdout.splitlines() if "  other workload  " in line]
    assert len(other) == POINTS * len(GATED) and result.stdout.count(" · mpfa\n") == POINTS
    assert " · fa3" not in result.stdout

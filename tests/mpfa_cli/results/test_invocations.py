"""Each `mpfa bench` call stores an invocation id with its runs: compare's default takes, per backend and point, the
runs of the newest call, never an interrupted call's repeats mixed with an older one's, and says which calls."""
from __future__ import annotations

import io
import json
from pathlib import Path

from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.export import export_runs, read_export
from mpfa.mpfa_cli.results.store import ResultStore


def _bench(make_run, invocation: str | None, start: float, repeats: int, status_of_last: str = "ok",
           **fields) -> list:
    """One bench call's runs of fa4-bf16 and mpfa at one point; its last run ends `status_of_last`."""
    runs = [make_run(backend, repeat, {"otps": 1000.0}, started_at=start + 10 * b + repeat,
                     finished_at=start + 10 * b + repeat + 0.5, invocation=invocation, **fields)
            for b, backend in enumerate(("fa4-bf16", "mpfa")) for repeat in range(repeats)]
    runs[-1].status = status_of_last
    return runs


def test_the_newest_bench_of_each_point_is_taken_whole_never_mixed_with_an_older_one(tmp_path, make_run):
    with ResultStore(tmp_path / "r.db") as store:
        # An old mpfa before ids were recorded, then bench a (3 repeats), then bench b interrupted in mpfa's repeat 1.
        store.import_runs([*_bench(make_run, None, 1e9, 3), *_bench(make_run, "a", 2e9, 3),
                           *_bench(make_run, "b", 3e9, 2, "interrupted"),
                           *_bench(make_run, "c", 4e9, 1, input_len=8192)])
        by_point: dict[tuple[str, int], list] = {}
        for run in store.latest_runs():
            by_point.setdefault((run.backend, run.input_len), []).append((run.invocation, run.repeat))
        by_point = {point: sorted(runs) for point, runs in by_point.items()}
        assert by_point == {("fa4-bf16", 16384): [("b", 0), ("b", 1)], ("mpfa", 16384): [("b", 0)],
                            ("fa4-bf16", 8192): [("c", 0)], ("mpfa", 8192): [("c", 0)]}
        assert store.interrupted_invocations(["a", "b", "c", None]) == {"b"}


def test_runs_before_invocations_count_as_one_bench(tmp_path, make_run):
    with ResultStore(tmp_path / "r.db") as store:
        store.import_runs([*_bench(make_run, None, 1e9, 3), *_bench(make_run, None, 2e9, 1)])
        assert sorted((r.backend, r.repeat, r.started_at) for r in store.latest_runs()) == [
            ("fa4-bf16", 0, 2e9), ("fa4-bf16", 1, 1e9 + 1), ("fa4-bf16", 2, 1e9 + 2),
            ("mpfa", 0, 2e9 + 10), ("mpfa", 1, 1e9 + 11), ("mpfa", 2, 1e9 + 12)]


def test_exports_carry_the_invocation_and_older_exports_read_as_none(tmp_path, make_run):
    run = make_run("mpfa", invocation="3f2a9c01", id=1)
    path = tmp_path / "e.json"
    export_runs([run], "json", path)
    assert json.loads(path.read_text())["runs"][0]["invocation"] == "3f2a9c01"
    assert read_export(path)[0].invocation == "3f2a9c01"
    doc = json.loads(path.read_text())
    del doc["runs"][0]["invocation"]
    path.write_text(json.dumps(doc))
    assert read_export(path)[0].invocation is None
    csv_text = io.StringIO()
    export_runs([run], "csv", csv_text)
    header, row = csv_text.getvalue().splitlines()[:2]
    assert row.split(",")[header.split(",").index("invocation")] == "3f2a9c01"


def test_compare_names_the_benches_used_and_the_interrupted_one(tmp_path, make_run):
    db = tmp_path / "r.db"
    with ResultStore(db) as store:
        store.import_runs([make_run("mpfa", 0, {"otps": 1.0}, invocation="77777777", scenario="other", started_at=1e9,
                                    finished_at=1e9 + 1),
                           *_bench(make_run, "0a1b2c3d", 2e9, 3), *_bench(make_run, "3f2a9c01", 3e9, 2, "interrupted")])
    result = CliRunner().invoke(app, ["compare", "--db", str(db)], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "using runs 8–10 (scenario paper) from bench 3f2a9c01 (interrupted)" in result.output
    export = tmp_path / "e.json"
    assert CliRunner().invoke(app, ["export", "--db", str(db), "-o", str(export)]).exit_code == 0
    result = CliRunner().invoke(app, ["compare", "--from", str(export)], env={"COLUMNS": "100"})
    # The export holds the bench's runs that finished ok: the interrupted one, and so the mark, stay in the database.
    assert "using 3 runs of 1 export(s) (scenario paper) from bench 3f2a9c01\n" in result.output

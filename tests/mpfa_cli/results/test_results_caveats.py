"""Caveated runs (measured, but the numbers are not the backend's own): stored, upgraded from version 2, and
labelled wherever they appear — runs/show/compare tables, JSON/CSV export, the plot, and the gate."""
from __future__ import annotations

import csv
import dataclasses
import json
import sqlite3

import matplotlib.pyplot as plt
import pytest
from rich.console import Console

from mpfa.backends.specs import BACKENDS, PLUGIN_PREFILL_CAVEAT
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.results.export import export_runs
from mpfa.mpfa_cli.reports.gate import (baseline_from_runs, gate_table, github_benchmark_entries, read_baseline,
                                        run_gate, write_baseline)
from mpfa.mpfa_cli.reports.plot import plot_runs
from mpfa.mpfa_cli.harness.records import RunRecord
from mpfa.mpfa_cli.reports.tables import compare_table, runs_table, show_run
from mpfa.mpfa_cli.results.store import SCHEMA_VERSION, ResultStore

CAVEAT = PLUGIN_PREFILL_CAVEAT


def render(renderable) -> str:
    """The text as printed, with whitespace runs collapsed (a footnote wraps at the table's width)."""
    console = Console(record=True, width=250, color_system=None)
    console.print(renderable)
    return " ".join(console.export_text().split())


def two_backends(make_run, caveat: str | None = CAVEAT):
    """fa4-bf16 and mpfa (caveated unless `caveat` is None), three repeats each, with every gated metric."""
    return [
        make_run(b, i, {"otps": base * (1 + 0.01 * i), "ttft_ms_median": 100.0 + i, "tpot_ms_median": 10.0 + i},
                 id=10 * k + i, caveat=caveat if b == "mpfa" else None)
        for k, (b, base) in enumerate((("fa4-bf16", 100.0), ("mpfa", 150.0))) for i in range(3)
    ]


def test_mpfa_backends_carry_the_plugin_caveat_and_the_others_none():
    assert {n: s.caveat for n, s in BACKENDS.items() if s.caveat} == {"mpfa": CAVEAT, "mpfa-direct": CAVEAT}
    assert "prefill" in CAVEAT and "TTFT" in CAVEAT


# --- store ----------------------------------------------------------------------------------------------------------


def test_caveat_round_trips_through_the_store(tmp_path, make_run):
    stored = make_run("mpfa", caveat=CAVEAT)
    run = RunRecord(**{f.name: getattr(stored, f.name) for f in dataclasses.fields(RunRecord)})
    with ResultStore(tmp_path / "r.db") as store:
        caveated = store.begin_run(run)
        plain = store.begin_run(dataclasses.replace(run, backend="fa4-bf16", caveat=None, id=None))
    with ResultStore(tmp_path / "r.db") as store:
        assert store.get_run(caveated).caveat == CAVEAT
        assert store.get_run(plain).caveat is None
        assert [r.caveat for r in store.list_runs()] == [None, CAVEAT]


def test_a_version_2_database_is_upgraded_in_place(v2_database):
    with sqlite3.connect(v2_database) as conn:
        assert "caveat" not in {row[1] for row in conn.execute("PRAGMA table_info(runs)")}
    with ResultStore(v2_database) as store:
        fa4, mpfa, mpfa_sim = store.get_runs([1, 2, 3], with_requests=True)
        assert (fa4.backend, fa4.simulated, fa4.caveat) == ("fa4-bf16", False, None)
        assert (mpfa_sim.backend, mpfa_sim.simulated, mpfa_sim.caveat) == ("mpfa", True, None)
        # A measured mpfa run stored before caveats existed was served by the plugin's reference prefill too.
        assert (mpfa.backend, mpfa.simulated, mpfa.caveat) == ("mpfa", False, CAVEAT)
        assert fa4.summary == {"otps": 250.0, "ttft_ms_median": 500.0, "n_ok": 2.0}
        assert [len(r.requests) for r in (fa4, mpfa, mpfa_sim)] == [2, 2, 2]
        assert fa4.requests[1].chunk_s == [0.6, 0.62] and fa4.server_info == {"attention_backend": "fa4"}
        assert fa4.invocation is None  # stored before bench calls were recorded
        assert store.get_profile(1).result == {"mpfa": {"us": 40.5}}
        new = store.begin_run(dataclasses.replace(mpfa, id=None, requests=[]))
        assert store.get_run(new).caveat == CAVEAT
    with sqlite3.connect(v2_database) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 6


# --- tables ---------------------------------------------------------------------------------------------------------


def test_runs_table_marks_caveated_backends_and_prints_the_caveat_once(make_run):
    runs = [make_run("mpfa", i, {"otps": 1.0}, id=i + 1, caveat=CAVEAT) for i in range(3)]
    runs.append(make_run("fa4-bf16", 0, {"otps": 2.0}, id=9))
    text = render(runs_table(runs))
    assert text.count("mpfa †") == 3 and "fa4-bf16 †" not in text
    assert text.count(CAVEAT) == 1 and f"† mpfa: {CAVEAT}" in text
    plain = render(runs_table(runs[3:]))
    assert "†" not in plain and CAVEAT not in plain


def test_show_marks_the_backend_and_prints_the_caveat(make_run):
    text = render(show_run(make_run("mpfa", 0, {"otps": 1.0, "ttft_ms_median": 2.0}, id=4, caveat=CAVEAT)))
    assert "mpfa †" in text and text.count(CAVEAT) == 1
    plain = render(show_run(make_run("mpfa", 0, {"otps": 1.0}, id=5)))
    assert "†" not in plain and CAVEAT not in plain


def test_compare_marks_the_caveated_backend_columns_with_one_footnote(make_run):
    runs = two_backends(make_run)
    text = render(compare_table(runs, "fa4-bf16", ["otps", "ttft_ms_median"]))
    assert "┃ mpfa † ┃ mpfa † speedup ┃" in text and "fa4-bf16 †" not in text
    assert text.count(CAVEAT) == 1 and f"† mpfa: {CAVEAT}" in text
    plain = render(compare_table(two_backends(make_run, caveat=None), "fa4-bf16", ["otps"]))
    assert "†" not in plain and CAVEAT not in plain


def test_compare_takes_the_caveat_only_from_runs_it_shows(make_run):
    runs = two_backends(make_run, caveat=None)
    runs.append(make_run("mpfa", 3, {"otps": 1.0}, id=99, status="failed", caveat=CAVEAT))
    text = render(compare_table(runs, "fa4-bf16", ["otps"]))
    assert "†" not in text and CAVEAT not in text and "1 run(s) that did not finish ok" in text


# --- export and plot ------------------------------------------------------------------------------------------------


def test_export_carries_the_caveat_in_json_and_csv(tmp_path, make_run):
    runs = [make_run("mpfa", 0, {"otps": 1.0}, id=1, caveat=CAVEAT), make_run("fa4-bf16", 0, {"otps": 2.0}, id=2)]
    export_runs(runs, "json", tmp_path / "runs.json")
    assert [r["caveat"] for r in json.loads((tmp_path / "runs.json").read_text())["runs"]] == [CAVEAT, None]
    export_runs(runs, "csv", tmp_path / "runs.csv")
    with (tmp_path / "runs.csv").open(newline="") as f:
        assert [(r["id"], r["caveat"]) for r in csv.DictReader(f)] == [("1", CAVEAT), ("2", "")]


@pytest.fixture
def drawn(monkeypatch):
    """The figures plot_runs draws, kept open for inspection instead of closed."""
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    yield figures
    monkeypatch.undo()
    for fig in figures:
        plt.close(fig)


def _footnote_and_legend(fig) -> tuple[str, list[str]]:
    return fig.get_supxlabel(), [t.get_text() for t in fig.legends[0].get_texts()]


def test_plot_marks_caveated_backends_in_the_legend_and_adds_a_footnote(tmp_path, make_run, drawn):
    plot_runs(two_backends(make_run), "fa4-bf16", tmp_path / "caveated.png")
    plot_runs(two_backends(make_run, caveat=None), "fa4-bf16", tmp_path / "plain.png")
    (footnote, legend), (plain_footnote, plain_legend) = (_footnote_and_legend(f) for f in drawn)
    assert footnote == f"† mpfa: {CAVEAT}"
    assert legend == ["fa4-bf16 c=8", "mpfa † c=8"]
    assert plain_footnote == "" and plain_legend == ["fa4-bf16 c=8", "mpfa c=8"]
    assert (tmp_path / "caveated.png").read_bytes().startswith(b"\x89PNG")


# --- gate -----------------------------------------------------------------------------------------------------------


def test_gate_refuses_caveated_runs_naming_the_caveat(tmp_path, make_run):
    runs = two_backends(make_run)
    baseline = baseline_from_runs(two_backends(make_run, caveat=None))
    with pytest.raises(UserError, match=r"run\(s\) 10, 11, 12 of mpfa carry a caveat \(prefill runs") as exc:
        run_gate(baseline, runs)
    assert "--allow-caveats" in str(exc.value)
    with pytest.raises(UserError, match="carry a caveat"):
        write_baseline(runs, tmp_path / "baseline.json")
    assert not (tmp_path / "baseline.json").exists()


def test_gate_allows_caveats_when_asked_and_marks_them(tmp_path, make_run):
    runs = two_backends(make_run)
    written = write_baseline(runs, tmp_path / "baseline.json", allow_caveats=True)
    assert {(e.backend, e.caveat) for e in written.entries} == {("fa4-bf16", None), ("mpfa", CAVEAT)}
    baseline = read_baseline(tmp_path / "baseline.json")
    assert baseline == written
    remeasured = [dataclasses.replace(r, started_at=r.started_at + 1000) for r in runs]
    result = run_gate(baseline, remeasured, allow_caveats=True)
    assert result.ok
    text = render(gate_table(result, verbose=True))
    assert text.count("mpfa †") == 1 and "fa4-bf16 †" not in text and text.count(CAVEAT) == 1  # its heading
    # A caveated baseline is refused too: judging clean runs against it would be as wrong.
    with pytest.raises(UserError, match="baseline entries of mpfa carry a caveat"):
        run_gate(baseline, two_backends(make_run, caveat=None))


def test_github_benchmark_entries_carry_the_caveat(make_run):
    bigger, smaller = github_benchmark_entries(two_backends(make_run))
    extras = {e["name"].split("/")[3]: e["extra"] for e in bigger}
    assert extras["mpfa"].endswith(f"; † {CAVEAT}") and "†" not in extras["fa4-bf16"]
    assert all(CAVEAT in e["extra"] for e in smaller if "/mpfa/" in e["name"])

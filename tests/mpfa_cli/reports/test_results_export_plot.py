"""Export (JSON/CSV, every record carries `simulated`) and the PNG figure."""
from __future__ import annotations

import csv
import io
import json
import math

import pytest

from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.results.export import export_runs
from mpfa.mpfa_cli.reports.plot import plot_runs


@pytest.fixture
def mixed_runs(make_run, random_requests):
    sim_requests = random_requests(6)
    return [
        make_run("mpfa", 0, summarize(sim_requests), id=1, engine="sim", simulated=True,
                 requests=sim_requests),
        make_run("fa4-bf16", 0, {"otps": 512.5, "ttft_ms_median": math.nan}, id=2),
    ]


def test_json_export_carries_simulated_summary_and_optional_requests(tmp_path, mixed_runs):
    export_runs(mixed_runs, "json", tmp_path / "runs.json", include_requests=True)
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert [r["simulated"] for r in runs] == [True, False]
    assert runs[0]["summary"]["otps"] == pytest.approx(mixed_runs[0].summary["otps"])
    assert runs[1]["summary"]["ttft_ms_median"] is None  # NaN is not JSON
    assert len(runs[0]["requests"]) == 6 and runs[0]["requests"][-1]["ok"] is False
    assert runs[0]["requests"][1]["chunk_s"] == mixed_runs[0].requests[1].chunk_s

    stream = io.StringIO()
    export_runs(mixed_runs, "json", stream)
    assert all("requests" not in r for r in json.loads(stream.getvalue())["runs"])


def test_csv_export_has_one_row_per_run_with_simulated(tmp_path, mixed_runs):
    export_runs(mixed_runs, "csv", tmp_path / "runs.csv")
    with (tmp_path / "runs.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["id"], r["simulated"]) for r in rows] == [("1", "True"), ("2", "False")]
    assert float(rows[1]["otps"]) == 512.5 and rows[1]["ttft_ms_median"] == ""
    assert float(rows[0]["ttft_ms_p99"]) == pytest.approx(mixed_runs[0].summary["ttft_ms_p99"])
    assert json.loads(rows[0]["load"]) == {"concurrency": 8}


def test_export_rejects_unknown_format_and_unwritable_destination(tmp_path, mixed_runs):
    with pytest.raises(UserError, match="unknown export format 'xml'"):
        export_runs(mixed_runs, "xml", tmp_path / "x")
    with pytest.raises(UserError, match="cannot write export file"):
        export_runs(mixed_runs, "csv", tmp_path / "no-such-dir" / "x.csv")


def test_plot_writes_png(tmp_path, rng, make_run):
    runs = [
        make_run(backend, repeat, {"otps": scale * rng.uniform(900, 1100) * 16384 / n,
                                   "ttft_ms_median": rng.uniform(90, 110) * n / 16384 / scale,
                                   "tpot_ms_median": rng.uniform(9, 11) / scale},
                 input_len=n, load={"concurrency": c}, simulated=True, engine="sim")
        for backend, scale in (("fa4-bf16", 1.0), ("mpfa", 1.4), ("flashinfer-fp8", 1.2))
        for n in (16384, 32768, 65536) for c in (1, 8) for repeat in range(2)
    ]
    png, svg = plot_runs(runs, "fa4-bf16", tmp_path / "figs" / "sweep.png", "both")
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert svg == tmp_path / "figs" / "sweep.svg" and b"<svg" in svg.read_bytes()[:1000]


def test_plot_draws_one_figure_per_scenario(tmp_path, make_run):
    runs = [make_run(b, 0, {"otps": 1.0, "ttft_ms_median": 1.0, "tpot_ms_median": 1.0}, scenario=name)
            for name in ("long", "short") for b in ("fa4-bf16", "mpfa")]
    paths = plot_runs(runs, "fa4-bf16", tmp_path / "serving.svg", "svg")
    assert paths == [tmp_path / "serving-long.svg", tmp_path / "serving-short.svg"]


def test_plot_without_reference_is_a_clear_error(tmp_path, make_run):
    with pytest.raises(UserError, match="reference backend"):
        plot_runs([make_run("mpfa", 0, {"otps": 1.0})], "fa4-bf16", tmp_path / "x.png")


def test_plot_title_names_the_setup_axes_start_at_zero_and_speedups_have_error_bars(tmp_path, make_run,
                                                                                     monkeypatch):
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)
    runs = [make_run(b, rep, {"otps": otps + rep, "ttft_ms_median": 50.0 + rep, "tpot_ms_median": 5.0 + rep})
            for b, otps in (("fa4-bf16", 100.0), ("mpfa", 150.0)) for rep in range(3)]
    plot_runs(runs, "fa4-bf16", tmp_path / "s.png")
    (fig,) = drawn
    title = fig._suptitle.get_text()
    assert "paper:" in title and "llama-3.1-8b on NVIDIA H200" in title and "engine sglang" in title
    assert "2023-11-14" in title
    assert all(ax.get_ylim()[0] == 0 for ax in fig.axes)
    speedup_bars = [c for c in fig.axes[1].containers if c.has_yerr]
    (low, high), = [(seg[0][1], seg[1][1]) for seg in speedup_bars[0].lines[2][0].get_segments()]
    assert low < 1.0 < high
    plt.close(fig)

"""`mpfa report`: one self-contained HTML page (compare's tables, plot's figures, provenance, caveats, the SIMULATED
label), and that a real headless Chromium renders it with every run in its DOM (skipped where none is installed)."""
from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.reports.html import render_report
from mpfa.mpfa_cli.results.export import export_runs
from mpfa.mpfa_cli.results.store import ResultStore

CHROMIUM = next((found for name in ("chromium", "chromium-browser", "google-chrome")
                 if (found := shutil.which(name))), None)


@pytest.fixture
def sweep(make_run):
    """fa4-bf16 and mpfa (30% faster, carrying a caveat) at two contexts, two repeats each, and one failed run."""
    def summary(scale: float, n: int, repeat: int) -> dict[str, float]:
        jitter = 1 + 0.01 * repeat
        return {"otps": 1000 * scale * jitter * 16384 / n, "ttft_ms_median": 100 * n / 16384 / scale * jitter,
                "tpot_ms_median": 10 / scale * jitter}

    def make(**overrides):
        runs = [make_run(backend, repeat, summary(scale, n, repeat), input_len=n,
                         caveat="prefill ran <FA3> & bf16" if backend == "mpfa" else None, **overrides)
                for backend, scale in (("fa4-bf16", 1.0), ("mpfa", 1.3)) for n in (16384, 32768)
                for repeat in range(2)]
        runs.append(make_run("mpfa", 2, {}, status="failed", **overrides))
        for run_id, run in enumerate(runs, start=1):
            run.id = run_id
        return runs

    return make


def test_report_holds_tables_figures_runs_caveats_and_simulated_label(sweep):
    runs = sweep(simulated=True, engine="sim", gpu="simulated")
    page = render_report(runs, "fa4-bf16", "using runs 1–9 (scenario paper)")
    assert page.count("SIMULATED") >= 2 and "latency model (engine sim), not from a GPU" in page
    assert all(f'<tr id="run-{run.id}">' in page for run in runs)
    assert page.count('src="data:image/png;base64,') == 1  # one scenario, one figure
    assert page.count("<caption>paper · ") == 2  # a table per point
    assert '<td class="num">1306 ± 82.59<span class="speedup better">1.30×</span></td>' in page  # CIs apart
    assert "mpfa †" in page and "prefill ran &lt;FA3&gt; &amp; bf16" in page  # caveat marked and its note escaped
    assert "1 run(s) that did not finish ok are left out" in page
    assert not re.search(r"(src|href)=\"?(https?:)?//|<script|<link", page)  # nothing loaded from elsewhere


def test_measured_report_has_no_simulated_label_and_escapes_every_run_string(sweep):
    runs = sweep(scenario="<script>alert(1)</script>", model="m&m", backend_flags=['--x="<b>"'])
    page = render_report(runs, "fa4-bf16", "using <runs>")
    assert "SIMULATED" not in page
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "m&amp;m" in page and "--x=&quot;&lt;b&gt;&quot;" in page and "using &lt;runs&gt;" in page


def report(*args: str | Path):
    return CliRunner().invoke(app, ["report", *map(str, args)], env={"COLUMNS": "200"})


def test_report_command_writes_an_owner_only_page_of_the_selected_runs(tmp_path, sweep):
    db, page = tmp_path / "r.db", tmp_path / "report.html"
    with ResultStore(db) as store:
        store.import_runs(sweep())
    result = report("--db", db, "--output", page, "--ref", "mpfa")
    assert result.exit_code == 0, result.output
    # by default, as compare: the runs that finished ok (the failed one is in only when named)
    assert "using runs 1–8 (scenario paper)" in result.output and f"wrote {page}" in result.output
    assert stat.S_IMODE(page.stat().st_mode) == 0o600
    assert "mpfa report: paper vs mpfa" in page.read_text()
    (tmp_path / "link.html").symlink_to(page)
    refused = report("--db", db, "--output", tmp_path / "link.html")
    assert refused.exit_code == 2 and "is a symbolic link" in refused.output
    assert report("--db", db, "-o", page, "--ref", "fa3-fp8").exit_code == 2  # no such backend among the runs


def test_report_takes_its_runs_from_exports_as_compare_does(tmp_path, sweep):
    exported, page = tmp_path / "runs.json", tmp_path / "report.html"
    export_runs(sweep(), "json", exported)
    result = report("--from", exported, "-o", page)
    assert result.exit_code == 0, result.output
    assert "using 8 runs of 1 export(s) (scenario paper)" in result.output
    assert page.read_text().count('<tr id="run-') == 8
    refused = report("1", "--from", exported, "-o", page)
    assert refused.exit_code == 2
    assert "--from takes the runs from the exports: drop the run ids and --db" in refused.output


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start; the page is this test's own file
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=60,
                          check=True)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt-get install chromium)")
def test_headless_chromium_renders_every_table_figure_and_run(tmp_path, sweep):
    db, page, shot = tmp_path / "r.db", tmp_path / "report.html", tmp_path / "report.png"
    runs = sweep(simulated=True, engine="sim", gpu="simulated")
    with ResultStore(db) as store:
        store.import_runs(runs)
    ids = [str(i) for i in range(1, len(runs) + 1)]  # every run, the failed one too
    assert report(*ids, "--db", db, "--output", page).exit_code == 0
    chromium(f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri(), profile=tmp_path / "profile")
    with Image.open(shot) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is None or len(colours) > 50  # text, tables, the banner and a figure, not one blank colour
    dom = chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile").stdout
    assert all(f'id="run-{i}"' in dom for i in ids)
    assert dom.count("<table") == 4 and dom.count("data:image/png;base64,") == 1 and "SIMULATED" in dom

"""Every table `bench`, `runs`, `show`, `scenarios` and `backends` print fits 80 and 100 columns without cutting a
cell short ("…"): numbers may wrap, never lose digits."""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from rich.console import Console, RenderableType

from mpfa.mpfa_cli.harness.records import RequestRecord
from mpfa.mpfa_cli.reports.tables import compare_tables, runs_table, show_run
from mpfa.mpfa_cli.results.store import StoredRun

WIDTHS = (80, 100)
BACKENDS = ("fa4-bf16", "flashinfer-fp8", "mpfa")
# Magnitudes as long runs give them: 128K-context TTFTs in ms, KV pools in tokens, CIs that are not round.
SUMMARY = {"otps": 15837.51, "ttft_ms_median": 120523.4, "ttft_ms_p99": 202713.9, "tpot_ms_median": 27.137,
           "itl_ms_p99": 1234.56, "e2e_s_mean": 158.3, "req_per_s": 0.0123, "n_ok": 16}


def _run(backend: str, repeat: int, **overrides: Any) -> StoredRun:
    scale = 1.0 + 0.37 * BACKENDS.index(backend) + 0.013 * repeat
    fields: dict[str, Any] = dict(
        scenario="serving-matrix", backend=backend, engine="sim", simulated=True, load={"concurrency": 16},
        repeat=repeat, input_len=131072, output_len=1024, num_requests=16, seed=0, workload_hash="f00d" * 16,
        started_at=1_700_000_000.0, status="ok", model="llama-3.1-8b", gpu="simulated", id=1000 + repeat,
        finished_at=1_700_000_100.0, summary={k: v * scale for k, v in SUMMARY.items()},
        server_info={"max_total_num_tokens": int(20271543 * scale)}, caveat="a caveat " * 12 if repeat else None,
        kernels={"attention_backend": "fa4", "source": "simulated"},
        backend_flags=["--attention-backend", "fa4", "--kv-cache-dtype", "fp8_e4m3", "--page-size", "128"],
    )
    fields.update(overrides)
    return StoredRun(**fields)


RUNS = [_run(b, r, id=10 * i + r) for i, b in enumerate(BACKENDS) for r in range(3)]


def _render(renderable: RenderableType, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"), color_system=None)
    console.print(renderable)
    return console.export_text()


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("table", ["compare", "runs", "show"])
def test_table_fits_without_truncation(table: str, width: int) -> None:
    run = RUNS[1]
    run.requests = [RequestRecord(0, 131072, 1024, 0.0, chunk_s=[1.0], chunk_tokens=[1024], completion_s=2.0,
                                  output_tokens=1024)]
    renderable = {"compare": lambda: compare_tables(RUNS, "fa4-bf16"), "runs": lambda: runs_table(RUNS),
                  "show": lambda: show_run(run)}[table]()
    text = _render(renderable, width)
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width
    if table == "compare":
        assert "122090 ± 3892" in text and "20535073 ± 654645" in text  # whole numbers and CIs


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", ["scenarios", "backends"])
def test_catalog_tables_fit_without_truncation(command: str, width: int) -> None:
    result = subprocess.run([sys.executable, "-m", "mpfa.mpfa_cli", command], capture_output=True, text=True,
                            env={"COLUMNS": str(width), "PATH": "/usr/bin:/bin", "TERM": "dumb"}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout, result.stdout


def test_metrics_explain_names_every_compare_label() -> None:
    from mpfa.mpfa_cli.results.metrics import registry

    result = subprocess.run([sys.executable, "-m", "mpfa.mpfa_cli", "metrics", "--explain"], capture_output=True, text=True,
                            env={"COLUMNS": "1000", "PATH": "/usr/bin:/bin", "TERM": "dumb"}, timeout=60)
    assert result.returncode == 0, result.stderr
    for key in registry.shown_in(registry.Report.COMPARE):
        assert f"{registry.column(key).label} for {key}" in result.stdout
    assert "kv_tokens (tokens; higher is better): Tokens the server's KV cache holds" in result.stdout

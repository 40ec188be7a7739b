"""`mpfa accuracy served ID`'s table fits the console: a column per backend where it fits, else a row per cell and
backend, with no name or number cut short. Checked on the committed H100 export (seven backends)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from mpfa.mpfa_cli.accuracy.served import read_export, render

EXPORT = (Path(__file__).resolve().parents[3] / "profiles" / "results"
          / "accuracy-serve-niah-qwen2.5-coder-1.5b-fa3-fa4-flashinfer-mpfa-h100.json")


def _rendered(width: int) -> list[str]:
    (exported,) = read_export(json.loads(EXPORT.read_text()))
    out = io.StringIO()
    render(exported.result, Console(file=out, width=width, force_terminal=False))
    return out.getvalue().splitlines()


@pytest.mark.parametrize("width", [100, 250])
def test_the_table_fits_and_cuts_nothing(width):
    lines = _rendered(width)
    assert all(len(line) <= width for line in lines)
    table = [line for line in lines if line.startswith(("│", "┃"))]
    assert table and not any("…" in line for line in table)
    backends = ("fa3-bf16", "mpfa+fp8", "mpfa+exact", "fa3-fp8", "mpfa-direct", "fa4-bf16", "flashinfer-fp8")
    assert all(any(b in line for line in lines) for b in backends)
    assert any("-3.8 [-7.5, -0.6]" in line for line in table)  # mpfa's pooled four-needle difference


def test_a_narrow_console_gets_a_row_per_backend_and_a_wide_one_a_column():
    narrow, wide = _rendered(100), _rendered(250)
    header = next(line for line in narrow if "task" in line and "backend" in line)
    assert "fa3-bf16" not in header  # backends are rows
    assert sum("│ flashinfer-fp8 " in line for line in narrow) == 10  # 8 cells and 2 pooled rows
    header = next(line for line in wide if "task" in line)
    assert "flashinfer-fp8" in header and "backend" not in header

"""At 80 and 100 columns, `bench --help`, `gate --help`, `runs` and `compare` cut nothing short: no '…', every option
name and default whole, no word of a run listing split over lines; `runs` lists the newest 20 unless --all. The
panels of `bench --help` and the version are read from a real `mpfa` process, the rest in this one."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperOption

from mpfa.mpfa_cli.app import app
from mpfa.mpfa_cli.results.store import ResultStore, StoredRun

WIDTHS = (80, 100)
BACKENDS = ("fa4-bf16", "flashinfer-fp8", "mpfa")
MPFA = typer.main.get_command(app)


def _options(*path: str) -> list[TyperOption]:
    command = MPFA
    for name in path:
        command = command.commands[name]
    return [p for p in command.params if isinstance(p, TyperOption)]


def _plain(text: str) -> str:
    """The help's text without the panels' borders, each line's cells joined by one space."""
    return "\n".join(" ".join(line.replace("│", " ").split()) for line in text.splitlines())


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", ["bench", "gate"])
def test_help_cuts_no_option_name_or_default(mpfa, command: str, width: int) -> None:
    result = mpfa.invoke(command, "--help", columns=width)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout, result.stdout
    assert max(map(len, result.stdout.splitlines())) <= width
    assert "<" not in result.stdout  # placeholders are words (TEXT, N, SECONDS), not <list[str]>
    words = set(_plain(result.stdout).split())
    for option in _options(command):
        # a name is whole in the help: alone, or before ',' or ' /' when its short form or negation follows it
        for name in (*option.opts, *option.secondary_opts):
            assert name in words or f"{name}," in words, (name, result.stdout)
        if option.show_default is not False and option.default not in (None, False) and not option.is_flag:
            assert f"[default: {option.default}]" in _plain(result.stdout), (option.name, result.stdout)
        elif option.is_flag and option.secondary_opts:
            shown = (option.opts if option.default else option.secondary_opts)[0].lstrip("-")
            assert f"[default: {shown}]" in _plain(result.stdout), (option.name, result.stdout)


def test_bench_help_groups_its_options_in_panels(mpfa) -> None:
    result = mpfa.run_at(80, "bench", "--help")
    panels = re.findall(r"╭─ (\w+) ─", result.stdout)
    assert panels == ["Options", "Workload", "Server", "Simulator", "Timeouts", "Output"]


def _run(backend: str, repeat: int, **overrides: Any) -> StoredRun:
    scale = 1.0 + 0.37 * BACKENDS.index(backend) + 0.013 * repeat
    summary = {"otps": 15837.51 * scale, "ttft_ms_median": 120523.4 * scale, "tpot_ms_median": 27.137 * scale,
               "ttft_ms_p99": 202713.9 * scale, "itl_ms_p99": 1234.56 * scale, "n_ok": 16}
    fields: dict[str, Any] = dict(
        scenario="serving-matrix", backend=backend, engine="sim", simulated=True, load={"concurrency": 16},
        repeat=repeat, input_len=131072, output_len=1024, num_requests=16, seed=0, workload_hash="f00d" * 16,
        started_at=1_700_000_000.0 + 10 * repeat + BACKENDS.index(backend), status="ok", model="llama-3.1-8b",
        gpu="simulated", finished_at=1_700_000_100.0, summary=summary,
        server_info={"max_total_num_tokens": int(20271543 * scale), "time_scale": 0.0001,
                     "metrics_clock": "modelled"},
    )
    fields.update(overrides)
    return StoredRun(**fields)


@pytest.fixture
def stored(mpfa) -> list[int]:
    """A 128K serving-matrix point of three backends, 3 repeats each, and 20 older runs of another point."""
    runs = [_run("fa4-bf16", 0, input_len=32768, started_at=1_600_000_000.0 + k, seed=k) for k in range(20)]
    runs += [_run(b, r) for b in BACKENDS for r in range(3)]
    with ResultStore(mpfa.db) as store:
        return [run_id for run_id, _ in store.import_runs(runs)]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", ["runs", "compare"])
def test_runs_and_compare_cut_and_split_nothing(mpfa, stored, command: str, width: int) -> None:
    result = mpfa.invoke(command, columns=width)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout, result.stdout
    assert max(map(len, result.stdout.splitlines())) <= width
    for word in ("serving-matrix", "flashinfer-fp8", "fa4-bf16"):
        assert word in result.stdout, result.stdout  # whole: not folded over two lines


def test_runs_lists_the_newest_20_unless_all_and_counts_repeats_from_1(mpfa, stored) -> None:
    listed = mpfa.invoke("runs", columns=100).stdout
    ids = [int(line.split()[0]) for line in listed.splitlines() if re.match(r"\s*\d+\s+\d\d-\d\d ", line)]
    assert ids == sorted(stored, reverse=True)[:20]
    assert "9 older run(s) not listed: --all lists every run" in listed
    every = mpfa.invoke("runs", "--all", columns=100).stdout
    assert len([line for line in every.splitlines() if re.match(r"\s*\d+\s+\d\d-\d\d ", line)]) == 29
    reps = {line.split()[8] for line in listed.splitlines() if re.match(r"\s*\d+\s+\d\d-\d\d ", line)}
    assert reps == {"1", "2", "3"}


def test_version(mpfa) -> None:
    result = mpfa("--version")
    assert result.returncode == 0 and re.fullmatch(r"mpfa \S+( \(git \w+(-dirty)?\))?\n", result.stdout), result.stdout

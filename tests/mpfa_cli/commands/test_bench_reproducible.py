"""The simulator gives the same numbers, to the last bit, whenever the same point is measured again (requests sent
at one modelled instant may reach it in either order), and bench's estimated duration is honest on it."""
from __future__ import annotations

import json
import re
import resource
import time
from pathlib import Path

import pytest

# What differs between two measurements of the same runs: when they ran, the process and the bench call.
VOLATILE = ("started_at", "finished_at", "environment", "invocation")


def _cpu_s_of_children() -> float:
    """CPU seconds of this process's children that have ended (and theirs, each reaped by its parent)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _measured(mpfa, db: Path, *args: str) -> tuple[list[dict], str, float, float]:
    """The runs' export (with requests, what differs between benches aside), bench's output, its wall time and the
    CPU time it and its servers used."""
    cpu, start = _cpu_s_of_children(), time.perf_counter()
    result = mpfa("bench", *args, "--db", str(db), timeout=180)
    took, cpu = time.perf_counter() - start, _cpu_s_of_children() - cpu
    assert result.returncode == 0, result.stderr
    export = db.with_suffix(".json")
    assert mpfa.invoke("export", "--requests", "--db", str(db), "-o", str(export)).returncode == 0
    runs = [{k: v for k, v in run.items() if k not in VOLATILE} for run in json.loads(export.read_text())["runs"]]
    return runs, result.stdout, took, cpu


@pytest.mark.parametrize("point", [
    ["--scenario", "smoke", "--backend", "mpfa,fa4-bf16"],
    # Where it was seen: eight 128K requests dispatched together, whose summary was summed in the order they ended.
    ["--scenario", "serving-matrix", "--points", "128K:c=8", "--repeats", "1", "--backend", "fa4-bf16"],
], ids=["smoke", "serving-matrix-128K-c8"])
def test_the_same_point_measured_twice_exports_the_same_numbers(mpfa, tmp_path, point):
    first, output, took, cpu = _measured(mpfa, tmp_path / "first.db", *point, "--time-scale", "1e-5")
    second, *_ = _measured(mpfa, tmp_path / "second.db", *point, "--time-scale", "1e-5")
    assert first == second
    assert all(run["requests"] and run["status"] == "ok" for run in first)
    if point[1] == "smoke":  # the estimate counts the servers' starts and every step's and request's fixed costs
        estimated = float(re.search(r"estimated duration ~(\d+) s", output).group(1))
        # at most 1.5x the time the bench took, at least the CPU time it and its servers used over 1.5 (about its
        # time on an idle machine): other work beside it (tests on other cores) stretches the one, never the other;
        # the estimate is printed in whole seconds (±0.5 s)
        assert cpu / 1.5 - 0.5 <= estimated <= took * 1.5 + 0.5, (estimated, cpu, took)

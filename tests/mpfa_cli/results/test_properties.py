"""Properties of the code that reads hostile input, over generated cases (hypothesis): a scenario, a gate baseline
and an export are either refused in one line naming the file, or read into values that every later step takes
(bounds hold, the gate judges, the store keeps and lists); a summary is finite, stored without NaN, and its
duration spans the completed requests."""
from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mpfa.mpfa_cli.results.metrics.per_request import MIN_SPAN_S, measured
from mpfa.mpfa_cli.results.metrics.summary import summarize
from mpfa.mpfa_cli.errors import UserError
from mpfa.mpfa_cli.results.export import derive_summary, read_export, run_to_dict
from mpfa.mpfa_cli.reports.gate import gate_table, read_baseline, run_gate, write_baseline
from mpfa.mpfa_cli.harness.records import RequestRecord
from mpfa.mpfa_cli.reports.tables import runs_records, runs_table, show_record
from mpfa.mpfa_cli.harness.scenario import (MAX_CONCURRENCY, MAX_INPUT_LEN, MAX_OUTPUT_LEN, MAX_RATE, MAX_REPEATS,
                                            MAX_REQUESTS, load_scenario)
from mpfa.mpfa_cli.results.store import ResultStore, StoredRun

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Any JSON (and TOML) value, hostile numbers included: huge ints, NaN, infinities, -0.0, bools where ints go.
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-3, 3) | st.floats()
           | st.sampled_from([2**63, 2**31, -1, 0, 1e308]) | st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def one_line_naming(exc: UserError, path: Path) -> bool:
    return "\n" not in str(exc) and path.name in str(exc)


def _finite_json(text: str) -> Any:
    """JSON that holds no NaN or infinity (SQLite's JSON functions reject them)."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in stored JSON: {text}")
    return json.loads(text, parse_constant=refuse)


# --- scenarios -----------------------------------------------------------------------------------------------------

SCENARIO_FIELDS = ["model", "description", "input_len", "output_len", "num_requests", "warmup_requests", "repeats",
                   "seed", "concurrency", "rate", "burstiness", "points", "unknown"]
POINT = st.fixed_dictionaries({}, optional={k: VALUES | st.integers(1, 64) for k in
                                            ("input_len", "concurrency", "rate", "num_requests", "extra\n")})
OVERRIDES = st.dictionaries(st.sampled_from(SCENARIO_FIELDS),
                            VALUES | st.integers(1, 64) | st.lists(st.integers(0, 64), max_size=3)
                            | st.lists(POINT, max_size=2), max_size=4)


@pytest.fixture(scope="module")
def scenario_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("scenario") / "hostile.toml"
    path.write_text('model = "llama-3.1-8b"\ninput_len = [256]\noutput_len = 8\nnum_requests = 4\n'
                    "concurrency = [2]\n")
    return path


@FAST
@given(overrides=OVERRIDES)
def test_a_scenario_is_refused_in_one_line_or_within_every_bound(scenario_path, overrides):
    try:
        scenario = load_scenario(str(scenario_path), overrides)
    except UserError as exc:
        assert one_line_naming(exc, scenario_path), str(exc)
        return
    points = scenario.points()
    assert points and isinstance(scenario.model, str)
    assert all(1 <= p.input_len <= MAX_INPUT_LEN and 1 <= p.num_requests <= MAX_REQUESTS for p in points)
    assert all(p.concurrency is None or 1 <= p.concurrency <= MAX_CONCURRENCY for p in points)
    assert all(p.rate is None or 0 < p.rate <= MAX_RATE for p in points)
    assert 1 <= scenario.output_len <= MAX_OUTPUT_LEN and 1 <= scenario.repeats <= MAX_REPEATS
    assert 0 <= scenario.warmup_requests <= MAX_REQUESTS and 0 < scenario.burstiness < math.inf


@FAST
@given(content=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_any_bytes_are_a_scenario_or_one_line(scenario_path, content):
    path = scenario_path.with_name("bytes.toml")
    path.write_bytes(content)
    try:
        load_scenario(str(path))
    except UserError as exc:
        assert path.name in str(exc)


# --- gate baselines ------------------------------------------------------------------------------------------------


def _summary(repeat: int) -> dict[str, float]:
    return {"otps": 1000.0 + repeat, "ttft_ms_median": 50.0 - repeat, "tpot_ms_median": 5.0}


def _run(repeat: int, **fields: Any) -> StoredRun:
    return StoredRun(scenario="paper", backend="mpfa", engine="sglang", simulated=False, load={"concurrency": 8},
                     repeat=repeat, input_len=16384, output_len=4, num_requests=3, seed=repeat, workload_hash="f00d",
                     started_at=1_700_000_000.0 + repeat, status="ok", model="llama-3.1-8b", gpu="NVIDIA H200",
                     finished_at=1_700_000_100.0 + repeat, **fields)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[dict, Path]:
    """A good baseline document (3 repeats, 3 metrics), and where to write variants of it."""
    path = tmp_path_factory.mktemp("baseline") / "hostile-baseline.json"
    write_baseline([_run(i, summary=_summary(i)) for i in range(3)], path)
    return json.loads(path.read_text()), path


def _mutated(doc: Any, data: st.DataObject) -> Any:
    """`doc` with one value somewhere inside it replaced by a hostile one, or one key dropped or added."""
    if isinstance(doc, dict) and doc and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(doc)))
        action = data.draw(st.sampled_from(["replace", "drop", "add", "descend"]))
        if action == "replace":
            return {**doc, key: data.draw(VALUES)}
        if action == "drop":
            return {k: v for k, v in doc.items() if k != key}
        if action == "add":
            return {**doc, data.draw(st.text(max_size=8)): data.draw(VALUES)}
        return {**doc, key: _mutated(doc[key], data)}
    if isinstance(doc, list) and doc:
        i = data.draw(st.integers(0, len(doc) - 1))
        return [*doc[:i], _mutated(doc[i], data), *doc[i + 1:]]
    return data.draw(VALUES)


@FAST
@given(data=st.data())
def test_a_baseline_is_refused_in_one_line_or_judged(baseline, data):
    doc, path = baseline
    path.write_text(json.dumps(_mutated(doc, data)))
    try:
        read = read_baseline(path)
    except UserError as exc:
        assert one_line_naming(exc, path), str(exc)
        return
    for entry in read.entries:
        assert isinstance(entry.n, int) and 1 <= entry.n <= MAX_REPEATS and math.isfinite(entry.mean)
        assert (entry.ci_low is None) == (entry.ci_high is None) == (entry.n == 1)
        assert entry.ci_low is None or entry.ci_low <= entry.mean <= entry.ci_high
    runs = [_run(i, summary=_summary(i), id=i + 1) for i in range(3)]
    try:
        result = run_gate(read, runs, allow_missing=True)
    except UserError:  # e.g. a baseline of another GPU or model: refused, in one line
        return
    gate_table(result)


# --- imports -------------------------------------------------------------------------------------------------------


def _request(index: int, ok: bool = True) -> RequestRecord:
    start = 0.1 * index
    if not ok:
        return RequestRecord(index, 16384, 4, start, error="HTTP 500: overloaded")
    return RequestRecord(index, 16384, 4, start, chunk_s=[start + 0.5, start + 0.52, start + 0.55],
                         chunk_tokens=[2, 1, 1], completion_s=start + 0.56, output_tokens=4, prompt_tokens=16384)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> tuple[dict, Path]:
    requests = [_request(0), _request(1), _request(2, ok=False)]
    run = _run(0, summary=summarize(requests), requests=requests, id=3, kernels={"attention_backend": "fa3"})
    path = tmp_path_factory.mktemp("export") / "hostile-export.json"
    return run_to_dict(run, include_requests=True), path


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_export_is_refused_in_one_line_or_stored_and_listed(export, data):
    run, path = export
    path.write_text(json.dumps({"runs": [_mutated(run, data)]}))
    try:
        (read,) = read_export(path)
    except UserError as exc:
        assert one_line_naming(exc, path), str(exc)
        return
    derive_summary(read)
    db = path.with_suffix(".db")
    db.unlink(missing_ok=True)
    with ResultStore(db) as store:
        store.import_runs([read])
        (stored,) = store.list_runs(with_requests=True)
    runs_table([stored])
    runs_records([stored])
    show_record(stored)


# --- summaries -----------------------------------------------------------------------------------------------------

TIMES = st.floats(0, 1e4)
GAPS = st.floats(0, 10)


@st.composite
def requests(draw: st.DrawFn) -> list[RequestRecord]:
    """Requests as the client records them: completed ones with chunks after their dispatch, failed ones (some
    never connected: dispatched at 0), warmup ones."""
    records = []
    for index in range(draw(st.integers(0, 8))):
        dispatch = draw(TIMES)
        if draw(st.integers(0, 3)) == 0:
            records.append(RequestRecord(index, 16, 4, draw(st.sampled_from([0.0, dispatch])), error="refused"))
            continue
        chunk_tokens = draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
        chunk_s = [dispatch + draw(GAPS)]
        for _ in chunk_tokens[1:]:
            chunk_s.append(chunk_s[-1] + draw(GAPS))
        records.append(RequestRecord(index, 16, sum(chunk_tokens), dispatch, warmup=draw(st.integers(0, 4)) == 0,
                                     chunk_s=chunk_s, chunk_tokens=chunk_tokens,
                                     completion_s=chunk_s[-1] + draw(GAPS), output_tokens=sum(chunk_tokens)))
    return records


@settings(max_examples=150, deadline=None)
@given(records=requests())
def test_a_summary_is_finite_and_spans_the_completed_requests(records):
    summary = summarize(records, slo={"ttft": 1000.0, "tpot": 50.0})
    ok = [r for r in measured(records) if r.ok]
    assert summary["n_ok"] + summary["n_failed"] == len(measured(records))
    assert all(math.isfinite(v) for v in summary.values()), summary
    for prefix in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_s"):
        if f"{prefix}_mean" in summary:
            assert summary[f"{prefix}_median"] <= summary[f"{prefix}_p90"] <= summary[f"{prefix}_p99"]
            assert summary[f"{prefix}_std"] >= 0
    span = max((r.completion_s for r in ok), default=0.0) - min((r.dispatch_s for r in ok), default=0.0)
    if span >= MIN_SPAN_S:
        assert summary["duration_s"] == span
        assert summary["otps"] * span == pytest.approx(sum(r.output_tokens for r in ok))
        assert summary["goodput_req_per_s"] <= summary["req_per_s"]
    else:
        assert "duration_s" not in summary and "otps" not in summary


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[ResultStore]:
    with ResultStore(tmp_path_factory.mktemp("store") / "r.db") as store:
        yield store


@settings(max_examples=60, deadline=None)
@given(summary=st.dictionaries(st.sampled_from(["otps", "ttft_ms_p99", "duration_s", "n_ok"]), st.floats()))
def test_a_stored_summary_holds_no_nan_and_reads_back_as_written(store, summary):
    run = _run(0)
    run.status = "running"
    run_id = store.begin_run(run)
    store.finish_run(run_id, "ok", summary=summary)
    with sqlite3.connect(store.path) as conn:
        _finite_json(conn.execute("SELECT summary FROM runs WHERE id = ?", (run_id,)).fetchone()[0])
    back = store.get_run(run_id).summary
    assert back.keys() == summary.keys()
    assert all(back[k] == v if math.isfinite(v) else math.isnan(back[k]) for k, v in summary.items())


@pytest.mark.parametrize("when", [-6.776804060974081e16, 1e300])
def test_an_export_whose_run_started_at_no_showable_time_is_refused(export, when):
    run, path = export
    path.write_text(json.dumps({"runs": [{**run, "started_at": when}]}))
    with pytest.raises(UserError) as refused:
        read_export(path)
    assert one_line_naming(refused.value, path) and "started_at" in str(refused.value)

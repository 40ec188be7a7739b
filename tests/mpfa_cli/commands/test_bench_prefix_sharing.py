"""`mpfa bench` on the simulator with workloads that share prefixes: the prefix cache on for them (off for every
other), the hits stored per request and shown as a hit rate, and a run flagged whose hits differ from its
workload's declaration."""
from __future__ import annotations

import json
import sqlite3
import time



def _write(tmp_path, table: str, concurrency: int = 1) -> str:
    path = tmp_path / "sharing.toml"
    path.write_text(f'model = "llama-3.1-8b"\noutput_len = 8\nwarmup_requests = 1\nconcurrency = [{concurrency}]\n'
                    f"repeats = 2\nseed = 1\n{table}")
    return str(path)



def _stored(db) -> tuple[list[sqlite3.Row], list[sqlite3.Row]]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return (conn.execute("SELECT * FROM runs ORDER BY id").fetchall(),
                conn.execute("SELECT * FROM requests WHERE warmup = 0 ORDER BY run_id, \"index\"").fetchall())
    finally:
        conn.close()


SHARED = "[shared_prefix]\ngroups = 2\nprefix_len = 300\nsuffix_len = 20\nper_group = 3\n"


def test_shared_prefix_hits_exactly_what_it_declares_on_every_repeat(mpfa, tmp_path) -> None:
    started = time.monotonic()
    result = mpfa("bench", "--scenario", _write(tmp_path, SHARED), "--backend", "mpfa,fa3-fp8", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 60
    runs, requests = _stored(mpfa.db)
    assert len(runs) == 4
    for run in runs:
        info, flags = json.loads(run["server_info"]), json.loads(run["backend_flags"])
        assert "--disable-radix-cache" not in flags and info["disable_radix_cache"] is False
        page = 128 if run["backend"] == "mpfa" else 1
        assert info["workload"] == {"kind": "shared-prefix", "prefix_cache": True, "page_size": page,
                                    "expected_cached_tokens": 2 * 2 * (300 // page * page)}
        cached = [r["cached_tokens"] for r in requests if r["run_id"] == run["id"]]
        # round-robin over the groups: each group's first request misses, the others hit its whole pages;
        # the second repeat's fresh prefixes hit nothing the first one cached
        assert cached == [0, 0] + [300 // page * page] * 4
        summary = json.loads(run["summary"])
        assert summary["cached_tokens"] == 4 * (300 // page * page)
        assert summary["hit_rate"] == 100 * summary["cached_tokens"] / (6 * 320)
    assert {row["metric"] for row in json.loads(result.stdout)} >= {"hit_rate"}
    shown = mpfa.invoke("compare", "--scenario", "sharing")
    assert shown.returncode == 0, shown.stderr
    assert "prefix hits (%)" in shown.stdout and "workload declares" not in shown.stdout


def test_a_run_whose_hits_differ_from_its_declaration_is_flagged(mpfa, tmp_path) -> None:
    # all of a group's requests at once: the later ones arrive before the first is prefilled, and miss
    result = mpfa("bench", "--scenario", _write(tmp_path, SHARED, concurrency=6), "--backend", "fa3-fp8",
                  "--repeats", "1")
    assert result.returncode == 0, result.stderr
    assert "run 1 (fa3-fp8): 0 prompt tokens hit the prefix cache, its shared-prefix workload declares 1200" \
        in result.stdout


def test_multi_turn_sends_each_answer_back_and_hits_the_history(mpfa, tmp_path) -> None:
    table = "[multi_turn]\nconversations = 2\nturns = 3\nuser_len = 40\nthink_time_s = 0.5\n"
    result = mpfa("bench", "--scenario", _write(tmp_path, table, concurrency=2), "--backend", "fa3-fp8",
                  "--repeats", "1")
    assert result.returncode == 0, result.stderr
    runs, requests = _stored(mpfa.db)
    assert [r["input_len"] for r in requests] == [40, 88, 136] * 2  # turn t: t user messages, t - 1 answers
    assert [r["cached_tokens"] for r in requests] == [0, 47, 95] * 2  # the last turn's prompt and answer but one
    assert json.loads(runs[0]["server_info"])["workload"]["expected_cached_tokens"] == 2 * (47 + 95)
    assert "workload declares" not in result.stdout


def test_plain_scenarios_run_with_the_prefix_cache_off(mpfa, scenario_file) -> None:
    result = mpfa("bench", "--scenario", str(scenario_file(repeats=2)), "--backend", "fa4-bf16")
    assert result.returncode == 0, result.stderr
    runs, requests = _stored(mpfa.db)
    for run in runs:
        assert "--disable-radix-cache" in json.loads(run["backend_flags"])
        assert json.loads(run["server_info"])["workload"]["expected_cached_tokens"] == 0
    assert {r["cached_tokens"] for r in requests} == {0}  # the second repeat's same prompts hit nothing


def test_a_trace_that_shares_blocks_runs_with_the_prefix_cache_on_and_each_repeat_misses_the_last(mpfa, tmp_path):
    lines = [{"timestamp": 0, "input_length": 700, "output_length": 4, "hash_ids": [7, 8]},
             {"timestamp": 900, "input_length": 600, "output_length": 4, "hash_ids": [7, 9]},
             {"timestamp": 1800, "input_length": 300, "output_length": 4, "hash_ids": [5]}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "trace.toml").write_text('model = "llama-3.1-8b"\ntrace = "t.jsonl"\nrepeats = 2\n'
                                         "warmup_requests = 0\nseed = 0\n")
    result = mpfa("bench", "--scenario", str(tmp_path / "trace.toml"), "--backend", "fa3-fp8,mpfa", "--real-time")
    assert result.returncode == 0, result.stderr
    runs, requests = _stored(mpfa.db)
    assert len(runs) == 4
    for run in runs:
        info = json.loads(run["server_info"])
        assert "--disable-radix-cache" not in json.loads(run["backend_flags"]) and info["disable_radix_cache"] is False
        page = 128 if run["backend"] == "mpfa" else 1
        assert info["workload"] == {"kind": "trace", "prefix_cache": True, "page_size": page,
                                    "most_cached_tokens": 512 // page * page}
        # the second request reuses block 7; the second repeat's blocks are its own, so it hits the same
        assert [r["cached_tokens"] for r in requests if r["run_id"] == run["id"]] == [0, 512 // page * page, 0]
    assert "trace's shared blocks" not in result.stdout

"""ResultStore profiles table: round trip of a real H200 profile result, listing, errors, and the upgrade of a
version-1 database (runs only) that keeps its runs (the version-2 upgrade: test_results_caveats)."""
from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import pytest

from mpfa.mpfa_cli.results.store import SCHEMA_VERSION, ResultStore, StoreError

H200_PREFILL = Path(__file__).parents[3] / "profiles" / "results" / "profile-prefill-64k-32x8-fa4-bf16-flashinfer-fp8-h200.json"


def test_a_real_profile_result_round_trips(tmp_path):
    result = json.loads(H200_PREFILL.read_text())
    with ResultStore(tmp_path / "r.db") as store:
        profile_id = store.add_profile("prefill", "NVIDIA H200", result["workload"], result, created_at=1.7e9)
    with ResultStore(tmp_path / "r.db") as store:
        back = store.get_profile(profile_id)
    assert (back.id, back.kind, back.gpu, back.created_at, back.simulated) == (
        profile_id, "prefill", "NVIDIA H200", 1.7e9, False)
    assert back.params == result["workload"] and back.result == result
    fa4 = next(row for row in back.result["backends"] if row["backend"] == "fa4-bf16")
    assert fa4["timing"]["median_ms"] == pytest.approx(57.218, abs=5e-4)  # as printed in profile-prefill-64k-32x8-fa4-bf16-flashinfer-fp8-h200.txt


def test_non_finite_numbers_are_stored_as_null(tmp_path, rng):
    values = [rng.uniform(-1e3, 1e3) for _ in range(4)]
    result = {"a": values[0], "nested": {"nan": math.nan, "list": [values[1], math.inf, (values[2], -math.inf)]},
              "b": values[3]}
    with ResultStore(tmp_path / "r.db") as store:
        back = store.get_profile(store.add_profile("decode", "gpu", {"seq": 131072}, result, simulated=True))
    assert back.result == {"a": values[0], "nested": {"nan": None, "list": [values[1], None, [values[2], None]]},
                           "b": values[3]}
    assert back.simulated is True


def test_list_newest_first_by_kind_and_limit(tmp_path, rng):
    kinds = [rng.choice(["prefill", "decode", "serving"]) for _ in range(12)]
    with ResultStore(tmp_path / "r.db") as store:
        ids = [store.add_profile(kind, "NVIDIA H200", {"i": i}, {"value": rng.random()})
               for i, kind in enumerate(kinds)]
        assert [p.id for p in store.list_profiles()] == ids[::-1]
        decode_ids = [i for i, kind in zip(ids, kinds) if kind == "decode"]
        assert [p.id for p in store.list_profiles(kind="decode")] == decode_ids[::-1]
        assert [p.id for p in store.list_profiles(limit=3)] == ids[::-1][:3]
        assert store.list_profiles(kind="characterize") == []
        with pytest.raises(StoreError, match=f"no profile with id {ids[-1] + 1} in"):
            store.get_profile(ids[-1] + 1)


def test_a_version_1_database_is_upgraded_and_keeps_its_runs(v2_database):
    with sqlite3.connect(v2_database) as conn:  # make it what mpfa wrote before profiles existed
        conn.execute("DROP TABLE profiles")
        conn.execute("PRAGMA user_version = 1")
    with ResultStore(v2_database) as store:
        assert store.get_run(1).summary == {"otps": 250.0, "ttft_ms_median": 500.0, "n_ok": 2.0}
        profile_id = store.add_profile("serving", "NVIDIA H200", {"batch": 4}, {"decode": {"gpu_us": 1.0}})
        assert store.get_profile(profile_id).params == {"batch": 4}
    with sqlite3.connect(v2_database) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION

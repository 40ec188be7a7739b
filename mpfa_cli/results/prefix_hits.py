"""Whether a run's prefix-cache hits are what its workload declares (`server_info["workload"]`, stored by the bench;
a trace declares the most its shared blocks allow): fewer mean the cache did not hold what it should (requests of a
group arrived together, eviction), more that prompts shared what they should not (a server's cache filled by an
earlier bench)."""
from __future__ import annotations

import math

from .store import StoredRun


def hits_note(run: StoredRun) -> str | None:
    """A note on a run whose measured cached tokens differ from its workload's declared ones; None where they agree
    or cannot be compared (no declaration, no count reported, failed requests)."""
    declared = (run.server_info or {}).get("workload")
    cached = run.summary.get("cached_tokens", math.nan)
    if not isinstance(declared, dict) or math.isnan(cached) or run.summary.get("n_failed", 0):
        return None
    most = declared.get("most_cached_tokens")
    if isinstance(most, int):  # a trace: requests sent before their prefix's writer is prefilled find less
        return None if cached <= most else (
            f"run {run.id} ({run.backend}): {cached:.0f} prompt tokens hit the prefix cache, more than the "
            f"{most} its trace's shared blocks hold")
    expected = declared.get("expected_cached_tokens")
    if not isinstance(expected, int) or cached == expected:
        return None
    return (f"run {run.id} ({run.backend}): {cached:.0f} prompt tokens hit the prefix cache, its {declared.get('kind')} "
            f"workload declares {expected}")


def hits_notes(runs: list[StoredRun]) -> list[str]:
    return [note for run in runs if run.status == "ok" and (note := hits_note(run)) is not None]

"""`mpfa bench --goodput-search`: per backend and input length, the highest request rate at which a share of the
requests (`mpfa bench --goodput-share`, 90% by default) meets every SLO given, found by a bounded sweep of rate-based (Poisson) load points.

As AIPerf and vLLM count goodput, a request meets the SLOs when its TTFT and its TPOT are each within their
bound; a failed request meets none. The sweep starts at `start_rate`, doubles it while the share is met (halves it
while not) until the answer is bracketed, then bisects the bracket geometrically until its ends are within
`precision` of each other; it stops after `most_probes` points whatever it has found. Each probe is a stored run,
with goodput in its summary; the answer is the highest rate that met the share (None if none did).
"""
from __future__ import annotations

import json
import math
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.table import Table

from ...backends.specs import BackendSpec
from ..harness.records import RequestRecord
from ..harness.scenario import MAX_RATE, LoadPoint, Scenario
from ..results.metrics.per_request import meets_slo

if TYPE_CHECKING:
    from .runner import Steps

MAX_PROBES = 64
PRECISION = 0.1  # bisect until the failing rate is within 10% of the passing one
MIN_RATE = 1e-3  # requests/s: below it a probe of a few requests lasts hours


def share_meeting(records: list[RequestRecord], slo: dict[str, float]) -> float:
    """The share of `records` that succeeded within every SLO (ms)."""
    if not records:
        return 0.0
    return sum(1 for r in records if r.ok and meets_slo(r, slo)) / len(records)


@dataclass
class GoodputResult:
    backend: str
    input_len: int
    rate: float | None  # the highest probed rate whose share met the target; None: none did
    probes: list[tuple[float, float]] = field(default_factory=list)  # (rate, share meeting the SLOs), in order


@dataclass
class GoodputSearch:
    """The sweep's settings; `steps` drives one backend's probes, and `results` collects each search's answer."""

    scenario: Scenario
    slo: dict[str, float]  # ms
    share: float  # of the measured requests, that must meet every SLO
    most_probes: int  # per backend and input length
    results: list[GoodputResult] = field(default_factory=list)

    @property
    def start_rate(self) -> float:
        """The scenario's lowest rate, else 1 request/s."""
        return min(self.scenario.rate, default=1.0)

    def steps(self, spec: BackendSpec) -> Steps:
        """Every input length's sweep for the backend, warmup before each's first probe."""
        for input_len in self.scenario.input_len:
            result = GoodputResult(spec.name, input_len, None)
            self.results.append(result)
            rates = next_rates(self.start_rate, self.most_probes)
            rate = next(rates)
            while rate is not None:
                point = LoadPoint(input_len=input_len, num_requests=self.scenario.num_requests, rate=rate,
                                  burstiness=self.scenario.burstiness)
                warmup = self.scenario.warmup_requests if not result.probes else 0
                share = share_meeting((yield point, 0, warmup), self.slo)
                result.probes.append((rate, share))
                if share >= self.share:
                    result.rate = max(rate, result.rate or 0.0)
                rate = rates.send(share >= self.share)


def next_rates(start: float, most_probes: int) -> Generator[float | None, bool, None]:
    """The sweep's rates: yields one, is sent whether it met the share, yields the next (None once done)."""
    passed, failed = 0.0, math.inf  # the highest passing and lowest failing rates so far
    rate = start
    for _ in range(most_probes):
        if (yield rate):
            passed = rate
        else:
            failed = rate
        if failed == math.inf:
            rate = min(rate * 2, MAX_RATE)
        elif passed == 0.0:
            rate = rate / 2
        else:
            rate = float(f"{math.sqrt(passed * failed):.3g}")  # a rate a label shows in full
        if failed / max(passed, MIN_RATE) <= 1 + PRECISION or rate < MIN_RATE or rate in (passed, failed):
            break
    yield None


def _slo_text(slo: dict[str, float]) -> str:
    return ",".join(f"{key}={value:g}ms" for key, value in slo.items())


def goodput_table(search: GoodputSearch) -> Table:
    """Each search's answer: the highest rate meeting the SLOs, and the probes that found it."""
    table = Table(title=f"Goodput search: highest rate at which >= {search.share:.0%} of requests meet "
                        f"{_slo_text(search.slo)}", title_justify="left")
    for column in ("backend", "input", "goodput rate (req/s)", "probes: rate (share meeting)"):
        table.add_column(column, justify="right" if column == "goodput rate (req/s)" else "left")
    for result in search.results:
        probes = ", ".join(f"{rate:.3g} ({share:.0%})" for rate, share in result.probes)
        table.add_row(result.backend, str(result.input_len),
                      "none probed" if result.rate is None else f"{result.rate:.3g}", probes)
    return table


def goodput_json(search: GoodputSearch) -> str:
    return json.dumps([{"backend": r.backend, "input_len": r.input_len, "slo_ms": search.slo,
                        "share": search.share, "rate": r.rate,
                        "probes": [{"rate": rate, "share_meeting": share} for rate, share in r.probes]}
                       for r in search.results], indent=2) + "\n"

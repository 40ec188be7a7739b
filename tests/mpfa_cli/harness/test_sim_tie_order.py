"""Requests that arrive at one modelled instant are scheduled alike whichever reaches the simulator first."""
from __future__ import annotations

import asyncio

from mpfa.backends.specs import BACKENDS
from mpfa.mpfa_cli.harness.latency_model import LatencyModel
from mpfa.mpfa_cli.harness.sim_server import BatchScheduler, LoadHint, SimRequest, load_model_shape, prompt_digest


def _modelled_times(prompts: list[list[int]]) -> dict[str, list[float]]:
    """Each prompt's modelled token times when the prompts are submitted together in this order; one request runs
    at a time, so the first admitted finishes first."""
    async def serve() -> dict[str, list[float]]:
        scheduler = BatchScheduler(LatencyModel(BACKENDS["mpfa"].sim, load_model_shape("llama-3.1-8b")), 1e-6,
                                   max_running=1)
        scheduler.set_hint(LoadHint(expected=len(prompts), requests=len(prompts)))
        requests = [SimRequest(str(i), len(p), [1, 2, 3], 0.0, prompt_digest(p)) for i, p in enumerate(prompts)]
        for request in requests:
            scheduler.submit(request)
        task = asyncio.create_task(scheduler.run())
        while not all(r.finished for r in requests):
            await asyncio.sleep(0.001)
        task.cancel()
        return {r.digest: r.token_v for r in requests}
    return asyncio.run(serve())


def test_the_order_in_which_simultaneous_requests_arrive_changes_no_time():
    prompts = [[7] * 64, [9] * 64, [11] * 64]
    times = _modelled_times(prompts)
    assert len({tuple(t) for t in times.values()}) == 3  # one at a time: each request's times are its own
    assert _modelled_times(prompts[::-1]) == times == _modelled_times(prompts[1:] + prompts[:1])

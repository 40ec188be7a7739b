"""The exact prefill kernel (`prefill_exact`) on the GPU: against the oracle of its numerics (``mpfa`` with 64-key
tiles, the kernel's) and the float64 reference (test_prefill_gpu's inputs and checks, loaded from that file), and
against the mma-sync kernel on the same inputs: the paper's numerics on 32-key tiles, so the difference may not
exceed what the tile size alone explains (the distance between the oracles with 32- and 64-key tiles) by more than
10% + the summation-order allowance (``ORDER_SLACK``: its oracle's rms bound, twice, as Delta_S enters last here
and first there), in rms and in max |diff|.

Cases, GQA 32:8 and 40:8 (a warpgroup: 4 heads x 16 rows, or 1 head x 64 rows): causal and non-causal, chunked
prefill (q_len < kv_len), ragged lengths (not multiples of 64 or 16), pages of 64 and 128, a single-token sequence,
a long case where the ring wraps many times, CTAs whose later warpgroup lies past the sequence's queries and CTAs
whose first causal tile only the later warpgroup sees (the earlier one skips it).

    pytest -q -m gpu tests/kernels/sm90/test_prefill_exact_gpu.py -x
"""

from __future__ import annotations

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


prefill_tests = load("test_prefill_gpu.py", "_prefill_gpu_exact")

ORDER_SLACK = 2e-3  # summation-order allowance on top of the tile-size difference
CASES = [  # (q_lens, kv_lens, page size, causal)
    ([1, 77, 300], [1, 77, 420], 128, True),  # a single token, ragged, one chunked prefill
    ([77, 129, 1], [77, 300, 33], 128, False),  # non-causal, chunked
    ([1000, 555, 17], [1000, 2100, 17], 128, True),  # ~33 tiles per CTA: the ring wraps many times
    ([250, 97], [250, 400], 64, False),  # page 64 (one tile per page), non-causal
    ([17, 48, 1, 95], [500, 48, 1, 95], 64, True),  # page 64, short rows, chunked
    ([95, 33, 47], [130, 33, 47], 128, False),  # lengths off every tile size
    ([64, 128, 200], [64, 192, 200], 64, True),  # lengths on and off 64-key tiles, page 64
    ([40, 100, 33], [80, 110, 300], 64, True),  # offsets 40, 10, 267 (first tiles one warpgroup skips)
]
IDS = ["causal-chunked", "noncausal-chunked", "long-chunked", "page64-noncausal", "page64-short-chunked",
       "noncausal-ragged", "page64-tile-edges", "page64-warpgroup-skips"]
# GQA 40:8 (a CTA: 128 rows): CTAs whose later warpgroup lies past the queries (q_len % 128 in 1..64: 100, 150) and
# whose last causal tile only the later warpgroup sees (offsets 40, 60)
GROUP5_SKIPS = ([100, 150, 200], [140, 150, 260], 64, True)
SHAPES = [(32, *case) for case in CASES] + [(40, *case) for case in CASES] + [(40, *GROUP5_SKIPS)]
SHAPE_IDS = [f"32:8-{name}" for name in IDS] + [f"40:8-{name}" for name in IDS] + ["40:8-page64-warpgroup-skips-128"]


@pytest.mark.parametrize("group", [1, 2, 3, 6, 7, 8])
def test_other_gqa_groups_match_their_oracle(gen, group):
    """GQA groups other than 4 and 5 (a CTA of 1, 2 or 4 of the group's heads)."""
    problem = prefill_tests._problem(gen, [300, 129], [700, 129], 8 * group, 8, 128)
    prefill_tests.run_against_oracle(problem, True, "exact")


@pytest.mark.parametrize("hq,q_lens,kv_lens,page_size,causal", SHAPES, ids=SHAPE_IDS)
def test_exact_matches_its_oracle_and_the_mma_sync_kernel(gen, hq, q_lens, kv_lens, page_size, causal):
    problem = prefill_tests._problem(gen, q_lens, kv_lens, hq, 8, page_size)
    out, expected = prefill_tests.run_against_oracle(problem, causal, "exact")
    mma_sync = prefill_tests._run(problem, causal, kernel="mma-sync")
    tiling = prefill_tests.oracle(problem, causal, "mma-sync")  # what the tile size alone changes
    scale = float(expected.abs().max())
    assert prefill_tests._rms_ratio(out, mma_sync) <= 1.1 * prefill_tests._rms_ratio(expected, tiling) + ORDER_SLACK
    assert prefill_tests._max_diff(out, mma_sync) <= 1.1 * prefill_tests._max_diff(expected, tiling) + 0.02 * scale

"""The wgmma prefill (v3, `prefill_wgmma`, and v3w8, its 2-warpgroup CTA) on the GPU: the oracle with v3's
tiling, v1, and the float64 reference; v3w8 against v3, bit for bit.

v3 walks 64-key tiles (v1 / v2: 32), so its online softmax sees a different running max at each key and quantizes
P = e4m3(448 P) from different values: it is `reference.attention(..., block_n=64)`'s computation, not v1's, and
equals that oracle up to FP32 summation order (the FP16 / e4m3 products are exact, only the order of the FP32 sums
differs; a sum that moves a P across an e4m3 rounding boundary moves it by one e4m3 step, hence tolerances rather
than equality). The checks, per case:

* against the oracle with 64-key tiles: test_prefill_gpu's ``_check`` (every output finite, so NaN-poisoned rows
  left unwritten fail; rms ratio <= 1e-3, max |diff| <= 2% of max |O|, and no further from the float64 reference
  than the oracle is, + 1%);
* against v1 (same inputs, same launch): the difference may not exceed what the tile size alone explains, the
  distance between the oracles with 32- and 64-key tiles, by more than 10% + the summation-order allowance
  (``V1_SLACK``), in rms and in max |diff|;
* v3w8 against v3: equal bit for bit (each warpgroup runs v3's arithmetic on v3's tiles in v3's order; only which
  threads copy and expand K / V differs).

Inputs are test_prefill_gpu's (loaded from that file): fresh random non-zero BF16 Q/K/V through the Triton KV
write into a NaN-poisoned paged cache behind a shuffled page table, NaN-poisoned outputs. GQA 32:8; causal and
non-causal, chunked prefill (q_len < kv_len), ragged lengths (not multiples of 64 or 16), pages of 64 and 128, a single-token sequence, and a long case where the ring wraps many times; for v3w8, CTAs
whose later warpgroup lies past the sequence's queries (q_len % 32 in 1..16) and CTAs whose first causal tile
only the later warpgroup sees (offset kv_len - q_len % 32 in 1..16: the earlier one skips it). Every case also at
GQA 40:8 (a warpgroup: 1 head x 64 rows), plus the same two v3w8 situations at its 128-row CTA.

    pytest -q -m gpu tests/kernels_sm90/test_prefill_wgmma_gpu.py -x
"""

from __future__ import annotations

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


v1_tests = load("test_prefill_gpu.py", "_prefill_gpu_v1")

V3_TILE_KEYS = 64
V1_SLACK = 1e-3  # summation-order allowance on top of the tile-size difference (the oracle check's rms bound)
CASES = [  # (q_lens, kv_lens, page size, causal), GQA 32:8
    ([1, 77, 300], [1, 77, 420], 128, True),  # v1's first case: a single token, ragged, one chunked prefill
    ([77, 129, 1], [77, 300, 33], 128, False),  # non-causal, chunked
    ([1000, 555, 17], [1000, 2100, 17], 128, True),  # ~33 tiles per CTA: the ring wraps many times
    ([250, 97], [250, 400], 64, False),  # page 64 (one tile per page), non-causal
    ([17, 48, 1, 95], [500, 48, 1, 95], 64, True),  # page 64, short rows, chunked
    ([95, 33, 47], [130, 33, 47], 128, False),  # lengths off every tile size
    ([64, 128, 200], [64, 192, 200], 64, True),  # lengths on and off 64-key tiles, page 64
    ([40, 100, 33], [80, 110, 300], 64, True),  # v3w8: offsets 40, 10, 267 (first tiles one warpgroup skips)
]
IDS = ["causal-chunked", "noncausal-chunked", "long-chunked", "page64-noncausal", "page64-short-chunked",
       "noncausal-ragged", "page64-tile-edges", "page64-warpgroup-skips"]
# GQA 40:8 (a warpgroup = 1 head x 64 rows, a v3w8 CTA 128 rows): CTAs whose later warpgroup lies past the queries
# (q_len % 128 in 1..64: 100, 150) and whose last causal tile only the later warpgroup sees (offsets 40, 60)
GROUP5_SKIPS = ([100, 150, 200], [140, 150, 260], 64, True)
SHAPES = ([(32, *case) for case in CASES] + [(40, *case) for case in CASES] + [(40, *GROUP5_SKIPS)])
SHAPE_IDS = [f"32:8-{name}" for name in IDS] + [f"40:8-{name}" for name in IDS] + ["40:8-page64-warpgroup-skips-128"]
KERNELS = ["v3", "v3w8"]


def _oracle(problem, causal: bool, block_n: int, sm_scale: float | None = None) -> torch.Tensor:
    return v1_tests.attention(**problem.reference_inputs, variant="mpfa", causal=causal, block_m=64,
                              block_n=block_n, sm_scale=sm_scale)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("hq,q_lens,kv_lens,page_size,causal", SHAPES, ids=SHAPE_IDS)
def test_wgmma_matches_oracle_and_v1(gen, kernel, hq, q_lens, kv_lens, page_size, causal):
    problem = v1_tests._problem(gen, q_lens, kv_lens, hq, 8, page_size)
    out = v1_tests._run(problem, causal, kernel=kernel)
    expected = _oracle(problem, causal, V3_TILE_KEYS)
    _, exact = v1_tests._expected(problem, causal)
    v1_tests._check(out, expected, exact)

    v1 = v1_tests._run(problem, causal, kernel="v1")
    tiling = _oracle(problem, causal, v1_tests.TILE_KEYS)  # v1's oracle: what the tile size alone changes
    scale = float(expected.abs().max())
    assert v1_tests._rms_ratio(out, v1) <= 1.1 * v1_tests._rms_ratio(expected, tiling) + V1_SLACK
    assert _max_diff(out, v1) <= 1.1 * _max_diff(expected, tiling) + 0.02 * scale
    # Repeatable, and the launch with the longest query length given computes the same.
    assert torch.equal(v1_tests._run(problem, causal, kernel=kernel, max_seqlen_q=max(q_lens)), out)
    if kernel != "v3":  # v3w8: v3's output, bit for bit
        v3 = v1_tests._run(problem, causal, kernel="v3")
        assert torch.equal(out, v3), f"{kernel} differs from v3 (max |diff| {_max_diff(out, v3)})"


@pytest.mark.parametrize("kernel", KERNELS)
def test_wgmma_bf16_output_through_the_switch(gen, monkeypatch, kernel):
    """``MPFA_PREFILL_KERNEL=v3`` (``v3w8``) selects it when ``kernel`` is not given; BF16 output, another
    sm_scale."""
    from mpfa.kernels.sm90 import prefill_launch

    problem = v1_tests._problem(gen, [150, 33], [150, 200], 32, 8, 128)
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, kernel)
    out = v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05)
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    expected = _oracle(problem, True, V3_TILE_KEYS, sm_scale=0.05)
    assert v1_tests._rms_ratio(out.float(), expected) <= 4e-3  # + BF16 output rounding (2**-9)
    if kernel != "v3":
        assert torch.equal(out, v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05, kernel="v3"))


@pytest.mark.parametrize("kernel", KERNELS)
def test_wgmma_refuses_other_groups(gen, kernel):
    problem = v1_tests._problem(gen, [40], [40], 48, 8, 128)
    with pytest.raises(ValueError, match="group 4 or 5 only"):
        v1_tests._run(problem, True, kernel=kernel)

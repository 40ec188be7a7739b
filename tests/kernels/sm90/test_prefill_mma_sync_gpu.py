"""The mma-sync prefill kernel (`prefill_mma_sync`) on the GPU, against the oracle of its numerics (``mpfa`` with
32-key tiles) and the float64 reference: test_prefill_gpu's inputs and checks (loaded from that file). Cases: GQA
32:8 and 40:8, causal / chunked / non-causal, pages of 128, 64 and 32, ragged lengths; long ones where the ring
wraps many times and CTAs of one launch walk very different numbers of tiles; short ones where the row blocks of a
40:8 CTA (one head x 4 blocks of 16 rows) have different diagonals or lie past the sequence; and the shapes only
this kernel takes: an odd number of query heads (5:1, Qwen3-14B at tensor parallelism 8; 3:3, GQA group 1) and GQA
groups 3 and 6.

    pytest -q -m gpu tests/kernels/sm90/test_prefill_mma_sync_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


prefill_tests = load("test_prefill_gpu.py", "_prefill_gpu_mma_sync")

CASES = [  # (q_lens, kv_lens, Hq, Hkv, page size, causal)
    ([1, 77, 300], [1, 77, 420], 32, 8, 128, True),  # Llama-3.1-8B heads; odd lengths; one chunked prefill
    ([300, 45], [300, 1000], 40, 8, 128, True),  # Qwen3-14B heads; a 45-token chunk after 955 cached tokens
    ([77, 129, 1], [77, 300, 33], 32, 8, 128, False),  # non-causal
    ([200, 64], [257, 64], 40, 8, 64, False),  # page 64, non-causal
    ([1000, 555, 17], [1000, 2100, 17], 32, 8, 128, True),  # ~66 tiles per CTA: the ring wraps many times
    ([333, 129], [900, 129], 40, 8, 64, True),  # GQA 5, page 64, chunked
    ([640, 1, 130], [700, 1, 130], 40, 8, 128, False),  # GQA 5 non-causal, a single-token sequence
    ([17, 48, 1, 95], [500, 48, 1, 95], 40, 8, 64, True),  # row blocks with different diagonals, or none
    ([95, 33, 47], [130, 33, 47], 32, 8, 32, False),  # pages of 32 keys, lengths off every tile size
    ([300, 77, 1], [420, 77, 1], 5, 1, 128, True),  # 5:1: an odd number of query heads
    ([129, 40], [129, 300], 5, 1, 32, False),  # 5:1, pages of 32, non-causal
    ([64, 200], [64, 333], 3, 3, 64, True),  # 3:3: GQA group 1, odd Hq
    ([150, 33], [400, 33], 24, 8, 64, True),  # GQA group 3
    ([130, 17], [200, 17], 48, 8, 128, False),  # GQA group 6
]
IDS = ["32x8-causal", "40x8-causal-chunked", "32x8-noncausal", "40x8-page64-noncausal", "32x8-long-chunked",
       "40x8-page64-chunked", "40x8-noncausal-ragged", "40x8-page64-short-rowblocks", "32x8-page32-noncausal",
       "5x1-causal", "5x1-page32-noncausal", "3x3-page64-causal", "24x8-page64-causal", "48x8-noncausal"]


@pytest.mark.parametrize("q_lens,kv_lens,num_q_heads,num_kv_heads,page_size,causal", CASES, ids=IDS)
def test_mma_sync_matches_its_oracle(gen, q_lens, kv_lens, num_q_heads, num_kv_heads, page_size, causal):
    problem = prefill_tests._problem(gen, q_lens, kv_lens, num_q_heads, num_kv_heads, page_size)
    prefill_tests.run_against_oracle(problem, causal, "mma-sync")

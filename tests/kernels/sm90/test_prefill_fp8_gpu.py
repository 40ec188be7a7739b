"""The fp8 prefill kernel (`prefill_fp8` on the operand images of `prefill_fp8_pass`) on the GPU: against the oracle
of its numerics (`reference.attention(..., variant="mpfa-qk8tile-psum", block_n=128)`: Q and K requantized to e4m3
with power-of-two scales per query row and per 64-key tile, P against the maximum over the sequence's 128-key tiles,
l the sum of the e4m3 P) and the float64 reference, with test_prefill_gpu's inputs, checks and bounds (loaded from
that file). A difference beyond the bounds on a case that passes elsewhere is a synchronisation bug (a stage read
before its image landed, or refilled before both consumers released it), and a hang a deadlock of the ``full`` /
``empty`` mbarriers (`prefill_fp8`'s module docstring).

Cases: GQA 32:8 and 40:8 (a consumer warpgroup: 4 heads x 16 rows, or 1 head x 64 rows, each warp masking with its
own rows; the operand pass stages all 5 heads' Delta_S at 40:8), causal and non-causal, chunked prefill, ragged
lengths off 64 / 128 (odd and even walks: a walk's lone first 64-key step), pages of 64 and 128, a warpgroup whose
rows see no key of a step's first tile, and a long causal batch whose CTAs walk ~70 tiles (the 8 operand stages wrap
many times, every SM holds one CTA); the images sized from the host's lengths (``seq_lens_k_host``) on a page table
wider than the batch needs.

    pytest -q -m gpu tests/kernels/sm90/test_prefill_fp8_gpu.py -x
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


prefill_tests = load("test_prefill_gpu.py", "_prefill_gpu_fp8")
exact_tests = load("test_prefill_exact_gpu.py", "_prefill_exact_gpu_fp8")

LONG_CAUSAL_BATCH = ([4500, 3001, 64], [4500, 3300, 4000], 128, True)  # ~70 tiles per CTA


@pytest.mark.parametrize("num_q_heads,q_lens,kv_lens,page_size,causal",
                         [*exact_tests.SHAPES, (32, *LONG_CAUSAL_BATCH)],
                         ids=[*exact_tests.SHAPE_IDS, "32:8-long-causal-batch"])
def test_fp8_matches_its_oracle(gen, num_q_heads, q_lens, kv_lens, page_size, causal):
    problem = prefill_tests._problem(gen, q_lens, kv_lens, num_q_heads, 8, page_size)
    prefill_tests.run_against_oracle(problem, causal, "fp8")


OTHER_GROUPS = [1, 2, 3, 6, 7, 8]
OTHER_GROUP_CASES = [([300, 129], [700, 129], True), ([200], [200], False)]  # chunked causal + whole; non-causal


@pytest.mark.parametrize("q_lens,kv_lens,causal", OTHER_GROUP_CASES, ids=["chunked-causal", "non-causal"])
@pytest.mark.parametrize("group", OTHER_GROUPS, ids=[f"{8 * g}:8" for g in OTHER_GROUPS])
def test_other_gqa_groups_match_their_oracle(gen, group, q_lens, kv_lens, causal):
    """GQA groups other than 4 and 5: a CTA then holds gcd(group, 4) heads (2 at groups 2 and 6, 4 of 8 at group 8:
    new row-to-head maps and Delta_S offsets)."""
    problem = prefill_tests._problem(gen, q_lens, kv_lens, 8 * group, 8, 128)
    prefill_tests.run_against_oracle(problem, causal, "fp8")


def test_images_sized_from_the_host_lengths(gen):
    """With ``seq_lens_k_host`` the images hold exactly the sequences' tiles (no slack behind the last sequence's
    last tile of the last KV head) and the pass's grid the longest sequence's: the output of the images sized from
    the page table, bit for bit, on a ragged batch whose page table is wider than its longest sequence needs (the
    images of tiles past a sequence's end are never read), within the oracle's bounds."""
    q_lens, kv_lens = [300, 64, 1, 700], [300, 2000, 129, 700]
    problem = prefill_tests._problem(gen, q_lens, kv_lens, 32, 8, 128)
    spare = torch.zeros((len(kv_lens), 16), dtype=torch.int32, device="cuda")  # 16 pages more than any needs
    problem = dataclasses.replace(problem, page_table=torch.cat([problem.page_table, spare], dim=1))
    out, _ = prefill_tests.run_against_oracle(problem, True, "fp8", seq_lens_k_host=kv_lens)
    assert torch.equal(out, prefill_tests._run(problem, True, kernel="fp8"))

"""The warp-specialized prefill (v6, `prefill_wgmma_ws`) on the GPU: against the oracle of its numerics
(`reference.attention(..., variant="mpfa-qk8tile", block_n=64)`, v5's bounds), the float64 reference, and v5w8 --
bit for bit, because each consumer warpgroup runs v5's tile body (the same traced code: QK, Delta_S after the MMA,
online softmax, P packing, PV into a fresh accumulator added to O) on v5w8's tiles in v5w8's order, on K / V^T
operand tiles that the producer fills with v5's expansion and transpose code. Only who writes the operand tiles and
when changes; a difference means a synchronisation bug (a stage consumed before it was filled or refilled before
it was consumed), not numerics. Outputs are NaN-poisoned before each launch (`v1_tests._run`), so rows left
unwritten fail; inputs are fresh random problems (the session's generator). Cases: v3's (causal / non-causal,
ragged batches, chunked prefill, lengths off 64 / 128, pages of 64 and 128, a warpgroup skipping leading tiles,
~33 tiles per CTA), the direct build against v5w8's direct build, BF16 output through ``MPFA_PREFILL_KERNEL``, and
a longer causal batch whose CTAs walk ~70 tiles (the 8-stage ring and both operand stages wrap many times, every
SM holds one CTA) against v5w8 only. A hang in any of them is a deadlock (see the module docstring of
`prefill_wgmma_ws`: mbarrier phases and arrival counts).

The variants (`prefill_launch.WS_KERNELS`, profiles/NOTES.md "Prefill v6 variants") on v3's cases and the long
batch, each against the oracle bounds and against v6:

* v6a (one ``m64n128k32`` PV wgmma) and v6c (table look-up K expansion): v6's output bit for bit. v6c writes the
  same K bytes (proved on the CPU, `test_prefill_v6_compile.py`); v6a assumes the FP8 wgmma forms an output
  element the same way whatever the instruction's N -- a difference in v6a alone says it does not (then v6a is
  still right if it meets the oracle bounds), a difference in v6c is a bug.
* v6b (O = O alpha + P V in one FFMA) rounds O alpha once instead of twice on tiles where a row's maximum moved:
  within 4e-6 rms of v6 (FP32 output), not bit for bit; v6d = v6b bit for bit (only the producer differs).
* v6e (scores and Delta_S unscaled, lam 2**-7): v6d bit for bit (the softmax sees the same real numbers).
* v6g (v6e with two producer warpgroups sharing each tile's copies and expansion) and v6h (v6g with 3 operand
  stages): v6e bit for bit.
* v6i (v6e with FA3's intra-warpgroup overlap: QK of tile p and PV of tile p - 1 in flight together; 3 operand
  stages, a stage released one step later): v6e bit for bit; a hang is a deadlock of the later release.
* v6f (v6e with the consumers' QK ping-pong, named barriers 4 / 5): v6e bit for bit; a hang is a deadlock of the
  ping-pong protocol (`prefill_wgmma_ws.PrefillSm90WgmmaWsPingPong`), so run it under a timeout.
* v6j (v6e with PV folded into O every second tile: a pair's P V summed by the FP8 wgmma over 128 keys instead of
  64): within v5's allowance for PV on FP8 (rms 1e-3, max 1% of max |O|) of v6e, and the oracle's bounds widened by
  the same allowance; v6k (v6j with P's 448 in the exponent: P' = 448.00016 P) within 1e-4 rms and 0.2% max of v6j
  (only an e4m3 rounding of P' within ~4e-7 of a tie can differ); v6l (v6k's numerics on 128-key consumer steps: P
  against the maximum over the sequence's 128-key tile, rounded to e4m3 there) against the oracle with block_n 128
  (`softmax_keys`) and within `P_AT_128_KEYS` of v6k. The cases' walks have odd and even lengths (v6l's lone first
  step) and causal CTAs whose earlier consumer sees no key of a pair's first tile.
  v6m (v6l with two producer warpgroups, each thread staging one key's Delta_S): v6l bit for bit. v6n (v6l with the
  row sums on the PV wgmma): against its own oracle (``mpfa-qk8tile-psum``, l summing the e4m3 P) with v6l's slack,
  and within `PSUM_FROM_FP32_SUMS` of v6l.

    pytest -q -m gpu tests/kernels_sm90/test_prefill_v6_gpu.py -x
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from siblings import load

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


v5_tests = load("test_prefill_v5_gpu.py", "_prefill_v5_gpu_v6")
v4_tests, v3_tests, v1_tests = v5_tests.v4_tests, v5_tests.v3_tests, v5_tests.v1_tests

RMS, MAX = v5_tests.RMS, v5_tests.MAX  # v5's bounds from the oracle (the same arithmetic)
CASES, IDS = v3_tests.CASES, v3_tests.IDS


def _same(out: torch.Tensor, reference: torch.Tensor, name: str) -> None:
    assert torch.equal(out, reference), f"v6 differs from {name} (max |diff| {v3_tests._max_diff(out, reference)})"


@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", CASES, ids=IDS)
def test_v6_matches_oracle_and_v5w8(gen, q_lens, kv_lens, page_size, causal):
    problem = v1_tests._problem(gen, q_lens, kv_lens, 32, 8, page_size)
    out, _ = v4_tests.run_against_oracle(problem, causal, "v6", RMS, MAX)
    _same(out, v1_tests._run(problem, causal, kernel="v5w8"), "v5w8")
    _same(v1_tests._run(problem, causal, kernel="v6", max_seqlen_q=max(q_lens)), out, "itself (a second launch)")


@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", CASES[:3], ids=IDS[:3])
def test_v6_direct_matches_v5w8_direct(gen, q_lens, kv_lens, page_size, causal):
    """``compensate=False`` (no Delta_S copied or read): v5w8's direct build, bit for bit."""
    problem = v1_tests._problem(gen, q_lens, kv_lens, 32, 8, page_size)
    out = v1_tests._run(problem, causal, kernel="v6", compensate=False)
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    _same(out, v1_tests._run(problem, causal, kernel="v5w8", compensate=False), "v5w8 direct")


def test_v6_long_causal_batch_matches_v5w8(gen):
    """~70 tiles per CTA, more CTAs than SMs: the ring and the operand stages wrap many times in every CTA."""
    problem = v1_tests._problem(gen, [4500, 3001, 64], [4500, 3300, 4000], 32, 8, 128)
    out = v1_tests._run(problem, True, kernel="v6")
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    _same(out, v1_tests._run(problem, True, kernel="v5w8"), "v5w8")


def test_v6_bf16_output_through_the_switch(gen, monkeypatch):
    """``MPFA_PREFILL_KERNEL=v6`` selects it when ``kernel`` is not given; BF16 output, another sm_scale."""
    from mpfa.kernels.sm90 import prefill_launch

    problem = v1_tests._problem(gen, [150, 33], [150, 200], 32, 8, 128)
    monkeypatch.setenv(prefill_launch.KERNEL_ENV, "v6")
    out = v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05)
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    expected = v4_tests._oracle(problem, True, sm_scale=0.05)
    assert v1_tests._rms_ratio(out.float(), expected) <= RMS + 2**-9  # + BF16 output rounding
    _same(out, v1_tests._run(problem, True, torch.bfloat16, sm_scale=0.05, kernel="v5w8"), "v5w8")


def test_v6_refuses_other_groups(gen):
    problem = v1_tests._problem(gen, [40], [40], 40, 8, 128)
    with pytest.raises(ValueError, match="group 4 only"):
        v1_tests._run(problem, True, kernel="v6")


VARIANTS = ("v6a", "v6b", "v6c", "v6d", "v6e", "v6f", "v6g", "v6h", "v6i", "v6j", "v6k", "v6l", "v6m", "v6n")
SAME_AS = {"v6a": "v6", "v6c": "v6", "v6d": "v6b", "v6e": "v6d", "v6f": "v6e", "v6g": "v6e",
           "v6h": "v6e", "v6i": "v6e", "v6m": "v6l"}  # bit for bit; v6b: close to v6
FOLD_RMS = 4e-6  # v6b from v6: O alpha rounded once instead of twice on the rescaled tiles (FP32 output)
# v6n from v6l: l sums the e4m3 P instead of the FP32 P. Their reference variants on these tests' inputs are 3-7e-3
# rms and under 2.5% of max |O| apart (test_qk8_variants.test_psum_moves_o_by_the_fp8_roundings_of_p); plus v5's
# allowance for the FP8 wgmma's sums
PSUM_FROM_FP32_SUMS = (1e-2, 0.04)
# v6l from v6k: P rounded to e4m3 against the maximum over the 128-key tile instead of 64 keys (v6l's oracle, the
# reference with block_n 128, rounds it as v6l does); the reference with block_n 64 and 128 is 2e-3 to 1e-2 rms apart
# on these tests' inputs (test_qk8_variants.test_128_key_softmax_tiles_with_64_key_k_scales): 3x its upper end
P_AT_128_KEYS = (3e-2, 0.04)
CLOSE_TO = {"v6j": ("v6e", v5_tests.PV8_RMS, v5_tests.PV8_MAX),  # (kernel, rms, max fraction of max |O|)
            "v6k": ("v6j", 1e-4, 0.002), "v6l": ("v6k", *P_AT_128_KEYS), "v6n": ("v6l", *PSUM_FROM_FP32_SUMS)}
ORACLE_SLACK = {kernel: (v5_tests.PV8_RMS, v5_tests.PV8_MAX) for kernel in ("v6j", "v6k", "v6l", "v6m", "v6n")}


def _close_to(problem, causal: bool, kernel: str, out: torch.Tensor, **run) -> None:
    """``out`` within CLOSE_TO's bounds of the kernel it is measured against (same problem, same launch)."""
    base, rms, max_fraction = CLOSE_TO[kernel]
    reference = v1_tests._run(problem, causal, kernel=base, **run)
    distance = v1_tests._rms_ratio(out, reference)
    assert distance <= rms, f"{kernel}: {distance:.3g} rms from {base}"
    scale = float(reference.abs().max())
    assert v3_tests._max_diff(out, reference) <= max_fraction * scale, f"{kernel}: max diff from {base}"


def _same_as_close(problem, causal: bool, kernel: str, out: torch.Tensor, **run) -> bool:
    """A variant that gives a CLOSE_TO kernel's output (v6m: v6l's): checked bit for bit -> True; else False."""
    if kernel in CLOSE_TO:
        _close_to(problem, causal, kernel, out, **run)
        return True
    if SAME_AS.get(kernel) in CLOSE_TO:
        reference = v1_tests._run(problem, causal, kernel=SAME_AS[kernel], **run)
        assert torch.equal(out, reference), f"{kernel} differs from {SAME_AS[kernel]}"
        return True
    return False


def _check_variant(problem, causal: bool, kernel: str, out: torch.Tensor) -> None:
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    if _same_as_close(problem, causal, kernel, out):
        return
    v6 = v1_tests._run(problem, causal, kernel="v6")
    if SAME_AS.get(kernel) == "v6":
        assert torch.equal(out, v6), f"{kernel} differs from v6 (max |diff| {v3_tests._max_diff(out, v6)})"
    else:
        assert v1_tests._rms_ratio(out, v6) <= FOLD_RMS, f"{kernel}: {v1_tests._rms_ratio(out, v6):.3g} rms from v6"
        if kernel in SAME_AS:
            reference = v1_tests._run(problem, causal, kernel=SAME_AS[kernel])
            assert torch.equal(out, reference), f"{kernel} differs from {SAME_AS[kernel]}"


@pytest.mark.parametrize("kernel", VARIANTS)
@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", CASES, ids=IDS)
def test_v6_variant_matches_oracle_and_v6(gen, kernel, q_lens, kv_lens, page_size, causal):
    problem = v1_tests._problem(gen, q_lens, kv_lens, 32, 8, page_size)
    slack_rms, slack_max = ORACLE_SLACK.get(kernel, (0.0, 0.0))
    out, _ = v4_tests.run_against_oracle(problem, causal, kernel, RMS + slack_rms, MAX + slack_max)
    _check_variant(problem, causal, kernel, out)


@pytest.mark.parametrize("kernel", VARIANTS)
def test_v6_variant_long_causal_batch(gen, kernel):
    """The long batch (rings wrapping many times): against v6 as above."""
    problem = v1_tests._problem(gen, [4500, 3001, 64], [4500, 3300, 4000], 32, 8, 128)
    _check_variant(problem, True, kernel, v1_tests._run(problem, True, kernel=kernel))


@pytest.mark.parametrize("kernel", VARIANTS)
def test_v6_variant_direct_builds(gen, kernel):
    """``compensate=False``: the same relation to v6's direct build."""
    problem = v1_tests._problem(gen, [300, 64], [300, 200], 32, 8, 128)
    out = v1_tests._run(problem, True, kernel=kernel, compensate=False)
    assert bool(torch.isfinite(out).all())
    if _same_as_close(problem, True, kernel, out, compensate=False):
        return
    v6 = v1_tests._run(problem, True, kernel="v6", compensate=False)
    if SAME_AS.get(kernel) == "v6":
        assert torch.equal(out, v6)
    else:
        assert v1_tests._rms_ratio(out, v6) <= FOLD_RMS


WIDE = ("v6l", "v6m", "v6n")  # GQA groups 4 and 5
GROUP5_CASES = [case[1:] for case in v3_tests.SHAPES if case[0] == 40]
GROUP5_IDS = [name for name in v3_tests.SHAPE_IDS if name.startswith("40:8")]


@pytest.mark.parametrize("kernel", [*WIDE, "v7"])
@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", GROUP5_CASES, ids=GROUP5_IDS)
def test_wide_kernels_at_gqa_40_8(gen, kernel, q_lens, kv_lens, page_size, causal):
    """v6l .. v6n and v7 at 40:8 (a consumer warpgroup is one head x 64 rows, a CTA 128 rows; each warp masks with
    its own rows; v6l's producer stages one head's Delta_S from wherever it starts in its 4-byte word, v7's operand
    pass all 5 heads'): the oracle's bounds with their 32:8 slack; v6m = v6l and v7 = v6n bit for bit."""
    problem = v1_tests._problem(gen, q_lens, kv_lens, 40, 8, page_size)
    slack_rms, slack_max = ORACLE_SLACK["v6n" if kernel == "v7" else kernel]
    out, _ = v4_tests.run_against_oracle(problem, causal, kernel, RMS + slack_rms, MAX + slack_max)
    assert bool(torch.isfinite(out).all())
    same_as = {"v6m": "v6l", "v7": "v6n"}.get(kernel)
    if same_as:
        assert torch.equal(out, v1_tests._run(problem, causal, kernel=same_as)), f"{kernel} differs from {same_as}"


LONG_CAUSAL_BATCH = ([4500, 3001, 64], [4500, 3300, 4000], 128, True)  # rings wrapping many times


@pytest.mark.parametrize("q_lens,kv_lens,page_size,causal", [*CASES, LONG_CAUSAL_BATCH],
                         ids=[*IDS, "long-causal-batch"])
def test_v7_is_v6n_on_its_operand_images(gen, q_lens, kv_lens, page_size, causal):
    """v7 (`prefill_wgmma_pre`: v6n's consumers on operand images the operand pass expanded once per prefill, v6n's
    producer work byte for byte): v6n's output bit for bit; the images of tiles past a sequence's end are never
    read (pages of 64 and 128, ragged batches)."""
    problem = v1_tests._problem(gen, q_lens, kv_lens, 32, 8, page_size)
    out = v1_tests._run(problem, causal, kernel="v7")
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    v6n = v1_tests._run(problem, causal, kernel="v6n")
    assert torch.equal(out, v6n), f"v7 differs from v6n (max |diff| {v3_tests._max_diff(out, v6n)})"


@pytest.mark.parametrize("kernel", ["v7", "v7c", "v7d", "v7f"])
def test_v7_images_sized_from_the_host_lengths(gen, kernel):
    """With ``seq_lens_k_host`` the images hold exactly the sequences' tiles (no slack behind the last sequence's
    last tile of the last KV head) and the pass's grid the longest sequence's: v6n's output bit for bit on a ragged
    batch whose page table is wider than its longest sequence needs."""
    q_lens, kv_lens = [300, 64, 1, 700], [300, 2000, 129, 700]
    problem = v1_tests._problem(gen, q_lens, kv_lens, 32, 8, 128)
    spare = torch.zeros((len(kv_lens), 16), dtype=torch.int32, device="cuda")  # 16 pages more than any needs
    problem = dataclasses.replace(problem, page_table=torch.cat([problem.page_table, spare], dim=1))
    out = v1_tests._run(problem, True, kernel=kernel, seq_lens_k_host=kv_lens)
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    assert torch.equal(out, v1_tests._run(problem, True, kernel="v6n"))


@pytest.mark.parametrize("kernel", ["v7", "v7c", "v7d", "v7f", "v7i"])  # v7i: the default's direct build (mpfa-direct)
def test_v7_direct_build_is_v6n_direct(gen, kernel):
    """``compensate=False``: the operand pass copies and stages no Delta_S and the consumers read none: v6n's direct
    build, bit for bit."""
    problem = v1_tests._problem(gen, [300, 64], [300, 200], 32, 8, 128)
    out = v1_tests._run(problem, True, kernel=kernel, compensate=False)
    assert bool(torch.isfinite(out).all())
    assert torch.equal(out, v1_tests._run(problem, True, kernel="v6n", compensate=False))


@pytest.mark.parametrize("kernel", ["v7b", "v7c", "v7d", "v7f", "v7h", "v7i"])
@pytest.mark.parametrize("num_q_heads,q_lens,kv_lens,page_size,causal",
                         [(32, *LONG_CAUSAL_BATCH), *v3_tests.SHAPES],
                         ids=["32:8-long-causal-batch", *v3_tests.SHAPE_IDS])
def test_v7_variants_are_v7(gen, kernel, num_q_heads, q_lens, kv_lens, page_size, causal):
    """v7b (v7 with each step's fold deferred under the next step's QK wgmmas, the last after the walk), v7c (v7b
    with each image one bulk copy, completed on ``full`` by its bytes), v7d (v7c with each step's PV under the
    next step's softmax, its stages held until then), v7f (v7d with the consumers taking turns at their wgmma
    issues), v7h (v7c with turns around its QKs) and v7i (v7c with Delta_S loaded ahead of its QK waits): v7's
    output bit for bit at 32:8 and 40:8, odd and even walks, masked and whole steps; a hang in v7c is its bulk copies' barrier, in v7d its held stages, in v7f or v7h alone
    their turns."""
    problem = v1_tests._problem(gen, q_lens, kv_lens, num_q_heads, 8, page_size)
    out = v1_tests._run(problem, causal, kernel=kernel)
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    v7 = v1_tests._run(problem, causal, kernel="v7")
    assert torch.equal(out, v7), f"{kernel} differs from v7 (max |diff| {v3_tests._max_diff(out, v7)})"


@pytest.mark.parametrize("num_q_heads,q_lens,kv_lens,page_size,causal",
                         [(32, *LONG_CAUSAL_BATCH), *v3_tests.SHAPES],
                         ids=["32:8-long-causal-batch", *v3_tests.SHAPE_IDS])
def test_v7g_is_v7e(gen, num_q_heads, q_lens, kv_lens, page_size, causal):
    """v7g (v7e with the consumers taking turns at their wgmma issues): v7e's output bit for bit; a hang is its
    turns."""
    problem = v1_tests._problem(gen, q_lens, kv_lens, num_q_heads, 8, page_size)
    out = v1_tests._run(problem, causal, kernel="v7g")
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    v7e = v1_tests._run(problem, causal, kernel="v7e")
    assert torch.equal(out, v7e), f"v7g differs from v7e (max |diff| {v3_tests._max_diff(out, v7e)})"


# v7e from v7: a quarter of P by `exp2_poly` (relative error <= 7.5e-5) moves ~3-5e-4 of those e4m3 P by one step
# (test_exp2_poly.py); on causal rows of 3,000 keys with random scores (a CPU simulation of the e4m3 P and O) that
# moved O by 4-6e-4 rms: 5x that. The maximum is a short row's: one step of an e4m3 P (<= 2**-3 of it) of weight up
# to 1/2 (a row of 2 keys) moves O by up to 2**-4 of |V| (session 24, H100: 1.01% of max |O| at 40:8 short-chunked,
# against the 1% a 3,000-key row gave)
POLY_EXP_FROM_V7 = (3e-3, 2.0 ** -4)
POLY_EXP_FROM_EXACT = 1.05  # its error against float64, at most this times the oracle's (1.01 for the others)


@pytest.mark.parametrize("num_q_heads,q_lens,kv_lens,page_size,causal",
                         [(32, *LONG_CAUSAL_BATCH), *v3_tests.SHAPES],
                         ids=["32:8-long-causal-batch", *v3_tests.SHAPE_IDS])
def test_v7e_matches_the_oracle_and_v7_closely(gen, num_q_heads, q_lens, kv_lens, page_size, causal):
    """v7e (v7d with every 4th P on the FMA pipe): within POLY_EXP_FROM_V7 of v7 and, but for the long batch (its
    float64 oracle is slow), within v7's oracle bounds."""
    from mpfa.kernels.sm90.prefill_launch import prefill_numerics, softmax_keys

    problem = v1_tests._problem(gen, q_lens, kv_lens, num_q_heads, 8, page_size)
    out = v1_tests._run(problem, causal, kernel="v7e")
    assert bool(torch.isfinite(out).all()), "NaN/Inf in the output (or rows left unwritten)"
    v7 = v1_tests._run(problem, causal, kernel="v7")
    rms, max_fraction = POLY_EXP_FROM_V7
    assert v1_tests._rms_ratio(out, v7) <= rms, f"{v1_tests._rms_ratio(out, v7):.3g} rms from v7"
    assert v3_tests._max_diff(out, v7) <= max_fraction * float(v7.abs().max())
    if q_lens == LONG_CAUSAL_BATCH[0]:
        return
    expected = v4_tests._oracle(problem, causal, prefill_numerics("v7e"), block_n=softmax_keys("v7e"))
    _, exact = v1_tests._expected(problem, causal)
    slack_rms, slack_max = ORACLE_SLACK["v6n"]
    assert v1_tests._rms_ratio(out, expected) <= RMS + slack_rms
    assert v3_tests._max_diff(out, expected) <= (MAX + slack_max) * float(expected.abs().max())
    assert v1_tests._rms_ratio(out, exact) <= POLY_EXP_FROM_EXACT * v1_tests._rms_ratio(expected, exact)

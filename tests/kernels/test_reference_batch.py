"""`prepare_batch` / `attend_prepared_batch` (right-padded rows, one set of tensor ops) against the one-sequence
reference of each row: the task runner's batched questions must each get the numerics of running alone."""

from __future__ import annotations

import pytest
import torch

from mpfa.kernels import VARIANTS
from mpfa.kernels.reference import (attend_prepared, attend_prepared_batch, attention_one_sequence, prepare_batch,
                                    prepare_one_sequence)

HQ, HKV, D = 4, 2, 32
# With exact sums (float64 S, l, P V and exp2, see `attend_prepared_batch`) nothing depends on the shapes BLAS and the
# reductions see, so a row batched equals the row alone bit for bit (FP32 sums would differ in the last ulp, and an
# S one ulp apart can flip a BF16 P rounding: ~1e-4 of the output). float64 compares the tiled float64 form with the
# dense `attention_float64` of `attention_one_sequence`: float64 rounding apart.
FLOAT64_TOLERANCE = 1e-12


def _rows(gen: torch.Generator, q_lens: list[int], k_lens: list[int], offset: float = 4.0):
    """Per-row BF16 q [Sq, Hq, d], k, v [Lk, Hkv, d] (channel offsets as real Q/K have, never zeros)."""
    channel = torch.zeros(D)
    channel[torch.randperm(D, generator=gen)[:4]] = offset
    rows = []
    for q_len, k_len in zip(q_lens, k_lens):
        q = torch.randn(q_len, HQ, D, generator=gen) + channel
        k = torch.randn(k_len, HKV, D, generator=gen) + 1.5 * channel
        v = torch.randn(k_len, HKV, D, generator=gen)
        rows.append(tuple(x.bfloat16() for x in (q, k, v)))
    return rows


def _pad(gen: torch.Generator, rows, garbage: float = 50.0):
    """Right-pad rows into [B, Smax, Hq, d] / [B, Kmax, Hkv, d] with large non-zero garbage in the padding."""
    s_max, k_max = max(r[0].shape[0] for r in rows), max(max(r[1].shape[0] for r in rows), 1)
    batch = len(rows)
    q = (torch.randn(batch, s_max, HQ, D, generator=gen) * garbage).bfloat16()
    k = (torch.randn(batch, k_max, HKV, D, generator=gen) * garbage).bfloat16()
    v = (torch.randn(batch, k_max, HKV, D, generator=gen) * garbage).bfloat16()
    for b, (qr, kr, vr) in enumerate(rows):
        q[b, : qr.shape[0]], k[b, : kr.shape[0]], v[b, : vr.shape[0]] = qr, kr, vr
    lengths = lambda i: torch.tensor([r[i].shape[0] for r in rows])  # noqa: E731
    return q, k, v, lengths(0), lengths(1)


def _attention_batch(q, k, v, *, variant, key_lengths, query_lengths, block_n, exact_sums):
    """`attention_one_sequence` of B right-padded rows: `prepare_batch`, then `attend_prepared_batch`."""
    ops = prepare_batch(q, k, v, variant=variant, query_lengths=query_lengths, key_lengths=key_lengths)
    return attend_prepared_batch(ops.q, ops.k, ops.v, ops.delta_s, variant=variant, block_n=block_n,
                                 key_lengths=key_lengths, query_lengths=query_lengths, exact_sums=exact_sums)


def _close(batched: torch.Tensor, alone: torch.Tensor) -> None:
    assert bool(torch.isfinite(batched).all())
    if batched.dtype == torch.float64:
        assert float((batched - alone).abs().max()) <= FLOAT64_TOLERANCE * (float(alone.abs().max()) or 1.0)
    else:
        assert torch.equal(batched, alone)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("q_lens, k_lens, block_n", [
    ([70, 5, 33, 1], [70, 5, 33, 1], 16),  # prefills of different lengths: tiles of 16 from each row's key 0
    ([1, 1, 1], [150, 37, 129], 128),       # decode steps
    ([3, 1, 4], [45, 20, 4], 16),           # continuations scored on caches
])
def test_each_row_equals_its_one_sequence_attention(gen, variant, q_lens, k_lens, block_n) -> None:
    rows = _rows(gen, q_lens, k_lens)
    q, k, v, q_len, k_len = _pad(gen, rows)
    out = _attention_batch(q, k, v, variant=variant, key_lengths=k_len, query_lengths=q_len, block_n=block_n,
                           exact_sums=True)
    assert out.shape == q.shape and not bool(torch.isnan(out).any())
    for b, (qr, kr, vr) in enumerate(rows):
        alone = attention_one_sequence(qr, kr, vr, variant=variant, block_n=block_n, exact_sums=True)
        _close(out[b, : qr.shape[0]], alone.to(out.dtype))
        assert bool((out[b, qr.shape[0]:] == 0).all())  # padding query rows give 0


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "float64"])
def test_prepared_operands_of_valid_tokens_equal_each_rows(gen, variant) -> None:
    """Per-token formats (and NVFP4 V, blocked along tokens, on zero padding) leave every valid operand as the row's
    own; smoothing means are each row's own (same sums as `sequence_means`)."""
    rows = _rows(gen, [20, 3, 9], [20, 3, 9])
    q, k, v, q_len, k_len = _pad(gen, rows)
    ops = prepare_batch(q, k, v, variant=variant, query_lengths=q_len, key_lengths=k_len)
    for b, (qr, kr, vr) in enumerate(rows):
        alone = prepare_one_sequence(qr, kr, vr, variant=variant)
        n, m = qr.shape[0], kr.shape[0]
        assert torch.equal(ops.q[b, :n], alone.q) and torch.equal(ops.k[b, :m], alone.k)
        assert torch.equal(ops.v[b, :m], alone.v)
        if alone.delta_s is not None:
            assert torch.equal(ops.delta_s[b, :m], alone.delta_s)
        out = attend_prepared_batch(ops.q[b : b + 1, :n], ops.k[b : b + 1], ops.v[b : b + 1],
                                    None if ops.delta_s is None else ops.delta_s[b : b + 1], variant=variant,
                                    key_lengths=k_len[b : b + 1], block_n=16, exact_sums=True)[0]
        _close(out, attend_prepared(alone.q, alone.k, alone.v, alone.delta_s, variant=variant, block_n=16,
                                    exact_sums=True))


@pytest.mark.parametrize("variant", ["bf16", "mpfa", "qk4-pv4"])
def test_padding_and_other_rows_do_not_change_a_row(gen, variant) -> None:
    """A row's output does not depend on its padding's contents or on the other rows (bit for bit), and a row
    with no keys at all gives 0 without NaN (fully masked tiles leave the state at m = -inf, l = 0)."""
    rows = _rows(gen, [1, 1, 1], [40, 17, 33])
    q, k, v, q_len, k_len = _pad(gen, rows)
    kw = {"variant": variant, "query_lengths": q_len, "block_n": 16, "exact_sums": True}
    out = _attention_batch(q, k, v, key_lengths=k_len, **kw)
    q_alt, k_alt, v_alt, _, _ = _pad(gen, rows, garbage=300.0)  # other padding garbage
    k_alt[2], v_alt[2] = -k_alt[2], torch.randn(v_alt[2].shape, generator=gen).bfloat16()  # another row 2, same length
    out_alt = _attention_batch(q_alt, k_alt, v_alt, key_lengths=k_len, **kw)
    assert torch.equal(out[:2], out_alt[:2])
    empty = _attention_batch(q, k, v, key_lengths=torch.tensor([40, 0, 33]), **kw)  # row 1: all keys are padding
    assert torch.equal(empty[0], out[0]) and torch.equal(empty[2], out[2])
    assert bool((empty[1] == 0).all()) and not bool(torch.isnan(empty).any())


def test_query_positions_give_the_slots_each_query_sees(gen) -> None:
    """Explicit `query_positions` (the swap's form: queries that are not the row's last keys, -1 for padding)."""
    (qr, kr, vr), = _rows(gen, [6], [30])
    ops = prepare_one_sequence(qr, kr, vr, variant="fp8")
    positions = torch.tensor([[9, 10, 11, -1, 29, 29]])
    out = attend_prepared_batch(ops.q[None], ops.k[None], ops.v[None], None, variant="fp8", block_n=16,
                                query_positions=positions, exact_sums=True)[0]
    for i, last in enumerate(positions[0].tolist()):
        if last < 0:
            assert bool((out[i] == 0).all())
            continue
        alone = attend_prepared(ops.q[i : i + 1], ops.k[: last + 1], ops.v[: last + 1], None, variant="fp8",
                                block_n=16, exact_sums=True)
        _close(out[i : i + 1], alone)

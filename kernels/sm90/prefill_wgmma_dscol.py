"""MpFA prefill v3c / v3w8c: v3 / v3w8 with Delta_S on the tensor cores as an extra K column.

In v3 the compensation enters as the QK accumulator's initial value: every thread loads its 16 keys' Delta_S from
the ring, widens them to FP32 and scales them by 2**-7 before each tile's QK, ~77 of v3w8's 697 instructions per
tile in an issue-bound kernel (profiles/NOTES.md, "The compensation's cost inside prefill v3w8"). Here Delta_S is
one more k-step of the same wgmma group, the issue's "fold Delta_S into an extra K column":

* an extra [64 keys][16] FP16 B tile, shared by the CTA: key j holds the BF16 of the Delta_S words the ring stage
  holds (`prefill_staged_layout.ds_words`): columns 0-3, the group's 4 heads, for group 4; columns 0-1 for group
  5's one head, the 2-head word it lies in. Copied at each tile's expansion, one value per thread; zeros in the
  other columns (written once);
* an extra [64 rows][16] FP16 A tile per warpgroup, written once: a row (head h of the CTA, `tile_row_query`)
  holds 2**-7 in its head's column (h, + 1 where a one-head CTA's head is its word's second half,
  `prefill_staged_layout.ds_lead`) and 0 elsewhere;
* QK = Q K^T 2**-7 (v3's 8 k-steps, the accumulator starting at 0, or -inf where masked) + one m64n64k16 k-step:
  S 2**-7 = Q K^T 2**-7 + Delta_S 2**-7.

The other half of a one-head CTA's word is a neighbour head or an unwritten padding entry of the Delta_S row
(`cache_layout.delta_s_row`), which may hold anything, NaN included: the widening clamps with the non-propagating
min / max (``FMNMX``, not ``FMNMX.NAN``), so it is finite and its 0 in the one-hot column cancels it (0 x NaN would
be NaN in the MMA: the first 40:8 GPU run failed on exactly that).

The product 2**-7 Delta_S is exact in FP32, and BF16 Delta_S is exact in FP16 for |Delta_S| in [2**-14, 65504]
(8 significant bits in 11); smaller values round to FP16's subnormal grid (an absolute error below 2**-25 on a
score), larger ones are clamped to 65504 (a score that size already decides its row's softmax alone). So v3's
numerics up to the FP32 summation order (Delta_S is added last instead of first), within v3's oracle bounds, not
bit for bit. The direct build (``compensate=False``) has no Delta_S and is v3's direct build.

Shared memory: v3's plus 2 KB per warpgroup and 2 KB for the CTA (v3w8c: 96 KB, still 2 CTAs per SM).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float16, Float32
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum

from mpfa.kernels.sm90 import prefill_staged_layout as sl
from mpfa.kernels.sm90.prefill_wgmma import OPERAND_ALIGN, THREADS, TILE_KEYS, PrefillSm90Wgmma, tile_row_query
from mpfa.kernels.sm90.ptx import bits_to_f32
from mpfa.kernels.sm90.smem_pipeline import load_shared_u16

DS_COLUMNS = 16  # the extra k-step: FP16 wgmma's K
EXTRA_BYTES = TILE_KEYS * DS_COLUMNS * 2  # one [64][16] FP16 tile
ONE_HOT = 2.0 ** -7  # Q's extra column: the scale of v3's scores (S 2**-7)
FP16_MAX = 65504.0


def extra_layout():
    """CuTe's layout of a [64][16] FP16 wgmma operand tile, the 16 elements contiguous (K-major, 32-byte swizzle)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.Float16, DS_COLUMNS), cutlass.Float16)
    return cute.tile_to_shape(atom, (TILE_KEYS, DS_COLUMNS), order=(0, 1))


class PrefillSm90WgmmaDsColumn(PrefillSm90Wgmma):
    """v3c (``warpgroups`` 1) / v3w8c (2): `PrefillSm90Wgmma` with Delta_S as an extra k-step of QK (module
    docstring)."""

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True, warpgroups: int = 1):
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate, warpgroups)
        self.ds_columns = 2 * sl.ds_words(self.heads)  # BF16 Delta_S per key in the ring stage
        assert self.ds_columns <= DS_COLUMNS
        # (the warpgroups' one-hot Q tiles, then the CTA's Delta_S K tile), after v3's ring
        self.extra_offset = -(-self.smem_bytes // OPERAND_ALIGN) * OPERAND_ALIGN
        if self.compensate:
            self.smem_bytes = self.extra_offset + (warpgroups + 1) * EXTRA_BYTES

    def _extra_tile(self, smem_ptr, index):
        """Extra tile ``index`` (warpgroup w's one-hot Q tile: w; the Delta_S K tile: ``warpgroups``)."""
        layout = extra_layout()
        offset = self.extra_offset + index * EXTRA_BYTES
        if not isinstance(index, int):
            offset = cute.assume(offset, divby=EXTRA_BYTES)
        return cute.make_tensor(cute.recast_ptr(smem_ptr + offset, layout.inner, dtype=Float16), layout.outer)

    @cute.jit
    def _expand_q(self, q_codes: cute.Tensor, q_scales: cute.Tensor, q_start, q_len, row0, first_head, wg_tid,
                  q_tile):
        """v3's Q tile, then (compensated) the warpgroup's one-hot tile and, by warpgroup 0, the Delta_S tile's
        zeros (its columns past ``ds_columns`` stay 0; the others are rewritten every tile)."""
        PrefillSm90Wgmma._expand_q(self, q_codes, q_scales, q_start, q_len, row0, first_head, wg_tid, q_tile)
        if cutlass.const_expr(self.compensate):
            smem_ptr = cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN)
            wg = cute.arch.thread_idx()[0] // THREADS
            one_hot = self._extra_tile(smem_ptr, wg)
            # the column of the CTA's first head: 1 where it is the second BF16 of its Delta_S word (an even number
            # of heads starts word-aligned)
            lead = 0 if self.heads % 2 == 0 else sl.ds_lead(first_head % self.group) >> 1
            for r in cutlass.range_constexpr(TILE_KEYS * DS_COLUMNS // THREADS):
                unit = wg_tid + THREADS * r
                row, column = unit // DS_COLUMNS, unit % DS_COLUMNS
                hot = lead + tile_row_query(row, self.heads)[1]
                one_hot[row, column] = Float16(cutlass.select_(column == hot, Float32(ONE_HOT), Float32(0.0)))
            if wg == 0:
                ds_tile = self._extra_tile(smem_ptr, self.warpgroups)
                for r in cutlass.range_constexpr(TILE_KEYS * DS_COLUMNS // THREADS):
                    unit = wg_tid + THREADS * r
                    ds_tile[unit // DS_COLUMNS, unit % DS_COLUMNS] = Float16(0.0)

    @cute.jit
    def _expand_kv(self, stage, threads, smem, state: cute.Tensor):
        """v3's K and V expansion, then (compensated) the tile's Delta_S into columns 0 .. ``ds_columns`` - 1 of
        the Delta_S tile: one BF16 of the ring stage per (key, column), widened exactly (clamped to FP16's range) to
        FP16."""
        PrefillSm90Wgmma._expand_kv(self, stage, threads, smem, state)
        if cutlass.const_expr(self.compensate):
            ds_tile = self._extra_tile(cute.arch.get_dyn_smem(cutlass.Uint8, alignment=OPERAND_ALIGN), self.warpgroups)
            units = TILE_KEYS * self.ds_columns
            for r in cutlass.range_constexpr(-(-units // self.threads)):
                unit = threads[0] + self.threads * r
                if cutlass.const_expr(units % self.threads == 0):
                    self._widen_ds(stage, ds_tile, unit)
                else:
                    if unit < units:  # a part-round (one head: 128 values for 256 threads)
                        self._widen_ds(stage, ds_tile, unit)

    @cute.jit
    def _widen_ds(self, stage, ds_tile, unit):
        """Delta_S ``unit`` (key ``unit // ds_columns``, column ``unit % ds_columns``) of the ring stage -> FP16,
        clamped with the non-propagating min / max (a NaN becomes finite; module docstring)."""
        key, column = unit // self.ds_columns, unit % self.ds_columns
        half, in_half = key // sl.TILE_KEYS, key % sl.TILE_KEYS
        # the ring's Delta_S row of a key: its ds_words 4-byte words (`prefill_staged_layout.ds_copy`)
        bits = load_shared_u16(stage + half * self.stage_bytes + sl.DS_OFFSET + 4 * sl.ds_words(self.heads) * in_half
                               + 2 * column)
        # max(min(x, M), -M) on the non-propagating max alone: min(x, M) = -max(-x, -M)
        below = -cute.arch.fmax(-bits_to_f32(bits << 16), Float32(-FP16_MAX))
        value = cute.arch.fmax(below, Float32(-FP16_MAX))
        ds_tile[key, column] = Float16(value)

    def _ds_bits(self, stage, ds_lane):
        """No Delta_S for the accumulator's initial value (as the direct build): it is the extra k-step's."""
        return None

    def _qk_extra_operands(self, mma_qk, smem_ptr, wg, wg_tid):
        """The extra k-step of QK (compensated): (warpgroup's one-hot tile, the Delta_S tile)."""
        if not self.compensate:
            return None
        thr_qk = mma_qk.get_slice(wg_tid)
        return ((thr_qk.make_fragment_A(thr_qk.partition_A(self._extra_tile(smem_ptr, wg))),
                 thr_qk.make_fragment_B(thr_qk.partition_B(self._extra_tile(smem_ptr, self.warpgroups)))),)

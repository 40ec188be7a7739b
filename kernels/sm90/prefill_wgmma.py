"""What the two wgmma prefill kernels (`prefill_fp8`, `prefill_exact`) share: two warpgroups of 64 wgmma rows each,
64-key tiles, Q expanded into a shared-memory operand tile, the K expansion of a ring stage, the online softmax on
the QK accumulator and the epilogue.

A warpgroup's 64 wgmma rows are the 4-warp CTA of `prefill_base` (`prefill_staged_layout.cta_shape`,
`tile_row_query`): group 4 -> M row ``16 h + i`` is query head ``first_head + h``, query row ``row0 + i``; group 5
-> one head x 64 rows. Warp h of a warpgroup then owns 16 rows and thread (g, c) of it the rows g and g + 8, so the
online softmax (`prefill_tile.online_softmax`) runs on the accumulator as on the mma-sync kernel's registers.
Warpgroup w computes the query rows ``wg_rows w`` .. + ``wg_rows`` - 1 of the CTA's heads. A 64-key tile is two
32-key ring stages (`prefill_staged_layout`), so pages must hold 64 keys. The CTA walks the tiles its last row sees
and splits masked / whole tiles on the keys its first row sees; each warpgroup masks with its own rows' limits
(with one head x 64 rows, each warp with its own 16 rows').
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int64, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

from . import dispatch
from . import prefill_staged_layout as sl
from . import prefill_tile as tile_math
from .prefill_base import HEAD_DIM, PrefillSm90Base
from .ptx import f32x2_to_bf16x2, load_shared_v4_u32, load_u16, load_v4_u32, store_u32, store_v2_f32
from .smem_pipeline import load_shared_u16, store_shared_v4_u32
from .warp_mma import P_SCALE

TILE_KEYS = 64  # keys per wgmma tile: two 32-key ring stages
HALVES = TILE_KEYS // sl.TILE_KEYS
N_BLOCKS = TILE_KEYS // 8  # 8-key column blocks of the S accumulator
ROWS = sl.WARP_ROWS  # query rows per warp
THREADS = 128  # one warpgroup
WARPGROUPS = 2  # warpgroups computing rows per CTA
OPERAND_ALIGN = 1024  # the 128-byte swizzle repeats every 8 rows of 128 bytes
# e4m3(448 P)'s 448 in the softmax's exponent: P' = 2**(lam S - (lam m - log2 448)) = 448 P from the same exp2, one
# subtraction per row instead of a multiply per P; the row sums l' = 448 l, O / l' at the end. log2(448) in FP32
# makes P' = 448.00016 P, which O = sum P' V / sum P' cancels; an e4m3 rounding of P' within ~4e-7 of a tie can come
# out one step apart from e4m3(448 P)'s.
P_SCALE_LOG2 = math.log2(P_SCALE)


def warpgroup_half(wg, r: int, warpgroups: int):
    """The 32-key half of a 64-key tile that warpgroup ``wg`` copies into the ring (the 4-warp copy plan) and
    whose K it expands, in round ``r`` (``0 .. 2 // warpgroups - 1``): the halves h with h % warpgroups == wg
    (one warpgroup: both; two: half w for warpgroup w)."""
    return wg + warpgroups * r


def tile_row_query(row, heads: int) -> tuple:
    """(query row from the warpgroup's first, head of the CTA) of row ``row`` of a 64-row wgmma tile: warp
    ``row // 16`` is head ``warp % heads``, rows ``16 (warp // heads)`` .. + 15 (the 4-warp CTA's warps; 4 heads:
    row 16 h + i is head h, query i; 1 head: row i is query i)."""
    warp = row >> 4
    return ((warp // heads) << 4) + (row & (ROWS - 1)), warp % heads


def softmax_update(scores: list, state: cute.Tensor, lam_scaled, p_scale_log2: float, lane_max: list | None = None,
                   exp2=None) -> tuple:
    """The online softmax of one tile's scores (exact alpha), rows' maxima and sums updated in ``state[0:4]``
    -> (P in the scores' layout, alphas); P and the sums times 2**``p_scale_log2``; ``lane_max``: the scores' lane
    maxima if taken already; ``exp2``: the timing ablations' replacement (`prefill_tile.online_softmax`)."""
    probs, alphas, m_rows, l_rows = tile_math.online_softmax(scores, [state[0], state[1]], [state[2], state[3]],
                                                             lam_scaled, exp2=exp2, exact_alpha=True,
                                                             p_scale_log2=p_scale_log2, lane_max=lane_max)
    for r in range(2):
        state[r] = m_rows[r]
        state[2 + r] = l_rows[r]
    return probs, alphas


@cute.jit
def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, frag_a: cute.Tensor, frag_b: cute.Tensor,
         fresh: cutlass.Constexpr = False, wait: cutlass.Constexpr = True, extra=None) -> None:
    """acc += A B over the k-steps on wgmma (accumulating onto acc's current value; ``fresh``: acc = A B, the
    first k-step ignoring acc), then ``extra``'s (A, B) fragment pairs' k-steps in the same group, waited for
    (``wait`` False: committed only; the caller waits with ``warpgroup.wait_group`` before reading acc)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    for k in cutlass.range_constexpr(cute.size(frag_a.shape[2])):
        atom.set(warpgroup.Field.ACCUMULATE, not (fresh and k == 0))
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
    if cutlass.const_expr(extra is not None):
        atom.set(warpgroup.Field.ACCUMULATE, True)
        for extra_a, extra_b in extra:
            for k in cutlass.range_constexpr(cute.size(extra_a.shape[2])):
                cute.gemm(atom, acc, extra_a[None, None, k], extra_b[None, None, k], acc)
    warpgroup.commit_group()
    if cutlass.const_expr(wait):
        warpgroup.wait_group(0)


class PrefillSm90Wgmma(PrefillSm90Base):
    """`PrefillSm90Base`'s shape on two warpgroups of wgmma rows (module docstring): GQA groups 4 and 5, pages of
    >= 64 keys, an even number of query heads (`dispatch.check_wgmma_shape`). A subclass gives its `dispatch`
    ``name``, QK's operand type (``qk_dtype``, `_qk_layout`), where a 16-byte unit of a Q / K operand row goes
    (`_unit_offset`), which K chunks a thread expands (`_k_unit`), how a Q chunk is expanded (`_expand_q_chunk`) and
    a row's softmax denominator (`_row_sum`)."""

    def __init__(self, num_kv_heads: int, group: int, page_size: int, causal: bool, out_dtype: str = "BFloat16",
                 compensate: bool = True):
        super().__init__(num_kv_heads, group, page_size, causal, out_dtype, compensate)
        dispatch.check_wgmma_shape(self.name, self.num_q_heads, num_kv_heads, page_size)
        self.wg_rows = sl.warpgroup_rows(group)  # a warpgroup's query rows of each of its heads
        self.row_blocks *= WARPGROUPS
        self.block_m = ROWS * self.row_blocks
        self.tile_bytes = HALVES * self.stage_bytes  # one 64-key ring stage
        self.fill_warpgroups = WARPGROUPS  # warpgroups sharing a tile's ring copies and K expansion

    def _warpgroup_plan(self, cta_row0, wg, wg_warp, q_len, kv_len, g) -> tuple:
        """(the warpgroup's first row (of each of its heads), the warp's first row, the tiles the warpgroup's rows
        see, (last key row g sees, row g + 8's) of the warp's rows, leading keys all the warpgroup's rows see):
        with fewer heads than warps (group 5: one head x 64 rows) each warp masks with its own 16 rows' limits."""
        row0 = cta_row0 + self.wg_rows * wg
        num_tiles, limits, common = tile_math.warp_plan(row0, q_len, kv_len, g, causal=self.causal,
                                                        tile_keys=TILE_KEYS, warp_rows=self.wg_rows)
        warp_row0 = row0
        if self.wg_rows > ROWS:
            warp_row0 = row0 + self._warp_row(wg_warp)
            _, limits, _ = tile_math.warp_plan(warp_row0, q_len, kv_len, g, causal=self.causal, tile_keys=TILE_KEYS,
                                               warp_rows=ROWS)
        return row0, warp_row0, num_tiles, limits, common

    def _qk_operands(self, smem_ptr, q_offset, k_offset):
        """(QK's tiled MMA ``m64n64`` in ``qk_dtype``, Q and K operand tiles in shared memory), K-major both."""
        layout = self._qk_layout()
        s_q, s_k = [cute.make_tensor(cute.recast_ptr(smem_ptr + offset, layout.inner, dtype=self.qk_dtype),
                                     layout.outer) for offset in (q_offset, k_offset)]
        mma_qk = sm90_utils.make_trivial_tiled_mma(self.qk_dtype, self.qk_dtype, OperandMajorMode.K,
                                                   OperandMajorMode.K, Float32, (1, 1, 1), (64, TILE_KEYS))
        return mma_qk, s_q, s_k

    # --- operands in shared memory ---------------------------------------------------------------------------------

    @cute.jit
    def _expand_q(self, q_codes: cute.Tensor, q_scales: cute.Tensor, q_start, q_len, row0, first_head, wg_tid,
                  q_tile):
        """Q of the warpgroup's 64 rows into its Q operand tile ``q_tile`` (`_expand_q_chunk`): thread ``wg_tid``
        of the warpgroup expands the 16-byte chunks ``wg_tid`` and ``wg_tid + 128`` (row ``unit >> 2``, chunk
        ``unit & 3``; `tile_row_query`); rows past the sequence are zeros."""
        for r in cutlass.range_constexpr(2):
            unit = wg_tid + THREADS * r
            row, chunk = unit >> 2, unit & 3
            query, head = tile_row_query(row, self.heads)
            valid = Uint32(row0 + query < q_len)
            q_row = Int64(q_start + row0 + query) * self.num_q_heads + first_head + head
            words = load_v4_u32(q_codes.iterator.toint() + q_row * sl.K_ROW_BYTES + 16 * chunk, valid)
            scales = load_u16(q_scales.iterator.toint() + q_row * sl.SCALE_ROW_BYTES + 2 * chunk, valid, Uint32(0))
            self._expand_q_chunk(q_tile, row, chunk, words, scales)

    @cute.jit
    def _store_chunk(self, tile, row, chunk, words: list):
        """The words of NVFP4 chunk ``chunk`` expanded (32 elements: 16 f16x2 or 8 e4m3x4) -> their 16-byte units
        of ``row`` of an operand tile (`_unit_offset`)."""
        units = len(words) // 4
        for unit in cutlass.range_constexpr(units):
            store_shared_v4_u32(tile + self._unit_offset(row, units * chunk + unit), *words[4 * unit:4 * unit + 4])

    @cute.jit
    def _copy_wgmma_tile(self, tile_index, page, stage, kv_len, threads, sources, ragged: cutlass.Constexpr):
        """cp.async 64-key tile ``tile_index`` as two 32-key tiles (one page holds both), each by one warpgroup with
        the 4-warp copy plan (`prefill_staged_layout.copy_plan`): the halves `warpgroup_half` gives it (with two
        warpgroups half w, so a thread computes the cache addresses of one half only)."""
        _, wg, wg_tid, wg_warp = threads
        for r in cutlass.range_constexpr(HALVES // self.fill_warpgroups):
            half = warpgroup_half(wg, r, self.fill_warpgroups)
            self._copy_tile(HALVES * tile_index + half, page, stage + half * self.stage_bytes, kv_len, wg_tid, wg_warp,
                            sources, ragged)

    @cute.jit
    def _expand_k_chunks(self, stage, threads, smem, convert):
        """The thread's K chunks of the 64-key tile in ring stage ``stage`` (`_k_unit`: its 16 bytes of codes and
        its two block scales) through ``convert(words, scales)`` into the K operand tile. Keys past the sequence
        end were zero-filled by the copy."""
        _, wg, wg_tid, _ = threads
        for r in cutlass.range_constexpr(HALVES // self.fill_warpgroups):
            half, key, chunk = self._k_unit(wg, wg_tid, r, self.fill_warpgroups)
            raw = stage + half * self.stage_bytes
            words = load_shared_v4_u32(raw + sl.K_OFFSET + sl.K_ROW_BYTES * key + 16 * chunk)
            scales = load_shared_u16(raw + sl.SCALE_OFFSET + sl.SCALE_ROW_BYTES * key + 2 * chunk)
            self._store_chunk(smem + self.offsets[1], sl.TILE_KEYS * half + key, chunk, convert(words, scales))

    # --- epilogue ---------------------------------------------------------------------------------------------------

    @cute.jit
    def _store_rows(self, state: cute.Tensor, acc_o: cute.Tensor, out: cute.Tensor, q_start, q_len, row0, head, g,
                    c):
        """O / l of rows g, g + 8 (P and l carry e4m3(448 P)'s 448; 0 for a row that saw no key): dimensions
        8 j + 2c, + 1 of accumulator column block j; rows past the sequence are not written."""
        elem_bytes = 4 if self.out_f32 else 2
        for r in cutlass.range_constexpr(2):
            l_row = self._row_sum(state, acc_o, r)
            inv = Float32(cutlass.select_(l_row > Float32(0.0), Float32(1.0) / l_row, Float32(0.0)))
            row = row0 + g + 8 * r
            if row < q_len:
                base = out.iterator.toint() + (Int64(q_start + row) * self.num_q_heads + head) * HEAD_DIM * elem_bytes
                for j in cutlass.range_constexpr(HEAD_DIM // 8):
                    lo, hi = acc_o[4 * j + 2 * r] * inv, acc_o[4 * j + 2 * r + 1] * inv
                    address = base + (8 * j + 2 * c) * elem_bytes
                    if cutlass.const_expr(self.out_f32):
                        store_v2_f32(address, lo, hi)
                    else:
                        store_u32(address, f32x2_to_bf16x2(lo, hi))

"""`mpfa profile characterize`: the MpFA paper's Fig. 3 on this GPU — where the fp8 prefill kernel's time goes.

The paper splits a FlashAttention tile's time into MMA, softmax and the rest by timing compile-time ablations of
the kernel. Here the ladder of the fp8 prefill kernel (the default; `prefill_launch.ablation_ladder`) is timed on
one causal prefill (default 64K tokens, batch 1, 32:8 heads, d = 128), each step removing one more piece from the
tile loop:

    full -> -exp2 -> -exp2 -rowstats -> QK MMA + copies only

and each piece's share is the time difference between consecutive steps, as a fraction of the full kernel's
time (a negative difference is reported as it is: timing noise, or a removal that made the compiler schedule
worse). What the last step still runs (QK^T MMAs, the operands' copies, Delta_S, masking, the loop, the epilogue,
and the operand pass, which expands K once per prefill) is "QK MMA + rest"; "MMA" in the summary is PV (the `pv`
step) plus that remainder, an upper bound of the MMA share since the copies cannot be removed without deleting
the loop. Every ablated kernel keeps the full kernel's occupancy (one CTA per SM, by its shared memory), so a
share is the piece's time, not an occupancy gain from the registers its removal frees. The kernel has no
dequantization step to ablate: its operand pass expands K before the attention kernel runs.

Which formats the Hopper kernel supports: QK^T from NVFP4 requantized to e4m3 with power-of-two scales (the FP8
tensor cores; sm_90 has no FP4 MMA) and PV in FP8 e4m3; there is no BF16-QK or NVFP4-PV MpFA kernel on sm90, so
the paper's other format rows are not produced. FA4-BF16 (BF16 QK and PV) and FlashInfer-FP8 are context rows,
through the `mpfa profile prefill` adapters. The kernel's direct build (no Delta_S read) is timed on the full
kernel's inputs too: the full kernel over it is the compensation's cost (the paper: ~2%).

Time per KV block: the paper's unit, a 128 x 128 (query x key) block of one head. A causal prefill of T tokens
visits n (n + 1) / 2 such blocks per head and sequence (n = ceil(T / 128), diagonal blocks counted whole);
"SM-µs per block" = median time x number of SMs / blocks, the time one SM spends on one block when every SM is
busy (the kernels walk their own tiles; the 128 x 128 block is a unit of work).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..mpfa_cli.errors import ProfileError
from .attention_workload import AttentionWorkload
from .timing import TimingSummary, measure, summarize

if TYPE_CHECKING:
    import torch

BLOCK = 128  # the paper's KV block: 128 query rows x 128 keys of one head
DIRECT_LABEL = "direct (no Delta_S)"
CONTEXT_BACKENDS = ("fa4-bf16", "flashinfer-fp8")
DEFAULT_SEED = 1234
KERNEL = "fp8"  # the prefill kernel with compile-time ablations (`prefill_launch.ablation_ladder`)
Progress = Callable[[str], None]


@dataclass
class LadderRow:
    label: str
    ablation: str  # `Ablation.name`
    removed: str | None  # the piece this step removes (None: the full kernel)
    timing: TimingSummary | None = None
    first_call_s: float | None = None
    error: str | None = None


@dataclass
class ContextRow:
    backend: str
    description: str | None
    timing: TimingSummary | None
    error: str | None = None


@dataclass(frozen=True)
class Share:
    piece: str  # exp2, rowstats, pv, "qk+rest"
    ms: float
    fraction: float  # of the full kernel's median


@dataclass
class CharacterizeResult:
    workload: AttentionWorkload
    device: str
    num_sms: int
    blocks: int
    kernel: str  # the prefill kernel ablated (`KERNEL`)
    ladder: list[LadderRow]
    context: list[ContextRow] = field(default_factory=list)
    direct: LadderRow | None = None  # the kernel's direct build (no Delta_S) on the same inputs
    json_path: str | None = None

    def shares(self) -> list[Share] | None:
        return ladder_shares([row.timing.median_ms if row.timing else None for row in self.ladder],
                             [row.removed for row in self.ladder])

    def compensation(self) -> float | None:
        """The full kernel's median over its direct build's (None without both)."""
        full = self.ladder[0].timing if self.ladder else None
        direct = self.direct.timing if self.direct else None
        return None if full is None or direct is None else full.median_ms / direct.median_ms

    def per_block_us(self, ms: float | None) -> float | None:
        return None if ms is None else sm_us_per_block(ms, self.blocks, self.num_sms)

    def to_json(self) -> dict[str, Any]:
        shares = self.shares()
        return {
            "kind": "characterize",
            "kernel": self.kernel,
            "workload": asdict(self.workload),
            "device": self.device,
            "num_sms": self.num_sms,
            "blocks_128x128": self.blocks,
            "block_definition": "128 query rows x 128 keys of one head; SM-us per block = median ms x SMs / blocks",
            "ladder": [{**asdict(row), "sm_us_per_block": self.per_block_us(row.timing.median_ms if row.timing
                                                                              else None)} for row in self.ladder],
            "context": [{**asdict(row), "sm_us_per_block": self.per_block_us(row.timing.median_ms if row.timing
                                                                               else None)} for row in self.context],
            "shares": None if shares is None else [asdict(share) for share in shares],
            "summary": None if shares is None else summary_fractions(shares),
            "direct": None if self.direct is None else asdict(self.direct),
            "compensation_full_over_direct": self.compensation(),
        }

    def write_json(self, out_dir: Path) -> Path:
        w = self.workload
        name = f"characterize-{self.kernel}-s{w.seq}-b{w.batch}-h{w.q_heads}x{w.kv_heads}-d{w.head_dim}.json"
        path = out_dir / name
        self.json_path = str(path)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


# --- arithmetic (no GPU) -------------------------------------------------------------------------------------

def causal_blocks(seq: int, batch: int, q_heads: int, causal: bool = True) -> int:
    """128 x 128 blocks a prefill of ``seq`` tokens visits over all heads and sequences."""
    n = -(-seq // BLOCK)
    return batch * q_heads * (n * (n + 1) // 2 if causal else n * n)


def sm_us_per_block(ms: float, blocks: int, num_sms: int) -> float:
    """SM-microseconds per block: the time one SM spends on one block when all ``num_sms`` are busy."""
    if blocks <= 0 or num_sms <= 0:
        raise ValueError("blocks and num_sms must be positive")
    return ms * 1e3 * num_sms / blocks


def ladder_shares(medians: list[float | None], removed: list[str | None]) -> list[Share] | None:
    """Shares from the cumulative ladder's median times (first: the full kernel; each later step removes
    ``removed[i]``): piece i costs medians[i - 1] - medians[i]; what the last step still runs is "qk+rest".
    None when a step has no time."""
    if len(medians) != len(removed) or len(medians) < 2 or removed[0] is not None:
        raise ValueError("the ladder starts with the full kernel and removes one piece per step")
    if any(ms is None for ms in medians):
        return None
    full = medians[0]
    if full <= 0:
        raise ValueError(f"the full kernel's time must be positive, got {full}")
    shares = [Share(piece, before - after, (before - after) / full)
              for piece, before, after in zip(removed[1:], medians[:-1], medians[1:])]
    return shares + [Share("qk+rest", medians[-1], medians[-1] / full)]


def summary_fractions(shares: list[Share]) -> dict[str, float]:
    """The paper's split: softmax (exp2 + row statistics) and MMA (PV step plus the QK-MMA-and-copies remainder, an
    upper bound). Dequantization has no share: the fp8 kernel expands K in its operand pass, inside every step's
    time."""
    by_piece = {share.piece: share.fraction for share in shares}
    return {
        "softmax": by_piece.get("exp2", 0.0) + by_piece.get("rowstats", 0.0),
        "exp2": by_piece.get("exp2", 0.0),
        "rowstats": by_piece.get("rowstats", 0.0),
        "mma_upper_bound": by_piece.get("pv", 0.0) + by_piece.get("qk+rest", 0.0),
    }


# --- measurement (GPU) ---------------------------------------------------------------------------------------

def _prefill_inputs(w: AttentionWorkload, device: "torch.device"):
    """One set of MpFA prefill inputs exactly as `mpfa profile prefill` builds them (`kernels_mpfa`)."""
    import torch

    from ..kernels.cache_layout import CenteredQuery, MpfaKVCache
    from ..kernels.smoothing import SmoothingMeans
    from .kernels_mpfa import PAGE_SIZE, _fill, paged_layout

    generator = torch.Generator(device=device).manual_seed(DEFAULT_SEED)
    means = SmoothingMeans(torch.randn(w.batch, w.q_heads, w.head_dim, device=device, generator=generator),
                           torch.randn(w.batch, w.kv_heads, w.head_dim, device=device, generator=generator))
    tokens = w.batch * w.seq
    page_table, slots_of_token, num_pages = paged_layout(w, device)
    cache = MpfaKVCache.allocate(num_pages, PAGE_SIZE, w.q_heads, w.kv_heads, w.head_dim, device)
    query = CenteredQuery.allocate(tokens, w.q_heads, w.head_dim, device)

    def keep_all(first: int, chunk: CenteredQuery) -> None:
        query.codes[first:first + chunk.codes.shape[0]] = chunk.codes
        query.scales[first:first + chunk.codes.shape[0]] = chunk.scales

    _fill(w, cache, slots_of_token, means, device, generator, keep_all)
    return dict(
        query=query, cache=cache, page_table=page_table,
        cu_seqlens_q=torch.arange(0, (w.batch + 1) * w.seq, w.seq, dtype=torch.int32, device=device),
        seq_lens_k=torch.full((w.batch,), w.seq, dtype=torch.int32, device=device),
        out=torch.empty((tokens, w.q_heads, w.head_dim), dtype=torch.bfloat16, device=device),
    )


def _timed(row: LadderRow, say: Progress, run: Callable[[int], "torch.Tensor"]) -> LadderRow:
    """``row`` with ``run``'s first-call time and timing, or its one-line error (one failed step leaves the others;
    the shares are then not computed)."""
    try:
        say(f"mpfa {row.label}: compile + first call, then timing")
        measurement = measure(run, 1)
        row.first_call_s, row.timing = measurement.first_call_s, summarize(measurement.times_ms)
        say(f"mpfa {row.label}: median {row.timing.median_ms:.3f} ms")
    except Exception as exc:  # noqa: BLE001 - reported in the row
        row.error = _one_line(exc)
        say(f"mpfa {row.label}: {row.error}")
    return row


def _one_line(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:300]


def run_characterize(seq: int, batch: int = 1, heads: tuple[int, int] = (32, 8), head_dim: int = 128,
                     out_dir: Path = Path("mpfa-profiles"), context: tuple[str, ...] = CONTEXT_BACKENDS,
                     progress: Progress | None = None) -> CharacterizeResult:
    """Time the fp8 prefill kernel's ablation ladder (and the context backends) on one causal prefill; writes the
    JSON into ``out_dir``. Raises ValueError for bad arguments (a shape the fp8 kernel does not take among them)
    and ProfileError when there is no CUDA device."""
    from ..kernels.sm90.dispatch import prefill_kernel
    from ..kernels.sm90.prefill_launch import ablation_ladder
    from .kernels_mpfa import PAGE_SIZE
    from .registry import adapter_for

    workload = AttentionWorkload("prefill", seq, batch, heads[0], heads[1], head_dim)
    if head_dim != 128:
        raise ValueError(f"the sm90 prefill kernel is built for head dim 128, got {head_dim}")
    kernel = prefill_kernel(heads[0], heads[1], PAGE_SIZE, KERNEL)
    ladder = ablation_ladder(kernel)
    adapters = [adapter_for(name) for name in context]
    say = progress or (lambda _message: None)

    import torch

    if not torch.cuda.is_available():
        raise ProfileError("no CUDA device: `mpfa profile` runs the attention kernels on a GPU")
    from ..kernels.sm90.prefill_launch import mpfa_prefill_ablated

    device = torch.device("cuda", torch.cuda.current_device())
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(device)
    result = CharacterizeResult(workload, torch.cuda.get_device_name(device), props.multi_processor_count,
                                causal_blocks(seq, batch, heads[0]), kernel, [])

    say(f"mpfa: building the prefill inputs ({seq} tokens)")
    inputs = _prefill_inputs(workload, device)
    torch.cuda.synchronize()
    for label, ablation, removed in ladder:
        result.ladder.append(_timed(LadderRow(label, ablation.name, removed), say, lambda _index, ablation=ablation:
                                    mpfa_prefill_ablated(ablation, max_seqlen_q=seq, causal=True, kernel=kernel,
                                                         **inputs)))
    full = ladder[0][1]
    result.direct = _timed(LadderRow(DIRECT_LABEL, full.name, None), say, lambda _index: mpfa_prefill_ablated(
        full, max_seqlen_q=seq, causal=True, kernel=kernel, compensate=False, **inputs))
    del inputs
    torch.cuda.empty_cache()

    from .microbench import benchmark_backend

    for adapter in adapters:
        backend = benchmark_backend(adapter, workload, device, say)
        result.context.append(ContextRow(adapter.name, backend.description, backend.timing, backend.error))
    result.write_json(out_dir)
    return result


# --- report --------------------------------------------------------------------------------------------------

def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _timing_cells(result: CharacterizeResult, t: TimingSummary | None, full: float | None) -> list[str]:
    """A row's median, p20-p80, SM-us per block and time over the full kernel's."""
    return [_cell(t and t.median_ms), "-" if t is None else f"{t.p20_ms:.3f}-{t.p80_ms:.3f}",
            _cell(result.per_block_us(t and t.median_ms), 2),
            "-" if t is None or not full else f"{t.median_ms / full:.2f}"]


def table_rows(result: CharacterizeResult) -> tuple[list[str], list[list[str]]]:
    """Headers and rows of the report table: the ladder, then the context backends."""
    headers = ["kernel", "removed", "median ms", "p20-p80 ms", "SM-us / 128x128 block", "x full",
               "share of full", "note"]
    shares = {share.piece: share for share in (result.shares() or [])}
    full = result.ladder[0].timing.median_ms if result.ladder and result.ladder[0].timing else None
    rows = []
    for row in result.ladder:
        share = shares.get(row.removed) if row.removed else None
        rows.append([f"mpfa {result.kernel} {row.label}", row.removed or "-",
                     *_timing_cells(result, row.timing, full),
                     "-" if share is None else f"{row.removed} {100 * share.fraction:+.1f}%",
                     row.error or ("real kernel" if row.removed is None else "timing only: output meaningless")])
    if (direct := result.direct) is not None:
        ratio = result.compensation()
        rows.append([f"mpfa {result.kernel} {direct.label}", "-", *_timing_cells(result, direct.timing, full),
                     "-" if ratio is None else f"compensation {100 * (1 - 1 / ratio):+.1f}%",
                     direct.error or "the direct build on the same inputs: timing only"])
    for row in result.context:
        rows.append([row.backend, "-", *_timing_cells(result, row.timing, full), "-",
                     row.error or (row.description or "")])
    return headers, rows


def render_characterize(result: CharacterizeResult, console) -> None:
    from rich.table import Table

    w = result.workload
    headers, rows = table_rows(result)
    table = Table(title=f"MpFA prefill ({result.kernel}) characterization: {w.seq} tokens, batch {w.batch}, "
                        f"{w.q_heads}:{w.kv_heads} heads, d={w.head_dim}, causal — {result.device}, "
                        f"{result.num_sms} SMs, {result.blocks:,} blocks of 128x128")
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i in (0, 1, 6, 7) else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if (ratio := result.compensation()) is not None:
        console.print(f"compensation (Delta_S): the full kernel takes {ratio:.3f}x its direct build's time")
    shares = result.shares()
    if shares is None:
        console.print("shares: not computed (a ladder step failed)")
        return
    parts = ", ".join(f"{s.piece} {100 * s.fraction:.1f}% ({s.ms:.3f} ms)" for s in shares)
    summary = summary_fractions(shares)
    console.print(f"shares of the full kernel: {parts}")
    console.print(f"softmax {100 * summary['softmax']:.1f}% (exp2 {100 * summary['exp2']:.1f}%, row statistics "
                  f"{100 * summary['rowstats']:.1f}%), dequantization in the operand pass (not ablated), MMA + "
                  f"copies <= {100 * summary['mma_upper_bound']:.1f}%")
    if result.json_path:
        console.print(f"raw results: {result.json_path}")

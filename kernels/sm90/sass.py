"""Reading compiled sm_90a kernels: the SASS tile loops of the wgmma prefill kernels and the limits that decide
how many CTAs fit an SM (what the compile tests and the lab book's per-tile instruction counts use)."""

from __future__ import annotations

import re

REGISTERS_PER_SM = 65536
MAX_REGISTERS = 255  # per thread
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024  # the driver's share of each CTA's shared memory
WARPGROUP = 128  # threads


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of every instruction in `cuobjdump --dump-sass` output."""
    return [(int(a, 16), op.strip()) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def mma_loops(sass: str, mma_prefixes: tuple[str, ...] = ("HGMMA", "QGMMA")) -> list[list[str]]:
    """The instructions of each loop body that issues warpgroup MMAs: from a backward branch's target to the
    branch."""
    return loops_issuing(sass, mma_prefixes)


def loops_issuing(sass: str, prefixes: tuple[str, ...]) -> list[list[str]]:
    """The instructions of each loop body (from a conditional backward branch's target to the branch) with an
    instruction starting with one of ``prefixes`` (e.g. a producer's loops: its named barrier
    ``BAR.SYNC.DEFER_BLOCKING 0x1,``). Unconditional backward branches are not loops' back edges: ptxas may place
    an mbarrier wait's retry block after the loops and branch back from it into the middle of one."""
    ops = instructions(sass)
    loops = []
    for address, op in ops:
        target = re.search(r"^@!?U?P\d+ BRA 0x([0-9a-f]+)", op)
        if target and int(target[1], 16) < address:
            body = [o for a, o in ops if int(target[1], 16) <= a <= address]
            if any(o.startswith(prefixes) for o in body):
                loops.append(body)
    return loops


def ctas_per_sm(registers: int, threads: int, smem_bytes: int) -> int:
    """CTAs of ``threads`` threads that fit one SM with ``registers`` per thread (allocated in multiples of 8) and
    ``smem_bytes`` of shared memory per CTA (plus the driver's share); 0 past the per-CTA shared-memory limit."""
    if smem_bytes > SMEM_PER_CTA:
        return 0
    return min(REGISTERS_PER_SM // (-(-registers // 8) * 8 * threads),
               SMEM_PER_SM // (smem_bytes + SMEM_RESERVED_PER_CTA))

"""MpFA: NVFP4 QK^T and FP8 PV over an NVFP4-K / FP8-V cache, with sequence-centred Q and K.

The CuTe kernels are another issue's work and do not exist yet, so `prepare` raises `KernelNotBuilt` and the
profile shows a "not built" row, never a number. The storage format is known already, so the row still shows
the bytes MpFA will need. When the kernels land, `prepare` builds the NVFP4/FP8 cache and returns their launch;
`kernel_regex` must then be checked against the real kernel name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from mpfa.profiles.errors import KernelNotBuilt
from mpfa.profiles.kernel_adapter import PreparedKernel
from mpfa.profiles.workload import MPFA, AttentionWorkload

if TYPE_CHECKING:
    import torch


class MpfaAdapter:
    name = "mpfa"
    tensor_format = MPFA
    math_dtype = "fp8"  # sm_90 has no FP4 tensor cores: NVFP4 operands go through FP8 MMAs
    kernel_regex = "[Mm]p[Ff][Aa]"

    def set_bytes(self, workload: AttentionWorkload) -> int:
        return int(workload.bytes_needed(self.tensor_format))

    def prepare(self, workload: AttentionWorkload, num_sets: int, device: "torch.device",
                seed: int) -> PreparedKernel:
        raise KernelNotBuilt("MpFA attention kernels are not built yet (mpfa.kernels.sm90 has none)")

"""The backend registry: every attention backend declared once, as a `BackendSpec` passed to `register_backend`.

A spec carries all a backend needs: the SGLang flags, environment and packages its server needs; `expect`, what
`/get_server_info` must report once the server is up, so a run can confirm that the backend and KV-cache dtype it
measured are the ones it asked for (SGLang silently falls back otherwise); the simulator's latency-model
parameters (`SimulatedCosts`); and the kernel-bench adapter that `mpfa profile prefill|decode` times it with.
Kernel-bench-only variants (a pinned prefill kernel, FA3 on contiguous K/V, FlashInfer's other templates) are
`KernelVariant`s: `mpfa profile` times them, `mpfa bench` does not serve them.

`caveat`, where set, says which of a backend's measured numbers are not the backend's own. Every measured run of
the backend stores the sentence, and tables, exports, plots and the gate show it, as they show SIMULATED for
simulator runs (a simulated run gets no caveat: its numbers come from the latency model, not from this code).

Everything here is plain data: this package sits below the CLI and the profiles, so an adapter is named by its
"module:Class" path, never imported.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..kernels.sm90.dispatch import PREFILL_KERNELS
from . import kv_scales


@dataclass(frozen=True)
class SimulatedCosts:
    """What distinguishes a backend in the simulator's latency model (`mpfa.mpfa_cli.harness.latency_model`):
    plausible assumptions chosen to make the backends differ the way their designs suggest, never measurements."""

    k_bytes_per_element: float
    v_bytes_per_element: float
    attention_efficiency: float  # prefill attention FLOP/s as a fraction of the dense BF16 peak
    kv_bandwidth_efficiency: float  # decode KV reads as a fraction of HBM bandwidth
    step_overhead_s: float  # scheduling and launch cost of one batch step
    logprob_perturbation: float = 0.0  # half-width of its simulated logprobs' noise: arbitrary, so backends differ


@dataclass(frozen=True)
class KernelBench:
    """The kernel-bench adapter that times a backend's attention kernels (`mpfa profile prefill|decode`): its
    class as "module:Class" and the keyword arguments it is built with."""

    adapter: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendSpec:
    """A serving backend, declared once: what its server needs and reports, its simulated costs, its adapter."""

    name: str
    description: str
    sglang_args: tuple[str, ...]
    expect: dict[str, str]
    sim: SimulatedCosts
    kernel_bench: KernelBench | None = None  # None: `mpfa profile` has no adapter for it
    modules: tuple[str, ...] = ()  # Python modules the server needs (extras: serve, kernels)
    compute_capabilities: tuple[str, ...] = ("9.0", "10.0")
    env: dict[str, str] = field(default_factory=dict)
    plugin: str | None = None  # module that registers this backend with SGLang, if not built in
    caveat: str | None = None  # one sentence: which of its measured numbers are not the backend's own, if any
    caveat_when: Mapping[str, str] = field(default_factory=dict)  # server environment it applies to ({}: always)
    numerics: str | None = None  # the `mpfa.kernels.reference` variant whose attention numerics it computes
    kv_scales: bool = False  # serves only a checkpoint carrying calibrated FP8 KV scales (`kv_scales.py`)

    def caveat_for(self, environ: Mapping[str, str]) -> str | None:
        """The caveat of a server started with `environ` (its own `env` applied on top), or None."""
        server_env = {**environ, **self.env}
        if self.caveat and all(server_env.get(k) == v for k, v in self.caveat_when.items()):
            return self.caveat
        return None

    def missing(self) -> list[str]:
        """Modules this backend needs that are not importable here."""
        needed = self.modules + ((self.plugin,) if self.plugin else ())
        return [m for m in needed if not _importable(m)]


@dataclass(frozen=True)
class KernelVariant:
    """A kernel-bench-only variant: `mpfa profile prefill|decode --backend NAME` times it; no server runs it."""

    name: str
    description: str
    kernel_bench: KernelBench
    serve_as: str | None = None  # the `mpfa bench` flags whose servers run the same kernels, if any


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


BACKENDS: dict[str, BackendSpec] = {}  # the serving backends, in the order `mpfa backends` lists them
KERNEL_VARIANTS: dict[str, KernelVariant] = {}


class UnknownBackend(ValueError):
    """A name that no serving backend is registered under."""


def register_backend(spec: BackendSpec) -> BackendSpec:
    """Add a serving backend to the registry (every command that takes a backend then knows it)."""
    _check_new(spec.name)
    BACKENDS[spec.name] = spec
    return spec


def register_kernel_variant(variant: KernelVariant) -> KernelVariant:
    """Add a kernel-bench-only variant (`mpfa profile` times it; `mpfa bench` refuses it with its `serve_as`)."""
    _check_new(variant.name)
    KERNEL_VARIANTS[variant.name] = variant
    return variant


def _check_new(name: str) -> None:
    if name in BACKENDS or name in KERNEL_VARIANTS:
        raise ValueError(f"backend '{name}' is registered already")


def backend_spec(name: str) -> BackendSpec:
    """The serving backend registered as `name`; UnknownBackend says what to use instead."""
    if name in BACKENDS:
        return BACKENDS[name]
    valid = f"serving backends: {', '.join(BACKENDS)}"
    if (variant := KERNEL_VARIANTS.get(name)) is not None:
        instead = f"serve its kernels with `mpfa bench {variant.serve_as}`" if variant.serve_as else valid
        raise UnknownBackend(f"'{name}' is a kernel-bench variant (`mpfa profile prefill|decode --backend {name}`), "
                             f"not a serving backend; {instead}")
    raise UnknownBackend(f"unknown backend '{name}'; valid: {', '.join(BACKENDS)}")


def kernel_benches() -> dict[str, KernelBench]:
    """Every name `mpfa profile prefill|decode` can time, serving backends first, with its adapter."""
    served = {name: spec.kernel_bench for name, spec in BACKENDS.items() if spec.kernel_bench is not None}
    return {**served, **{name: variant.kernel_bench for name, variant in KERNEL_VARIANTS.items()}}


# Bytes per cached K or V element. NVFP4: a 4-bit value plus one FP8 (E4M3) scale per 16 elements.
BF16_BYTES_PER_ELEMENT = 2.0
FP8_BYTES_PER_ELEMENT = 1.0
NVFP4_BYTES_PER_ELEMENT = 0.5 + 1 / 16

_SGLANG = ("sglang",)

# The plugin's extend runs the sm90 prefill kernel unless the server's environment selects its PyTorch reference
# path (`MPFA_PREFILL=reference`); runs measured that way carry the caveat.
PREFILL_ENV = "MPFA_PREFILL"
PREFILL_PATHS = ("kernel", "reference")  # the first is the default
PLUGIN_PREFILL_CAVEAT = (
    "prefill runs the plugin's slow PyTorch reference path: TTFT and prefill-bound metrics are not MpFA's"
)
_REFERENCE_PREFILL = {PREFILL_ENV: "reference"}

_FA3 = "mpfa.profiles.kernels_fa3:Fa3"
_FLASHINFER = "mpfa.profiles.kernels_flashinfer"
_MPFA = "mpfa.profiles.kernels_mpfa:MpfaAdapter"

register_backend(BackendSpec(
    name="fa4-bf16",
    numerics="bf16",
    description="FlashAttention-4 (CuTe DSL), BF16 KV cache",
    sglang_args=("--attention-backend", "fa4", "--page-size", "128"),
    expect={"attention_backend": "fa4"},
    sim=SimulatedCosts(BF16_BYTES_PER_ELEMENT, BF16_BYTES_PER_ELEMENT, attention_efficiency=0.55,
                       kv_bandwidth_efficiency=0.80, step_overhead_s=0.5e-3),
    kernel_bench=KernelBench("mpfa.profiles.kernels_fa4:Fa4Bf16"),
    modules=_SGLANG + ("flash_attn.cute",),
))
# FA3 as SGLang serves it on Hopper, assumed by the simulator (not measured by this project yet): BF16 decode near
# the copy bandwidth, a less efficient FP8 decode path, FP8 prefill through a page table a little faster than BF16.
register_backend(BackendSpec(
    name="fa3-bf16",
    numerics="bf16",
    description="FlashAttention-3 (sgl_kernel), BF16 KV cache: SGLang's default on Hopper",
    sglang_args=("--attention-backend", "fa3"),
    expect={"attention_backend": "fa3"},
    sim=SimulatedCosts(BF16_BYTES_PER_ELEMENT, BF16_BYTES_PER_ELEMENT, attention_efficiency=0.60,
                       kv_bandwidth_efficiency=0.90, step_overhead_s=0.5e-3),
    kernel_bench=KernelBench(_FA3, {"kv_fp8": False}),
    modules=_SGLANG + ("sgl_kernel",),
    compute_capabilities=("9.0",),
))
_FA3_FP8 = BackendSpec(
    name="fa3-fp8",
    numerics="fp8-qkpv",
    description="FlashAttention-3 with an FP8 (e4m3) KV cache; SGLang casts Q to e4m3 too",
    sglang_args=("--attention-backend", "fa3", "--kv-cache-dtype", "fp8_e4m3"),
    expect={"attention_backend": "fa3", "kv_cache_dtype": "fp8_e4m3"},
    sim=SimulatedCosts(FP8_BYTES_PER_ELEMENT, FP8_BYTES_PER_ELEMENT, attention_efficiency=0.66,
                       kv_bandwidth_efficiency=0.60, step_overhead_s=0.5e-3, logprob_perturbation=1.5e-2),
    kernel_bench=KernelBench(_FA3, {"kv_fp8": True}),
    modules=_SGLANG + ("sgl_kernel",),
    compute_capabilities=("9.0",),
)
register_backend(_FA3_FP8)
# The same server and kernels with the checkpoint's calibrated scales switched on: one K and one V scale per layer,
# the finest SGLang applies here (`kv_scales.py`). `mpfa profile` times its kernels as fa3-fp8's (the scales' values
# change no timing); the simulator models it as fa3-fp8; no reference variant computes per-layer scales.
register_backend(replace(
    _FA3_FP8,
    name="fa3-fp8-calibrated",
    numerics=None,
    description="fa3-fp8 with the checkpoint's calibrated K and V scales, one each per layer "
                "(`mpfa accuracy calibrate-kv`)",
    sglang_args=_FA3_FP8.sglang_args + kv_scales.SGLANG_ARGS,
    kernel_bench=None,
    kv_scales=True,
))
register_backend(BackendSpec(
    name="flashinfer-fp8",
    numerics="fp8",
    description="FlashInfer with an FP8 (e4m3) KV cache",
    sglang_args=("--attention-backend", "flashinfer", "--kv-cache-dtype", "fp8_e4m3"),
    expect={"attention_backend": "flashinfer", "kv_cache_dtype": "fp8_e4m3"},
    sim=SimulatedCosts(FP8_BYTES_PER_ELEMENT, FP8_BYTES_PER_ELEMENT, attention_efficiency=0.40,
                       kv_bandwidth_efficiency=0.75, step_overhead_s=0.6e-3, logprob_perturbation=1e-2),
    kernel_bench=KernelBench(f"{_FLASHINFER}:FlashInferPaged", {"kv_fp8": True}),  # the fa2 template, as SGLang's
    modules=_SGLANG + ("flashinfer",),
))
register_backend(BackendSpec(
    name="triton-bf16",
    numerics="bf16",
    description="SGLang's Triton attention, BF16 KV cache",
    sglang_args=("--attention-backend", "triton"),
    expect={"attention_backend": "triton"},
    sim=SimulatedCosts(BF16_BYTES_PER_ELEMENT, BF16_BYTES_PER_ELEMENT, attention_efficiency=0.30,
                       kv_bandwidth_efficiency=0.65, step_overhead_s=0.6e-3, logprob_perturbation=1e-3),
    modules=_SGLANG,
))
# MpFA in the simulator: NVFP4 K + FP8 V is (0.5625 + 1) / 2 = 0.78 of an FP8 cache; centering and the rank-one
# ΔS correction are assumed to cost a little attention throughput and bandwidth efficiency.
register_backend(BackendSpec(
    name="mpfa",
    numerics="mpfa",
    description="MpFA: NVFP4 QK, FP8 PV, NVFP4-K/FP8-V cache, centering + rank-one compensation",
    sglang_args=("--attention-backend", "mpfa", "--page-size", "128"),
    expect={"attention_backend": "mpfa"},
    sim=SimulatedCosts(NVFP4_BYTES_PER_ELEMENT, FP8_BYTES_PER_ELEMENT, attention_efficiency=0.48,
                       kv_bandwidth_efficiency=0.70, step_overhead_s=0.6e-3, logprob_perturbation=2e-2),
    kernel_bench=KernelBench(_MPFA),  # the prefill kernel `mpfa.kernels.sm90.dispatch` chooses for the shape
    modules=_SGLANG,
    plugin="mpfa.backends.sglang_plugin",
    caveat=PLUGIN_PREFILL_CAVEAT,
    caveat_when=_REFERENCE_PREFILL,
))
register_backend(BackendSpec(
    name="mpfa-direct",
    numerics="qk4-pv8-direct",
    description="MpFA numerics without centering (direct NVFP4 QK, FP8 PV)",
    sglang_args=("--attention-backend", "mpfa-direct", "--page-size", "128"),
    expect={"attention_backend": "mpfa-direct"},
    sim=SimulatedCosts(NVFP4_BYTES_PER_ELEMENT, FP8_BYTES_PER_ELEMENT, attention_efficiency=0.50,
                       kv_bandwidth_efficiency=0.72, step_overhead_s=0.6e-3, logprob_perturbation=4e-2),
    kernel_bench=KernelBench(_MPFA, {"compensate": False}),  # mpfa over mpfa-direct: the compensation's cost
    modules=_SGLANG,
    plugin="mpfa.backends.sglang_plugin",
    caveat=PLUGIN_PREFILL_CAVEAT,
    caveat_when=_REFERENCE_PREFILL,
))

register_kernel_variant(KernelVariant(
    "fa3-fp8-contiguous", "FA3-FP8 prefill on contiguous K/V (flash_attn_varlen_func): FA3's best case, not what "
    "a server runs", KernelBench(_FA3, {"kv_fp8": True, "contiguous": True})))
register_kernel_variant(KernelVariant(
    "flashinfer-bf16", "FlashInfer's fa2 template (SGLang's flashinfer backend) on a BF16 KV cache",
    KernelBench(f"{_FLASHINFER}:FlashInferPaged", {"kv_fp8": False})))
register_kernel_variant(KernelVariant(
    "flashinfer-fp8-xqa", "FlashInfer's FP8 XQA decode, as SGLang's trtllm_mha decode runs on Hopper",
    KernelBench(f"{_FLASHINFER}:FlashInferXqaFp8")))
register_kernel_variant(KernelVariant(
    "flashinfer-fp8-fa3", "FlashInfer's FP8 prefill on its fa3 template (sm_90a)",
    KernelBench(f"{_FLASHINFER}:FlashInferFa3Fp8")))
register_kernel_variant(KernelVariant(
    "flashinfer-fp8-fmha-v2", "FlashInfer's FP8 prefill on TRT-LLM's FMHAv2 context kernel",
    KernelBench(f"{_FLASHINFER}:FlashInferFmhaV2Fp8")))
# Every MpFA prefill kernel but the first, which `mpfa` itself runs wherever the wgmma kernels fit, pinned for timing.
for _kernel in list(PREFILL_KERNELS)[1:]:
    register_kernel_variant(KernelVariant(
        f"mpfa-{_kernel}", f"MpFA with the {_kernel} prefill kernel pinned",
        KernelBench(_MPFA, {"prefill_kernel": _kernel}), serve_as=f"--backend mpfa --prefill-kernel {_kernel}"))

"""Server specs for each attention backend: the SGLang flags, environment and packages a backend needs.

`expect` holds what `/get_server_info` must report once the server is up, so a run can confirm that the
backend and KV-cache dtype it measured are the ones it asked for (SGLang silently falls back otherwise).

`caveat`, where set, says which of a backend's measured numbers are not the backend's own. Every measured run of
the backend stores the sentence, and tables, exports, plots and the gate show it, as they show SIMULATED for
simulator runs (a simulated run gets no caveat: its numbers come from the latency model, not from this code).
"""
from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BackendSpec:
    name: str
    description: str
    sglang_args: tuple[str, ...]
    expect: dict[str, str]
    modules: tuple[str, ...] = ()  # Python modules the server needs (extras: serve, kernels)
    compute_capabilities: tuple[str, ...] = ("9.0", "10.0")
    env: dict[str, str] = field(default_factory=dict)
    plugin: str | None = None  # module that registers this backend with SGLang, if not built in
    caveat: str | None = None  # one sentence: which of its measured numbers are not the backend's own, if any
    caveat_when: Mapping[str, str] = field(default_factory=dict)  # server environment the caveat applies to ({}: always)
    numerics: str | None = None  # the `mpfa.kernels.reference` variant whose attention numerics it computes

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


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


_SGLANG = ("sglang",)

# The plugin's extend runs the sm90 prefill kernel unless the server's environment selects its PyTorch reference
# path (`MPFA_PREFILL=reference`); runs measured that way carry the caveat.
PREFILL_ENV = "MPFA_PREFILL"
PREFILL_PATHS = ("kernel", "reference")  # the first is the default
PLUGIN_PREFILL_CAVEAT = (
    "prefill runs the plugin's slow PyTorch reference path: TTFT and prefill-bound metrics are not MpFA's"
)
_REFERENCE_PREFILL = {PREFILL_ENV: "reference"}

BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in [
        BackendSpec(
            name="fa4-bf16",
            numerics="bf16",
            description="FlashAttention-4 (CuTe DSL), BF16 KV cache",
            sglang_args=("--attention-backend", "fa4", "--page-size", "128"),
            expect={"attention_backend": "fa4"},
            modules=_SGLANG + ("flash_attn.cute",),
        ),
        BackendSpec(
            name="fa3-bf16",
            numerics="bf16",
            description="FlashAttention-3 (sgl_kernel), BF16 KV cache: SGLang's default on Hopper",
            sglang_args=("--attention-backend", "fa3"),
            expect={"attention_backend": "fa3"},
            modules=_SGLANG + ("sgl_kernel",),
            compute_capabilities=("9.0",),
        ),
        BackendSpec(
            name="fa3-fp8",
            numerics="fp8-qkpv",
            description="FlashAttention-3 with an FP8 (e4m3) KV cache; SGLang casts Q to e4m3 too",
            sglang_args=("--attention-backend", "fa3", "--kv-cache-dtype", "fp8_e4m3"),
            expect={"attention_backend": "fa3", "kv_cache_dtype": "fp8_e4m3"},
            modules=_SGLANG + ("sgl_kernel",),
            compute_capabilities=("9.0",),
        ),
        BackendSpec(
            name="flashinfer-fp8",
            numerics="fp8",
            description="FlashInfer with an FP8 (e4m3) KV cache",
            sglang_args=("--attention-backend", "flashinfer", "--kv-cache-dtype", "fp8_e4m3"),
            expect={"attention_backend": "flashinfer", "kv_cache_dtype": "fp8_e4m3"},
            modules=_SGLANG + ("flashinfer",),
        ),
        BackendSpec(
            name="triton-bf16",
            numerics="bf16",
            description="SGLang's Triton attention, BF16 KV cache",
            sglang_args=("--attention-backend", "triton"),
            expect={"attention_backend": "triton"},
            modules=_SGLANG,
        ),
        BackendSpec(
            name="mpfa",
            numerics="mpfa",
            description="MpFA: NVFP4 QK, FP8 PV, NVFP4-K/FP8-V cache, centering + rank-one compensation",
            sglang_args=("--attention-backend", "mpfa", "--page-size", "128"),
            expect={"attention_backend": "mpfa"},
            modules=_SGLANG,
            plugin="mpfa.backends.sglang_plugin",
            caveat=PLUGIN_PREFILL_CAVEAT,
            caveat_when=_REFERENCE_PREFILL,
        ),
        BackendSpec(
            name="mpfa-direct",
            numerics="qk4-pv8-direct",
            description="MpFA numerics without centering (direct NVFP4 QK, FP8 PV)",
            sglang_args=("--attention-backend", "mpfa-direct", "--page-size", "128"),
            expect={"attention_backend": "mpfa-direct"},
            modules=_SGLANG,
            plugin="mpfa.backends.sglang_plugin",
            caveat=PLUGIN_PREFILL_CAVEAT,
            caveat_when=_REFERENCE_PREFILL,
        ),
    ]
}

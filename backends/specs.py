"""Server specs for each attention backend: the SGLang flags, environment and packages a backend needs.

`expect` holds what `/get_server_info` must report once the server is up, so a run can confirm that the
backend and KV-cache dtype it measured are the ones it asked for (SGLang silently falls back otherwise).

`caveat`, where set, says which of a backend's measured numbers are not the backend's own. Every measured run of
the backend stores the sentence, and tables, exports, plots and the gate show it, as they show SIMULATED for
simulator runs (a simulated run gets no caveat: its numbers come from the latency model, not from this code).
"""
from __future__ import annotations

import importlib.util
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

# The plugin's decode is the sm90 kernel, but its prefill still runs a PyTorch reference path.
PLUGIN_PREFILL_CAVEAT = (
    "prefill runs the plugin's slow PyTorch reference path: TTFT and prefill-bound metrics are not MpFA's"
)

BACKENDS: dict[str, BackendSpec] = {
    spec.name: spec
    for spec in [
        BackendSpec(
            name="fa4-bf16",
            description="FlashAttention-4 (CuTe DSL), BF16 KV cache",
            sglang_args=("--attention-backend", "fa4", "--page-size", "128"),
            expect={"attention_backend": "fa4"},
            modules=_SGLANG + ("flash_attn.cute",),
        ),
        BackendSpec(
            name="flashinfer-fp8",
            description="FlashInfer with an FP8 (e4m3) KV cache",
            sglang_args=("--attention-backend", "flashinfer", "--kv-cache-dtype", "fp8_e4m3"),
            expect={"attention_backend": "flashinfer", "kv_cache_dtype": "fp8_e4m3"},
            modules=_SGLANG + ("flashinfer",),
        ),
        BackendSpec(
            name="triton-bf16",
            description="SGLang's Triton attention, BF16 KV cache",
            sglang_args=("--attention-backend", "triton"),
            expect={"attention_backend": "triton"},
            modules=_SGLANG,
        ),
        BackendSpec(
            name="mpfa",
            description="MpFA: NVFP4 QK, FP8 PV, NVFP4-K/FP8-V cache, centering + rank-one compensation",
            sglang_args=("--attention-backend", "mpfa", "--page-size", "128"),
            expect={"attention_backend": "mpfa"},
            modules=_SGLANG,
            plugin="mpfa.backends.sglang_plugin",
            caveat=PLUGIN_PREFILL_CAVEAT,
        ),
        BackendSpec(
            name="mpfa-direct",
            description="MpFA numerics without centering (direct NVFP4 QK, FP8 PV)",
            sglang_args=("--attention-backend", "mpfa-direct", "--page-size", "128"),
            expect={"attention_backend": "mpfa-direct"},
            modules=_SGLANG,
            plugin="mpfa.backends.sglang_plugin",
            caveat=PLUGIN_PREFILL_CAVEAT,
        ),
    ]
}

"""MpFA numerics: bit-exact formats, sequence smoothing and the reference attention every kernel is tested against.

Pure PyTorch, device-agnostic (CPU or CUDA tensors). The names below load on first use, so that importing a
submodule that needs no PyTorch (`mpfa.kernels.sm90.dispatch`, `mpfa.kernels.kv_capacity`) does not import it.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_MODULE_OF = {
    "capacity_table": "kv_capacity",
    "compression_vs_bf16": "kv_capacity",
    "format_capacity_table": "kv_capacity",
    "kv_bytes_per_token": "kv_capacity",
    "E2M1_GRID": "formats",
    "E2M1_MAX": "formats",
    "E4M3_MAX": "formats",
    "NVFP4_BLOCK": "formats",
    "P_FP8_SCALE": "formats",
    "FormatError": "formats",
    "NVFP4Tensor": "formats",
    "decode_e2m1": "formats",
    "dequantize_fp8": "formats",
    "dequantize_nvfp4": "formats",
    "e4m3_pow2_scale": "formats",
    "encode_e2m1": "formats",
    "fake_quant_fp8": "formats",
    "fake_quant_fp8_pow2": "formats",
    "fake_quant_nvfp4": "formats",
    "fake_quant_p_fp8": "formats",
    "nvfp4_global_scale": "formats",
    "pack_e2m1": "formats",
    "quantize_fp8": "formats",
    "quantize_nvfp4": "formats",
    "unpack_e2m1": "formats",
    "VARIANTS": "reference",
    "DecodePartials": "reference",
    "VariantSpec": "reference",
    "attention": "reference",
    "attention_float64": "reference",
    "decode": "reference",
    "decode_partials": "reference",
    "merge_partials": "reference",
    "SmoothingMeans": "smoothing",
    "center": "smoothing",
    "delta_s": "smoothing",
    "sequence_means": "smoothing",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)

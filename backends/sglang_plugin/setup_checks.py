"""Startup validation for the MpFA backends: every unsupported setup fails with one clear line before any forward.

Runs twice: on SGLang's ``ServerArgs`` in the launcher (`check_server_args`, through a hook on the attention-backend
resolution step, before any scheduler starts) and in each scheduler when the backend is built (`check_model`,
`check_device`, `check_kernel_packages`, `prefill_path`, `numerics`). SGLang-free: arguments are read by attribute
name.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from .variants import is_mpfa_backend
from ..specs import PREFILL_ENV, PREFILL_PATHS
from ...kernels.served_numerics import ServedNumerics, served_numerics

HEAD_DIM = 128
MAX_GROUP = 8  # query heads per KV head the sm90 decode kernel packs
SM90 = (9, 0)
KERNEL_MODULES = {"triton": "triton==3.6.0", "cutlass": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi"}
ACCEPTED_KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16")
PREFILL_GRAPH_DISABLED = "disabled"  # sglang.srt.model_executor.cuda_graph_config.Backend.DISABLED


class MpfaSetupError(RuntimeError):
    """A configuration the MpFA backends cannot serve; the message is one line naming the fix."""


def _fail(message: str) -> None:
    raise MpfaSetupError(f"MpFA attention backend: {message}")


def prefill_path() -> str:
    """The extend implementation ``$MPFA_PREFILL`` selects (``kernel`` when unset)."""
    path = os.environ.get(PREFILL_ENV, PREFILL_PATHS[0])
    if path not in PREFILL_PATHS:
        _fail(f"{PREFILL_ENV}={path!r}: choose one of {', '.join(PREFILL_PATHS)}")
    return path


def numerics() -> ServedNumerics:
    """The numerics ``$MPFA_NUMERICS`` selects (``paper`` when unset); a bad value is one line."""
    try:
        return served_numerics()
    except ValueError as error:
        raise MpfaSetupError(f"MpFA attention backend: {error}") from None


def check_model(head_dim: int, v_head_dim: int, num_q_heads: int, num_kv_heads: int, dtype: str) -> None:
    """Model shape and dtype the sm90 kernels support (per tensor-parallel rank)."""
    if head_dim != HEAD_DIM or v_head_dim != HEAD_DIM:
        _fail(f"head_dim must be {HEAD_DIM} (the sm90 kernels are built for it), the model has q/k {head_dim}, "
              f"v {v_head_dim}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        _fail(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if num_q_heads // num_kv_heads > MAX_GROUP:
        _fail(f"at most {MAX_GROUP} query heads per KV head (GQA group), the model has "
              f"{num_q_heads // num_kv_heads}")
    if dtype.replace("torch.", "") not in ("bfloat16", "bf16"):
        _fail(f"the model must run in bfloat16 (the KV-write kernel takes BF16 q/k/v), got {dtype}; "
              f"pass --dtype bfloat16")


def check_device(capability: tuple[int, int] | None) -> None:
    """The decode kernel is compiled for sm_90a (H100/H200)."""
    if capability is None:
        _fail("needs a CUDA GPU (sm_90, H100/H200); none is visible")
    if tuple(capability) != SM90:
        _fail(f"needs an sm_90 GPU (H100/H200), this one is sm_{capability[0]}{capability[1]}")


def missing_kernel_modules(find: Callable[[str], Any] = importlib.util.find_spec) -> list[str]:
    """Kernel packages (pip names) that are not importable here."""
    missing = []
    for module, package in KERNEL_MODULES.items():
        try:
            found = find(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(package)
    return missing


def check_kernel_packages(find: Callable[[str], Any] = importlib.util.find_spec) -> None:
    if missing := missing_kernel_modules(find):
        _fail(f"missing kernel packages {', '.join(missing)}; install them with pip install -e '.[kernels]'")


def _get(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def check_server_args(args: Any) -> list[str]:
    """Validate an SGLang ``ServerArgs`` whose attention backend is an MpFA one and apply the setting the backend
    needs; returns a description of each setting changed (empty when the backend is not MpFA).

    Changed: the prefill CUDA graph is disabled (the prefill runs eagerly). The radix cache stays as the server
    asked: a cached prefix carries its writer's means at its first page (`kv_store`)."""
    backend = _get(args, "attention_backend")
    if not is_mpfa_backend(backend):
        return []
    for field in ("prefill_attention_backend", "decode_attention_backend"):
        other = _get(args, field)
        if other is not None and other != backend:
            _fail(f"--{field.replace('_', '-')} {other} differs from --attention-backend {backend}: the MpFA cache "
                  f"is written and read only by the MpFA backend")
    kv_dtype = str(_get(args, "kv_cache_dtype", "auto"))
    if kv_dtype not in ACCEPTED_KV_CACHE_DTYPES:
        _fail(f"--kv-cache-dtype {kv_dtype} is not supported: the backend stores its own NVFP4-K / FP8-V cache; "
              f"drop the flag")
    page_size = _get(args, "page_size")
    if page_size is not None and (page_size <= 0 or page_size & (page_size - 1)):
        _fail(f"--page-size must be a power of two, got {page_size}")
    unsupported = {
        "speculative decoding": _get(args, "speculative_algorithm") is not None,
        "hierarchical cache": bool(_get(args, "enable_hierarchical_cache", False)),
        "PD disaggregation": _get(args, "disaggregation_mode", "null") not in (None, "null"),
        "DP attention": bool(_get(args, "enable_dp_attention", False)),
        "the page-major KV layout": bool(_get(args, "enable_page_major_kv_layout", False)),
        "decode context parallelism": (_get(args, "dcp_size", 1) or 1) > 1,
        "attention context parallelism": (_get(args, "attn_cp_size", 1) or 1) > 1,
        "diffusion LLMs": _get(args, "dllm_algorithm") is not None,
        "the unified memory pool": bool(_get(args, "enable_unified_memory", False)),
    }
    for feature, enabled in unsupported.items():
        if enabled:
            _fail(f"{feature} is not supported")
    changes = []
    graphs = _get(args, "cuda_graph_config")
    prefill = getattr(graphs, "prefill", None)
    if prefill is not None and getattr(prefill, "backend", PREFILL_GRAPH_DISABLED) != PREFILL_GRAPH_DISABLED:
        prefill.backend = PREFILL_GRAPH_DISABLED
        changes.append("prefill CUDA graph disabled: the MpFA prefill runs eagerly (it reads the key lengths on the "
                       "host)")
    return changes

"""Startup checks on SGLang's ``ModelRunner`` (in each scheduler, before the KV pool is allocated) and on the
model's attention layers (when the backend is built). Objects are read by attribute; SGLang is imported lazily."""

from __future__ import annotations

from typing import Any

from .pool_sizing import PoolGeometry
from .setup_checks import HEAD_DIM, MpfaSetupError, check_device, check_kernel_packages, check_model


def attention_tp_size() -> int:
    from sglang.srt.layers.dp_attention import get_attention_tp_size

    return get_attention_tp_size()


def geometry_of(runner: Any, num_layers: int) -> PoolGeometry:
    """Per-rank heads, head_dim and KV layers of the runner's model."""
    config, tp = runner.model_config, attention_tp_size()
    return PoolGeometry(config.get_num_attention_heads(tp), config.get_num_kv_heads(tp), config.head_dim, num_layers)


def check_runner(runner: Any) -> None:
    """Device, kernel packages, model shape and pool family, before any memory is allocated."""
    import torch

    check_kernel_packages()
    check_device(torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    config, tp = runner.model_config, attention_tp_size()
    check_model(config.head_dim, config.v_head_dim, config.get_num_attention_heads(tp), config.get_num_kv_heads(tp),
                str(config.dtype))
    families = {
        "MLA models": bool(getattr(runner, "use_mla_backend", False)),
        "hybrid sliding-window models": bool(getattr(runner, "is_hybrid_swa", False)),
        "hybrid linear-attention (Mamba) models": getattr(runner, "mambaish_config", None) is not None,
        "speculative decoding": not runner.spec_algorithm.is_none() if hasattr(runner, "spec_algorithm") else False,
    }
    for family, present in families.items():
        if present:
            raise MpfaSetupError(f"MpFA attention backend: {family} are not supported (plain MHA/GQA only)")


def check_layers(model: Any) -> None:
    """Every attention layer is plain causal decoder attention with head_dim 128 and no logit cap or window."""
    layers = [m for m in model.modules() if hasattr(m, "tp_q_head_num") and hasattr(m, "layer_id")]
    for layer in layers:
        problems = []
        if layer.qk_head_dim != HEAD_DIM or layer.v_head_dim != HEAD_DIM:
            problems.append(f"head_dim {layer.qk_head_dim}/{layer.v_head_dim} (need {HEAD_DIM})")
        if getattr(layer, "logit_cap", 0) not in (0, 0.0, None):
            problems.append(f"logit cap {layer.logit_cap}")
        if (getattr(layer, "sliding_window_size", -1) or -1) > -1:
            problems.append(f"sliding window {layer.sliding_window_size}")
        if getattr(layer, "is_cross_attention", False):
            problems.append("cross attention")
        attn_type = getattr(getattr(layer, "attn_type", None), "value", "decoder")
        if attn_type != "decoder":
            problems.append(f"attention type {attn_type}")
        if problems:
            raise MpfaSetupError(f"MpFA attention backend: layer {layer.layer_id} is unsupported: "
                                 f"{', '.join(problems)}")

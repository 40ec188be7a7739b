"""The SGLang hooks (``sglang.srt.plugins.hook_registry``) that give the MpFA backends their server settings and
KV pool without forking SGLang. Every hook is a pass-through unless ``--attention-backend`` is an MpFA backend.

* ``ServerArgs.add_cli_args`` (AFTER): add ``--mpfa-prefill-kernel`` (`kernel_choice`; the one hook that acts
  whatever the backend: the argument must parse before the backend is known).
* ``ServerArgs._handle_attention_backend_compatibility`` (AFTER): validate the server arguments, the model, the
  prefill kernel choice, ``$MPFA_NUMERICS`` and the machine in the launcher, before any scheduler starts; disable
  the prefill CUDA graph.
* ``DefaultPoolConfigurator._compute_cell_size`` (AROUND): the MpFA bytes per token, the means' share included
  (`pool_sizing.cell_size`), so the token capacity SGLang derives from free memory reflects the real cache.
* ``ModelRunnerKVCacheMixin._init_pools`` (AROUND): run SGLang's own pool construction with its MHA pool class
  swapped for `MpfaTokenToKVPool` for the duration of the call (req_to_token pool and allocator stay SGLang's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .pool_sizing import cell_size
from .kernel_choice import add_server_arguments, check_prefill_kernel
from .setup_checks import (MpfaSetupError, check_device, check_kernel_packages, check_model, check_server_args,
                           numerics, prefill_path)
from .variants import is_mpfa_backend, variant_of

logger = logging.getLogger(__name__)

_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs._handle_attention_backend_compatibility"
_DEFAULT_PAGE_SIZE = 1  # SGLang's page size without --page-size
_CELL_SIZE = "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size"
_INIT_POOLS = "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._init_pools"
_MIXIN_MODULE = "sglang.srt.model_executor.model_runner_kv_cache_mixin"


def _backend_of(runner: Any) -> str | None:
    return getattr(runner.server_args, "attention_backend", None)


def after_add_cli_args(result: Any, parser: Any) -> None:
    add_server_arguments(parser)


def after_attention_backend_compat(result: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """Launcher-side validation; raises `MpfaSetupError` (one line) for any unsupported setup."""
    if not is_mpfa_backend(getattr(server_args, "attention_backend", None)):
        return None
    for change in check_server_args(server_args):
        logger.warning("MpFA attention backend: %s", change)
    check_kernel_packages()
    import torch

    check_device(torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
    config, tp = server_args.get_model_config(), max(1, int(getattr(server_args, "tp_size", 1) or 1))
    heads = config.get_num_attention_heads(tp), config.get_num_kv_heads(tp)
    check_model(config.head_dim, config.v_head_dim, *heads, str(config.dtype))
    if prefill_path() == "kernel":
        check_prefill_kernel(*heads, getattr(server_args, "page_size", None) or _DEFAULT_PAGE_SIZE)
    numerics()
    return None


def around_compute_cell_size(original: Callable, configurator: Any, runner: Any, num_layers: int, *args: Any,
                             **kwargs: Any) -> int:
    backend = _backend_of(runner)
    if not is_mpfa_backend(backend):
        return original(configurator, runner, num_layers, *args, **kwargs)
    from .runner_checks import geometry_of

    geometry, smoothing = geometry_of(runner, num_layers), variant_of(backend).smoothing
    page_size = getattr(runner.server_args, "page_size", None) or _DEFAULT_PAGE_SIZE
    size = cell_size(geometry, page_size, smoothing)
    logger.info("MpFA KV pool sizing: %d B/token over %d layers, frozen means included (BF16 pool: %d)", size,
                num_layers, 2 * geometry.num_kv_heads * geometry.head_dim * 2 * num_layers)
    return size


def pool_factory(runner: Any, backend: str) -> Callable[..., Any]:
    """A drop-in for SGLang's ``MHATokenToKVPool(...)`` call that builds the MpFA pool for this runner."""
    from .runner_checks import attention_tp_size
    from .sglang_pool import MpfaTokenToKVPool

    def make(*args: Any, **kwargs: Any) -> MpfaTokenToKVPool:
        return MpfaTokenToKVPool(
            *args, backend=backend, smoothing=variant_of(backend).smoothing,
            num_q_heads=runner.model_config.get_num_attention_heads(attention_tp_size()), **kwargs)

    return make


def around_init_pools(original: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
    backend = _backend_of(runner)
    if not is_mpfa_backend(backend):
        return original(runner, *args, **kwargs)
    import importlib

    from .runner_checks import check_runner
    from .sglang_pool import MpfaTokenToKVPool

    check_runner(runner)
    mixin = importlib.import_module(_MIXIN_MODULE)
    saved = mixin.MHATokenToKVPool
    mixin.MHATokenToKVPool = pool_factory(runner, backend)
    try:
        result = original(runner, *args, **kwargs)
    finally:
        mixin.MHATokenToKVPool = saved
    if not isinstance(runner.token_to_kv_pool, MpfaTokenToKVPool):
        raise MpfaSetupError(f"MpFA attention backend: SGLang built a {type(runner.token_to_kv_pool).__name__} for "
                             f"this model; only plain MHA/GQA models are supported")
    return result


def hook_table() -> dict[str, tuple[Callable, str]]:
    """Target -> (hook, HookType name)."""
    return {
        _CLI_ARGS: (after_add_cli_args, "AFTER"),
        _SERVER_ARGS: (after_attention_backend_compat, "AFTER"),
        _CELL_SIZE: (around_compute_cell_size, "AROUND"),
        _INIT_POOLS: (around_init_pools, "AROUND"),
    }


def register_hooks() -> None:
    """Register every hook once per process (load_plugins applies them right after the plugins ran)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    registered = getattr(HookRegistry, "_hooks", {})
    for target, (hook, kind) in hook_table().items():
        if any(existing is hook for _, existing, _ in registered.get(target, ())):
            continue
        HookRegistry.register(target, hook, HookType[kind])

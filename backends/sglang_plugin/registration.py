"""The plugin entry point's work: add the MpFA backends to SGLang's choices, registry and hooks (idempotent).

SGLang calls the entry point in the launcher (before parsing arguments) and again in every scheduler process.
Exceptions raised here are logged by SGLang and swallowed, so configuration errors are raised from the hooks and
the backend factory instead (`setup_checks`, `runner_checks`), where they stop the server.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

from .setup_checks import MpfaSetupError
from .variants import BACKEND_NAMES, variant_of

logger = logging.getLogger(__name__)


def require_sglang() -> None:
    if importlib.util.find_spec("sglang") is None:
        raise MpfaSetupError("MpFA attention backend: SGLang is not installed; install it with pip install -e "
                             "'.[serve]' (sglang==0.5.15.post1)")


def backend_factory(name: str) -> Callable[[Any], Any]:
    """SGLang's ``ATTENTION_BACKENDS[name]``: builds the backend for a model runner."""
    variant = variant_of(name)

    def create(runner: Any) -> Any:
        from .sglang_backend import MpfaAttnBackend

        return MpfaAttnBackend(runner, variant)

    create.__name__ = create.__qualname__ = f"create_{name.replace('-', '_')}_backend"
    return create


def register() -> None:
    """Add ``mpfa`` and ``mpfa-direct`` to ``--attention-backend``, register their factories and the hooks."""
    require_sglang()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from .hooks import register_hooks

    if new := [name for name in BACKEND_NAMES if name not in ATTENTION_BACKEND_CHOICES]:
        add_attention_backend_choices(new)
    for name in BACKEND_NAMES:
        if name not in ATTENTION_BACKENDS:
            register_attention_backend(name)(backend_factory(name))
    register_hooks()
    logger.info("MpFA SGLang plugin registered attention backends %s", ", ".join(BACKEND_NAMES))

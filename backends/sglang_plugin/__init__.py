"""The MpFA attention backends (``--attention-backend mpfa | mpfa-direct``) as an SGLang 0.5.15 plugin.

SGLang loads general plugins from the entry-point group ``sglang.srt.plugins`` and calls each loaded object with no
arguments, in the launcher and in every scheduler process; this package's entry point is `register`. Importing the
package is free of side effects and of SGLang/torch imports; `register` imports SGLang lazily.

Modules: `variants` (backend names), `setup_checks` / `runner_checks` (startup validation), `kernel_choice` (the
``--mpfa-prefill-kernel`` server argument and the kernels' log line), `pool_sizing` (byte accounting), `kv_store`
(cache + frozen means), `decode_plan` (page table, workspaces), `reference_extend` (the SLOW REFERENCE prefill path),
`attention` (one layer on plain tensors), `sglang_pool` / `sglang_backend` (SGLang adapters), `hooks` and
`registration` (wiring into SGLang).
"""

from __future__ import annotations

from .variants import BACKEND_NAMES

__all__ = ["BACKEND_NAMES", "register"]


def register() -> None:
    """Entry point (``sglang.srt.plugins``): register the MpFA backends with SGLang; idempotent."""
    from .registration import register as _register

    _register()

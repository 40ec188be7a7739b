"""Which attention kernels a backend's server runs: what each run records (`RunRecord.kernels`), `mpfa backends`
lists and the simulator says it simulates.

An MpFA backend's server runs the prefill kernel that `mpfa.kernels.sm90.dispatch` chooses for the served model's
query and KV heads and page size, and the split-KV decode. The override is the user's prefill kernel (`mpfa bench
--prefill-kernel`, passed on as the plugin's server argument), else ``$MPFA_PREFILL_KERNEL``, which the servers
inherit. With ``MPFA_PREFILL=reference`` in the server's environment the prefill is the plugin's PyTorch
reference path, no kernel. The numerics the kernels serve are ``$MPFA_NUMERICS``'s (`served_numerics`: ``paper``
unless set), which the servers inherit too: an MpFA record names them (``numerics``). Other backends run SGLang's
attention backend: their record names it.

`source` says where the names come from: ``dispatch`` (worked out here for what the server was asked to run) or
``simulated`` (the simulator's claim: no kernel ran).
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

from ...backends.specs import PREFILL_ENV, PREFILL_PATHS, BackendSpec
from ...kernels.served_numerics import PAPER, served_numerics
from ..errors import UserError

SGLANG_DEFAULT_PAGE_SIZE = 1
# What SGLang reports as the KV-cache dtype of a server launched without `--kv-cache-dtype` (the model's, BF16 here),
# and its other names: the dtype of every backend whose spec expects none.
SGLANG_DEFAULT_KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16")
REFERENCE_PREFILL = "pytorch-reference"


def runs_mpfa_kernels(spec: BackendSpec) -> bool:
    """Whether the backend's server runs the MpFA kernels (through the SGLang plugin)."""
    return spec.plugin is not None


def launch_page_size(spec: BackendSpec) -> int:
    """The KV-cache page size the backend's server is launched with (SGLang's default without `--page-size`)."""
    args = spec.sglang_args
    return int(args[args.index("--page-size") + 1]) if "--page-size" in args else SGLANG_DEFAULT_PAGE_SIZE


def _dispatch() -> ModuleType:
    """`mpfa.kernels.sm90.dispatch`, imported when an MpFA backend is asked about (the `mpfa.kernels` package
    imports PyTorch)."""
    try:
        from ...kernels.sm90 import dispatch
    except ImportError as exc:
        raise UserError(f"MpFA's kernel choice needs PyTorch ({exc}): pip install torch") from None
    return dispatch


def check_prefill_kernel(kernel: str | None) -> str | None:
    """The user's prefill kernel (``--prefill-kernel``), checked; None when not given."""
    if kernel is None:
        return None
    try:
        return _dispatch().requested_prefill_kernel(kernel)
    except ValueError as exc:
        raise UserError(f"--prefill-kernel: {exc}") from None


def served_kernels(spec: BackendSpec, q_heads: int, kv_heads: int, page_size: int, prefill_kernel: str | None = None,
                   source: str = "dispatch") -> dict[str, str]:
    """The kernels the backend's server runs for a model of ``q_heads``:``kv_heads`` heads on pages of
    ``page_size`` keys, ``prefill_kernel`` (else ``$MPFA_PREFILL_KERNEL``) overriding the choice, and for MpFA the
    numerics they serve; a shape the override does not fit, or an unknown ``$MPFA_NUMERICS``, is a UserError.
    ``source``: "dispatch" or "simulated" (see the module's docstring)."""
    if not runs_mpfa_kernels(spec):
        return {"attention_backend": spec.expect.get("attention_backend", spec.name), "source": source}
    dispatch = _dispatch()
    server_env = {**os.environ, **spec.env}
    try:
        choice = dispatch.requested_prefill_kernel(prefill_kernel)  # else $MPFA_PREFILL_KERNEL's
        prefill = dispatch.prefill_kernel(q_heads, kv_heads, page_size, choice)
        numerics = served_numerics(server_env)
    except ValueError as exc:
        raise UserError(f"{spec.name}: {exc}") from None
    if server_env.get(PREFILL_ENV) == PREFILL_PATHS[1]:
        prefill = REFERENCE_PREFILL
    kernels = {"prefill": prefill, "decode": dispatch.DECODE_KERNEL.name, "numerics": numerics.name}
    if choice is not None:
        kernels["prefill_override"] = choice
    return {**kernels, "source": source}


def kernel_server_args(spec: BackendSpec, prefill_kernel: str | None) -> list[str]:
    """The server flag that passes the user's prefill kernel on (the plugin's; serve-sim takes it too): only MpFA's
    servers take it."""
    if not prefill_kernel or not runs_mpfa_kernels(spec):
        return []
    from ...backends.sglang_plugin.kernel_choice import PREFILL_KERNEL_ARG

    return [PREFILL_KERNEL_ARG, prefill_kernel]


def describe_kernels(kernels: Mapping[str, str]) -> str:
    """One line: "prefill fp8 (override), decode split-kv" (", numerics had128-k46" when they are not the paper's)
    or "SGLang attention backend fa4", then "(simulated)" for the simulator's claim; "not recorded" for runs stored
    before kernels were."""
    if not kernels:
        return "not recorded"
    if "attention_backend" in kernels:
        text = f"SGLang attention backend {kernels['attention_backend']}"
    else:
        override = " (override)" if kernels.get("prefill_override") else ""
        numerics = kernels.get("numerics", PAPER.name)  # runs stored before the option served the paper's
        text = f"prefill {kernels['prefill']}{override}, decode {kernels['decode']}"
        text += "" if numerics == PAPER.name else f", numerics {numerics}"
    return f"{text} (simulated: no kernel ran)" if kernels.get("source") == "simulated" else text

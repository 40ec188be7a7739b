"""Which sm90 kernels the backend runs: `mpfa.kernels.sm90.dispatch` chooses them; the plugin adds the server
argument that overrides the prefill choice, checks it against the model in the launcher and logs what runs.

``--mpfa-prefill-kernel {fp8,exact,mma-sync}`` sets ``MPFA_PREFILL_KERNEL`` while SGLang parses the launcher's
arguments, before any scheduler process starts, so every process of the server runs the same kernel (they inherit
the launcher's environment). SGLang-free: the parser is any ``argparse.ArgumentParser``.
"""

from __future__ import annotations

import argparse
import logging
import os
from functools import lru_cache
from typing import Any

from .setup_checks import MpfaSetupError
from ...kernels.sm90 import dispatch

logger = logging.getLogger(__name__)

PREFILL_KERNEL_ARG = "--mpfa-prefill-kernel"


class _ExportPrefillKernel(argparse._StoreAction):  # a store action: SGLang's --config files take only those
    """Check the choice (`dispatch.requested_prefill_kernel`), store it and export it as ``MPFA_PREFILL_KERNEL`` for
    the server's processes."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            kernel = dispatch.requested_prefill_kernel(values)
        except ValueError as error:
            raise argparse.ArgumentError(self, str(error)) from None
        super().__call__(parser, namespace, kernel, option_string)
        os.environ[dispatch.PREFILL_KERNEL_ENV] = kernel


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--mpfa-prefill-kernel`` to SGLang's server arguments."""
    parser.add_argument(
        PREFILL_KERNEL_ARG, metavar="{" + ",".join(dispatch.PREFILL_KERNELS) + "}", default=None,
        action=_ExportPrefillKernel,
        help="MpFA attention backends: the sm90 prefill kernel (sets MPFA_PREFILL_KERNEL for every server "
             "process); default: fp8 where the model's shape fits it, else mma-sync. "
             + "; ".join(f"{name}: {k.computes}" for name, k in dispatch.PREFILL_KERNELS.items()))


def check_prefill_kernel(num_q_heads: int, num_kv_heads: int, page_size: int) -> str:
    """The prefill kernel the server will run for this shape (per tensor-parallel rank); a requested kernel the
    shape does not take is one line of `MpfaSetupError`."""
    try:
        return dispatch.prefill_kernel(num_q_heads, num_kv_heads, page_size)
    except ValueError as error:
        raise MpfaSetupError(f"MpFA attention backend: {error}") from None


@lru_cache(maxsize=None)
def log_kernels(backend: str, num_q_heads: int, num_kv_heads: int, page_size: int, prefill_path: str,
                numerics: str) -> None:
    """Log once per process and shape which kernels the backend runs, in which numerics (``$MPFA_NUMERICS``)."""
    prefill = (f"sm90 {check_prefill_kernel(num_q_heads, num_kv_heads, page_size)}" if prefill_path == "kernel"
               else "SLOW REFERENCE PATH ($MPFA_PREFILL=reference; its timings are not MpFA's)")
    logger.info("MpFA backend %s, %d:%d heads, pages of %d: decode = sm90 %s, prefill = %s, numerics = %s",
                backend, num_q_heads, num_kv_heads, page_size, dispatch.DECODE_KERNEL.name, prefill, numerics)

"""Backends of your own without editing the package: `$MPFA_EXTENSIONS` names modules (comma-separated) that
register them (`mpfa.backends.specs.register_backend`). Every `mpfa` process imports them before its command runs,
the simulator servers a bench starts included (they inherit the environment)."""
from __future__ import annotations

import importlib
import os

from ..errors import UserError

EXTENSIONS_ENV = "MPFA_EXTENSIONS"


def load_extensions() -> None:
    """Import every module `$MPFA_EXTENSIONS` names; one that fails is a UserError naming it."""
    for module in [m.strip() for m in os.environ.get(EXTENSIONS_ENV, "").split(",") if m.strip()]:
        try:
            importlib.import_module(module)
        except Exception as exc:  # an extension's own error (a duplicate name, a bad spec) is one line too
            raise UserError(f"${EXTENSIONS_ENV}: cannot load '{module}': {type(exc).__name__}: {exc}") from None

"""The errors the harness and the profiler raise; the CLI prints each as one line and exits non-zero."""
from __future__ import annotations

from collections.abc import Iterable


class UserError(Exception):
    """Bad input or an unusable environment; `exit_code` is what the CLI exits with."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def field_names(names: Iterable[str]) -> str:
    """Field names from a user's file for a one-line message: plain names as they are, any other quoted (a key may
    hold a newline)."""
    return ", ".join(name if name.isidentifier() else repr(name) for name in names)


class ProfileError(RuntimeError):
    """The profile cannot run here (no CUDA device, not enough memory, ...)."""


class ServingProfileError(ProfileError):
    """A serving profile failed: the server refused a profile request, a request failed, or no usable trace."""


class ToolError(RuntimeError):
    """An external profiler (ncu, nsys) is missing, lacks permission, or produced no usable report."""

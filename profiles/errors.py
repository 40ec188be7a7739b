"""Errors the profiler raises; the CLI prints each as one line and exits non-zero."""
from __future__ import annotations


class ProfileError(RuntimeError):
    """The profile cannot run here (no CUDA device, not enough memory, ...)."""


class ServingProfileError(ProfileError):
    """A serving profile failed: the server refused a profile request, a request failed, or no usable trace."""


class KernelNotBuilt(RuntimeError):
    """The backend's kernel does not exist yet; its row says so instead of showing a number."""


class ToolError(RuntimeError):
    """An external profiler (ncu, nsys) is missing, lacks permission, or produced no usable report."""

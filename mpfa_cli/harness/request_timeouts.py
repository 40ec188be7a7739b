"""How long a request may wait, in one place: the client's connections enforce it (`stamped_reads`), the CLI shows
its defaults (nothing else is imported here, so `mpfa --help` stays quick)."""
from __future__ import annotations

import dataclasses


class BadTimeout(ValueError):
    """A timeout that is not a positive, finite number of seconds; `field` names it."""

    def __init__(self, field: str, value: float) -> None:
        super().__init__(f"timeout {field} must be a positive number of seconds, got {value}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds a request may wait before it fails with the reason (all > 0)."""

    connect_s: float = 30.0
    first_token_s: float = 1800.0  # from dispatch to the first body bytes: a queued 128K prefill can be minutes
    chunk_s: float = 600.0  # silence between reads once the body has started
    request_s: float = 7200.0  # the whole request, from dispatch to the end of its body

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not 0 < value < float("inf"):
                raise BadTimeout(field.name, value)

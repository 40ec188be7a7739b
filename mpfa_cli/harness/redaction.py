"""Secrets out of what a run stores: the values of secret-looking server flags (`--api-key=...`, `--hf-token X`,
passwords) and of secret-looking keys in a server's own report (SGLang's `/get_server_info` lists `api_key`).

The server itself is launched with the real values; only the stored copy (and so every export) says `<redacted>`.
A flag is secret-looking when its last word is key, token, password, secret or credentials, or any word is
password, passwd or secret (`--admin-api-key`, `--ssl-keyfile-password`; not `--max-total-tokens`, whose last word is
tokens).
"""
from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
_SECRET_LAST_WORDS = {"key", "apikey", "token", "password", "passwd", "secret", "credential", "credentials"}
_SECRET_WORDS = {"password", "passwd", "secret", "apikey"}


def is_secret_name(name: str) -> bool:
    """Whether a flag (`--api-key`) or key (`api_key`) names a secret."""
    words = [w for w in re.split(r"[-_.\s]+", name.lower()) if w]
    return bool(words) and (words[-1] in _SECRET_LAST_WORDS or bool(_SECRET_WORDS & set(words)))


def redact_args(args: list[str]) -> list[str]:
    """Server flags with every secret-looking flag's value replaced: `--api-key=s3cret` and `--api-key s3cret`
    become `--api-key=<redacted>` and `--api-key <redacted>`."""
    redacted: list[str] = []
    hide_next = False
    for arg in args:
        if hide_next and not arg.startswith("--"):
            redacted.append(REDACTED)
            hide_next = False
            continue
        flag, equals, _ = arg.partition("=")
        secret = arg.startswith("-") and is_secret_name(flag)
        redacted.append(f"{flag}={REDACTED}" if secret and equals else arg)
        hide_next = secret and not equals
    return redacted


def redact_info(value: Any) -> Any:
    """A server's report with the value of every secret-looking key replaced (unless it holds no secret: null, a
    boolean, ""), and any list of strings redacted as server flags; nested objects too."""
    if isinstance(value, dict):
        return {k: REDACTED if is_secret_name(str(k)) and _may_hold_secret(v) else redact_info(v)
                for k, v in value.items()}
    if isinstance(value, list):
        items = [redact_info(v) for v in value]
        return redact_args(items) if items and all(isinstance(v, str) for v in items) else items
    return value


def _may_hold_secret(value: Any) -> bool:
    return not (value is None or isinstance(value, bool) or value == "")

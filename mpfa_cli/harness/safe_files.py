"""Files and folders mpfa writes for the user: never through a symbolic link, owner-only (0600 files, 0700 folders).

A path given by the user (`--db`, `export -o`, `--baseline`, a log beside the database) may be a link someone
planted to make mpfa overwrite its target; each helper here refuses a link at the path in one line. A file that
replaces another is written beside it and renamed over it (a rename replaces a link, never its target), so it is
whole or not there. Folders above the path are the user's own and are followed as they are.
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, BinaryIO

from ..errors import UserError

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIR_MODE = 0o700
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def refuse_link(path: Path, what: str) -> None:
    """A one-line UserError when `path` is a symbolic link (dangling or not)."""
    if path.is_symlink():
        raise UserError(f"{what} {path} is a symbolic link; mpfa does not write through one: give the real path")


def private_dir(path: Path, what: str) -> Path:
    """`path` as a folder, created owner-only (missing parents too) unless it exists; returns it."""
    try:
        path.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the folder of {what} {path}: {_reason(exc)}") from None
    return path


def touch_private(path: Path, what: str) -> None:
    """Create `path` empty and owner-only unless it exists; a link there is refused."""
    refuse_link(path, what)
    try:
        os.close(os.open(path, _NEW_FILE | os.O_EXCL, PRIVATE_FILE_MODE))
    except FileExistsError:
        refuse_link(path, what)  # created meanwhile, as a link
    except OSError as exc:
        raise UserError(f"cannot create {what} {path}: {_reason(exc)}") from None


def append_private(path: Path, what: str, exclusive: bool = False) -> BinaryIO:
    """`path` opened for appending, created owner-only if missing (`exclusive`: it must not exist yet)."""
    flags = _NEW_FILE | os.O_APPEND | (os.O_EXCL if exclusive else 0)
    refuse_link(path, what)
    try:
        return os.fdopen(os.open(path, flags, PRIVATE_FILE_MODE), "ab")
    except OSError as exc:
        raise UserError(f"cannot write {what} {path}: {_reason(exc)}") from None


@contextmanager
def replace_private(path: Path, what: str, binary: bool = False) -> Iterator[IO]:
    """A stream whose content becomes `path` when the block ends without error: a new owner-only file beside it,
    renamed over it then (removed on error). Text streams are UTF-8 with newlines as written."""
    refuse_link(path, what)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(temporary, _NEW_FILE | os.O_EXCL, PRIVATE_FILE_MODE)
        try:
            with (os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8", newline="")) as stream:
                yield stream
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    except OSError as exc:
        raise UserError(f"cannot write {what} {path}: {_reason(exc)}") from None


def write_private(path: Path, data: bytes, what: str) -> None:
    """`data` as the whole of `path` (see `replace_private`)."""
    with replace_private(path, what, binary=True) as stream:
        stream.write(data)


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)

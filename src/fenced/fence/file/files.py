"""Durable file primitives of the file store, and the errors a failed one raises.

Writes are complete (:func:`write_all` loops over short writes) and synced before they return;
:func:`replace_file` renames a synced temporary file over its target, so a reader sees the old
or the new content, never a mix. An :class:`OSError` inside ``with translated(what):`` becomes
:class:`~fenced.ConfigurationError` when retrying cannot help (no permission, read-only, not a
directory) and :class:`~fenced.Unavailable` otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

from fenced.core.errors import ConfigurationError, FencedError, Unavailable
from fenced.fence.translated import Translated

CONFIG_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR}
"""Errors that retrying cannot fix: a configuration error, not an unavailable store."""


def os_error(error: OSError, what: str) -> FencedError:
    if error.errno in CONFIG_ERRNOS:
        return ConfigurationError(f"{what}: {error}")
    return Unavailable(f"{what}: {error}; nothing was changed, retry")


class translated(Translated):
    """``with translated(what):`` turns an OSError into the fenced error for doing ``what``."""

    __slots__ = ()
    catches = OSError
    translate = staticmethod(os_error)


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_dir(path: Path) -> None:
    """Create ``path`` (its parent exists) and make the new entry durable."""
    if path.is_dir():
        return
    try:
        path.mkdir()
    except FileExistsError:
        if not path.is_dir():
            raise
        return
    fsync_dir(path.parent)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_whole(path: str) -> bytes:
    """The bytes of ``path`` up to its size when opened (what is appended later may be left)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        chunks = [os.read(fd, size)]  # a buffer of the file's size, not of a fixed maximum
        while (got := sum(map(len, chunks))) < size and (chunk := os.read(fd, size - got)):
            chunks.append(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


def write_file(path: str | Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, data: bytes) -> None:
    """Replace ``path`` by a synced temporary file; the caller syncs the directory."""
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        write_file(temporary, data)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0

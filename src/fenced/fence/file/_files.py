"""Durable file primitives of the file store, and the errors a failed one raises.

Writes are complete (:func:`write_all` loops over short writes) and synced before they return;
:func:`replace_file` renames a synced temporary file over its target, so a reader sees the old
or the new content, never a mix. An :class:`OSError` inside ``with translated(what):`` becomes
:class:`~fenced.ConfigurationError` when retrying cannot help (no permission, read-only, not a
directory) and :class:`~fenced.Unavailable` otherwise.

Every file and directory the store creates gets its mode from the directory it is created in
(:mod:`fenced._drivers.permissions`): ``0600`` and ``0700`` whatever the umask, ``0660`` and
``2770`` in a shared (setgid group) directory. The modes of existing ones are never changed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

from fenced._drivers.permissions import (
    create_file,
    make_directory,
    new_directory_mode,
    new_file_mode,
)
from fenced.core._errors import ConfigurationError, FencedError, Unavailable
from fenced.fence._translated import Translated

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


def ensure_dir(path: Path, mode: int | None = None) -> None:
    """Create ``path`` (its parent exists) and make the new entry durable. Its mode is ``mode``,
    or (None) the one its parent gives (``0700``, or ``2770`` in a shared directory)."""
    if path.is_dir():
        return
    if make_directory(path, new_directory_mode(path.parent) if mode is None else mode):
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


def new_file(path: str | Path, flags: int = os.O_WRONLY) -> int:
    """Create ``path`` (``FileExistsError`` if it exists) with the mode its directory gives;
    return its descriptor, opened with ``flags``."""
    return create_file(path, new_file_mode(os.path.dirname(path) or "."), flags)


def open_creating(path: str, flags: int) -> int:
    """Open ``path`` with ``flags``, creating it (as :func:`new_file` does) if it is missing."""
    try:
        return os.open(path, flags | os.O_CLOEXEC)
    except FileNotFoundError:
        pass
    try:
        return new_file(path, flags)
    except FileExistsError:  # created by another process meanwhile
        return os.open(path, flags | os.O_CLOEXEC)


def write_file(path: str | Path, data: bytes) -> None:
    fd = new_file(path)
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

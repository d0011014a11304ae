"""The modes of the files and directories fenced creates on a local file system: the embedded
coordinator's database and the ``sqlite:`` and ``file:`` stores.

Private by default, whatever the umask (the mode is set again after creating, since the umask
may have taken bits away):

- a file fenced creates is ``0600``, a directory ``0700``;
- **a shared directory** — setgid, group-writable and group-searchable, not writable by others
  (``install -d -m 2770 -g GROUP DIR``) — is the one way to widen this: a file created in it is
  ``0660`` and a directory created in it (by the stores, inside their own directory) ``2770``.
  The setgid bit gives each the directory's group, and passes the sharing on to what is created
  below. Nothing fenced creates is ever readable or writable by others;
- the mode of a file or directory that exists is never changed here.

Failure behaviour: the functions raise the :class:`OSError` of the failing system call; a file
created before a failing ``fchmod`` is closed (its mode then is what the umask left).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = [
    "PRIVATE_DIRECTORY",
    "PRIVATE_FILE",
    "SHARED_DIRECTORY",
    "SHARED_FILE",
    "create_file",
    "create_missing",
    "is_shared",
    "make_directory",
    "new_directory_mode",
    "new_file_mode",
]

PRIVATE_FILE = 0o600
SHARED_FILE = 0o660
PRIVATE_DIRECTORY = 0o700
SHARED_DIRECTORY = 0o2770


def is_shared(directory: str | Path) -> bool:
    """True if ``directory`` is deliberately shared with its group: setgid, group-writable and
    group-searchable, and not writable by others (``/tmp`` is not)."""
    mode = os.stat(directory).st_mode
    return bool(
        mode & stat.S_ISGID
        and mode & stat.S_IWGRP
        and mode & stat.S_IXGRP
        and not mode & stat.S_IWOTH
    )


def new_file_mode(directory: str | Path) -> int:
    """The mode of a file fenced creates in ``directory``: ``0660`` in a shared directory, else
    ``0600``."""
    return SHARED_FILE if is_shared(directory) else PRIVATE_FILE


def new_directory_mode(directory: str | Path) -> int:
    """The mode of a directory a store creates in ``directory`` (inside the store's own
    directory): ``2770`` in a shared directory, else ``0700``."""
    return SHARED_DIRECTORY if is_shared(directory) else PRIVATE_DIRECTORY


def create_file(path: str | Path, mode: int, flags: int = os.O_WRONLY) -> int:
    """Create ``path``, which must not exist (``FileExistsError`` if it does), with exactly
    ``mode``; return its descriptor, opened with ``flags`` (``O_CREAT | O_EXCL | O_CLOEXEC``
    added)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits away
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_missing(path: str | Path, mode: int) -> bool:
    """Create ``path`` as an empty file with exactly ``mode``; False if it exists already
    (another opener may just have created it; its mode is left as it is)."""
    try:
        os.close(create_file(path, mode))
    except FileExistsError:
        return False
    return True


def make_directory(path: str | Path, mode: int) -> bool:
    """Create the directory ``path`` (its parent exists) with exactly ``mode``; False if a
    directory was there already (its mode is left as it is). ``FileExistsError`` if something
    else is there."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path):
            raise
        return False
    os.chmod(path, mode)  # the umask may have taken bits away
    return True

"""The lock of a resource's critical section: an exclusive ``flock`` on its lock file.

The lock file holds no data; closing its descriptor releases the lock, so a process that dies
holding it releases it too. A lock held by another writer for longer than the caller's timeout
raises :class:`~fenced.Unavailable`.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from fenced.core._errors import Unavailable
from fenced.fence.file._files import open_creating


@contextmanager
def flocked(path: str, timeout: float, then: str) -> Iterator[None]:
    """Hold an exclusive flock on ``path``; poll up to ``timeout`` seconds, then Unavailable.

    ``then``: what the error says about the caller's state, after the reason.
    """
    fd = open_creating(path, os.O_RDWR)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise Unavailable(
                        f"another writer held the lock {path} for over {timeout}s; {then}"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock

"""Waiting for another process's SQLite write lock, the same way in every SQLite backend.

SQLite's own busy handler sleeps 1-100 ms between attempts, and some steps bypass it altogether
(switching a new database file to WAL answers ``SQLITE_BUSY`` at once while another process opens
the same file). :func:`retrying` waits in short sleeps instead. Used by the SQLite store and,
from the layer above, by the embedded coordinator.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["error_code", "is_busy", "retrying"]

T = TypeVar("T")
_FIRST_PAUSE = 50e-6
_MAX_PAUSE = 1e-3


def error_code(error: sqlite3.Error) -> int:
    """The primary result code of ``error`` (``SQLITE_BUSY``, …), -1 if it carries none."""
    code = getattr(error, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else -1


def is_busy(error: sqlite3.Error) -> bool:
    """True for SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock; nothing done."""
    return error_code(error) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def retrying(step: Callable[..., T], *args: Any, timeout: float) -> T:
    """Run ``step(*args)`` (which changes nothing when it fails with SQLITE_BUSY) until it gets
    the lock: short sleeps, doubling from 50 µs to 1 ms, for at most ``timeout`` seconds; then the
    last SQLITE_BUSY error propagates. Any other error propagates at once."""
    try:
        return step(*args)
    except sqlite3.OperationalError as error:
        if not is_busy(error):
            raise
    deadline = time.monotonic() + timeout
    pause = _FIRST_PAUSE
    while True:
        time.sleep(pause)
        try:
            return step(*args)
        except sqlite3.OperationalError as error:
            if not is_busy(error) or time.monotonic() >= deadline:
                raise
        pause = min(pause * 2, _MAX_PAUSE)

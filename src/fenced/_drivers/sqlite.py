"""The ``sqlite3`` plumbing of every SQLite component (the embedded coordinator, the SQLite store
and its guard): waiting for another process's write lock, ending a transaction, and translating
driver errors.

SQLite's own busy handler sleeps 1-100 ms between attempts, and some steps bypass it altogether
(switching a new database file to WAL answers ``SQLITE_BUSY`` at once while another process opens
the same file). :func:`retrying` waits in short sleeps instead.

:func:`translate` is the one mapping of a ``sqlite3.Error`` to the fenced error a caller can act
on; the caller raises it ``from`` the driver's error, so the cause stays attached.

:func:`commit` and :func:`rollback` end a transaction: a failed ``COMMIT`` is rolled back before
its error goes on, and a rollback never raises (SQLite rolls a transaction back anyway on error
or close).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fenced.core._errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable

__all__ = ["commit", "error_code", "is_busy", "retrying", "rollback", "translate"]

T = TypeVar("T")
_FIRST_PAUSE = 50e-6
_MAX_PAUSE = 1e-3
_CORRUPT = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
_UNUSABLE = frozenset(
    {sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH}
)


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


def rollback(conn: sqlite3.Connection) -> None:
    """Roll back the transaction of ``conn``, if one is open; never raises."""
    if conn.in_transaction:
        # if ROLLBACK fails the transaction is gone anyway: SQLite rolls back on error or close
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def commit(conn: sqlite3.Connection) -> None:
    """``COMMIT`` the transaction of ``conn``. If that fails, the transaction is rolled back
    and the driver's error propagates, for the caller to translate as a commit's (the change
    may or may not have reached the database, unless it was busy)."""
    try:
        conn.execute("COMMIT")
    except sqlite3.Error:
        rollback(conn)
        raise


def translate(
    error: sqlite3.Error, what: str, *, where: str = "", committing: bool = False
) -> FencedError:
    """The fenced error for ``error``, raised while doing ``what`` on the database ``where`` (a
    path, or empty when ``what`` names it already).

    - Busy or locked (another process kept the write lock) → :class:`~fenced.Unavailable`:
      nothing was changed.
    - A corrupt file or not a database → :class:`~fenced.ConfigurationError`; a file that
      cannot be opened or written → ``ConfigurationError``; a misuse of the driver
      (``ProgrammingError``, ``InterfaceError``) → ``ConfigurationError``.
    - Any other failure of a step that commits a write (``committing``) →
      :class:`~fenced.OutcomeUnknown`: the commit may have reached the database; otherwise →
      ``Unavailable``: nothing was changed.
    """
    at = f" {where}" if where else ""
    name = getattr(error, "sqlite_errorname", None) or type(error).__name__
    detail = f"{error} ({name})"
    code = error_code(error)
    if is_busy(error):
        return Unavailable(
            f"{what}: the database{at} is busy, locked by another process ({detail}); "
            "nothing was changed, retry"
        )
    if code in _CORRUPT:
        return ConfigurationError(
            f"{what}: the database{at} is not a usable SQLite database ({detail})"
        )
    if code in _UNUSABLE:
        return ConfigurationError(f"{what}: cannot open or write the database{at} ({detail})")
    if isinstance(error, sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return ConfigurationError(f"{what}: {detail}")
    if committing:
        return OutcomeUnknown(
            f"{what}: the commit to the database{at} failed ({detail}); it may or may not have "
            "taken effect"
        )
    return Unavailable(f"{what}: the database{at} failed ({detail}); nothing was changed")

"""How a transaction of the ``sqlite:`` store ends: :func:`commit` and :func:`rollback`.

A failed ``COMMIT`` is rolled back and raised as :class:`Unavailable` when the database was busy
(nothing changed), else as :class:`OutcomeUnknown` (the change may or may not be on disk). A
rollback never raises: SQLite rolls a transaction back anyway on error or close.
"""

from __future__ import annotations

import contextlib
import sqlite3

from fenced._drivers.sqlite import is_busy
from fenced.core._errors import OutcomeUnknown, Unavailable

__all__ = ["commit", "rollback"]


def rollback(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        # if ROLLBACK fails the transaction is gone anyway: SQLite rolls back on error or close
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")


def commit(conn: sqlite3.Connection, what: str) -> None:
    try:
        conn.execute("COMMIT")
    except sqlite3.Error as error:
        busy = is_busy(error)
        rollback(conn)
        if busy:
            raise Unavailable(f"{what}: the database is busy; nothing changed, retry") from error
        raise OutcomeUnknown(
            f"{what}: COMMIT failed ({error}); the change may or may not have been applied: "
            "retry with the same op_id to find out"
        ) from error

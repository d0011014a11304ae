"""How a write transaction of the ``sqlite:`` store ends: :func:`commit`.

A failed ``COMMIT`` is rolled back (:func:`fenced._drivers.sqlite.commit`) and raised as
:class:`Unavailable` when the database was busy (nothing changed), else as
:class:`OutcomeUnknown` (the change may or may not be on disk: the same ``op_id`` finds out).
"""

from __future__ import annotations

import sqlite3

from fenced._drivers import sqlite as sqlite_driver
from fenced._drivers.sqlite import is_busy
from fenced.core._errors import OutcomeUnknown, Unavailable

__all__ = ["commit"]


def commit(conn: sqlite3.Connection, what: str) -> None:
    try:
        sqlite_driver.commit(conn)
    except sqlite3.Error as error:
        if is_busy(error):
            raise Unavailable(f"{what}: the database is busy; nothing changed, retry") from error
        raise OutcomeUnknown(
            f"{what}: COMMIT failed ({error}); the change may or may not have been applied: "
            "retry with the same op_id to find out"
        ) from error

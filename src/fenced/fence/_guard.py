"""``guard(connection, token)``: the fencing check inside the caller's own SQL transaction.

The guard keeps one row per resource in a table ``fenced_fence(resource PRIMARY KEY,
coordinator_id, epoch)`` of the caller's database (created if missing) and, inside the caller's
open transaction, moves it to ``token.epoch`` only if the epoch is not below the stored one and
the coordinator id matches. The row write takes the database's write lock, held until the
caller commits, so the check is atomic with the caller's own writes in that transaction::

    A (81): BEGIN IMMEDIATE; guard(81) ok; UPDATE ... ── pause ────────────── COMMIT ok
    B (82):                  BEGIN IMMEDIATE ── waits for A's lock ──────── guard(82) ok; ...
    A (81): BEGIN IMMEDIATE; UPDATE ...; guard(81) → StaleToken, A's UPDATE rolled back

The guard has **no separate install step**: it follows the monotonic rule (the largest epoch it
has seen wins). To install a new epoch before the first real write (a strict handoff), run the
guard once in a transaction of its own: ``BEGIN IMMEDIATE; guard(conn, token); COMMIT``.

Backends dispatch on the connection's type (:func:`functools.singledispatch`): another module
adds, say, psycopg with ``@guard.register(psycopg.Connection)``.
"""

from __future__ import annotations

import functools
import sqlite3

from fenced._drivers.sqlite import translate
from fenced.core._errors import ConfigurationError, ForeignToken, StaleToken
from fenced.core._token import FencingToken

__all__ = ["FENCE_TABLE", "guard"]

FENCE_TABLE = "fenced_fence"


@functools.singledispatch
def guard(connection: object, token: FencingToken) -> int:
    """Check and record ``token`` inside ``connection``'s open transaction; return its epoch.

    Call it inside your transaction, before (or among) your writes, then commit as usual. If the
    token is stale (its epoch is below the recorded one) or comes from another coordinator than
    the one the resource is bound to, the guard **rolls back your transaction** (your earlier
    writes in it are undone) and raises :class:`~fenced.StaleToken` /
    :class:`~fenced.ForeignToken`. A connection with no open transaction is a
    :class:`~fenced.ConfigurationError` (begin one first, e.g. ``BEGIN IMMEDIATE``); so is a
    connection type without a registered guard. Driver errors (busy, …) also roll back and are
    translated (:class:`~fenced.Unavailable`, …): your writes never commit unguarded.
    """
    if type(connection).__module__.partition(".")[0] in ("psycopg", "sqlalchemy"):
        from fenced.fence.postgres._guard import guard_postgres  # noqa: PLC0415

        return guard_postgres(connection, token)
    kind = type(connection)
    raise ConfigurationError(
        f"no fenced guard for {kind.__module__}.{kind.__qualname__} connections "
        f"(available: {', '.join(sorted(_names()))})"
    )


def _names() -> list[str]:
    return [f"{k.__module__}.{k.__qualname__}" for k in guard.registry if k is not object]


def _check_token(token: object) -> FencingToken:
    if not isinstance(token, FencingToken):
        raise ConfigurationError(f"guard needs a fenced.FencingToken, got {type(token).__name__}")
    return token


@guard.register
def _guard_sqlite3(connection: sqlite3.Connection, token: FencingToken) -> int:
    token = _check_token(token)
    if not connection.in_transaction:
        raise ConfigurationError(
            "guard() must run inside your open transaction: execute 'BEGIN IMMEDIATE' (or make "
            "your first write) before calling guard(connection, token)"
        )
    try:
        connection.execute(
            f"CREATE TABLE IF NOT EXISTS {FENCE_TABLE}(resource TEXT PRIMARY KEY,"
            " coordinator_id TEXT NOT NULL, epoch INTEGER NOT NULL)"
        )
        before = connection.total_changes
        connection.execute(
            f"INSERT INTO {FENCE_TABLE}(resource, coordinator_id, epoch) VALUES (?, ?, ?)"
            " ON CONFLICT(resource) DO UPDATE SET epoch = excluded.epoch"
            f" WHERE {FENCE_TABLE}.coordinator_id = excluded.coordinator_id"
            f" AND {FENCE_TABLE}.epoch <= excluded.epoch",
            (token.resource, token.coordinator_id, token.epoch),
        )
        accepted = connection.total_changes > before
        row = None
        if not accepted:
            row = connection.execute(
                f"SELECT coordinator_id, epoch FROM {FENCE_TABLE} WHERE resource = ?",
                (token.resource,),
            ).fetchone()
    except sqlite3.Error as error:
        connection.rollback()
        raise translate(error, f"guard({token.resource!r})") from error
    if accepted:
        return token.epoch
    connection.rollback()
    coordinator_id, epoch = row if row is not None else (token.coordinator_id, token.epoch)
    if coordinator_id != token.coordinator_id:
        raise ForeignToken(token.resource, token.coordinator_id, coordinator_id)
    raise StaleToken(token.resource, token.epoch, epoch)

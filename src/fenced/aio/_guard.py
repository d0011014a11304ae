"""``await fenced.aio.guard(connection, token)``: the fencing check inside the caller's own
asyncio SQL transaction, for psycopg's ``AsyncConnection`` and SQLAlchemy's ``AsyncConnection``
(``sqlalchemy.ext.asyncio``, PostgreSQL).

The semantics are :func:`fenced.guard`'s for PostgreSQL (:mod:`fenced.fence.postgres._guard`):
inside the caller's open transaction, one statement moves the resource's row to
``token.epoch`` if the epoch is not below the recorded one and the coordinator matches; the
row lock is held until the caller's COMMIT, so the check is atomic with the caller's writes. A
stale (or foreign) token makes the server abort the caller's transaction — its earlier writes
never commit — and raises :class:`~fenced.StaleToken` (:class:`~fenced.ForeignToken`). No open
transaction (an autocommit connection outside ``transaction()``, an ``AUTOCOMMIT`` SQLAlchemy
connection) or an unsupported connection type is a :class:`~fenced.ConfigurationError`.

One copy of the SQL and of the logic: a psycopg ``AsyncConnection`` runs the sync guard's
statements (:func:`~fenced.fence.postgres._guard.check_statement`,
:func:`~fenced.fence.postgres._guard.ensure_steps`) with ``await``; a SQLAlchemy
``AsyncConnection`` runs the sync SQLAlchemy guard itself through ``run_sync`` (SQLAlchemy's way
of running sync code on an async connection: its statements still go through the async driver,
so the loop is never blocked, and SQLAlchemy keeps track of its transaction).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fenced.core._errors import ConfigurationError
from fenced.core._token import FencingToken

if TYPE_CHECKING:
    from fenced.fence.postgres._guard import Steps

__all__ = ["guard"]


async def guard(connection: object, token: FencingToken) -> int:
    """Check and record ``token`` inside ``connection``'s open transaction; return its epoch.

    ``connection`` is a psycopg ``AsyncConnection`` (not in autocommit mode, or inside ``async
    with conn.transaction():``) or a SQLAlchemy ``AsyncConnection`` to PostgreSQL (inside
    ``async with engine.begin() as conn:``, or autobegun). Raises
    :class:`~fenced.StaleToken` / :class:`~fenced.ForeignToken` with the transaction aborted,
    :class:`~fenced.ConfigurationError` without an open transaction or for another connection
    type (a sync connection belongs to :func:`fenced.guard`).
    """
    module = type(connection).__module__
    if module.partition(".")[0] == "psycopg":
        import psycopg  # noqa: PLC0415 - the postgres extra, only when asked

        if isinstance(connection, psycopg.AsyncConnection):
            return await _guard_psycopg(connection, token)
    elif module.startswith("sqlalchemy.ext.asyncio"):
        from sqlalchemy.ext.asyncio import AsyncConnection  # noqa: PLC0415 - optional

        if isinstance(connection, AsyncConnection):
            return await _guard_sqlalchemy(connection, token)
    kind = type(connection)
    raise ConfigurationError(
        f"no fenced.aio guard for {kind.__module__}.{kind.__qualname__} connections (available: "
        "psycopg.AsyncConnection, sqlalchemy.ext.asyncio.AsyncConnection; use fenced.guard for "
        "a sync connection)"
    )


async def _guard_psycopg(connection: Any, token: FencingToken) -> int:
    """:func:`~fenced.fence.postgres._guard.guard_psycopg`, awaited."""
    import psycopg  # noqa: PLC0415

    from fenced._drivers.postgres import DEFAULT_SCHEMA  # noqa: PLC0415
    from fenced.fence.postgres import _guard as pg  # noqa: PLC0415

    schema = DEFAULT_SCHEMA
    token = pg.check_arguments(token, schema)
    problem = pg.transaction_problem(connection.autocommit, connection.info.transaction_status)
    if problem is not None:
        raise ConfigurationError(problem)
    try:
        if not pg.is_ready(connection, schema):
            await _run_steps(connection, pg.ensure_steps(schema))
            pg.mark_ready(connection, schema)
        cursor = await connection.execute(
            pg.check_statement(schema).encode(),
            (token.resource, token.coordinator_id, token.epoch),
        )
        row = await cursor.fetchone()
    except psycopg.Error as error:
        failure, cause = pg.guard_failure(connection, error, token)
        raise failure from cause
    assert row is not None
    return int(row[0])


async def _run_steps(connection: Any, steps: Steps) -> None:
    """:func:`~fenced.fence.postgres._guard.run_steps` on a psycopg ``AsyncConnection``."""
    from fenced.fence.postgres._guard import next_step  # noqa: PLC0415

    row = None
    while (step := next_step(steps, row)) is not None:
        cursor = await connection.execute(*step.arguments())
        row = await cursor.fetchone() if step.fetch else None


async def _guard_sqlalchemy(connection: Any, token: FencingToken) -> int:
    """:func:`~fenced.fence.postgres._guard.guard_sqlalchemy` inside ``run_sync``."""
    from fenced.fence.postgres._guard import guard_sqlalchemy  # noqa: PLC0415

    epoch: int = await connection.run_sync(guard_sqlalchemy, token)
    return epoch

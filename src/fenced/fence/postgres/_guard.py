"""``guard(connection, token)`` for psycopg 3 connections and SQLAlchemy ``Connection``\\ s.

Inside the caller's open transaction, one statement (``SELECT fenced.guard_check(...)``) moves
the resource's row in ``<schema>.guard_fences`` to ``token.epoch`` with ``INSERT … ON CONFLICT
DO UPDATE … WHERE epoch <= excluded.epoch AND coordinator_id = excluded.coordinator_id``. The row
lock it takes is held until the caller's COMMIT or ROLLBACK, so the check is atomic with the
caller's own writes in the same transaction, and guarded transactions of one resource run one
after the other::

    A (81): BEGIN; guard(81) ok; UPDATE invoices … ── pause ──────────────── COMMIT ok
    B (82): BEGIN; ─────── guard(82) waits for A's row lock ───────────────── ok; UPDATE …
    A (81): BEGIN; UPDATE invoices …; guard(81) → StaleToken: the server aborts A's transaction,
            its UPDATE never commits (a later COMMIT is answered with ROLLBACK)

A stale token (or one of another coordinator) makes the **server** raise an error inside the
caller's transaction: PostgreSQL then refuses every further statement of that transaction and
turns its COMMIT into a ROLLBACK. The caller gets :class:`~fenced.StaleToken` /
:class:`~fenced.ForeignToken`; none of its writes in that transaction can commit. (Only an explicit
``ROLLBACK TO SAVEPOINT`` around the guard call would undo that: don't.)

The guard follows the monotonic rule (the largest epoch it has seen wins; there is no separate
install step). For a strict handoff, run the guard once in a transaction of its own right after
acquiring: ``with conn.transaction(): guard(conn, token)``.

On first use per connection the guard creates its table and function if they are missing (inside
the caller's transaction, under a transaction-level advisory lock, so concurrent first users do
not collide). That needs the CREATE privilege on the database; otherwise run
:func:`install` once as a privileged user.

Failure behaviour: no open transaction (an autocommit connection outside ``transaction()``) →
:class:`~fenced.ConfigurationError`; another SQLAlchemy dialect than ``postgresql`` →
:class:`~fenced.ConfigurationError`; driver errors → translated (the transaction is aborted).

The asyncio face (:func:`fenced.aio.guard`) runs the same statements (:func:`check_statement`,
:func:`ensure_steps`: one copy) on a psycopg ``AsyncConnection``, and this module's
:func:`guard_sqlalchemy` itself inside a SQLAlchemy ``AsyncConnection``'s ``run_sync``.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq

from fenced._drivers.postgres import DEFAULT_SCHEMA, translate
from fenced.core._errors import (
    ConfigurationError,
    FencedError,
    ForeignToken,
    StaleToken,
    Unavailable,
)
from fenced.core._token import FencingToken

__all__ = [
    "GUARD_TABLE",
    "Step",
    "Steps",
    "check_arguments",
    "check_statement",
    "ensure_steps",
    "guard_failure",
    "guard_postgres",
    "guard_psycopg",
    "guard_sqlalchemy",
    "install",
    "is_ready",
    "mark_ready",
    "next_step",
    "run_steps",
    "transaction_problem",
]

GUARD_TABLE = "guard_fences"
"""The table (in the guard's schema, default ``fenced``): each resource's coordinator and floor."""
_STALE = "FN001"
_FOREIGN = "FN002"
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,47}")

# The guard's statements, one copy for the sync guard and the asyncio one (fenced.aio._guard).
_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))"
_FIND_FUNCTION = "SELECT to_regprocedure(%s)"
_FIND_SCHEMA = "SELECT to_regnamespace(%s)"


def check_statement(schema: str) -> str:
    """The statement that checks and records a token: parameters resource, coordinator, epoch."""
    return f'SELECT "{schema}".guard_check(%s, %s, %s)'


def _ddl(schema: str) -> list[str]:
    s = f'"{schema}"'
    return [
        f"CREATE SCHEMA IF NOT EXISTS {s}",
        f"""CREATE TABLE IF NOT EXISTS {s}.{GUARD_TABLE} (
            resource text PRIMARY KEY,
            coordinator_id text NOT NULL,
            epoch bigint NOT NULL,
            updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )""",
        f"""CREATE OR REPLACE FUNCTION {s}.guard_check(
            p_resource text, p_coordinator text, p_epoch bigint) RETURNS bigint
        LANGUAGE plpgsql AS $$
        DECLARE
            v_coordinator text;
            v_epoch bigint;
        BEGIN
            INSERT INTO {s}.{GUARD_TABLE} AS f (resource, coordinator_id, epoch)
            VALUES (p_resource, p_coordinator, p_epoch)
            ON CONFLICT (resource) DO UPDATE
                SET epoch = excluded.epoch, updated_at = clock_timestamp()
                WHERE f.coordinator_id = excluded.coordinator_id AND f.epoch <= excluded.epoch
            RETURNING f.epoch INTO v_epoch;
            IF FOUND THEN
                RETURN v_epoch;
            END IF;
            -- the conflicting row is locked by the statement above: this reads it as it stays
            SELECT f.coordinator_id, f.epoch INTO v_coordinator, v_epoch
            FROM {s}.{GUARD_TABLE} f WHERE f.resource = p_resource;
            IF v_coordinator <> p_coordinator THEN
                RAISE EXCEPTION 'fenced: token for % comes from coordinator %, but this '
                    'database is bound to coordinator %', p_resource, p_coordinator, v_coordinator
                    USING ERRCODE = '{_FOREIGN}', DETAIL = v_coordinator;
            END IF;
            RAISE EXCEPTION 'fenced: stale token for %: epoch % is below the floor %',
                p_resource, p_epoch, v_epoch
                USING ERRCODE = '{_STALE}', DETAIL = v_epoch::text;
        END $$""",
    ]


@dataclass(frozen=True, slots=True)
class Step:
    """One statement of :func:`ensure_steps`: ``params`` None means no parameters (the DDL has
    ``%`` of its own), ``fetch`` that the generator wants the first row back."""

    sql: str
    params: tuple[object, ...] | None = None
    fetch: bool = False

    def arguments(self) -> tuple[bytes] | tuple[str, tuple[object, ...]]:
        """What ``execute`` is given: the SQL as bytes alone (so that psycopg takes its ``%``
        literally), or the SQL and its parameters."""
        return (self.sql.encode(),) if self.params is None else (self.sql, self.params)


Steps = Generator[Step, Any, None]
"""Statements to run in order; each ``fetch`` step is answered by sending its first row."""


def ensure_steps(schema: str) -> Steps:
    """Create the guard objects inside the current transaction if they are missing (sans I/O:
    :func:`run_steps` runs them on a sync connection, fenced.aio on an async one)."""
    found = yield Step(_FIND_FUNCTION, (f'"{schema}".guard_check(text,text,bigint)',), fetch=True)
    if found is not None and found[0] is not None:
        return
    yield Step(_LOCK, (f"fenced.guard.{schema}",))
    yield from _create_steps(schema)


def _create_steps(schema: str) -> Steps:
    """The guard's DDL as steps; ``CREATE SCHEMA`` only if the schema does not exist (``IF NOT
    EXISTS`` would still need CREATE on the database, which a schema's owner may lack)."""
    found = yield Step(_FIND_SCHEMA, (f'"{schema}"',), fetch=True)
    statements = _ddl(schema)
    if found is not None and found[0] is not None:
        statements = statements[1:]
    for statement in statements:
        yield Step(statement)


def next_step(steps: Steps, row: Any) -> Step | None:
    """The next of ``steps``, sent ``row`` (the first row of the last ``fetch`` step, else
    None), or None once they are done: what a runner of steps, sync or async, loops on."""
    try:
        return steps.send(row)
    except StopIteration:
        return None


def run_steps(execute: Callable[..., Any], steps: Steps) -> None:
    """Run ``steps`` with a sync ``execute(sql[, params])`` that returns a cursor."""
    row = None
    while (step := next_step(steps, row)) is not None:
        cursor = execute(*step.arguments())
        row = cursor.fetchone() if step.fetch else None


def transaction_problem(autocommit: bool, status: pq.TransactionStatus) -> str | None:
    """Why a psycopg connection (sync or async) in this state cannot be guarded, or None."""
    if autocommit and status == pq.TransactionStatus.IDLE:
        return (
            "guard() must run inside your open transaction: this psycopg connection is in "
            "autocommit mode; use `with conn.transaction(): guard(conn, token); ...`"
        )
    if status == pq.TransactionStatus.INERROR:
        return "guard(): the transaction is already aborted by an earlier error; roll it back"
    return None


def check_arguments(token: object, schema: str) -> FencingToken:
    """The token and schema checks every guard (sync or async) makes first."""
    if not isinstance(token, FencingToken):
        raise ConfigurationError(f"guard needs a fenced.FencingToken, got {type(token).__name__}")
    if not _SCHEMA.fullmatch(schema):
        raise ConfigurationError(f"schema must be 1-48 characters of [a-z0-9_], got {schema!r}")
    return token


def _rejection(error: BaseException, token: FencingToken) -> FencedError | None:
    """The StaleToken/ForeignToken a guard error stands for, if it is one."""
    state = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    diag = getattr(error, "diag", None)
    detail = getattr(diag, "message_detail", None) or ""
    if state == _STALE:
        try:
            floor = int(detail)
        except ValueError:
            floor = token.epoch + 1
        return StaleToken(token.resource, token.epoch, floor)
    if state == _FOREIGN:
        return ForeignToken(token.resource, token.coordinator_id, detail or "?")
    return None


# -- psycopg --------------------------------------------------------------------------------

_ready: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def install(connection: psycopg.Connection[Any], *, schema: str = DEFAULT_SCHEMA) -> None:
    """Create the guard's table and function (idempotent) and commit, on a psycopg connection.

    For deployments where application roles may not create objects: run once as a privileged
    user, then ``GRANT USAGE ON SCHEMA``, ``GRANT SELECT, INSERT, UPDATE ON <schema>.guard_fences``
    and ``GRANT EXECUTE ON FUNCTION <schema>.guard_check`` to the application role.
    """
    if not _SCHEMA.fullmatch(schema):
        raise ConfigurationError(f"schema must be 1-48 characters of [a-z0-9_], got {schema!r}")
    with connection.transaction():
        connection.execute(_LOCK, (f"fenced.guard.{schema}",))
        run_steps(connection.execute, _create_steps(schema))


def guard_psycopg(
    connection: psycopg.Connection[Any], token: FencingToken, *, schema: str = DEFAULT_SCHEMA
) -> int:
    """Check and record ``token`` inside ``connection``'s open transaction; return its epoch.

    ``connection`` is a psycopg 3 connection: either not in autocommit mode (psycopg opens the
    transaction, your later statements join it) or inside ``with connection.transaction():``.
    Raises :class:`~fenced.StaleToken` / :class:`~fenced.ForeignToken` and leaves the transaction
    aborted (see the module docstring).
    """
    token = check_arguments(token, schema)
    problem = transaction_problem(connection.autocommit, connection.info.transaction_status)
    if problem is not None:
        raise ConfigurationError(problem)
    try:
        if not is_ready(connection, schema):
            run_steps(connection.execute, ensure_steps(schema))
            mark_ready(connection, schema)
        row = connection.execute(
            check_statement(schema).encode(),
            (token.resource, token.coordinator_id, token.epoch),
        ).fetchone()
    except psycopg.Error as error:
        failure, cause = guard_failure(connection, error, token)
        raise failure from cause
    assert row is not None
    return int(row[0])


def is_ready(connection: object, schema: str) -> bool:
    """Whether the guard objects of ``schema`` are known to exist for ``connection``."""
    return schema in _ready.get(connection, set())


def mark_ready(connection: object, schema: str) -> None:
    """Remember that the guard objects of ``schema`` exist for ``connection``."""
    _ready.setdefault(connection, set()).add(schema)


def guard_failure(
    connection: object, error: psycopg.Error, token: FencingToken
) -> tuple[FencedError, BaseException | None]:
    """What a psycopg error during the guard is raised as, and from what: StaleToken or
    ForeignToken (from None) for a rejection, else the translated error (from ``error``; the
    guard objects are forgotten if the error says they are gone)."""
    rejection = _rejection(error, token)
    if rejection is not None:
        return rejection, None
    _forget(connection, error)
    return translate(error, f"guard({token.resource!r})", sent=False), error


def _forget(connection: object, error: BaseException) -> None:
    """Forget that the guard objects exist if the error says they do not (rolled back)."""
    if (getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)) in ("42P01", "42883"):
        _ready.pop(connection, None)


# -- SQLAlchemy -----------------------------------------------------------------------------


def guard_sqlalchemy(connection: Any, token: FencingToken, *, schema: str = DEFAULT_SCHEMA) -> int:
    """:func:`guard_psycopg` for a SQLAlchemy 2 ``Connection`` to PostgreSQL (any driver).

    Use it inside ``with engine.begin() as conn:`` (or after ``conn.begin()``, or relying on
    autobegin). A connection with ``isolation_level="AUTOCOMMIT"`` is refused. After a
    rejection, the exception leaving ``engine.begin()`` rolls the transaction back.
    """
    from sqlalchemy import exc, text  # noqa: PLC0415 - SQLAlchemy is optional

    token = check_arguments(token, schema)
    if connection.dialect.name != "postgresql":
        dialect = connection.dialect.name
        raise ConfigurationError(
            f"this guard is for PostgreSQL; the SQLAlchemy connection uses {dialect}"
        )
    level = connection.get_execution_options().get("isolation_level")
    if level is None:
        try:
            level = connection.get_isolation_level()
        except exc.SQLAlchemyError:
            level = None
    if str(level).upper() == "AUTOCOMMIT":
        raise ConfigurationError(
            "guard() must run inside your transaction: this SQLAlchemy connection autocommits"
        )
    # the driver's own connection (psycopg's, also under an AsyncConnection's run_sync, whose
    # DBAPI adapter cannot be weakly referenced): what the guard's readiness is remembered for
    raw = connection.connection.driver_connection
    key = raw if raw is not None else connection

    def execute(statement: str | bytes, params: tuple[object, ...] = ()) -> Any:
        names = {f"p{i}": value for i, value in enumerate(params)}
        query = statement.decode() if isinstance(statement, bytes) else statement
        for name in names:
            query = query.replace("%s", f":{name}", 1)
        return connection.execute(text(query), names)

    try:
        if not is_ready(key, schema):
            run_steps(execute, ensure_steps(schema))
            mark_ready(key, schema)
        epoch = execute(
            check_statement(schema),
            (token.resource, token.coordinator_id, token.epoch),
        ).scalar_one()
    except exc.DBAPIError as error:
        orig = error.orig if error.orig is not None else error
        rejection = _rejection(orig, token)
        if rejection is not None:
            raise rejection from None
        _forget(key, orig)
        if isinstance(orig, psycopg.Error):
            raise translate(orig, f"guard({token.resource!r})", sent=False) from error
        raise Unavailable(f"guard({token.resource!r}): {orig}; nothing was committed") from error
    return int(epoch)


def guard_postgres(connection: Any, token: FencingToken, *, schema: str = DEFAULT_SCHEMA) -> int:
    """:func:`guard_psycopg` or :func:`guard_sqlalchemy`, by the connection's type."""
    if isinstance(connection, psycopg.Connection):
        return guard_psycopg(connection, token, schema=schema)
    module = type(connection).__module__
    if module.startswith("sqlalchemy"):
        return guard_sqlalchemy(connection, token, schema=schema)
    raise ConfigurationError(
        f"no PostgreSQL guard for {module}.{type(connection).__qualname__} connections"
    )

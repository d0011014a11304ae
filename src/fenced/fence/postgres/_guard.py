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
"""

from __future__ import annotations

import re
import weakref
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

__all__ = ["GUARD_TABLE", "guard_postgres", "guard_psycopg", "guard_sqlalchemy", "install"]

GUARD_TABLE = "guard_fences"
"""The table (in the guard's schema, default ``fenced``): each resource's coordinator and floor."""
_STALE = "FN001"
_FOREIGN = "FN002"
_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,47}")


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


def _check(token: object, schema: str) -> FencingToken:
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
        connection.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"fenced.guard.{schema}",)
        )
        _create(connection.execute, schema)


def guard_psycopg(
    connection: psycopg.Connection[Any], token: FencingToken, *, schema: str = DEFAULT_SCHEMA
) -> int:
    """Check and record ``token`` inside ``connection``'s open transaction; return its epoch.

    ``connection`` is a psycopg 3 connection: either not in autocommit mode (psycopg opens the
    transaction, your later statements join it) or inside ``with connection.transaction():``.
    Raises :class:`~fenced.StaleToken` / :class:`~fenced.ForeignToken` and leaves the transaction
    aborted (see the module docstring).
    """
    token = _check(token, schema)
    status = connection.info.transaction_status
    if connection.autocommit and status == pq.TransactionStatus.IDLE:
        raise ConfigurationError(
            "guard() must run inside your open transaction: this psycopg connection is in "
            "autocommit mode; use `with conn.transaction(): guard(conn, token); ...`"
        )
    if status == pq.TransactionStatus.INERROR:
        raise ConfigurationError(
            "guard(): the transaction is already aborted by an earlier error; roll it back"
        )
    try:
        if schema not in _ready.get(connection, set()):
            _ensure(connection.execute, schema)
            _ready.setdefault(connection, set()).add(schema)
        row = connection.execute(
            f'SELECT "{schema}".guard_check(%s, %s, %s)'.encode(),
            (token.resource, token.coordinator_id, token.epoch),
        ).fetchone()
    except psycopg.Error as error:
        rejection = _rejection(error, token)
        if rejection is not None:
            raise rejection from None
        _forget(connection, error)
        raise translate(error, f"guard({token.resource!r})", sent=False) from error
    assert row is not None
    return int(row[0])


def _ensure(execute: Any, schema: str) -> None:
    """Create the guard objects inside the current transaction if they are missing."""
    found = execute(
        "SELECT to_regprocedure(%s)", (f'"{schema}".guard_check(text,text,bigint)',)
    ).fetchone()
    if found is not None and found[0] is not None:
        return
    execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"fenced.guard.{schema}",))
    _create(execute, schema)


def _create(execute: Any, schema: str) -> None:
    """Run the guard's DDL; ``CREATE SCHEMA`` only if the schema does not exist (``IF NOT
    EXISTS`` would still need CREATE on the database, which a schema's owner may lack)."""
    found = execute("SELECT to_regnamespace(%s)", (f'"{schema}"',)).fetchone()
    statements = _ddl(schema)
    if found is not None and found[0] is not None:
        statements = statements[1:]
    for statement in statements:
        execute(statement.encode())


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

    token = _check(token, schema)
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
    raw = connection.connection.dbapi_connection
    key = raw if raw is not None else connection

    def execute(statement: str | bytes, params: tuple[object, ...] = ()) -> Any:
        names = {f"p{i}": value for i, value in enumerate(params)}
        query = statement.decode() if isinstance(statement, bytes) else statement
        for name in names:
            query = query.replace("%s", f":{name}", 1)
        return connection.execute(text(query), names)

    try:
        if schema not in _ready.get(key, set()):
            _ensure(execute, schema)
            _ready.setdefault(key, set()).add(schema)
        epoch = execute(
            f'SELECT "{schema}".guard_check(%s, %s, %s)',
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

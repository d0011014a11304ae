"""The seeded defects of the PostgreSQL coordinator (``fenced verify --mutants``).

Loaded by :func:`fenced.verify._seeded.coordinator_backend` only for a ``postgresql:``
coordinator with one of these defects (it needs psycopg). The decisions of the PostgreSQL
backend are PL/pgSQL functions of the coordinator's schema (:mod:`~fenced.coordinator.backends.
postgres._schema`); a defect is the newest text of one of them with one clause changed
(:func:`~fenced.verify._seeded._one_clause_changed`: a text that no longer has the clause exactly
once is a :class:`ValueError`, never the correct function run under the defect's name):

* ``renew-revives-expired``: ``renew`` without its "still live" condition
  (``r.expires_at > v_now``): a renewal that arrives after the lease expired, before anyone
  noticed the expiry, sets it to expire ttl after the renewal's arrival;
* ``pg-grant-read-committed``: ``try_grant`` reads the resource's row without ``FOR UPDATE``
  and writes the epoch it read + 1: two grants that overlap (READ COMMITTED) both write the
  same epoch.

The variant is created as a **session-local** function (``pg_temp``), on each connection before
its first call, and the backend calls it instead of the schema's: the schema, which other
clients of the same database use, is never altered, and nothing is left behind. (A pooler that
discards sessions would lose the variant; verify reaches the server directly.)
"""

from __future__ import annotations

import weakref
from typing import Any

import psycopg
from psycopg import pq, sql

from fenced._drivers.postgres import Lender, guarded
from fenced.coordinator.backends.postgres import _plans as plans
from fenced.coordinator.backends.postgres import _schema as postgres_schema
from fenced.coordinator.backends.postgres._backend import PostgresBackend
from fenced.coordinator.backends.postgres._statements import (
    _FAST_GRANT,
    _TRY_GRANT,
    Call,
    DirectStatement,
    Rows,
    StatementRunner,
    _left,
)
from fenced.verify._seeded import (
    PG_GRANT_READ_COMMITTED,
    RENEW_REVIVES_EXPIRED,
    _one_clause_changed,
)

__all__ = ["SeededPostgresBackend", "function_text"]


def function_text(schema: str, name: str) -> str:
    """The newest ``CREATE OR REPLACE FUNCTION`` text of the schema's function ``name``, as
    the migrations create it in ``schema``."""
    head = "CREATE OR REPLACE FUNCTION {s}." + name + "("
    found = [
        statement
        for migration in postgres_schema.migrations(schema)
        for statement in migration.statements
        if statement.startswith(head)
    ]
    if not found:
        raise ValueError(f"no function {name} in the coordinator's schema")
    quoted = sql.Identifier(schema).as_string(None)
    return found[-1].replace("{s}", quoted)


def _temporary(schema: str, name: str, clause: str, replacement: str) -> str:
    """The function ``name`` with its ``clause`` replaced, created in ``pg_temp``."""
    quoted = sql.Identifier(schema).as_string(None)
    text = _one_clause_changed(function_text(schema, name), clause, replacement)
    return _one_clause_changed(
        text,
        f"CREATE OR REPLACE FUNCTION {quoted}.{name}(",
        f"CREATE OR REPLACE FUNCTION pg_temp.{name}(",
    )


class _SeededRunner(StatementRunner):
    """The backend's statement runner, calling the variant functions of ``defects`` (created
    on each connection before its first statement that calls one)."""

    def __init__(
        self, pool: Lender, url: str, schema: str, found: plans.Settings, defects: frozenset[str]
    ) -> None:
        super().__init__(pool, url, schema, found)
        quoted = sql.Identifier(schema).as_string(None)
        self._creates: dict[str, bytes] = {}
        """Statement name → the CREATE of the variant it calls."""
        self._made: weakref.WeakKeyDictionary[pq.abc.PGconn, set[bytes]] = (
            weakref.WeakKeyDictionary()
        )
        """Per server session: the variants created in it."""
        if RENEW_REVIVES_EXPIRED in defects:
            live = "\n          AND r.expires_at > v_now"
            self._creates["renew"] = _temporary(schema, "renew", live, "").encode()
            call = self.queries["renew"].decode()
            renew = _one_clause_changed(call, f"{quoted}.renew(", "pg_temp.renew(")
            self.queries["renew"] = renew.encode()
        if PG_GRANT_READ_COMMITTED in defects:
            unlocked = _temporary(schema, "try_grant", " FOR UPDATE OF r;", ";").encode()
            for name, text in (("grant", _FAST_GRANT), ("grant_queued", _TRY_GRANT)):
                self._creates[name] = unlocked
                filled = self._filled(text)
                called = _one_clause_changed(filled, f"{quoted}.try_grant(", "pg_temp.try_grant(")
                self.direct[name] = DirectStatement(called)

    def _filled(self, text: str) -> str:
        """A statement of :mod:`~fenced.coordinator.backends.postgres._statements` as
        ``direct_statements`` fills it in."""
        quoted = sql.Identifier(self.schema).as_string(None)
        lock_class = str(postgres_schema.LISTEN_LOCK_CLASS)
        return text.replace("{s}", quoted).replace("{c}", self.channel).replace("{k}", lock_class)

    def _run(
        self, conn: psycopg.Connection[Any], call: Call, budget: float, deadline: float
    ) -> Rows:
        doing, name = call[0], call[1]
        create = self._creates.get(name)
        made = self._made.setdefault(conn.pgconn, set())
        if create is not None and create not in made:
            with guarded(conn, _left(doing, self.url, deadline, budget)) as fired:
                try:
                    conn.execute(create)
                except psycopg.Error as error:
                    raise self.failure(
                        error, doing, budget, mutation=False, fired=fired()
                    ) from error
            made.add(create)
        return super()._run(conn, call, budget, deadline)


class SeededPostgresBackend(PostgresBackend):
    """The PostgreSQL coordinator with ``renew-revives-expired`` and/or
    ``pg-grant-read-committed`` (see the module docstring)."""

    def __init__(self, url: str, defects: frozenset[str]) -> None:
        super().__init__(url)
        try:
            found = plans.settings(self._parsed)
            runner = _SeededRunner(self._pool, self._parsed.display, self.schema, found, defects)
        except BaseException:
            self.close()
            raise
        self._statements = runner
        self._direct = runner.direct

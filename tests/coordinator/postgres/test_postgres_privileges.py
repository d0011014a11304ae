"""Least privilege on PostgreSQL: the grants docs/postgres.md gives ("Schema and privileges",
its ``sql`` block, run here as written) are enough for a worker, and nothing less is.

On a fresh database of the session's server: a superuser runs the documented SQL (roles renamed
per test), with PUBLIC's default EXECUTE on the owner's functions revoked, so that the documented
EXECUTE grant is what lets the worker call them. The owner role creates the coordinator's, a
store's and the guard's objects. Then the worker role, which may create nothing, runs a whole
lease cycle (acquire, renew, a waiter on LISTEN handed the resource by the release, history), a
store cycle (fence, put/get, publish, read, records, gc) and the guard inside its own
transaction. A role without the grants, or with ``USAGE`` on the schema only, and a worker
that finds the schema older than its fenced (it would have to migrate) each get a one-line
:class:`ConfigurationError` saying ``permission denied``.
"""

from __future__ import annotations

import io
import re
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

import fenced
from fenced.core._errors import ConfigurationError
from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer

R = "jobs/least-privilege"
DOC = Path(__file__).resolve().parents[3] / "docs" / "postgres.md"


def _documented_sql() -> str:
    """The ``sql`` block of the "Schema and privileges" section of docs/postgres.md."""
    text = DOC.read_text()
    section = text.split("## Schema and privileges", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"^```sql\n(.*?)^```", section, re.DOTALL | re.MULTILINE)
    assert found is not None, "docs/postgres.md lost its grants"
    return found.group(1)


def _statements(sql: str) -> list[str]:
    without_comments = re.sub(r"--[^\n]*", "", sql)
    return [part.strip() for part in without_comments.split(";") if part.strip()]


def _one_line_denied(opener: Callable[[str], fenced.Coordinator | fenced.Store], url: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        opener(url).close()
    message = str(caught.value)
    assert "\n" not in message and "permission denied" in message, message


def test_the_documented_grants_are_enough_for_a_worker_and_nothing_less_is(
    postgres_server: PostgresServer,
) -> None:
    suffix = uuid.uuid4().hex[:8]
    database = f"priv_{suffix}"
    owner, worker = f"fenced_owner_{suffix}", f"fenced_worker_{suffix}"
    nobody, usage_only = f"fenced_nobody_{suffix}", f"fenced_usage_{suffix}"
    postgres_server.create_database(database)
    sql = _documented_sql()
    assert "fenced_owner" in sql and "fenced_worker" in sql
    sql = sql.replace("fenced_owner", owner).replace("fenced_worker", worker)
    with psycopg.connect(postgres_server.dsn(database), autocommit=True) as admin:
        for statement in _statements(sql):
            admin.execute(statement.encode())
        # stricter than PostgreSQL's default, so that the documented EXECUTE grant is needed
        revoke = (
            f"ALTER DEFAULT PRIVILEGES FOR ROLE {owner} REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC"
        )
        admin.execute(revoke.encode())
        admin.execute(f"CREATE ROLE {nobody} LOGIN".encode())
        admin.execute(f"CREATE ROLE {usage_only} LOGIN".encode())
        admin.execute(f"GRANT USAGE ON SCHEMA fenced TO {usage_only}".encode())

    def url(role: str) -> str:
        return f"postgresql://{role}@{postgres_server.host}:{postgres_server.port}/{database}"

    # the owner creates everything once (fenced's schema already exists: made by the SQL above)
    fenced.connect(url(owner)).close()
    fenced.open_store(url(owner), mode="strict").close()
    with psycopg.connect(url(owner)) as conn:
        fenced.fence.install_postgres_guard(conn)

    with psycopg.connect(postgres_server.dsn(database), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'fenced' AND has_function_privilege('public', p.oid, 'EXECUTE')"
        ).fetchall()
        assert rows == [], "PUBLIC can still execute fenced's functions: the test proves less"

    with fenced.connect(url(worker)) as coord, fenced.open_store(url(worker)) as store:
        lease = coord.acquire(R, ttl=30, wait=0)
        lease = coord.renew(lease)
        got: list[fenced.Lease] = []
        errors: list[BaseException] = []

        def waiter() -> None:
            try:
                got.append(coord.acquire(R, ttl=30, wait=20, holder="second"))
            except BaseException as error:
                errors.append(error)

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_for(lambda: coord.backend.listener_state == "listening", 20, "the listener")  # type: ignore[attr-defined]
        store.fence(lease.token)
        store.put(lease.token, "k", b"v1")
        assert coord.release(lease) is True
        thread.join(20)
        assert errors == [] and len(got) == 1, errors
        second = got[0]
        assert second.epoch == lease.epoch + 1

        store.fence(second.token)
        written = store.put(second.token, "k", b"v2")
        item = store.get(R, "k")
        assert item is not None and item.version == written.version and item.value == b"v2"
        store.publish(second.token, io.BytesIO(b"y" * 200_000))
        with store.open(R) as stream:
            assert stream.read() == b"y" * 200_000
        assert store.history(R) and store.floors()[R] == second.epoch
        assert store.gc(keep=1, grace=0) == 0
        assert len(coord.history(R)) >= 3

        with psycopg.connect(url(worker)) as conn, conn.transaction():
            assert fenced.guard(conn, second.token) == second.epoch
        assert coord.release(second) is True

    # less is refused, in one line
    for role in (nobody, usage_only):
        _one_line_denied(fenced.connect, url(role))
        _one_line_denied(fenced.open_store, url(role))

    # a worker never migrates: a schema older than its fenced is the owner's to upgrade
    version = "SELECT value FROM fenced.meta WHERE key = 'schema_version'"
    change = "UPDATE fenced.meta SET value = %s WHERE key = 'schema_version'"
    with psycopg.connect(url(owner), autocommit=True) as conn:
        row = conn.execute(version).fetchone()
        assert row is not None
        conn.execute(change, ("0",))
    try:
        _one_line_denied(fenced.connect, url(worker))
    finally:
        with psycopg.connect(url(owner), autocommit=True) as conn:
            conn.execute(change, (row[0],))
    fenced.connect(url(worker)).close()
    postgres_server.drop_database(database)

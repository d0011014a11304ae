"""``await fenced.aio._guard.guard`` on psycopg's ``AsyncConnection`` and SQLAlchemy's
``AsyncConnection`` (``postgresql+psycopg``), against the session's real PostgreSQL server."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from fenced.aio._guard import guard
from fenced.core._errors import ConfigurationError, ForeignToken, StaleToken
from fenced.fence.postgres import _guard as sync_guard
from support.guard_fixtures import C1, C2, R, dsn, status, tok

__all__ = ["dsn"]  # a fixture from support.guard_fixtures, used here

UPDATE = "UPDATE invoices SET status = %s WHERE id = 1"


@pytest.fixture
async def engine(dsn: str) -> AsyncIterator[AsyncEngine]:
    made = create_async_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    yield made
    await made.dispose()


def fence_row(dsn: str) -> tuple[str, int] | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT coordinator_id, epoch FROM fenced.guard_fences WHERE resource = %s", (R,)
        ).fetchone()
        return None if row is None else (str(row[0]), int(row[1]))


# -- psycopg AsyncConnection -----------------------------------------------------------------


async def test_psycopg_a_guarded_write_commits_with_the_current_token(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        assert await guard(conn, tok(42)) == 42  # creates the guard objects in this transaction
        await conn.execute(UPDATE, ("paid by 42",))
        await conn.commit()
        assert await guard(conn, tok(42)) == 42  # the same epoch again: fine
        await conn.execute(UPDATE, ("paid again by 42",))
        await conn.commit()
    assert status(dsn) == "paid again by 42"
    assert fence_row(dsn) == (C1, 42)


async def test_psycopg_a_stale_token_aborts_the_callers_whole_transaction(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await guard(conn, tok(42))
        await conn.execute(UPDATE, ("paid by 42",))
        await conn.commit()
    async with await psycopg.AsyncConnection.connect(dsn) as late:
        await late.execute(UPDATE, ("paid by 41",))  # a write before the guard
        with pytest.raises(StaleToken) as caught:
            await guard(late, tok(41))
        assert (caught.value.resource, caught.value.presented, caught.value.floor) == (R, 41, 42)
        assert late.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        with pytest.raises(ConfigurationError, match="already aborted"):
            await guard(late, tok(43))
        await late.commit()  # the server answers COMMIT of an aborted transaction with ROLLBACK
    assert status(dsn) == "paid by 42"
    assert fence_row(dsn) == (C1, 42)


async def test_psycopg_a_token_of_another_coordinator_is_foreign(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        async with conn.transaction():
            await guard(conn, tok(5))
        with pytest.raises(ForeignToken) as caught:
            async with conn.transaction():
                await conn.execute(UPDATE, ("by the other coordinator",))
                await guard(conn, tok(50, C2))
        assert (caught.value.presented, caught.value.bound) == (C2, C1)
    assert status(dsn) == "open"
    assert fence_row(dsn) == (C1, 5)


async def test_psycopg_without_a_transaction_is_a_configuration_error(dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        with pytest.raises(ConfigurationError, match="autocommit"):
            await guard(conn, tok(1))
        async with conn.transaction():
            assert await guard(conn, tok(5)) == 5
            await conn.execute(UPDATE, ("by 5",))
        with pytest.raises(ConfigurationError, match="FencingToken"):
            await guard(conn, str(tok(6)))  # type: ignore[arg-type]
    assert status(dsn) == "by 5"


async def test_unsupported_connections_are_configuration_errors(dsn: str) -> None:
    with psycopg.connect(dsn) as sync_conn:
        with pytest.raises(ConfigurationError, match=r"fenced\.guard for a sync connection"):
            await guard(sync_conn, tok(1))
        assert sync_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    lite = sqlite3.connect(":memory:")
    try:
        with pytest.raises(ConfigurationError, match=r"sqlite3\.Connection"):
            await guard(lite, tok(1))
    finally:
        lite.close()


async def test_the_async_guard_sends_the_sync_guards_statements(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[bytes | str] = []
    execute: Any = psycopg.AsyncConnection.execute

    async def recording(self: Any, query: bytes | str, *args: Any, **kwargs: Any) -> Any:
        sent.append(query)
        return await execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.AsyncConnection, "execute", recording)
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await guard(conn, tok(3))
        await conn.commit()
    statements = [s.decode() if isinstance(s, bytes) else s for s in sent]
    ddl = sync_guard._ddl("fenced")
    assert statements[-1] == sync_guard.check_statement("fenced")
    assert all(statement in statements for statement in ddl)


# -- SQLAlchemy AsyncConnection --------------------------------------------------------------


async def test_sqlalchemy_a_guarded_write_commits_with_the_current_token(
    engine: AsyncEngine, dsn: str
) -> None:
    async with engine.begin() as conn:
        assert await guard(conn, tok(7)) == 7
        await conn.execute(text("UPDATE invoices SET status = 'by 7' WHERE id = 1"))
    async with engine.connect() as conn:  # autobegin
        assert await guard(conn, tok(8)) == 8
        await conn.execute(text("UPDATE invoices SET status = 'by 8' WHERE id = 1"))
        await conn.commit()
    assert status(dsn) == "by 8"
    assert fence_row(dsn) == (C1, 8)


async def test_sqlalchemy_a_stale_token_rolls_back_the_callers_earlier_writes(
    engine: AsyncEngine, dsn: str
) -> None:
    async with engine.begin() as conn:
        await guard(conn, tok(8))
        await conn.execute(text("UPDATE invoices SET status = 'by 8' WHERE id = 1"))
    with pytest.raises(StaleToken) as caught:
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE invoices SET status = 'by 7' WHERE id = 1"))
            await guard(conn, tok(7))
    assert (caught.value.presented, caught.value.floor) == (7, 8)
    assert status(dsn) == "by 8"


async def test_sqlalchemy_a_token_of_another_coordinator_is_foreign(
    engine: AsyncEngine, dsn: str
) -> None:
    async with engine.begin() as conn:
        await guard(conn, tok(8))
    with pytest.raises(ForeignToken) as caught:
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE invoices SET status = 'foreign' WHERE id = 1"))
            await guard(conn, tok(80, C2))
    assert (caught.value.presented, caught.value.bound) == (C2, C1)
    assert status(dsn) == "open"


async def test_sqlalchemy_an_autocommit_connection_is_a_configuration_error(
    engine: AsyncEngine, dsn: str
) -> None:
    async with engine.connect() as conn:
        autocommit = await conn.execution_options(isolation_level="AUTOCOMMIT")
        with pytest.raises(ConfigurationError, match="autocommits"):
            await guard(autocommit, tok(1))
    sync_engine = create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with (
            sync_engine.connect() as sync_conn,
            pytest.raises(ConfigurationError, match=r"fenced\.guard for a sync connection"),
        ):
            await guard(sync_conn, tok(1))
    finally:
        sync_engine.dispose()

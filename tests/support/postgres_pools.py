"""A user's own ``psycopg_pool.ConnectionPool`` and SQLAlchemy ``Engine`` on the session's
PostgreSQL server, configured as an application would (not autocommit, rows as dicts), for the
tests that hand them to ``fenced.connect`` and ``fenced.open_store``. Import the fixtures into a
test module to use them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer

__all__ = ["fresh_schema", "pool_as_it_was", "user_engine", "user_pool"]


def fresh_schema() -> str:
    """A schema name no other test uses."""
    return "u_" + uuid.uuid4().hex[:12]


@pytest.fixture
def user_pool(postgres_server: PostgresServer) -> Iterator[ConnectionPool[Any]]:
    """A pool named ``app-pool`` of at most 4 connections: not autocommit, rows as dicts."""
    pool: ConnectionPool[Any] = ConnectionPool(
        postgres_server.dsn(),
        min_size=1,
        max_size=4,
        kwargs={"row_factory": dict_row},
        name="app-pool",
        open=True,
    )
    yield pool
    pool.close()


@pytest.fixture
def user_engine(postgres_server: PostgresServer) -> Iterator[sqlalchemy.Engine]:
    """A ``postgresql+psycopg`` engine of at most 3 connections."""
    dsn = postgres_server.dsn().replace("postgresql://", "postgresql+psycopg://", 1)
    engine = sqlalchemy.create_engine(dsn, pool_size=3, max_overflow=0, pool_timeout=10)
    yield engine
    engine.dispose()


def pool_as_it_was(pool: ConnectionPool[Any]) -> None:
    """Assert that ``pool`` is open, every connection is back in it, and each is as the pool
    made it (autocommit off, psycopg's default prepare threshold, rows as dicts)."""
    assert not pool.closed

    def all_back() -> bool:  # a replaced connection may still be connecting
        stats = pool.get_stats()
        return stats["pool_available"] == stats["pool_size"]

    wait_for(all_back, 10, "every connection back in the pool")
    for _ in range(pool.get_stats()["pool_size"]):
        with pool.connection(timeout=5) as conn:
            assert conn.autocommit is False and conn.prepare_threshold == 5
            assert conn.execute("SELECT 1 AS one").fetchone() == {"one": 1}

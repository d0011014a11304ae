"""The PostgreSQL store on what a team already has: ``postgresql+psycopg://``, a
``psycopg_pool.ConnectionPool`` and a SQLAlchemy ``Engine`` handed to ``fenced.open_store``
instead of a URL — against the session's real PostgreSQL server.

What is checked: fence, put/get and publish/read (a snapshot read on a connection of its own)
work; every connection goes back to the user's pool as it was (autocommit off, the pool's row
factory), also after a snapshot read; a pooled connection the server ended is not used;
``close()`` leaves the user's pool or engine open.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import sqlalchemy
from psycopg_pool import ConnectionPool

import fenced
from fenced.core._errors import ConfigurationError
from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer
from fenced.testing.store_conformance import token
from support.postgres_pools import fresh_schema, pool_as_it_was, user_engine, user_pool

__all__ = ["user_engine", "user_pool"]  # fixtures from support.postgres_pools, used here

R = "exports/borrowed"


def _use(store: fenced.Store) -> None:
    """fence, put/get, publish/read (the read streams on a dedicated connection)."""
    first = token(1, R)
    assert store.fence(first) == 1
    version = store.put(first, "k", b"v1")
    item = store.get(R, "k")
    assert item is not None and (item.value, item.version) == (b"v1", version.version)
    store.publish(first, b"x" * 3_000_000, name="big")
    assert store.read(R, "big") == b"x" * 3_000_000
    latest = store.latest(R, "big")
    assert latest is not None and latest.size == 3_000_000
    assert store.latest(R, "none") is None
    with pytest.raises(fenced.NotFound):
        store.read(R, "none")  # a snapshot read that finds nothing gives its connection back


def test_store_on_a_driver_suffix_url(postgres_server: PostgresServer) -> None:
    url = postgres_server.url(schema=fresh_schema()).replace("postgresql", "postgresql+psycopg", 1)
    with fenced.open_store(url) as store:
        assert store.url.startswith("postgresql+psycopg://")
        _use(store)


def test_store_on_a_psycopg_pool(user_pool: ConnectionPool[Any]) -> None:
    store = fenced.open_store(user_pool, options={"schema": fresh_schema(), "timeout": 5})
    try:
        assert "app-pool" in store.url
        _use(store)
        pool_as_it_was(user_pool)  # between operations, nothing is kept lent
    finally:
        store.close()
    pool_as_it_was(user_pool)


def test_store_on_a_sqlalchemy_engine(user_engine: sqlalchemy.Engine) -> None:
    engine, schema = user_engine, fresh_schema()
    with fenced.open_store(engine, "monotonic", options={"schema": schema}) as store:
        _use(store)
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    with engine.connect() as conn:
        query = sqlalchemy.text(f"SELECT value FROM {schema}.store_meta WHERE key = 'mode'")
        assert conn.execute(query).scalar() == "monotonic"


def test_a_pooled_connection_the_server_ended_is_not_used(
    postgres_server: PostgresServer, user_pool: ConnectionPool[Any]
) -> None:
    with fenced.open_store(user_pool, options={"schema": fresh_schema()}) as store:
        store.fence(token(1, R))
        pool_as_it_was(user_pool)
        with psycopg.connect(postgres_server.dsn(), autocommit=True) as admin:
            ended = admin.execute(  # the timeout: each returns once its backend has exited
                "SELECT bool_and(pg_terminate_backend(pid, 10000)) FROM pg_stat_activity "
                "WHERE pid <> pg_backend_pid() AND datname = 'postgres' "
                "AND backend_type = 'client backend'"
            ).fetchone()
            assert ended is not None and ended[0] is True
        assert store.put(token(1, R), "k", b"after").version == 1  # nothing was sent on one
    wait_for(lambda: not user_pool.closed and user_pool.get_stats()["pool_size"] >= 1, 10, "pool")


def test_options_belong_to_pools_and_engines(
    postgres_server: PostgresServer, user_pool: ConnectionPool[Any]
) -> None:
    with pytest.raises(ConfigurationError, match="options= is for"):
        fenced.open_store(postgres_server.url(), options={"schema": "x"})
    with pytest.raises(ConfigurationError, match="options= is for"):
        fenced.open_store("sqlite:s.db", options={"schema": "x"})
    with pytest.raises(ConfigurationError, match="unknown option 'listen'"):
        fenced.open_store(user_pool, options={"listen": "off"})  # a coordinator's option
    with pytest.raises(ConfigurationError, match="postgresql\\+psycopg"):
        fenced.open_store(sqlalchemy.create_engine("sqlite://"))
    with pytest.raises(ConfigurationError, match="named by a URL"):
        fenced.open_store(None)
    pool_as_it_was(user_pool)

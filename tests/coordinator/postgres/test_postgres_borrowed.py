"""The PostgreSQL coordinator on what a team already has: SQLAlchemy's ``postgresql+psycopg://``
spelling, a ``psycopg_pool.ConnectionPool`` and a SQLAlchemy ``Engine`` handed to
``fenced.connect`` instead of a URL — against the session's real PostgreSQL server.

What is checked: acquire, renew and release work; a waiter is woken by LISTEN/NOTIFY on the
listening connection taken from the user's pool or engine; ``close()`` gives every connection
back and leaves the user's pool or engine open, its connections as they were (autocommit off, the
pool's row factory); bad inputs are one-line :class:`ConfigurationError`s.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
import sqlalchemy
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import fenced
from fenced.core._clock import ManualClock
from fenced.core._errors import ConfigurationError
from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer
from support.postgres_pools import fresh_schema, pool_as_it_was, user_engine, user_pool

__all__ = ["user_engine", "user_pool"]  # fixtures from support.postgres_pools, used here

R = "jobs/borrowed"


def _lease_cycle(coord: fenced.Coordinator) -> None:
    """acquire, renew, a waiter woken by the release (LISTEN/NOTIFY), release."""
    lease = coord.acquire(R, ttl=30, wait=0)
    renewed = coord.renew(lease)
    assert renewed.epoch == lease.epoch
    got: list[fenced.Lease] = []
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            got.append(coord.acquire(R, ttl=30, wait=20))
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()
    wait_for(lambda: coord.backend.listener_state == "listening", 20, "the listener")  # type: ignore[attr-defined]
    assert coord.release(renewed) is True
    thread.join(20)
    assert errors == [] and len(got) == 1 and got[0].epoch == lease.epoch + 1
    assert coord.release(got[0]) is True


def test_driver_suffix_urls_are_accepted(postgres_server: PostgresServer) -> None:
    for scheme in ("postgresql+psycopg", "postgres+psycopg", "postgres"):
        url = postgres_server.url(schema=fresh_schema()).replace("postgresql", scheme, 1)
        with fenced.connect(url) as coord:
            lease = coord.acquire(R, ttl=10, wait=0)
            assert coord.release(lease) is True
            assert coord.url.startswith(f"{scheme}://")


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        ("postgresql+psycopg2", "psycopg 3; write postgresql\\+psycopg:// or postgresql://"),
        ("postgresql+asyncpg", "psycopg 3"),
        ("postgres+pg8000", "psycopg 3; write postgres\\+psycopg://"),
    ],
)
def test_other_drivers_are_refused_naming_psycopg(
    postgres_server: PostgresServer, scheme: str, message: str
) -> None:
    url = postgres_server.url(schema=fresh_schema()).replace("postgresql", scheme, 1)
    with pytest.raises(ConfigurationError, match=message):
        fenced.connect(url)
    with pytest.raises(ConfigurationError, match=message):
        fenced.open_store(url)


def test_coordinator_on_a_psycopg_pool(user_pool: ConnectionPool[Any]) -> None:
    coord = fenced.connect(user_pool, options={"schema": fresh_schema(), "timeout": 5})
    try:
        assert "app-pool" in coord.url
        _lease_cycle(coord)
    finally:
        coord.close()
    pool_as_it_was(user_pool)


def test_coordinator_on_a_sqlalchemy_engine(user_engine: sqlalchemy.Engine) -> None:
    engine = user_engine
    coord = fenced.connect(engine, options={"schema": fresh_schema()})
    try:
        assert coord.url.startswith("postgresql+psycopg://")
        _lease_cycle(coord)
    finally:
        coord.close()
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    with engine.connect() as conn:
        assert conn.execute(sqlalchemy.text("SELECT 1")).scalar() == 1


def test_the_user_pool_outlives_the_coordinator_and_may_be_reused(
    user_pool: ConnectionPool[Any],
) -> None:
    schema = fresh_schema()
    with fenced.connect(user_pool, options={"schema": schema}) as coord:
        first = coord.acquire(R, ttl=10, wait=0)
        coord.release(first)
    with fenced.connect(user_pool, options={"schema": schema}) as coord:
        second = coord.acquire(R, ttl=10, wait=0)
        assert second.epoch == first.epoch + 1
        coord.release(second)
    pool_as_it_was(user_pool)


def test_a_pool_of_one_connection_is_refused_unless_it_never_listens(
    postgres_server: PostgresServer,
) -> None:
    with ConnectionPool(postgres_server.dsn(), min_size=1, max_size=1, open=True) as tiny:
        with pytest.raises(ConfigurationError, match="max_size >= 2"):
            fenced.connect(tiny, options={"schema": fresh_schema()})
        with fenced.connect(tiny, options={"schema": fresh_schema(), "listen": False}) as coord:
            lease = coord.acquire(R, ttl=10, wait=0)
            assert coord.release(lease) is True


def test_bad_pools_engines_and_options_are_configuration_errors(
    postgres_server: PostgresServer, user_pool: ConnectionPool[Any]
) -> None:
    with pytest.raises(ConfigurationError, match="postgresql\\+psycopg"):
        fenced.connect(sqlalchemy.create_engine("sqlite://"))
    with pytest.raises(ConfigurationError, match="AsyncConnectionPool"):
        fenced.connect(AsyncConnectionPool(postgres_server.dsn(), open=False))
    with pytest.raises(ConfigurationError, match="expected a postgresql:// URL"):
        fenced.connect(42)
    with pytest.raises(ConfigurationError, match="pool_size"):
        fenced.connect(user_pool, options={"pool_size": 3})
    with pytest.raises(ConfigurationError, match="unknown option 'sslmode'"):
        fenced.connect(user_pool, options={"sslmode": "require"})
    with pytest.raises(ConfigurationError, match="options= is for"):
        fenced.connect(postgres_server.url(), options={"schema": "x"})
    with pytest.raises(ConfigurationError, match="schema="):
        fenced.connect(user_pool, options={"schema": "Bad-Name"})
    with pytest.raises(ConfigurationError, match="host_clock"):
        fenced.connect(user_pool, host_clock=ManualClock())
    pool_as_it_was(user_pool)


def test_a_closed_user_pool_is_a_configuration_error(postgres_server: PostgresServer) -> None:
    pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
        postgres_server.dsn(), min_size=0, max_size=2, open=True
    )
    coord = fenced.connect(pool, options={"schema": fresh_schema()})
    try:
        pool.close()
        with pytest.raises(ConfigurationError, match="closed"):
            coord.acquire(R, ttl=10, wait=0)
    finally:
        coord.close()

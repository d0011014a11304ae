"""``postgresql:`` stores on the session's PostgreSQL server, for the store tests of both faces
(sync and asyncio): a fresh store URL per test and a snapshot of a store's tables. Import the
fixture into a test module to use it."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from fenced.fence import Store
from fenced.testing.postgres import PostgresServer

__all__ = ["postgres_snapshot", "store_url"]


@pytest.fixture
def store_url(postgres_server: PostgresServer) -> str:
    """The URL of a store in a schema no other test uses."""
    return postgres_server.url("postgres", schema="s_" + uuid.uuid4().hex[:12])


def postgres_snapshot(store: Store) -> list[tuple[str, list[tuple[object, ...]]]]:
    """Every row of every table of a ``postgresql:`` store but its records, read through a
    connection of its own (only ``store.url`` is used)."""
    schema = store.url.split("schema=", 1)[1].split("&", 1)[0]
    url = store.url.split("?", 1)[0]
    tables = ["store_domains", "store_items", "store_pointers", "store_objects", "store_chunks",
              "store_ops", "store_meta"]  # fmt: skip
    with psycopg.connect(url, autocommit=True) as conn:
        return [
            (
                table,
                conn.execute(f'SELECT * FROM "{schema}".{table} ORDER BY 1, 2'.encode()).fetchall(),
            )
            for table in tables
        ]

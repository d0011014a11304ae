"""The invoice database the PostgreSQL guard tests of both faces (``fenced.guard``,
``fenced.aio.guard``) run against, and their tokens. Import the fixture into a test module to
use it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from fenced.core._token import FencingToken
from fenced.testing.postgres import PostgresServer

__all__ = ["C1", "C2", "R", "dsn", "status", "tok"]

C1 = "c1" * 16
C2 = "c2" * 16
R = "billing/invoices"


def tok(epoch: int, coordinator: str = C1) -> FencingToken:
    """A token of resource :data:`R`."""
    return FencingToken(coordinator, R, epoch)


@pytest.fixture
def dsn(postgres_server: PostgresServer) -> Iterator[str]:
    """A fresh database with one open invoice (``invoices``: id 1, status ``open``)."""
    name = "g_" + uuid.uuid4().hex[:12]
    url = postgres_server.create_database(name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE invoices (id int PRIMARY KEY, status text NOT NULL)")
        conn.execute("INSERT INTO invoices VALUES (1, 'open')")
    yield url
    postgres_server.drop_database(name)


def status(dsn: str) -> str:
    """The invoice's status, read on a connection of its own."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT status FROM invoices WHERE id = 1").fetchone()
        assert row is not None
        return str(row[0])

"""The session's throwaway PostgreSQL server (see :mod:`fenced.testing.postgres`).

Registered by ``tests/conftest.py``. If the server cannot be started, every test that needs it
fails with the reason (they never skip).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.postgres import PostgresServer

__all__ = ["postgres_server"]


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One non-durable PostgreSQL 15 cluster for the whole session (fsync off: functional)."""
    server = PostgresServer(durable=False)
    try:
        server.start()
    except BaseException:
        server.stop("immediate")
        raise
    yield server
    server.stop("immediate")

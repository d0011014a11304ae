"""The coordinator conformance suites through ``fenced serve``: an ``http://`` client in this
process (sync, and asyncio on the embedded backend), the real application on uvicorn in a thread
(a fresh server per test), over the embedded, PostgreSQL and etcd backends."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.testing.aio_conformance import AsyncCoordinatorConformance, AsyncHistoryConformance
from fenced.testing.conformance import CoordinatorConformance, HistoryConformance
from fenced.testing.etcd import EtcdCluster
from fenced.testing.postgres import PostgresServer
from fenced.testing.server import ServedCoordinator


def _served(url: str) -> Iterator[str]:
    with ServedCoordinator(url, poll=2.0) as served:
        yield served.url


@pytest.fixture
def served_sqlite(tmp_path: Path) -> Iterator[str]:
    yield from _served(f"sqlite:///{tmp_path / 'fenced.db'}")


@pytest.fixture
def served_postgres(postgres_server: PostgresServer) -> Iterator[str]:
    yield from _served(postgres_server.url("postgres", schema=f"s{uuid.uuid4().hex[:12]}"))


@pytest.fixture
def served_etcd(etcd_cluster: EtcdCluster) -> Iterator[str]:
    yield from _served(etcd_cluster.url(prefix=f"/t{uuid.uuid4().hex[:12]}", timeout=2))


class TestHttpOverSqlite(CoordinatorConformance):
    @pytest.fixture
    def url(self, served_sqlite: str) -> str:
        return served_sqlite


class TestHttpHistoryOverSqlite(HistoryConformance):
    @pytest.fixture
    def url(self, served_sqlite: str) -> str:
        return served_sqlite


class TestHttpOverPostgres(CoordinatorConformance):
    @pytest.fixture
    def url(self, served_postgres: str) -> str:
        return served_postgres


class TestHttpOverEtcd(CoordinatorConformance):
    @pytest.fixture
    def url(self, served_etcd: str) -> str:
        return served_etcd


class TestAsyncHttpOverSqlite(AsyncCoordinatorConformance):
    @pytest.fixture
    def url(self, served_sqlite: str) -> str:
        return served_sqlite


class TestAsyncHttpHistoryOverSqlite(AsyncHistoryConformance):
    @pytest.fixture
    def url(self, served_sqlite: str) -> str:
        return served_sqlite

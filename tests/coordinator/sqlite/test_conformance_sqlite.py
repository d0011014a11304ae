"""The coordinator conformance suite on the embedded SQLite backend (a fresh database per test).

SQLite has every capability the suite checks: notifications for waiters, ``request_id``
deduplication, records (:class:`HistoryConformance`), and an injectable expiry clock
(:class:`ManualClockConformance`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from fenced.testing.aio_conformance import AsyncCoordinatorConformance, AsyncHistoryConformance
from fenced.testing.conformance import (
    CoordinatorConformance,
    HistoryConformance,
    ManualClockConformance,
)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/fenced.db"


class TestSQLiteCoordinator(CoordinatorConformance):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url


class TestSQLiteManualClock(ManualClockConformance):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url


class TestSQLiteHistory(HistoryConformance):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url


class TestSQLiteCoordinatorAsync(AsyncCoordinatorConformance):
    """Statements on the event loop's thread (the default)."""

    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url


class TestSQLiteCoordinatorAsyncOffloaded(AsyncCoordinatorConformance):
    """``fenced.aio.connect(url, offload=True)``: statements on a worker thread."""

    connect_options: ClassVar[dict[str, Any]] = {"offload": True}

    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url


class TestSQLiteHistoryAsync(AsyncHistoryConformance):
    @pytest.fixture
    def url(self, sqlite_url: str) -> str:
        return sqlite_url

"""The coordinator conformance suite on the embedded SQLite backend (a fresh database per test).

SQLite has every capability the suite checks: notifications for waiters, ``request_id``
deduplication, records (:class:`HistoryConformance`), and an injectable expiry clock
(:class:`ManualClockConformance`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

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

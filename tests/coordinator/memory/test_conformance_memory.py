"""The coordinator conformance suite on the in-memory reference backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from fenced.coordinator.backends.memory._backend import MemoryBackend
from fenced.testing.aio_conformance import AsyncCoordinatorConformance, AsyncHistoryConformance
from fenced.testing.conformance import (
    CoordinatorConformance,
    HistoryConformance,
    ManualClockConformance,
)


@pytest.fixture
def memory_url() -> Iterator[str]:
    name = uuid.uuid4().hex
    yield f"memory://{name}"
    MemoryBackend.forget(name)


class TestMemoryCoordinator(CoordinatorConformance):
    @pytest.fixture
    def url(self, memory_url: str) -> str:
        return memory_url


class TestMemoryHistory(HistoryConformance):
    @pytest.fixture
    def url(self, memory_url: str) -> str:
        return memory_url


class TestMemoryManualClock(ManualClockConformance):
    @pytest.fixture
    def url(self, memory_url: str) -> str:
        return memory_url


class TestMemoryCoordinatorAsync(AsyncCoordinatorConformance):
    @pytest.fixture
    def url(self, memory_url: str) -> str:
        return memory_url


class TestMemoryHistoryAsync(AsyncHistoryConformance):
    @pytest.fixture
    def url(self, memory_url: str) -> str:
        return memory_url

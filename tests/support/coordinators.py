"""Shared by the tests of the coordinator on real servers (etcd, PostgreSQL).

``open_coord`` is registered by ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from fenced.coordinator import _restore as restoring
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect
from fenced.core._clock import SystemClock

__all__ = ["DEADLINE_CLOCK", "open_coord", "restore_again_and_again"]

DEADLINE_CLOCK = SystemClock()
"""The clock of lease deadlines (``Clock.now``): compare deadlines with it, never with
``time.monotonic()``, which stops while the host is suspended."""


@pytest.fixture
def open_coord() -> Iterator[Callable[[str], Coordinator]]:
    """``connect(url)``; every coordinator is closed at the end of the test, even on failure."""
    opened: list[Coordinator] = []

    def make(url: str) -> Coordinator:
        opened.append(connect(url))
        return opened[-1]

    yield make
    for coord in opened:
        coord.close()


def restore_again_and_again(
    url: str, resource: str, backup: Callable[[], object], restore: Callable[[], object]
) -> None:
    """Three grants of ``resource``, then ``backup()``; then three times: ``restore()`` (of that
    backup), the advance step (``fenced restore --advance``) and three grants. Asserts that every
    first grant after a restore is above every grant issued before it."""
    with connect(url) as coord:
        for _ in range(3):
            coord.release(coord.acquire(resource, ttl=5, wait=0))
    backup()
    issued = [3]
    for _ in range(3):
        restore()
        with connect(url) as restored:
            assert restored.last_epoch(resource) == 3  # the state the restore replaced is gone
            restoring.advance(restored)
            first = restored.acquire(resource, ttl=5, wait=0)
            assert all(first.epoch > epoch for epoch in issued), (first.epoch, issued)
            for _ in range(2):
                restored.release(first)
                issued.append(first.epoch)
                first = restored.acquire(resource, ttl=5, wait=0)
            restored.release(first)
            issued.append(first.epoch)

"""How waiting tasks of the embedded coordinator's asyncio face are woken (``_aio._Waiting``).

A waiter's wait ends by a datagram on its ticket's socket (read by the event loop's selector) or
by its timer (the queue keep-alive, the hand-off patience). These tests count how each wait
ended, so a hand-off that reached its waiter only through the timer fails them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

import fenced.aio
from fenced.coordinator.backends.sqlite import _aio

R = "jobs/ping-pong"


@pytest.fixture
def endings(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How the waits ended: ``datagram`` or ``timer`` (each callback that ended one)."""
    seen: Counter[str] = Counter()
    over = _aio._Waiting._over

    def counted(self: _aio._Waiting, woken: bool) -> None:
        was_done = self.done.done()
        over(self, woken)
        if not was_done and self.done.done():
            seen["datagram" if woken else "timer"] += 1

    monkeypatch.setattr(_aio._Waiting, "_over", counted)
    return seen


async def test_hand_offs_between_tasks_of_one_loop_are_woken_by_datagrams(
    tmp_path: Path, endings: Counter[str]
) -> None:
    """Two tasks take turns 40 times: each grant closes the ticket's socket and the next acquire
    opens a new one (often with the same descriptor number) before the finished wait's reader
    is removed; every wait must still be ended by its datagram."""
    async with fenced.aio.connect(f"sqlite:///{tmp_path}/c.db") as coord:
        turns: list[str] = []
        first = await coord.acquire(R, ttl=5, wait=0)

        async def player(name: str) -> None:
            for _ in range(20):
                lease = await coord.acquire(R, ttl=5, wait=10, holder=name)
                turns.append(name)
                assert await coord.release(lease)  # then at once (no suspension) acquire again

        watched = _watched()
        players = [asyncio.create_task(player(name)) for name in ("a", "b")]
        await _until(lambda: _watched() == watched + 2)  # both wait on their sockets
        assert await coord.release(first)
        await asyncio.wait_for(asyncio.gather(*players), 20)
    assert len(turns) == 40
    assert endings["timer"] == 0
    assert endings["datagram"] >= 1


async def test_a_cancelled_wait_stops_watching_its_socket(tmp_path: Path) -> None:
    """Cancelling a waiting acquire removes the loop's reader and closes its descriptor."""
    async with fenced.aio.connect(f"sqlite:///{tmp_path}/c.db") as coord:
        held = await coord.acquire(R, ttl=5, wait=0)
        watched = _watched()
        waiter = asyncio.create_task(coord.acquire(R, ttl=5, wait=10))
        await _until(lambda: _watched() == watched + 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert _watched() == watched
        assert await coord.release(held)
        assert (await coord.acquire(R, ttl=5, wait=0)).epoch == held.epoch + 1


def _watched() -> int:
    """The descriptors the running loop's selector watches."""
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    return len(selector.get_map())


async def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)

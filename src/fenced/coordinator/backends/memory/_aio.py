"""The asyncio face of ``memory://NAME``: the model's own steps, waiting as tasks.

Every step is the sync :class:`~.MemoryBackend`'s (the executable model): they touch only the
shared in-process state under its lock and never block on I/O, so they run on the event loop
directly. Only waiting differs: a waiting task registers a waker with the shared state
(:attr:`MemoryState.wakers`), called at every change by either face from any thread, and
suspends on a future of its own loop — no thread per waiter. Sync and async coordinators on the
same ``memory://NAME`` wake each other.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.memory._backend import MemoryBackend
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._tasks import settle

__all__ = ["AsyncMemoryBackend"]


class AsyncMemoryBackend:
    """:class:`~fenced.coordinator.aio_backend.AsyncCoordinatorBackend` of ``memory://NAME``."""

    capabilities = MemoryBackend.capabilities
    inline = True
    """Every step but the waits runs to its end without suspending (the model's own steps)."""

    def __init__(self, name: str = "default") -> None:
        self._model = MemoryBackend(name)
        self.url = self._model.url
        self.coordinator_id = self._model.coordinator_id

    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        return self._model.try_grant(request, ticket)

    async def enqueue(self, request: GrantRequest) -> Ticket:
        return self._model.enqueue(request)

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        await self._changed(lambda: False, timeout)

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        return self._model.leave(ticket, take)

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return self._model.renew(resource, epoch, owner, ttl)

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        return self._model.release(resource, epoch, owner)

    async def current(self, resource: str) -> LeaseInfo | None:
        return self._model.current(resource)

    async def last_epoch(self, resource: str) -> int:
        return self._model.last_epoch(resource)

    async def resources(self) -> list[str]:
        return self._model.resources()

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        self._model.proclaim(resource, epoch, owner, value)

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        return self._model.records(resource, after, limit)

    async def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        self._model.report(resource, epoch, holder, kind, detail)

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        """Until ``resource`` has a record after ``after`` (its live lease's expiry counts: it is
        recorded when noticed, so the wait also ends at that expiry), or ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            if self._model.records(resource, after, 1):
                return
            left = deadline - loop.time()
            if left <= 0:
                return
            info = self._model.current(resource)
            if info is not None:
                left = min(left, max(info.expires_in, 0.0) + 0.001)
            await self._changed(lambda: False, left)

    async def _changed(self, done: Callable[[], bool], timeout: float) -> None:
        """Suspend until the shared state changes (any resource) or ``timeout`` passed."""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()

        def wake() -> None:  # called under the state's lock, from any thread
            loop.call_soon_threadsafe(settle, woken)

        state = self._model._state
        with state.cond:
            if done():
                return
            state.wakers.add(wake)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken, timeout)
        finally:
            with state.cond:
                state.wakers.discard(wake)

    async def aclose(self) -> None:
        """Nothing to close: the state lives as long as the process."""

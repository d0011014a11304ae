"""A verification worker whose coordinator and stores are the asyncio face (``--api async``).

:class:`AsyncWorker` is the sync :class:`~fenced.verify._worker.Worker` (the same modes,
commands, protected work and recorded events) with every coordinator and store call made through
:mod:`fenced.aio`: an :class:`~fenced.aio.AsyncCoordinator` over an
:class:`~fenced.verify._faults.AsyncRecordingBackend` (the same recorded events and wire faults,
delays suspending the task), ``async with coord.hold(...)`` entered on the worker's event loop
(so the renewals are its scheduler task's), and :class:`~fenced.aio.AsyncStore` stores. The
event loop runs in one thread of the worker process; the worker's script (a seeded schedule or
the case driver's commands) runs in the main thread and awaits each call on that loop, so a
SIGSTOP of the process stops the loop, its renewals and the script together, as it stops a sync
worker's threads.

The body of ``hold`` is the script, not a task, so the hold is entered with
``cancel_on_loss=False``: the worker learns of a loss from ``check()`` before each protected
write, as the sync worker does (the cancellation itself is tested by the conformance suites).
Seeded defects are built into the sync coordinator and stores only: ``--mutant`` with
``--api async`` is refused before anything runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fenced.aio._connect import open_async_backend
from fenced.aio._coordinator import AsyncCoordinator
from fenced.aio._keeper import AsyncHeldLease
from fenced.aio._store import open_store as open_async_store
from fenced.core._errors import ConfigurationError
from fenced.core._lease import Lease, LeaseState
from fenced.core._token import FencingToken
from fenced.fence.backend import Backend
from fenced.testing.aio_bridge import LoopThread, SyncStore
from fenced.verify._faults import AsyncRecordingBackend, FaultPlan
from fenced.verify._recorder import Recorder

__all__ = [
    "BridgedCoordinator",
    "BridgedHeld",
    "BridgedStore",
    "bridged_coordinator",
    "bridged_store",
]

T = TypeVar("T")


def _on_loop(loop: LoopThread, fn: Callable[[], T]) -> T:
    """``fn()`` on the loop's thread (for what must not race the loop)."""

    async def wrapped() -> T:
        return fn()

    return loop.call(wrapped())


class BridgedHeld:
    """An :class:`AsyncHeldLease` as the worker's script reads it (from its own thread)."""

    def __init__(self, held: AsyncHeldLease, loop: LoopThread) -> None:
        self._held = held
        self._loop = loop

    @property
    def epoch(self) -> int:
        return self._held.epoch

    @property
    def token(self) -> FencingToken:
        return self._held.token

    @property
    def deadline(self) -> float:
        return self._held.deadline

    @property
    def state(self) -> LeaseState:
        return self._held.state

    @property
    def lease(self) -> Lease:
        return self._held.lease

    def check(self) -> None:
        _on_loop(self._loop, self._held.check)

    def superseded(self, detail: str = "a store reported a newer epoch") -> None:
        _on_loop(self._loop, lambda: self._held.superseded(detail))


class BridgedCoordinator:
    """The calls a worker makes of its coordinator, made on an :class:`AsyncCoordinator`."""

    def __init__(self, coord: AsyncCoordinator, loop: LoopThread) -> None:
        self._coord = coord
        self._loop = loop

    @contextlib.contextmanager
    def hold(
        self, resource: str, ttl: float, *, fence: list[Any], **options: Any
    ) -> Iterator[BridgedHeld]:
        stores = [_AsyncFence(store) for store in fence]
        holding = self._coord.hold(resource, ttl, fence=stores, cancel_on_loss=False, **options)
        held = self._loop.call(holding.__aenter__())
        failure: BaseException | None = None
        try:
            yield BridgedHeld(held, self._loop)
        except BaseException as error:
            failure = error
            raise
        finally:
            exc = (type(failure), failure, failure.__traceback__) if failure else (None,) * 3
            self._loop.call(holding.__aexit__(*exc))

    def acquire(self, resource: str, ttl: float, wait: float | None, holder: str) -> Lease:
        return self._loop.call(self._coord.acquire(resource, ttl, wait, holder))

    def release(self, lease: Lease) -> bool:
        return self._loop.call(self._coord.release(lease))

    def close(self) -> None:
        self._loop.call(self._coord.aclose())


class _AsyncFence:
    """A worker's (recorded, sync) store as ``hold(fence=…)`` of the asyncio face awaits it:
    its ``fence`` runs in a thread, so the recorded call can await the store on the loop."""

    def __init__(self, store: Any) -> None:
        self._store = store

    async def fence(self, token: FencingToken) -> int:
        result: int = await asyncio.to_thread(self._store.fence, token)
        return result

    def __repr__(self) -> str:
        return repr(self._store)


class BridgedStore(SyncStore):
    """A worker's store: :class:`~fenced.testing.aio_bridge.SyncStore` over an
    :class:`AsyncStore`, whose backend :class:`~fenced.verify._worker.StopInCommit` reaches."""

    @property
    def _backend(self) -> Backend:
        return self.async_store._store._backend

    @_backend.setter
    def _backend(self, backend: Backend) -> None:
        self.async_store._store._backend = backend


def bridged_coordinator(
    url: str, recorder: Recorder, plan: FaultPlan, defects: frozenset[str], loop: LoopThread
) -> BridgedCoordinator:
    """The worker's coordinator: fenced.aio over the recording (and faulting) async backend."""
    if defects:
        raise ConfigurationError(
            "seeded defects are built into the sync face: not with --api async"
        )

    async def open_coordinator() -> AsyncCoordinator:
        backend = AsyncRecordingBackend(await open_async_backend(url), recorder, plan)
        return AsyncCoordinator(backend)

    return BridgedCoordinator(loop.call(open_coordinator()), loop)


def bridged_store(url: str, loop: LoopThread) -> BridgedStore:
    """A worker's store, opened with :func:`fenced.aio.open_store`."""
    return BridgedStore(loop, loop.call(open_async_store(url)))

"""Fault injection around a coordinator backend, for embedded backends and tests.

:class:`FaultyBackend` forwards every call to the wrapped backend, except that an armed fault
changes what the caller sees:

``unavailable``
    the call is not forwarded; :class:`~fenced.Unavailable` is raised (nothing happened);
``lose_reply``
    the call IS forwarded and takes effect, then :class:`~fenced.OutcomeUnknown` is raised (the
    reply was lost on the way back);
``delay``
    the call is forwarded after sleeping ``delay`` seconds (a slow network).

:class:`AsyncFaultyBackend` does the same around an asyncio backend.

Faults are armed per operation name (``"try_grant"``, ``"renew"``, ``"release"``, …) for a number
of calls (``times``, None = until disarmed). Thread-safe.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeVar

from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.coordinator.backend import (
    Blocked,
    CoordinatorBackend,
    Granted,
    GrantRequest,
    Ticket,
)
from fenced.core._errors import OutcomeUnknown, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

__all__ = ["AsyncFaultyBackend", "Fault", "FaultyBackend"]

Fault = Literal["unavailable", "lose_reply", "delay"]
T = TypeVar("T")


@dataclass
class _Armed:
    fault: Fault
    times: int | None
    delay: float


class _Injector:
    """The armed faults and the call counters; both faces' wrappers share them."""

    def __init__(self, inner: CoordinatorBackend | AsyncCoordinatorBackend) -> None:
        self.url = inner.url
        self.coordinator_id = inner.coordinator_id
        self.capabilities = inner.capabilities
        self._lock = threading.Lock()
        self._armed: dict[str, _Armed] = {}
        self.calls: dict[str, int] = {}
        """Calls made, per operation (counted when the call starts)."""
        self.answered: dict[str, int] = {}
        """Calls forwarded that returned (took effect), per operation, whatever the caller was
        told then: a witness that, say, a waiter's ``enqueue`` is done."""
        self.injected: dict[str, int] = {}

    def arm(
        self, operation: str, fault: Fault, *, times: int | None = 1, delay: float = 0.0
    ) -> None:
        """Inject ``fault`` into the next ``times`` calls of ``operation`` (None: every call)."""
        with self._lock:
            self._armed[operation] = _Armed(fault, times, delay)

    def disarm(self, operation: str | None = None) -> None:
        """Stop injecting into ``operation`` (or into everything)."""
        with self._lock:
            if operation is None:
                self._armed.clear()
            else:
                self._armed.pop(operation, None)

    def _take(self, operation: str) -> _Armed | None:
        with self._lock:
            self.calls[operation] = self.calls.get(operation, 0) + 1
            armed = self._armed.get(operation)
            if armed is None:
                return None
            if armed.times is not None:
                armed.times -= 1
                if armed.times <= 0:
                    del self._armed[operation]
            self.injected[operation] = self.injected.get(operation, 0) + 1
            return armed

    def _answered(self, operation: str, armed: _Armed | None) -> None:
        with self._lock:
            self.answered[operation] = self.answered.get(operation, 0) + 1
        if armed is not None and armed.fault == "lose_reply":
            raise OutcomeUnknown(f"injected fault: the reply to {operation} was lost")

    @staticmethod
    def _refuse(operation: str, armed: _Armed | None) -> None:
        if armed is not None and armed.fault == "unavailable":
            raise Unavailable(f"injected fault: {operation} did not reach the coordinator")


class FaultyBackend(_Injector):
    """A :class:`CoordinatorBackend` that injects faults into the calls of another one."""

    def __init__(self, inner: CoordinatorBackend) -> None:
        super().__init__(inner)
        self.inner = inner

    def _call(self, operation: str, forward: Callable[[], T]) -> T:
        armed = self._take(operation)
        self._refuse(operation, armed)
        if armed is not None and armed.fault == "delay":
            time.sleep(armed.delay)
        answer = forward()
        self._answered(operation, armed)
        return answer

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        return self._call("try_grant", lambda: self.inner.try_grant(request, ticket))

    def enqueue(self, request: GrantRequest) -> Ticket:
        return self._call("enqueue", lambda: self.inner.enqueue(request))

    def wait(self, ticket: Ticket, timeout: float) -> None:
        self.inner.wait(ticket, timeout)

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        return self.inner.leave(ticket, take)

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return self._call("renew", lambda: self.inner.renew(resource, epoch, owner, ttl))

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        return self._call("release", lambda: self.inner.release(resource, epoch, owner))

    def current(self, resource: str) -> LeaseInfo | None:
        return self._call("current", lambda: self.inner.current(resource))

    def last_epoch(self, resource: str) -> int:
        return self.inner.last_epoch(resource)

    def resources(self) -> list[str]:
        return self.inner.resources()

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        self._call("proclaim", lambda: self.inner.proclaim(resource, epoch, owner, value))

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        return self._call("records", lambda: self.inner.records(resource, after, limit))

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        self._call("report", lambda: self.inner.report(resource, epoch, holder, kind, detail))

    def watch(self, resource: str, after: int, timeout: float) -> None:
        self.inner.watch(resource, after, timeout)

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        return self._call("advance", lambda: self.inner.advance(minimum, floors, detail))

    def close(self) -> None:
        self.inner.close()


class AsyncFaultyBackend(_Injector):
    """An :class:`~fenced.coordinator.aio_backend.AsyncCoordinatorBackend` that injects the
    same faults into the calls of another one (``delay`` sleeps the task, not a thread)."""

    def __init__(self, inner: AsyncCoordinatorBackend) -> None:
        super().__init__(inner)
        self.inner = inner

    async def _call(self, operation: str, forward: Callable[[], Awaitable[T]]) -> T:
        armed = self._take(operation)
        self._refuse(operation, armed)
        if armed is not None and armed.fault == "delay":
            await asyncio.sleep(armed.delay)
        answer = await forward()
        self._answered(operation, armed)
        return answer

    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        return await self._call("try_grant", lambda: self.inner.try_grant(request, ticket))

    async def enqueue(self, request: GrantRequest) -> Ticket:
        return await self._call("enqueue", lambda: self.inner.enqueue(request))

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        await self.inner.wait(ticket, timeout)

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        return await self.inner.leave(ticket, take)

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return await self._call("renew", lambda: self.inner.renew(resource, epoch, owner, ttl))

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        return await self._call("release", lambda: self.inner.release(resource, epoch, owner))

    async def current(self, resource: str) -> LeaseInfo | None:
        return await self._call("current", lambda: self.inner.current(resource))

    async def last_epoch(self, resource: str) -> int:
        return await self.inner.last_epoch(resource)

    async def resources(self) -> list[str]:
        return await self.inner.resources()

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        await self._call("proclaim", lambda: self.inner.proclaim(resource, epoch, owner, value))

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        return await self._call("records", lambda: self.inner.records(resource, after, limit))

    async def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        await self._call("report", lambda: self.inner.report(resource, epoch, holder, kind, detail))

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        await self.inner.watch(resource, after, timeout)

    async def aclose(self) -> None:
        await self.inner.aclose()

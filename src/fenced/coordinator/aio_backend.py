"""The asyncio face of the backend contract: the same atomic steps, awaited.

Every method means exactly what its namesake in :class:`fenced.coordinator.backend.
CoordinatorBackend` means: same arguments, same answers (:class:`Granted`, :class:`Blocked`,
tickets, records), same errors. Only the waiting differs: ``wait`` and ``watch`` suspend the
calling task, never a thread, and a backend wakes its waiting tasks by the same notifications
as its sync twin (a datagram read by the event loop, ``NOTIFY`` as psycopg's async notifies, an
etcd watch over ``grpc.aio``).

Cancellation: a task cancelled while one of these calls is in flight gets
:class:`asyncio.CancelledError` and the step either happened or did not, as with a lost reply.
:class:`fenced.aio.AsyncCoordinator` runs the steps it wants completed (``leave``, ``release``)
shielded, in a task of their own, unless the backend says ``inline = True``: its steps run to
their end without ever suspending the caller (the memory model; SQLite on the loop's thread),
so no cancellation can arrive half way, and the shield's task and turn of the loop are saved.
"""

from __future__ import annotations

from typing import Protocol

from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

__all__ = ["AsyncCoordinatorBackend"]


class AsyncCoordinatorBackend(Protocol):
    """What an asyncio coordinator backend implements (see the module docstring).

    ``url``, ``coordinator_id`` and ``capabilities`` are known once the backend is opened
    (the factory that opens one is a coroutine); :meth:`aclose` releases its connections.
    """

    url: str
    coordinator_id: str
    capabilities: frozenset[str]

    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant if free and first in line (``CoordinatorBackend.try_grant``)."""
        ...

    async def enqueue(self, request: GrantRequest) -> Ticket:
        """Take a place at the end of ``request.resource``'s queue."""
        ...

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        """Suspend until notified of a change for the ticket's resource, or ``timeout`` passed.
        Holds no thread while suspended."""
        ...

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue (idempotent); with ``take`` return a lease handed to the ticket."""
        ...

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        """Extend a live lease of this owner and epoch; the coordinator's remaining time."""
        ...

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        """Delete the lease if owner and epoch match, atomically; wake the next waiter."""
        ...

    async def current(self, resource: str) -> LeaseInfo | None:
        """The live lease of ``resource`` or None."""
        ...

    async def last_epoch(self, resource: str) -> int:
        """The largest epoch granted or reserved for ``resource``."""
        ...

    async def resources(self) -> list[str]:
        """Every resource that has ever been granted, sorted."""
        ...

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        """Replace the advertised value of this owner's live lease, same epoch; record it."""
        ...

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        """Records with ``seq > after`` (of ``resource``, or of all), oldest first."""
        ...

    async def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        """Append a record reported by a holder (renewal failure, loss). Best effort."""
        ...

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        """Suspend until ``resource`` has a record with ``seq > after``, or ``timeout`` passed."""
        ...

    async def aclose(self) -> None:
        """Release connections, sockets and worker threads; idempotent. After it returns, the
        backend has no task and no thread left running."""
        ...

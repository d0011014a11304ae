"""The narrow contract every coordinator backend implements.

A backend does atomic steps on its own state and nothing else: it does not loop, retry, compute
local deadlines or validate parameters. :class:`fenced.coordinator.Coordinator` does that once,
above every backend. A backend translates its driver's errors into fenced errors at this
boundary (``raise Unavailable(...) from error``).

Waiting is first come, first served: a waiter takes a :class:`Ticket` (a place in the resource's
queue) and calls :meth:`CoordinatorBackend.try_grant` with it whenever :meth:`wait` returns.
``try_grant`` grants only when no live lease exists and no live ticket is ahead of the caller's
(a caller without a ticket is behind every queued waiter). Backends wake waiters by notification
(a datagram, NOTIFY, a watch), not by polling; :attr:`Blocked.retry_in` tells the caller when to
try again without a notification (the current lease's expiry, or the keep-alive of its ticket).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from fenced.core._errors import ConfigurationError
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

__all__ = [
    "CAP_RECORDS",
    "CAP_REQUEST_ID",
    "CAP_WAIT_NOTIFY",
    "Blocked",
    "CoordinatorBackend",
    "GrantRequest",
    "Granted",
    "Ticket",
    "owned_ticket",
]

CAP_WAIT_NOTIFY = "wait-notify"
"""Waiters are woken by a notification from the backend."""
CAP_REQUEST_ID = "request-id"
"""acquire(request_id=…) is deduplicated by the backend."""
CAP_RECORDS = "records"
"""The backend keeps ownership records (timeline)."""


@dataclass(frozen=True, slots=True)
class GrantRequest:
    """One acquire attempt, already validated by the Coordinator."""

    resource: str
    ttl: float
    owner: str = field(repr=False)
    holder: str
    request_id: str | None = None
    value: str | None = None
    """An election candidate's advertised value, shown by ``current`` while it leads."""
    queues: bool = False
    """The caller queues when this attempt is not granted (``acquire`` with ``wait`` other than
    0): it uses a :class:`Blocked` answer only to queue, so a backend may leave out work that
    only makes ``Blocked.remaining`` precise (an upper bound, such as the ttl, is enough)."""


@dataclass(frozen=True, slots=True)
class Granted:
    """The lease was granted (or, for a retried ``request_id``, found granted earlier).

    ``owner`` is the owner secret of the grant: equal to the request's, except when a retried
    ``request_id`` returns the earlier grant. ``expires_in`` is the remaining time by the
    coordinator's clock when it answered.
    """

    epoch: int
    owner: str = field(repr=False)
    holder: str
    ttl: float
    expires_in: float


@dataclass(frozen=True, slots=True)
class Blocked:
    """Not granted. ``holder`` is None when the resource is free but earlier waiters are queued.

    ``epoch`` is the live lease's epoch (or the last granted one); ``remaining`` its remaining
    time by the coordinator's clock; ``retry_in`` how long the caller may wait for a notification
    before it should try again anyway (None: only a notification can help).
    """

    holder: str | None
    epoch: int
    remaining: float
    retry_in: float | None


class Ticket(Protocol):
    """A backend-specific place in a resource's waiting queue."""

    @property
    def resource(self) -> str: ...


T = TypeVar("T", bound="Ticket")


def owned_ticket(backend: object, ticket: Ticket | None, resource: str, kind: type[T]) -> T | None:
    """``ticket`` as this backend's own ``kind`` of ticket for ``resource`` (None stays None).

    A ticket issued by another backend instance, or for another resource, is a caller's bug:
    :class:`~fenced.ConfigurationError`.
    """
    if ticket is None:
        return None
    if not isinstance(ticket, kind) or getattr(ticket, "_backend", None) is not backend:
        raise ConfigurationError(f"{ticket!r} was not issued by {backend!r}")
    if ticket.resource != resource:
        raise ConfigurationError(
            f"{ticket!r} is a place in the queue of {ticket.resource}, not of {resource}"
        )
    return ticket


class CoordinatorBackend(Protocol):
    """What a coordinator backend implements. Every method is one atomic step (or a wait).

    Errors: :class:`~fenced.Unavailable` when nothing happened; :class:`~fenced.OutcomeUnknown`
    when a mutating request may have taken effect; :class:`~fenced.LeaseLost` from ``renew``
    and from ``try_grant`` (a retried request_id whose grant has ended);
    :class:`~fenced.ConfigurationError` for unusable state.
    """

    url: str
    coordinator_id: str
    capabilities: frozenset[str]

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant with epoch = max(last epoch, minimum epoch) + 1 if free and first in line.

        The new epoch is durable before this returns. A granted ticket leaves the queue in the
        same step. A ``request_id`` seen before returns its earlier grant while that lease lives,
        and raises LeaseLost(REJECTED) once it has ended: never a second epoch; presented for
        another resource than its grant's, it is a ConfigurationError (never a lease).
        The memory backend is the executable model of these rules (its module docstring).
        """
        ...

    def enqueue(self, request: GrantRequest) -> Ticket:
        """Take a place at the end of ``request.resource``'s queue."""
        ...

    def wait(self, ticket: Ticket, timeout: float) -> None:
        """Block until notified of a change for the ticket's resource, or ``timeout`` passed."""
        ...

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue (idempotent); wakes the next waiter if that one may now proceed.

        A backend whose releases hand the lease to the head waiter checks, in the same atomic
        step as the leave, whether one was handed to this ticket: with ``take`` it returns that
        lease (the caller owns it now: ``Granted.expires_in`` measured when this answered);
        without, it releases it and passes the resource on. Returns None otherwise (always
        for a backend that does not hand over, and when the step failed: a grant that reached
        the ticket then expires within its ttl).
        """
        ...

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        """Extend a live lease of this owner and epoch to ``ttl`` from now.

        Returns the coordinator's remaining time. Raises LeaseLost(REJECTED) if the lease is not
        live or not this owner's: an expired lease is never revived.
        """
        ...

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        """Delete the lease if owner and epoch match, atomically; wake the next waiter.

        Returns False (and changes nothing) otherwise. Need not be durable by itself: a lost
        release only delays the next grant until expiry.
        """
        ...

    def current(self, resource: str) -> LeaseInfo | None:
        """The live lease of ``resource`` or None."""
        ...

    def last_epoch(self, resource: str) -> int:
        """The largest epoch granted or reserved for ``resource``: the next grant gets this + 1.

        0 for a resource never granted on a coordinator never restored.
        """
        ...

    def resources(self) -> list[str]:
        """Every resource that has ever been granted, sorted."""
        ...

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        """Replace the advertised value of this owner's live lease, same epoch; record it.

        Raises LeaseLost(REJECTED) if the lease is not live or not this owner's.
        """
        ...

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        """Records with ``seq > after`` (of ``resource``, or of all), oldest first.

        Expiries that are due are detected and recorded first, so the answer is current.
        """
        ...

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        """Append a record reported by a holder (renewal failure, loss). Best effort."""
        ...

    def watch(self, resource: str, after: int, timeout: float) -> None:
        """Block until ``resource`` has a record with ``seq > after``, or ``timeout`` passed.

        Woken by notification, like :meth:`wait`; the caller re-reads :meth:`records`.
        """
        ...

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        """Restore safety: no later grant of any resource gets an epoch ≤ ``minimum``.

        Raises the coordinator-wide minimum epoch to ``minimum`` (never lowers it) and each
        resource's last epoch to ``floors[resource]`` where that is higher; ends every live lease
        (they belong to the state before the restore); appends a RESTORED record per resource with
        ``detail``, after the EXPIRED record of each lease that had expired unnoticed (as
        :meth:`records` does). One atomic step. Returns the new coordinator-wide minimum.
        """
        ...

    def close(self) -> None:
        """Release connections and sockets; idempotent."""
        ...

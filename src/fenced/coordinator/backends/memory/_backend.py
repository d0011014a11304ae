"""The in-memory backend (``memory://NAME``) and the executable model of the lease rules.

One process, no durability: coordinators connected to the same ``memory://NAME`` in one process
share state; nothing survives the process.

**The model.** The lease rules are written once per backend — SQL (SQLite), PL/pgSQL
(PostgreSQL), etcd transaction compares — and stated here in plain Python, the simplest correct
way. Every backend answers exactly as this one does:
``tests/coordinator/test_model_lockstep.py`` drives it and each real backend with the same random
operations and clock steps and compares every answer (values and exception classes) and every
record (see docs/coordinator.md). The rules:

- A lease is **live** while its boot id is the host clock's and its expiry (boot-time clock) is
  in the future. An ended lease is never revived.
- :meth:`~MemoryBackend.try_grant`: a ``request_id`` seen before answers for its earlier grant
  and does nothing else — that grant while its lease lives, ``LeaseLost(REJECTED)`` once the
  lease ended, ``ConfigurationError`` if the grant was of another resource. Otherwise a live
  lease blocks (its holder and epoch), and so does a live waiter ahead in the queue (no holder,
  the last epoch); else the grant gets epoch = max(last epoch, minimum epoch) + 1.
- ``renew``, ``release`` and ``proclaim`` act only on the live lease of that epoch *and* owner;
  otherwise renew and proclaim raise ``LeaseLost(REJECTED)`` and release returns False.
- ``advance`` (a restore) raises the minimum epoch and the floors, never lowers them, ends every
  lease and records ``restored`` for every resource.
- Records: ``granted`` (``after``: how the previous lease ended — ``none``, ``released``,
  ``expired``, ``restored`` — and the candidate's ``value``), ``released``, ``proclaimed``,
  ``restored``, and ``expired``, written when the expiry is first noticed: by any operation on
  the resource, by ``records`` and by ``advance``: a resource's records are the same whether or
  not anyone looked in between.

The backends may differ only where the lockstep test normalises: remaining times (within their
bounds), ``Blocked.retry_in`` (a hint), record ``seq`` and ``at``, the coordinator id; and in
waiting, where the real backends hand a released lease to the head waiter inside the release
while this one leaves it to the waiter's next ``try_grant``.

Every reading of time (expiry, record times) and every timed wait goes through the injected
:class:`~fenced.core._clock.HostClock`: under a :class:`~fenced.core._clock.ManualClock` a wait ends
when it is notified or when the test moves the clock. Waiters are woken through a
:class:`threading.Condition`.
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from fenced.coordinator._hostclock import SystemHostClock
from fenced.coordinator.backend import (
    CAP_RECORDS,
    CAP_REQUEST_ID,
    CAP_WAIT_NOTIFY,
    Blocked,
    Granted,
    GrantRequest,
    Ticket,
)
from fenced.core._clock import HostClock
from fenced.core._errors import ConfigurationError, LeaseLost, LossReason
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._urls import redacted

__all__ = ["MemoryBackend", "MemoryState"]


@dataclass
class _Lease:
    epoch: int
    owner: str
    holder: str
    ttl: float
    expires_at: float
    boot_id: str
    value: str | None = None


@dataclass(frozen=True)
class _Ticket:
    resource: str
    number: int


@dataclass
class MemoryState:
    """The shared state of one ``memory://NAME``."""

    coordinator_id: str = field(default_factory=lambda: secrets.token_hex(16))
    epochs: dict[str, int] = field(default_factory=dict)
    leases: dict[str, _Lease] = field(default_factory=dict)
    requests: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    queues: dict[str, list[int]] = field(default_factory=dict)
    counter: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    cond: threading.Condition = field(default_factory=threading.Condition)
    log: list[Record] = field(default_factory=list)
    minimum: int = 0
    ended: dict[str, str] = field(default_factory=dict)
    wakers: set[Callable[[], None]] = field(default_factory=set)
    """Called (holding ``cond``) at every change: how the asyncio face's waiting tasks of this
    state are woken (``_aio.py``), as ``cond`` wakes the waiting threads."""

    def wake(self) -> None:
        """Wake every waiter, thread or task (the caller holds ``cond``)."""
        self.cond.notify_all()
        for waker in self.wakers:
            waker()

    def append(
        self,
        at: float,
        kind: RecordKind,
        resource: str,
        epoch: int,
        holder: str | None,
        detail: dict[str, object] | None = None,
    ) -> None:
        """Append a record (the caller holds ``cond``) and wake watchers."""
        seq = len(self.log) + 1
        self.log.append(Record(seq, at, kind, resource, epoch, holder, detail or {}))
        self.wake()


_STATES: dict[str, MemoryState] = {}
_STATES_LOCK = threading.Lock()


class MemoryBackend:
    """The model backend; see the module docstring."""

    capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})

    def __init__(self, name: str = "default", *, host_clock: HostClock | None = None) -> None:
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            shown = redacted(f"memory://{name}")  # a mistyped URL may carry a password
            raise ConfigurationError(f"memory:// name must be alphanumeric, got {shown!r}")
        with _STATES_LOCK:
            self._state = _STATES.setdefault(name, MemoryState())
        self.url = f"memory://{name}"
        self.coordinator_id = self._state.coordinator_id
        self._clock: HostClock = host_clock or SystemHostClock()

    @staticmethod
    def forget(name: str) -> None:
        """Drop the shared state of ``memory://name`` (tests)."""
        with _STATES_LOCK:
            _STATES.pop(name, None)

    def _live(self, resource: str) -> _Lease | None:
        """The live lease of ``resource``; an ended one is dropped and its expiry recorded."""
        lease = self._state.leases.get(resource)
        if lease is None:
            return None
        now = self._clock.boottime()
        if lease.boot_id != self._clock.boot_id() or lease.expires_at <= now:
            del self._state.leases[resource]
            expired_at = (
                self._wall(lease.expires_at)
                if lease.boot_id == self._clock.boot_id()
                else self._clock.wall()
            )
            self._state.ended[resource] = "expired"
            self._state.append(expired_at, RecordKind.EXPIRED, resource, lease.epoch, lease.holder)
            return None
        return lease

    def _wall(self, boottime: float) -> float:
        """The wall-clock instant of a boottime instant (for records only)."""
        return self._clock.wall() - (self._clock.boottime() - boottime)

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        state = self._state
        with state.cond:
            now = self._clock.boottime()
            if request.request_id is not None and request.request_id in state.requests:
                resource, epoch, owner = state.requests[request.request_id]
                if resource != request.resource:  # its grant is of another resource
                    raise ConfigurationError(
                        f"this request_id was already used to acquire {resource}, "
                        f"not {request.resource}"
                    )
                lease = self._live(resource)
                if lease is None or lease.epoch != epoch or lease.owner != owner:
                    raise LeaseLost(
                        LossReason.REJECTED, "the lease granted for this request_id has ended"
                    )
                return Granted(epoch, owner, lease.holder, lease.ttl, lease.expires_at - now)
            lease = self._live(request.resource)
            last = max(state.epochs.get(request.resource, 0), state.minimum)
            if lease is not None:
                remaining = lease.expires_at - now
                return Blocked(lease.holder, lease.epoch, remaining, remaining)
            queue = state.queues.get(request.resource, [])
            mine = ticket.number if isinstance(ticket, _Ticket) else None
            if queue and queue[0] != mine:
                return Blocked(None, last, 0.0, None)
            epoch = last + 1
            state.epochs[request.resource] = epoch
            state.leases[request.resource] = _Lease(
                epoch,
                request.owner,
                request.holder,
                request.ttl,
                now + request.ttl,
                self._clock.boot_id(),
                request.value,
            )
            after = state.ended.pop(request.resource, "none")
            state.append(
                self._clock.wall(),
                RecordKind.GRANTED,
                request.resource,
                epoch,
                request.holder,
                {"after": after}
                if request.value is None
                else {"after": after, "value": request.value},
            )
            if mine is not None:
                queue.remove(mine)
            if request.request_id is not None:
                state.requests[request.request_id] = (request.resource, epoch, request.owner)
            return Granted(epoch, request.owner, request.holder, request.ttl, request.ttl)

    def enqueue(self, request: GrantRequest) -> Ticket:
        with self._state.cond:
            ticket = _Ticket(request.resource, next(self._state.counter))
            self._state.queues.setdefault(request.resource, []).append(ticket.number)
            return ticket

    def wait(self, ticket: Ticket, timeout: float) -> None:
        with self._state.cond:
            self._clock.wait(self._state.cond, self._clock.boottime() + timeout)

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue. Nothing is ever handed to a waiter here: always None."""
        assert isinstance(ticket, _Ticket)
        with self._state.cond:
            queue = self._state.queues.get(ticket.resource, [])
            if ticket.number in queue:
                queue.remove(ticket.number)
                self._state.wake()
        return None

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        with self._state.cond:
            lease = self._live(resource)
            if lease is None or lease.epoch != epoch or lease.owner != owner:
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            lease.expires_at = self._clock.boottime() + ttl
            return ttl

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        with self._state.cond:
            lease = self._live(resource)
            if lease is None or lease.epoch != epoch or lease.owner != owner:
                return False
            del self._state.leases[resource]
            self._state.ended[resource] = "released"
            self._state.append(
                self._clock.wall(), RecordKind.RELEASED, resource, epoch, lease.holder
            )
            return True

    def current(self, resource: str) -> LeaseInfo | None:
        with self._state.cond:
            lease = self._live(resource)
            if lease is None:
                return None
            return LeaseInfo(
                resource,
                lease.epoch,
                lease.holder,
                lease.expires_at - self._clock.boottime(),
                lease.ttl,
                self.coordinator_id,
                lease.value,
            )

    def last_epoch(self, resource: str) -> int:
        with self._state.cond:
            return max(self._state.epochs.get(resource, 0), self._state.minimum)

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        state = self._state
        with state.cond:
            for name in list(state.leases):
                self._live(name)  # an expiry that is due is recorded before the restore
            state.minimum = max(state.minimum, minimum)
            for resource, floor in floors.items():
                state.epochs[resource] = max(state.epochs.get(resource, 0), floor)
            state.leases.clear()
            for resource in sorted(set(state.epochs) | set(floors)):
                state.ended[resource] = "restored"
                state.append(
                    self._clock.wall(),
                    RecordKind.RESTORED,
                    resource,
                    max(state.epochs.get(resource, 0), state.minimum),
                    None,
                    {**detail, "minimum": state.minimum},
                )
            return state.minimum

    def resources(self) -> list[str]:
        with self._state.cond:
            return sorted(self._state.epochs)

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        with self._state.cond:
            lease = self._live(resource)
            if lease is None or lease.epoch != epoch or lease.owner != owner:
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            lease.value = value
            self._state.append(
                self._clock.wall(),
                RecordKind.PROCLAIMED,
                resource,
                epoch,
                lease.holder,
                {"value": value},
            )

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        with self._state.cond:
            for name in list(self._state.leases):
                self._live(name)
            found = [
                record
                for record in self._state.log[max(after, 0) :]
                if resource is None or record.resource == resource
            ]
            return found[:limit]

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        with self._state.cond:
            self._state.append(self._clock.wall(), kind, resource, epoch, holder, detail)

    def watch(self, resource: str, after: int, timeout: float) -> None:
        deadline = self._clock.boottime() + timeout
        with self._state.cond:
            while True:
                self._live(resource)
                if any(r.resource == resource for r in self._state.log[max(after, 0) :]):
                    return
                if self._clock.boottime() >= deadline:
                    return
                lease = self._state.leases.get(resource)
                wake = deadline if lease is None else min(deadline, lease.expires_at)
                self._clock.wait(self._state.cond, wake)

    def close(self) -> None:
        """Nothing to close: the state lives as long as the process (see :meth:`forget`)."""

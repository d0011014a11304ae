"""Waiting for a lease of the embedded coordinator: tickets, the queue, and wake-ups.

A :class:`SQLiteTicket` is one place in a resource's queue: a ``waiters`` row (arrival order is
id order) and the waiter's :class:`~.wakeup.WakeSocket`. :class:`WaitingQueue` holds the backend
operations on the queue (``enqueue``, ``wait``, ``leave``, keep-alives) and the wake-ups sent
after a commit that frees a resource or records a change of it (the head waiter; every
watcher). Wake-ups are hints, best effort: a waiter that misses one retries when its keep-alive
lapses, and a datagram that says a lease was handed over is confirmed in the database before the
lease is returned. Database failures raise fenced errors (see :mod:`.database`); a wake-up that
cannot be delivered is never an error.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fenced.coordinator.backend import Granted, GrantRequest, Ticket, owned_ticket
from fenced.coordinator.backends.sqlite._database import Database
from fenced.coordinator.backends.sqlite._statements import (
    _DROP_EXPIRED_WAITERS,
    _ENQUEUE,
    _HEAD,
    _KEEP_ALIVE,
    _LEASE,
    _LIVE_WAITER,
    _WATCHED_OFF,
    _WATCHED_ON,
    NO_TICKET,
)
from fenced.coordinator.backends.sqlite._wakeup import NETNS, Delivery, Waker, WakeSocket
from fenced.core._clock import HostClock
from fenced.core._errors import FencedError

if TYPE_CHECKING:
    from fenced.core._lease import LeaseInfo
    from fenced.core._records import Record

__all__ = [
    "EXPIRY_MARGIN",
    "MAX_ATTEMPTS",
    "PREPARE",
    "QUEUE_KEEPALIVE",
    "SQLiteTicket",
    "WaitingQueue",
]

MAX_ATTEMPTS = 16
"""Grant attempts in one ``try_grant``, and waiters tried by one wake-up (dead heads, races)."""
EXPIRY_MARGIN = 0.001
"""Seconds past an expiry to wake at: just after it, never just before."""
PREPARE = b"prepare"
"""Sent to the head before a hand-off commits: "get ready" (and, delivered: "still there")."""
_HANDED_PREFIX = "granted"  # a wake-up datagram that carries a handed-over lease
_HANDOVER_PATIENCE = 0.05  # how long a prepared waiter waits for its grant before it asks

QUEUE_KEEPALIVE = 2.0
"""Seconds a waiter keeps its place after its last ``try_grant`` (a stopped waiter is skipped)."""


class SQLiteTicket:
    """A place in one resource's queue: a ``waiters`` row and the waiter's wake-up socket.

    Used by one thread at a time. It ends when granted or left; :meth:`SQLiteBackend.wait` on an
    ended ticket returns at once. ``owner`` is the owner secret a release may grant the lease
    to in this waiter's name (None for a request with a request_id: it grants itself).
    """

    __slots__ = (
        "_backend",
        "_handed",
        "_notified",
        "_pending",
        "_prepared",
        "_socket",
        "owner",
        "resource",
        "waiter_id",
    )

    def __init__(
        self, backend: object, resource: str, socket: WakeSocket, owner: str | None
    ) -> None:
        self._backend = backend
        self.resource = resource
        self.owner = owner
        self.waiter_id = 0
        self._socket = socket
        self._pending = False  # free and first in line at enqueue: the first wait returns
        self._notified = False  # the last wait ended by a wake-up: likely first in line now
        self._handed: int | None = None  # the epoch a datagram said a release handed us
        self._prepared = False  # a release is committing a hand-off to us

    @property
    def ended(self) -> bool:
        return self._socket.closed

    def __repr__(self) -> str:
        return f"SQLiteTicket({self.resource!r}, waiter_id={self.waiter_id})"


@dataclass(frozen=True, slots=True)
class _Peer:
    """A waiter or watcher to wake: its row and its socket address."""

    row_id: int
    addr: str
    netns: str


@dataclass(frozen=True, slots=True)
class _Handed:
    """A lease a release granted to the head waiter ``peer`` in its name (not yet told)."""

    peer: _Peer
    epoch: int

    def message(self) -> bytes:
        """The wake-up datagram that tells the waiter: a hint, which it confirms in the
        database (it carries no secret)."""
        return f"{_HANDED_PREFIX} {self.epoch}".encode()


class WaitingQueue:
    """The queue operations of :class:`~.backend.SQLiteBackend` (a base class of it).

    Holds nothing of its own: it uses the backend's database, host clock, waker and set of open
    tickets, declared here.
    """

    _db: Database
    _clock: HostClock
    _waker: Waker
    _tickets: set[SQLiteTicket]
    _tickets_pid: int

    if TYPE_CHECKING:

        def release(self, resource: str, epoch: int, owner: str) -> bool: ...

        def _reserve(self, resource: str) -> None: ...

        def records(
            self, resource: str | None, after: int = 0, limit: int = 1000
        ) -> list[Record]: ...

        def current(self, resource: str) -> LeaseInfo | None: ...

    def _params(self, **fixed: object) -> tuple[float, dict[str, object]]:
        """Statement parameters plus the host clock's ``now`` and ``boot``, read right now."""
        now = self._clock.boottime()
        fixed["now"] = now
        fixed["boot"] = self._clock.boot_id()
        return now, fixed

    # -- watching --------------------------------------------------------------------------------

    def watch(self, resource: str, after: int, timeout: float) -> None:
        """Block until ``resource`` has a record with ``seq > after``, or ``timeout`` passed.

        Woken by a datagram after every change of ``resource``, and at the live lease's expiry
        (which it then records). The caller re-reads :meth:`records`.
        """
        deadline = time.monotonic() + timeout
        sock = WakeSocket()
        try:
            row_id = self.start_watching(resource, sock, timeout)
            try:
                while (left := self.watch_pause(resource, after, deadline - time.monotonic())) > 0:
                    sock.wait(left)
            finally:
                self.stop_watching(resource, row_id)
        finally:
            sock.close()

    def start_watching(self, resource: str, sock: WakeSocket, timeout: float) -> int:
        """Register ``sock`` as a watcher of ``resource`` for up to ``timeout`` seconds (plus
        the keep-alive); its row id. Both faces watch through these three steps."""
        with self._db.transaction(f"watching {resource}", durable=False) as conn:
            _, params = self._params(
                name=resource, addr=sock.address, netns=NETNS, until=timeout + QUEUE_KEEPALIVE
            )
            conn.execute(f"DELETE FROM watchers WHERE NOT ({_LIVE_WAITER})", params)
            (row_id,) = conn.execute(
                "INSERT INTO watchers (name, addr, netns, expires_at, boot_id) "
                "VALUES (:name, :addr, :netns, :now + :until, :boot) RETURNING id",
                params,
            ).fetchone()
            conn.execute(_WATCHED_ON, params)
        return int(row_id)

    def watch_pause(self, resource: str, after: int, left: float) -> float:
        """How long a watcher may sleep on its socket now: 0 when ``resource`` has a record
        after ``after`` or ``left`` (the time left) is over, else up to the live lease's
        expiry."""
        if self.records(resource, after, limit=1) or left <= 0:
            return 0.0
        lease = self.current(resource)
        if lease is not None:
            left = min(left, lease.expires_in + EXPIRY_MARGIN)
        return max(left, 1e-6)

    def stop_watching(self, resource: str, row_id: int) -> None:
        """Remove the watcher row ``row_id`` (best effort)."""
        with suppress(FencedError), self._db.transaction("unwatching", durable=False) as c:
            c.execute("DELETE FROM watchers WHERE id = ?", (row_id,))
            c.execute(_WATCHED_OFF, {"name": resource})

    # -- waiting --------------------------------------------------------------------------------

    def enqueue(self, request: GrantRequest) -> SQLiteTicket:
        """Take a place at the end of ``request.resource``'s queue.

        If the resource is free and nobody is ahead, the first :meth:`wait` returns at once, so
        a release between the caller's last ``try_grant`` and this call is not missed.
        """
        owner = request.owner if request.request_id is None else None
        ticket = SQLiteTicket(self, request.resource, WakeSocket(), owner)
        doing = f"queueing for {request.resource}"
        try:
            _, params = self._params(**self._queued(ticket, request))
            ((ticket.waiter_id,),) = self._db.write(_ENQUEUE, params, doing, durable=False)
            _, params = self._params(name=request.resource, before=ticket.waiter_id)
            free = not self._db.read(_LEASE, params, doing)
            ticket._pending = free and not self._db.read(_HEAD, params, doing)
            if not ticket._pending and ticket.owner is not None:
                self._reserve(request.resource)
        except BaseException:
            ticket._socket.close()
            raise
        self._open_tickets().add(ticket)
        return ticket

    def wait(self, ticket: Ticket, timeout: float) -> None:
        """Block until woken for ``ticket`` or ``timeout`` seconds pass (no database access).

        Returns at once for an ended ticket. Consumes every wake-up queued for it, and keeps
        the epoch of a lease a datagram says was handed to it for the next :meth:`try_grant`,
        which confirms it in the database before it returns it.
        """
        mine = self.waiting(ticket)
        if mine is None:
            return
        started = time.monotonic()
        mine._notified = mine._socket.wait(timeout)
        patience = self.woken(mine)
        if patience is not None:
            left = timeout - (time.monotonic() - started)
            mine._socket.wait(max(0.0, min(left, patience)))
            self._read_messages(mine)
        mine._prepared = False

    def waiting(self, ticket: Ticket) -> SQLiteTicket | None:
        """The ticket to wait on, or None when a wait must return at once (the resource was
        free with nobody ahead at enqueue). Both faces wait through :meth:`waiting` and
        :meth:`woken` around a wait on the ticket's socket."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine._pending:
            mine._pending = False
            mine._notified = True
            return None
        return mine

    def woken(self, ticket: SQLiteTicket) -> float | None:
        """After a wait on the ticket's socket: read what the datagrams said; the seconds to
        wait once more when a release is committing a hand-off to this ticket (its grant
        follows within an fsync), else None. The caller then reads the messages again and
        clears ``_prepared``."""
        self._read_messages(ticket)
        if ticket._prepared and ticket._handed is None:
            return _HANDOVER_PATIENCE
        return None

    @staticmethod
    def _read_messages(ticket: SQLiteTicket) -> None:
        """Take the datagrams that carry a message: a hand-off being prepared, or the epoch of
        a lease handed over to this ticket (a hint, confirmed by :meth:`_take_handed`; fields
        after the epoch are ignored, and so is anything else)."""
        messages = ticket._socket.messages
        while messages:
            message = messages.pop(0)
            if message == PREPARE:
                ticket._prepared = True
                continue
            fields = message.decode("ascii", "replace").split(" ")
            if len(fields) >= 2 and fields[0] == _HANDED_PREFIX and ticket.owner is not None:
                with suppress(ValueError):
                    ticket._handed = int(fields[1])

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue (idempotent). If the caller was first in line and the resource is
        free, the next waiter is woken. A lease a release handed to this ticket (found in the
        same transaction that deletes its row, so no hand-off can follow) is returned with
        ``take``, else released and passed on."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine.ended:
            return None
        head = None
        handed = None
        now = 0.0
        try:
            with self._db.transaction(f"leaving the queue of {mine.resource}", durable=False) as c:
                now, params = self._params(
                    name=mine.resource, before=mine.waiter_id, owner=mine.owner
                )
                first = c.execute(_HEAD, params).fetchone() is None
                deleted = c.execute("DELETE FROM waiters WHERE id = ?", (mine.waiter_id,)).rowcount
                c.execute(_DROP_EXPIRED_WAITERS, params)
                if mine.owner is not None:
                    handed = c.execute(f"{_LEASE} AND owner = :owner", params).fetchone()
                if deleted and first and c.execute(_LEASE, params).fetchone() is None:
                    params["before"] = NO_TICKET
                    head = c.execute(_HEAD, params).fetchone()
        finally:
            self._forget_ticket(mine)
        if handed is not None and mine.owner is not None:
            # A release handed the lease to this ticket after the caller's last try_grant.
            epoch, holder, ttl, expires_at = handed[0], handed[1], handed[2], handed[3]
            if take:
                return Granted(epoch, mine.owner, holder, ttl, expires_at - now)
            self.release(mine.resource, epoch, mine.owner)  # passed on to the next waiter
        if head is not None:
            self._wake_first(mine.resource, _Peer(head[0], head[1], head[2]))
        return None

    def _own_ticket(self, ticket: Ticket | None, resource: str) -> SQLiteTicket | None:
        return owned_ticket(self, ticket, resource, SQLiteTicket)

    def _forget_ticket(self, ticket: SQLiteTicket) -> None:
        ticket._socket.close()
        self._open_tickets().discard(ticket)

    def _open_tickets(self) -> set[SQLiteTicket]:
        """This process's open tickets (a forked child does not inherit its parent's)."""
        if self._tickets_pid != os.getpid():
            self._tickets_pid = os.getpid()
            self._tickets = set()
        return self._tickets

    @staticmethod
    def _queued(ticket: SQLiteTicket, request: GrantRequest) -> dict[str, object]:
        """The parameters of ``ticket``'s ``waiters`` row (:data:`_ENQUEUE`)."""
        return {
            "name": request.resource,
            "addr": ticket._socket.address,
            "netns": NETNS,
            "pid": os.getpid(),
            "holder": request.holder,
            "keepalive": QUEUE_KEEPALIVE,
            "owner": ticket.owner,
            "ttl": request.ttl,
            "value": request.value,
            "ticket": ticket.waiter_id,
        }

    def _keep_alive(self, ticket: SQLiteTicket, request: GrantRequest) -> None:
        """Extend the ticket's row; re-insert it at the end of the line if it was dropped."""
        doing = f"queueing for {ticket.resource}"
        _, params = self._params(**self._queued(ticket, request))
        if self._db.write(_KEEP_ALIVE, params, doing, durable=False):
            return
        with self._db.transaction(doing, durable=False) as conn:
            conn.execute(_DROP_EXPIRED_WAITERS, params)
            (ticket.waiter_id,) = conn.execute(_ENQUEUE, params).fetchone()

    # -- wake-ups -------------------------------------------------------------------------------

    def _wake_waiter(self, resource: str, head: _Peer) -> Delivery:
        """Wake one waiter; a dead one's row is deleted (and DEAD returned)."""
        try:
            delivery = self._waker.wake(head.addr, head.netns)
        except OSError:
            return Delivery.UNREACHABLE
        if delivery is Delivery.DEAD:
            with self._db.transaction(f"dropping a dead waiter of {resource}", durable=False) as c:
                c.execute("DELETE FROM waiters WHERE id = ? AND addr = ?", (head.row_id, head.addr))
        return delivery

    def _wake_first(self, resource: str, head: _Peer) -> None:
        """After a commit that freed ``resource``: wake its first live waiter ``head``; if that
        one is dead, the next, while the resource stays free. Best effort: on failure waiters
        keep their retry timers."""
        try:
            for _ in range(MAX_ATTEMPTS):
                if self._wake_waiter(resource, head) is not Delivery.DEAD:
                    return
                _, params = self._params(name=resource, before=NO_TICKET)
                if self._db.read(_LEASE, params, f"waking waiters of {resource}"):
                    return  # taken meanwhile: nobody to wake
                heads = self._db.read(_HEAD, params, f"waking waiters of {resource}")
                if not heads:
                    return
                head = _Peer(heads[0][0], heads[0][1], heads[0][2])
        except FencedError:
            return

    def _wake_watchers(self, resource: str, *, flagged: bool = False) -> None:
        """Wake every watcher of ``resource`` (best effort; dead ones are dropped). ``flagged``:
        called because the resource's ``watched`` flag is set, which is cleared if none is left.
        """
        try:
            rows = self._db.read(
                "SELECT id, addr, netns FROM watchers WHERE name = ?", (resource,), "waking"
            )
            dead = [
                (row_id,)
                for row_id, addr, netns in rows
                if self._waker.wake(addr, netns) is Delivery.DEAD
            ]
            if dead or (flagged and not rows):
                with self._db.transaction("dropping dead watchers", durable=False) as conn:
                    conn.executemany("DELETE FROM watchers WHERE id = ?", dead)
                    conn.execute(_WATCHED_OFF, {"name": resource})
        except (FencedError, OSError):
            return

    def _wake_all(self, resource: str) -> None:
        """After ``resource`` was freed by an expiry or a restore: wake its head and watchers."""
        with suppress(FencedError):
            _, params = self._params(name=resource, before=NO_TICKET)
            heads = self._db.read(_HEAD, params, f"waking waiters of {resource}")
            if heads:
                self._wake_first(resource, _Peer(heads[0][0], heads[0][1], heads[0][2]))
        self._wake_watchers(resource)


def _head(first: str | None) -> tuple[_Peer | None, bool]:
    """The head waiter a release returned (one JSON cell: one subquery instead of four), and
    whether it can be handed the lease (it queued its request, not just a request_id)."""
    if first is None:
        return None, False
    row_id, addr, netns, takes = json.loads(first)
    return _Peer(int(row_id), str(addr), str(netns)), bool(takes)

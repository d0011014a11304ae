"""The embedded coordinator backend: one SQLite file shared by the processes of one host.

Guarantees
----------
- **Epochs never repeat.** A grant increments the resource's epoch and writes the lease in one
  ``BEGIN IMMEDIATE`` transaction whose ``COMMIT`` runs at ``synchronous=FULL``: the WAL is
  fsynced before :meth:`SQLiteBackend.try_grant` returns, so a kill -9 (or a power cut) at any
  instant can never let the same epoch be granted twice.
- **Expiry by the host's boot-time clock plus the boot id**, never the wall clock. A lease is
  live iff its row has an owner, its ``boot_id`` is the current boot's and ``expires_at >
  boottime()``. Every expiry decision reads the injected :class:`~fenced.core.clock.HostClock`.
- **Release and renew cost no fsync.** They commit at ``synchronous=NORMAL``: the WAL write
  reaches the OS at once (it survives the death of any process) and the disk at the next FULL
  commit. Only an OS crash or power cut can lose them, and that changes the boot id, which
  expires every lease of the old boot anyway: a lost release or renewal after a reboot changes
  nothing. (Without a reboot nothing is lost at all.)
- **First come, first served, woken by notification.** A waiter takes a :class:`SQLiteTicket`: a
  row in ``waiters`` (its id is its place in line) and an abstract Unix datagram socket
  (:mod:`.notify`). Whoever frees a resource (release, the head's leave, a caller that finds
  the head gone) sends one datagram to the head live waiter after its commit; a dead head
  (its socket refuses the datagram) is deleted and the next one is woken. A waiter's row stays
  live for :data:`QUEUE_KEEPALIVE` seconds after its last ``try_grant``; a stopped (SIGSTOP)
  waiter is skipped once that passes. A lease that simply expires wakes nobody: waiters retry
  at ``Blocked.retry_in``, which is never later than the lease's expiry (a timer, not a poll).

Race timeline (release → handoff)::

    holder A                      waiter B (head)                  waiter C
    release: UPDATE owner=NULL
    COMMIT (NORMAL, no fsync)
    sendto(B) ──────────────────▶ poll() returns
                                  try_grant(ticket B):
                                    BEGIN IMMEDIATE
                                    no live lease, no live ticket
                                    ahead of B → epoch+1
                                    COMMIT (FULL: fsync) → Granted  (C still ahead of nobody:
                                                                     B's row is gone, C is head)

Failure behaviour: another process holding the write lock longer than the busy timeout →
:class:`~fenced.Unavailable`; a failed COMMIT of a write → :class:`~fenced.OutcomeUnknown`; a
corrupt, foreign, newer-schema or unwritable database → :class:`~fenced.ConfigurationError`.
Nothing here logs or raises with an owner secret.

Thread-safe: one connection guarded by a lock (measured faster than one connection per thread
for the single-threaded cycle, and writes serialise in SQLite anyway). After ``fork()`` the
child transparently opens its own connection; the inherited one is never touched.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from fenced.coordinator.backend import (
    CAP_REQUEST_ID,
    CAP_WAIT_NOTIFY,
    Blocked,
    GrantRequest,
    Granted,
    Ticket,
)
from fenced.coordinator.backends.hostclock import SystemHostClock
from fenced.coordinator.backends.notify import NETNS, Delivery, WakeSocket, Waker
from fenced.coordinator.backends.sqlite_schema import connect, open_database, translate
from fenced.core.clock import HostClock
from fenced.core.errors import ConfigurationError, FencedError, LeaseLost, LossReason
from fenced.core.lease import LeaseInfo

__all__ = ["QUEUE_KEEPALIVE", "REQUEST_RETENTION", "SQLiteBackend", "SQLiteTicket"]

QUEUE_KEEPALIVE = 2.0
"""Seconds a waiter keeps its place after its last ``try_grant`` (a stopped waiter is skipped)."""
REQUEST_RETENTION = 24 * 3600.0
"""Seconds (wall clock) a ``request_id`` is remembered; a retry after that may get a new epoch."""

_RETRY_CAP = QUEUE_KEEPALIVE / 3  # a queued waiter retries at least this often (keep-alive)
_REFRESH_BELOW = QUEUE_KEEPALIVE * 2 / 3  # refresh a ticket row when less life than this is left
_EPSILON = 0.001  # retry just after an expiry, not just before it
_NO_TICKET = 2**63 - 1  # "behind every queued waiter"
_MAX_DEAD_SKIPS = 16  # dead waiters skipped in one call before giving up to the timers
_PRUNE_EVERY = 256  # request rows inserted between two prunes
_PRUNE_BATCH = 512  # oldest request rows examined by one prune

_LIVE = "owner IS NOT NULL AND boot_id = :boot AND expires_at > :now"
_LIVE_WAITER = "boot_id = :boot AND expires_at > :now"

_GRANT = f"""
INSERT INTO resources (name, epoch, owner, holder, ttl, expires_at, boot_id)
SELECT :name, 1, :owner, :holder, :ttl, :now + :ttl, :boot
WHERE NOT EXISTS (
    SELECT 1 FROM waiters WHERE name = :name AND {_LIVE_WAITER} AND id < coalesce(
        (SELECT id FROM waiters WHERE id = :ticket AND name = :name), {_NO_TICKET}))
ON CONFLICT (name) DO UPDATE SET
    epoch = epoch + 1, owner = excluded.owner, holder = excluded.holder, ttl = excluded.ttl,
    expires_at = excluded.expires_at, boot_id = excluded.boot_id
WHERE NOT (resources.owner IS NOT NULL AND resources.boot_id = :boot
           AND resources.expires_at > :now)
RETURNING epoch
"""
_RELEASE = f"""
UPDATE resources SET owner = NULL
WHERE name = :name AND epoch = :epoch AND owner = :owner AND {_LIVE}
RETURNING (SELECT id FROM waiters WHERE name = :name AND {_LIVE_WAITER} ORDER BY id LIMIT 1)
"""
_RENEW = f"""
UPDATE resources SET ttl = :ttl, expires_at = :now + :ttl
WHERE name = :name AND epoch = :epoch AND owner = :owner AND {_LIVE}
"""
_LEASE = f"""
SELECT epoch, holder, ttl, expires_at, {_LIVE} FROM resources WHERE name = :name
"""
_HEAD = f"""
SELECT id, addr, netns, expires_at FROM waiters
WHERE name = :name AND {_LIVE_WAITER} AND id < :before ORDER BY id LIMIT 1
"""
_DROP_EXPIRED_WAITERS = f"DELETE FROM waiters WHERE name = :name AND NOT ({_LIVE_WAITER})"
_ENQUEUE = """
INSERT INTO waiters (name, addr, netns, pid, holder, expires_at, boot_id)
VALUES (:name, :addr, :netns, :pid, :holder, :now + :keepalive, :boot) RETURNING id
"""


# Connections inherited through fork() are parked here and never used or closed in the child
# (SQLite forbids carrying a connection across fork).
_inherited: list[sqlite3.Connection] = []
_fork_generation = 0


def _after_fork_in_child() -> None:
    global _fork_generation  # noqa: PLW0603 - a process-wide fact, set once per fork
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class SQLiteTicket:
    """A place in one resource's queue: a ``waiters`` row and the waiter's wake-up socket.

    Used by one thread at a time. It ends when granted or left; :meth:`SQLiteBackend.wait` on an
    ended ticket returns at once.
    """

    __slots__ = ("_backend", "_pending", "_socket", "resource", "waiter_id")

    def __init__(self, backend: SQLiteBackend, resource: str, socket: WakeSocket) -> None:
        self._backend = backend
        self.resource = resource
        self.waiter_id = 0
        self._socket = socket
        self._pending = False  # woken before the first wait (free and first in line at enqueue)

    @property
    def ended(self) -> bool:
        return self._socket.closed

    def _end(self) -> None:
        self._socket.close()

    def __repr__(self) -> str:
        return f"SQLiteTicket({self.resource!r}, waiter_id={self.waiter_id})"


@dataclass(frozen=True, slots=True)
class _Head:
    """The first live waiter of a resource."""

    waiter_id: int
    addr: str
    netns: str


class SQLiteBackend:
    """The embedded coordinator backend on the SQLite file at ``path`` (see the module doc).

    Creates the parent directory and the database if missing. ``host_clock`` (default: the
    kernel's CLOCK_BOOTTIME and boot id) decides every expiry; tests inject a
    :class:`~fenced.core.clock.ManualClock`. ``coordinator_id_for_new`` is used only when the
    database is initialised here (restores, tests). Raises :class:`~fenced.ConfigurationError`
    for an unusable file (corrupt, not fenced's, newer schema, unwritable location).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        host_clock: HostClock | None = None,
        coordinator_id_for_new: str | None = None,
    ) -> None:
        self.path = Path(path).expanduser().absolute()
        self.url = f"sqlite://{self.path}"
        self.capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID})
        self._clock: HostClock = host_clock if host_clock is not None else SystemHostClock()
        conn, self.coordinator_id = open_database(self.path, coordinator_id_for_new)
        self._conn: sqlite3.Connection | None = conn
        self._lock = threading.Lock()
        self._generation = _fork_generation
        self._waker = Waker()
        self._tickets: set[SQLiteTicket] = set()
        self._requests_since_prune = 0

    def __repr__(self) -> str:
        return f"SQLiteBackend({self.url!r})"

    # -- transactions ---------------------------------------------------------------------------

    def _check_fork(self) -> None:
        """In a forked child: park the inherited connection, open a fresh one and a new lock."""
        if self._generation == _fork_generation:
            return
        self._lock = threading.Lock()  # the parent's may have been held by another thread
        self._waker = Waker()
        self._tickets = set()
        self._generation = _fork_generation
        if self._conn is not None:
            _inherited.append(self._conn)
            try:
                self._conn = connect(self.path)
            except FencedError:
                self._conn = None
                raise

    @contextmanager
    def _transaction(self, doing: str, *, durable: bool) -> Iterator[sqlite3.Connection]:
        """One ``BEGIN IMMEDIATE`` … ``COMMIT`` under the connection lock.

        ``durable=False`` commits at ``synchronous=NORMAL`` (no fsync; see the module doc). A
        driver error before the commit rolls back → Unavailable/ConfigurationError; a failed
        commit → OutcomeUnknown. Fenced errors raised by the body roll back and propagate.
        """
        self._check_fork()
        with self._lock:
            conn = self._conn
            if conn is None:
                raise ConfigurationError(f"{self!r} is closed")
            try:
                if not durable:
                    conn.execute("PRAGMA synchronous=NORMAL")
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        yield conn
                    except BaseException:
                        _rollback_quietly(conn)
                        raise
                    try:
                        conn.execute("COMMIT")
                    except sqlite3.Error as error:
                        _rollback_quietly(conn)
                        raise translate(error, self.path, doing, committing=True) from error
                finally:
                    if not durable:
                        conn.execute("PRAGMA synchronous=FULL")
            except sqlite3.Error as error:
                raise translate(error, self.path, doing) from error

    def _read(self, sql: str, params: dict[str, object], doing: str) -> list[sqlite3.Row]:
        """One autocommit SELECT (WAL: readers never wait for writers)."""
        self._check_fork()
        with self._lock:
            conn = self._conn
            if conn is None:
                raise ConfigurationError(f"{self!r} is closed")
            try:
                rows: list[sqlite3.Row] = conn.execute(sql, params).fetchall()
            except sqlite3.Error as error:
                raise translate(error, self.path, doing) from error
            return rows

    def _now(self) -> dict[str, object]:
        return {"now": self._clock.boottime(), "boot": self._clock.boot_id()}

    # -- leases ---------------------------------------------------------------------------------

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant with epoch = last epoch + 1 if no live lease and no live ticket is ahead.

        One write transaction; a grant is fsynced before this returns. A caller without a ticket
        is behind every live waiter. ``Blocked.retry_in`` is the lease's remaining time (plus a
        millisecond), or the head waiter's remaining keep-alive when waiters are ahead; for a
        queued caller never more than ``QUEUE_KEEPALIVE / 3``, so its ticket stays live. Each
        call by a queued caller keeps its ticket alive; a ticket whose row was dropped (its
        keep-alive lapsed) rejoins at the end of the line.

        A known ``request_id`` returns its original grant (owner, epoch) while that lease lives
        and raises ``LeaseLost(REJECTED)`` once it has ended; reusing it for another resource is
        a ``ConfigurationError``.
        """
        mine = self._own_ticket(ticket, request.resource)
        for _ in range(_MAX_DEAD_SKIPS):
            outcome = self._grant_step(request, mine)
            if not isinstance(outcome, tuple):
                return outcome
            blocked, head = outcome
            if head is None or self._wake(request.resource, head) is not Delivery.DEAD:
                return blocked
            # The head waiter is gone (its row is deleted now): ask again at once.
        return blocked

    def _grant_step(
        self, request: GrantRequest, ticket: SQLiteTicket | None
    ) -> Granted | tuple[Blocked, _Head | None]:
        """One grant transaction; when blocked, also the head waiter to wake (if any)."""
        with self._transaction(f"acquiring {request.resource}", durable=True) as conn:
            now, params = self._params(
                name=request.resource,
                owner=request.owner,
                holder=request.holder,
                ttl=request.ttl,
                ticket=ticket.waiter_id if ticket is not None else 0,
            )
            if request.request_id is not None:
                replayed = self._replay(conn, request, ticket, now, params)
                if replayed is not None:
                    return replayed
            granted = conn.execute(_GRANT, params).fetchone()
            if granted is not None:
                if ticket is not None:
                    conn.execute("DELETE FROM waiters WHERE id = ?", (ticket.waiter_id,))
                if request.request_id is not None:
                    self._remember(conn, request, granted[0])
            else:
                lease = conn.execute(_LEASE, params).fetchone()
                own_row = None
                if ticket is not None:
                    own_row = conn.execute(
                        "SELECT expires_at FROM waiters WHERE id = :ticket AND name = :name",
                        params,
                    ).fetchone()
                params["before"] = params["ticket"] if own_row is not None else _NO_TICKET
                head = None if lease and lease[4] else conn.execute(_HEAD, params).fetchone()
        if granted is not None:
            if ticket is not None:
                self._forget_ticket(ticket)
            return Granted(granted[0], request.owner, request.holder, request.ttl, request.ttl)
        if ticket is not None and (own_row is None or own_row[0] - now < _REFRESH_BELOW):
            self._keep_alive(ticket, request.holder)
        cap = _RETRY_CAP if ticket is not None else None
        if lease is not None and lease[4]:
            remaining = max(0.0, lease[3] - now)
            return Blocked(lease[1], lease[0], remaining, _cap(remaining + _EPSILON, cap)), None
        epoch = lease[0] if lease is not None else 0
        if head is None:  # impossible inside one transaction; be safe: retry soon
            return Blocked(None, epoch, 0.0, _EPSILON), None
        retry_in = _cap(max(0.0, head[3] - now) + _EPSILON, cap)
        return Blocked(None, epoch, 0.0, retry_in), _Head(head[0], head[1], head[2])

    def _replay(
        self,
        conn: sqlite3.Connection,
        request: GrantRequest,
        ticket: SQLiteTicket | None,
        params: dict[str, object],
    ) -> Granted | None:
        """The earlier grant of ``request.request_id``, if any (inside the grant transaction)."""
        row = conn.execute(
            "SELECT name, epoch, owner, holder, ttl FROM requests WHERE request_id = ?",
            (request.request_id,),
        ).fetchone()
        if row is None:
            return None
        name, epoch, owner, holder, ttl = row
        if name != request.resource:
            raise ConfigurationError(
                f"request_id {request.request_id!r} was already used to acquire {name}, "
                f"not {request.resource}"
            )
        live = conn.execute(
            f"SELECT expires_at FROM resources WHERE name = :name AND epoch = :epoch "
            f"AND owner = :found AND {_LIVE}",
            {**params, "epoch": epoch, "found": owner},
        ).fetchone()
        if live is None:
            raise LeaseLost(
                LossReason.REJECTED, "the lease granted for this request_id has ended"
            )
        if ticket is not None:
            conn.execute("DELETE FROM waiters WHERE id = ?", (ticket.waiter_id,))
            self._forget_ticket(ticket)
        return Granted(epoch, owner, holder, ttl, max(0.0, live[0] - float(params["now"])))  # type: ignore[arg-type]

    def _remember(self, conn: sqlite3.Connection, request: GrantRequest, epoch: int) -> None:
        """Record a grant's request_id (inside the grant transaction); prune now and then."""
        wall = time.time()  # retention only: a wall-clock step can only shorten it
        conn.execute(
            "INSERT INTO requests (request_id, name, epoch, owner, holder, ttl, created_wall) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (request.request_id, request.resource, epoch, request.owner, request.holder,
             request.ttl, wall),
        )
        self._requests_since_prune += 1
        if self._requests_since_prune >= _PRUNE_EVERY:
            self._requests_since_prune = 0
            conn.execute(
                "DELETE FROM requests WHERE seq IN "
                "(SELECT seq FROM requests ORDER BY seq LIMIT ?) AND created_wall < ?",
                (_PRUNE_BATCH, wall - REQUEST_RETENTION),
            )

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        """Set the live lease of this owner and epoch to expire ``ttl`` from now; return ``ttl``.

        Raises ``LeaseLost(REJECTED)`` if that lease is not live (expired, released, taken
        over, or from another boot): an expired lease is never revived, even if nobody took the
        resource. Commits without fsync (see the module doc: only a reboot can lose it).
        """
        with self._transaction(f"renewing {resource}", durable=False) as conn:
            params = {"name": resource, "epoch": epoch, "owner": owner, "ttl": ttl}
            params.update(self._now())
            renewed = conn.execute(_RENEW, params).rowcount == 1
        if not renewed:
            raise LeaseLost(
                LossReason.REJECTED,
                f"the coordinator has no live lease of {resource} at epoch {epoch} for this owner",
            )
        return ttl

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        """End the live lease of this owner and epoch; wake the head waiter. True if ended.

        Compare and delete in one transaction: a delayed release from an older owner (or of an
        expired lease) changes nothing and returns False. Commits without fsync: a release lost
        to an OS crash is moot, because the reboot expires the lease anyway.
        """
        with self._transaction(f"releasing {resource}", durable=False) as conn:
            params = {"name": resource, "epoch": epoch, "owner": owner}
            params.update(self._now())
            row = conn.execute(_RELEASE, params).fetchone()
            head = None
            if row is not None and row[0] is not None:
                head = conn.execute(
                    "SELECT id, addr, netns FROM waiters WHERE id = ?", (row[0],)
                ).fetchone()
        if head is not None:
            self._wake_first(resource, _Head(*head))
        return row is not None

    def current(self, resource: str) -> LeaseInfo | None:
        """The live lease of ``resource``, or None (expired and released leases are not live)."""
        params: dict[str, object] = {"name": resource, **self._now()}
        rows = self._read(_LEASE, params, f"reading {resource}")
        if not rows or not rows[0][4]:
            return None
        epoch, holder, ttl, expires_at, _ = rows[0]
        now = float(params["now"])  # type: ignore[arg-type]
        return LeaseInfo(resource, epoch, holder, expires_at - now, ttl, self.coordinator_id)

    def last_epoch(self, resource: str) -> int:
        """The last epoch granted for ``resource`` (0 if never). Survives restarts."""
        rows = self._read(
            "SELECT epoch FROM resources WHERE name = :name", {"name": resource}, "reading epochs"
        )
        return int(rows[0][0]) if rows else 0

    def resources(self) -> list[str]:
        """Every resource ever granted, sorted."""
        rows = self._read("SELECT name FROM resources ORDER BY name", {}, "listing resources")
        return [str(row[0]) for row in rows]

    # -- waiting --------------------------------------------------------------------------------

    def enqueue(self, request: GrantRequest) -> SQLiteTicket:
        """Take a place at the end of ``request.resource``'s queue.

        If the resource is free and nobody is ahead, the first :meth:`wait` returns at once, so
        a grant freed between the caller's last ``try_grant`` and this call is not missed.
        """
        self._check_fork()
        ticket = SQLiteTicket(self, request.resource, WakeSocket())
        try:
            with self._transaction(f"queueing for {request.resource}", durable=False) as conn:
                params: dict[str, object] = {
                    "name": request.resource,
                    "addr": ticket._socket.address,
                    "netns": NETNS,
                    "pid": os.getpid(),
                    "holder": request.holder,
                    "keepalive": QUEUE_KEEPALIVE,
                    **self._now(),
                }
                conn.execute(_DROP_EXPIRED_WAITERS, params)
                (ticket.waiter_id,) = conn.execute(_ENQUEUE, params).fetchone()
                params["before"] = ticket.waiter_id
                lease = conn.execute(_LEASE, params).fetchone()
                first = conn.execute(_HEAD, params).fetchone() is None
        except BaseException:
            ticket._end()
            raise
        ticket._pending = first and not (lease is not None and lease[4])
        self._tickets.add(ticket)
        return ticket

    def wait(self, ticket: Ticket, timeout: float) -> None:
        """Block until woken for ``ticket`` or ``timeout`` seconds pass (no database access).

        Returns at once for an ended ticket. Consumes every queued wake-up.
        """
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine._pending:
            mine._pending = False
            return
        mine._socket.wait(timeout)

    def leave(self, ticket: Ticket) -> None:
        """Leave the queue (idempotent). If the caller was first in line and the resource is
        free, the next waiter is woken."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine.ended:
            return
        head = None
        try:
            with self._transaction(f"leaving the queue of {mine.resource}", durable=False) as conn:
                params: dict[str, object] = {
                    "name": mine.resource,
                    "before": mine.waiter_id,
                    **self._now(),
                }
                first = conn.execute(_HEAD, params).fetchone() is None
                deleted = conn.execute(
                    "DELETE FROM waiters WHERE id = ?", (mine.waiter_id,)
                ).rowcount
                lease = conn.execute(_LEASE, params).fetchone()
                if deleted and first and not (lease is not None and lease[4]):
                    params["before"] = _NO_TICKET
                    head = conn.execute(_HEAD, params).fetchone()
        finally:
            self._forget_ticket(mine)
        if head is not None:
            self._wake_first(mine.resource, _Head(head[0], head[1], head[2]))

    def _own_ticket(self, ticket: Ticket | None, resource: str) -> SQLiteTicket | None:
        if ticket is None:
            return None
        if not isinstance(ticket, SQLiteTicket) or ticket._backend is not self:
            raise ConfigurationError(f"{ticket!r} was not issued by {self!r}")
        if ticket.resource != resource:
            raise ConfigurationError(
                f"{ticket!r} is a place in the queue of {ticket.resource}, not of {resource}"
            )
        return ticket

    def _forget_ticket(self, ticket: SQLiteTicket) -> None:
        ticket._end()
        self._tickets.discard(ticket)

    def _keep_alive(self, ticket: SQLiteTicket, holder: str) -> None:
        """Extend the ticket's row; re-insert it at the end of the line if it was dropped."""
        with self._transaction(f"queueing for {ticket.resource}", durable=False) as conn:
            params: dict[str, object] = {
                "name": ticket.resource,
                "ticket": ticket.waiter_id,
                "keepalive": QUEUE_KEEPALIVE,
                **self._now(),
            }
            kept = conn.execute(
                "UPDATE waiters SET expires_at = :now + :keepalive, boot_id = :boot "
                "WHERE id = :ticket AND name = :name",
                params,
            ).rowcount
            if not kept:
                params.update(
                    addr=ticket._socket.address, netns=NETNS, pid=os.getpid(), holder=holder
                )
                conn.execute(_DROP_EXPIRED_WAITERS, params)
                (ticket.waiter_id,) = conn.execute(_ENQUEUE, params).fetchone()

    def _wake(self, resource: str, head: _Head) -> Delivery:
        """Wake one waiter; a dead one's row is deleted (and DEAD returned)."""
        try:
            delivery = self._waker.wake(head.addr, head.netns)
        except OSError:
            return Delivery.UNREACHABLE
        if delivery is Delivery.DEAD:
            with self._transaction(f"dropping a dead waiter of {resource}", durable=False) as conn:
                conn.execute(
                    "DELETE FROM waiters WHERE id = ? AND addr = ?", (head.waiter_id, head.addr)
                )
        return delivery

    def _wake_first(self, resource: str, head: _Head) -> None:
        """After a commit that freed ``resource``: wake its first live waiter, skipping dead
        ones. Best effort: a failure here only leaves waiters to their retry timers."""
        try:
            for _ in range(_MAX_DEAD_SKIPS):
                if self._wake(resource, head) is not Delivery.DEAD:
                    return
                params: dict[str, object] = {"name": resource, "before": _NO_TICKET, **self._now()}
                rows = self._read(_HEAD, params, f"waking waiters of {resource}")
                lease = self._read(_LEASE, params, f"waking waiters of {resource}")
                if not rows or (lease and lease[0][4]):
                    return
                head = _Head(rows[0][0], rows[0][1], rows[0][2])
        except FencedError:
            return

    def close(self) -> None:
        """Leave every open ticket's queue (best effort), close the connection and sockets.

        Idempotent. Any later call raises ConfigurationError.
        """
        for ticket in list(self._tickets):
            with suppress(FencedError):
                self.leave(ticket)
            self._forget_ticket(ticket)
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is not None and self._generation == _fork_generation:
                conn.close()
            self._waker.close()

    def __enter__(self) -> SQLiteBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _cap(value: float, cap: float | None) -> float:
    return value if cap is None else min(value, cap)


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with suppress(sqlite3.Error):
            conn.execute("ROLLBACK")

"""The embedded coordinator backend: one SQLite file shared by the processes of one host.

Guarantees
----------
- **Epochs never repeat.** A grant raises the resource's epoch and writes the lease in one
  write transaction (a single autocommit statement on the uncontended path) that is durable
  before :meth:`SQLiteBackend.try_grant` returns (the WAL is fdatasync-ed right after the commit:
  see :mod:`.database`), so a kill -9 (or a power cut) at any instant can never let the same
  epoch be granted twice. The one exception is a hand-off (below), whose epoch was *reserved*
  durably beforehand.
- **Epoch reservations for hand-offs.** A waiter that queues behind a lease makes sure, in a
  durable commit it pays while it waits anyway, that ``resources.reserved`` reaches past the epochs
  its queue will need (:data:`_RESERVE`, :data:`_RESERVE_AHEAD` more each time), and records the
  boot (``reserved_boot``). A release may then grant the head an epoch ``≤ reserved`` in a
  commit without fsync. That commit survives the death of any process (it is in the OS at
  once); only an OS crash or a power cut can lose it, and those change the boot id. Every grant
  in a boot other than ``reserved_boot`` takes an epoch above ``reserved``
  (:data:`_LOST_RESERVATION`), so an epoch handed over before a crash is never granted again,
  whatever was lost. This is how PostgreSQL's sequences log values ahead; the cost is a gap of
  at most the reservation in the epochs after a crash (epochs only have to increase). Without a
  reservation of this boot (the first hand-offs after a reboot, or after ``advance``), a
  hand-off is durable like any grant.
- **Expiry by the host's boot-time clock plus the boot id**, never the wall clock. A lease is
  live iff its row has an owner, its ``boot_id`` is the current boot's and ``expires_at >
  boottime()``. Every expiry decision reads the injected :class:`~fenced.core._clock.HostClock`.
- **Release, renew, proclaim and queue changes cost no fsync.** Their commit reaches the OS at
  once (it survives the death of any process) and the disk with the next durable step. Only an
  OS crash or power cut can lose them, and that changes the boot id, which expires every lease of
  the old boot anyway: after the reboot a lost release or renewal changes nothing; without a
  reboot nothing is lost. (A release that hands the lease over is a grant too: see the
  reservations above.)
- **First come, first served, woken by notification.** A waiter takes a :class:`SQLiteTicket`:
  a row in ``waiters`` (its id is its place in line, and it carries the waiter's request: owner
  secret, holder, ttl, value) and an abstract Unix datagram socket (:mod:`.wakeup`).
- **A release hands the lease over.** A release that finds a live head waiter grants the lease
  to it in its name (:data:`_HAND_OFF`: epoch + 1, the head's row deleted) in the same commit
  (reserved epoch: no fsync), then sends it one datagram carrying the epoch. The datagram is
  only a hint (anyone on the host can send one to an abstract address): before ``try_grant``
  returns the lease, the waiter confirms it with one read, the live lease of that epoch in its
  own owner's name, and takes its expiry from there; an unconfirmed hint is dropped and the
  waiter asks the usual way. If the datagram is lost or unread, its next ``try_grant`` finds the
  live lease in its name. Before the grant the head is sent a ``prepare`` datagram: it tells
  whether the head is still there and wakes it while the releaser commits, so that it is
  running when the grant's datagram arrives. A process that met waiters on the resource
  recently releases and hands over in one transaction; otherwise the release commits alone and,
  if a waiter turns up in its answer, the handover is a second transaction (fsynced if the epoch
  is not reserved). A head whose socket is gone (its process died) is dropped before the
  grant; one that dies between that check and the datagram leaves its lease to expire by its
  ttl, like a holder that dies (a refused datagram cannot tell a dead waiter from one that has
  already found the lease in its name and closed its socket). A waiter with a ``request_id``
  (NULL owner in its row) is woken instead and grants itself, so that its request id is
  remembered with the grant.
- **Other wake-ups.** Whoever frees a resource without a handover (the head's leave, an expiry
  noticed by a caller that finds the resource free but the head not taking it) sends one
  datagram to the head live waiter after its commit; a dead head (its socket refuses the
  datagram) is deleted and the next one woken.
  A waiter's row stays live for :data:`QUEUE_KEEPALIVE` seconds after its last ``try_grant``; a
  stopped (SIGSTOP) waiter is skipped once that passes. A lease that simply expires wakes
  nobody: waiters retry at ``Blocked.retry_in``, never later than the expiry (a timer, not a
  poll).
- **Records** are written by database triggers in the statement that changes the lease (see
  :mod:`.schema`): a grant records itself, preceded by the end of the previous lease if
  that is not recorded yet. A release only marks its row (``end_recorded = 0``: no record page
  in its commit); its record is written by the next grant of that resource or by the next
  reader of the records, dated at the release. Expiries are recorded when first noticed (a grant,
  :meth:`~SQLiteBackend.records`, :meth:`~SQLiteBackend.watch`), dated at the expiry.

Race timelines
--------------
Release → handoff. One commit, by the releaser, without fsync (B reserved E when it queued);
the waiter does not write, it reads once to confirm::

    holder A                          waiter B (head)                 waiter C (behind B)
    release (BEGIN IMMEDIATE):
      UPDATE … owner = NULL
        RETURNING head = B (with owner)
      sendto(B, "prepare") ──────────▶ poll() returns (B runs again
        (refused: B is gone, skip it)   while A commits)
      _HAND_OFF: epoch E = + 1 ≤
        reserved, in B's name, B's row
        deleted
      COMMIT (no fsync)
    sendto(B, "granted E") ─────────▶ try_grant reads: live lease
                                      E in B's owner's name? yes →
                                      Granted(E)                    C is head now; B's release
                                                                    hands the lease to C

Anyone else on the host may send B "granted E'" at any moment (it is only a hint): B's read
finds no live lease E' in its name, and B asks again the usual way (a grant attempt, which
finds A's lease live: Blocked).

B's wait ran out just before the datagram arrived: B leaves the queue; ``leave`` finds the live
lease in B's name in the transaction that deletes B's row, and the Coordinator's ``acquire``
returns it (``leave(take=True)``) instead of Busy; a leave for another reason (an exception)
releases it, which hands it to C. B was SIGSTOPped at the head: the lease
is B's until its ttl runs out (like a stopped holder's); continued later, B's read finds that
lease expired and B asks again.

A release that falls between a caller's ``Blocked`` answer and its :meth:`~SQLiteBackend.enqueue`
wakes nobody (the caller had no row yet). The caller does not sleep through it: ``enqueue``
notices that the resource is free and the new ticket first, and the first ``wait`` returns at
once (and the Coordinator asks ``try_grant`` right after ``enqueue`` anyway).

A head waiter stopped with SIGSTOP when the resource is freed keeps its datagram queued. Others,
woken by their ``retry_in`` timers, find the resource free but the head ahead of them, probe it
with another datagram and retry when its keep-alive has lapsed (at most ``QUEUE_KEEPALIVE``);
then the next one takes the grant. The stopped process, when continued, is told ``Blocked`` and
keeps (or regains, at the end of the line) a place.

Costs
-----
The uncontended cycle is two statements: the grant (autocommit, durable: one fdatasync of usually
two 1 KiB WAL frames, the resource row and the records of the previous release and of this
grant) and the release (autocommit, no fsync: one frame). A process that granted a resource
before grants it again with a plain ``UPDATE`` (:data:`~.statements._GRANT_KNOWN`: no insert
attempt, one b-tree seek), and both statements read the ``watched`` flag instead of searching
the watchers table (:data:`~.statements._WATCHED_ON`). A handoff is one transaction of the
releaser (no fsync, within the reserved epochs), a datagram, and the waiter's read that confirms
it (a primary-key lookup). A caller that is probably not first in line (woken by its timer
rather than by a datagram, or a newcomer where this process recently saw waiters) reads before it
writes, so that blocked callers do not take the write lock the head needs. Waiting for the write
lock retries with sleeps of 50 µs to 1 ms (:mod:`.database`), not with SQLite's busy handler,
which sleeps 1-100 ms.

Files: the directory fenced creates is ``0700`` and the database, its ``-wal``/``-shm`` and
marker ``0600`` (``0660`` in a deliberately shared, setgid directory), whatever the umask: the
database holds owner secrets and request ids, which are bearer credentials. A database that is
missing or empty where its marker says one lived is refused, never re-created with epochs from
1 (see :mod:`.files`).

Failure behaviour: another process holding the write lock longer than the busy timeout →
:class:`~fenced.Unavailable`; a write whose commit may or may not have happened →
:class:`~fenced.OutcomeUnknown`; a corrupt, foreign, newer-schema or unwritable database, or a
lost one (above) → :class:`~fenced.ConfigurationError`. Nothing here logs or raises with an
owner secret or a request id.

Thread-safe (:class:`~.database.Database`: one connection behind a lock, held for one step;
SQLite serialises writers anyway). Linux only (the wake-up sockets). The SQL statements are in
:mod:`.statements`; tickets, the queue and wake-ups in :mod:`.waiting`.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from contextlib import suppress
from pathlib import Path

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
from fenced.coordinator.backends.sqlite._database import Database
from fenced.coordinator.backends.sqlite._schema import RECOMPUTE_WATCHED
from fenced.coordinator.backends.sqlite._statements import (
    _COVERAGE,
    _END_EXPIRED,
    _GRANT,
    _GRANT_KNOWN,
    _HAND_OFF,
    _HANDED,
    _HEAD_AHEAD,
    _LEASE,
    _LIVE,
    _MINIMUM,
    _PROCLAIM,
    _PRUNE_RECORDS,
    _RECORD,
    _RECORD_ENDS,
    _RELEASE,
    _RENEW,
    _RESERVE,
    _STATE,
    _UNSETTLED,
)
from fenced.coordinator.backends.sqlite._waiting import (
    EXPIRY_MARGIN,
    MAX_ATTEMPTS,
    PREPARE,
    QUEUE_KEEPALIVE,
    SQLiteTicket,
    WaitingQueue,
    _Handed,
    _head,
    _Peer,
)
from fenced.coordinator.backends.sqlite._wakeup import NETNS, Delivery, Waker
from fenced.core._clock import HostClock
from fenced.core._closing import Closing
from fenced.core._errors import ConfigurationError, FencedError, LeaseLost, LossReason
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._urls import url_of_path

__all__ = ["QUEUE_KEEPALIVE", "REQUEST_RETENTION", "SQLiteBackend", "SQLiteTicket"]

log = logging.getLogger("fenced.coordinator")

REQUEST_RETENTION = 24 * 3600.0
"""Seconds (wall clock) a ``request_id`` is remembered; a retry after that may get a new epoch."""

_RETRY_CAP = QUEUE_KEEPALIVE / 3  # a queued waiter retries at least this often (keep-alive)
_REFRESH_BELOW = QUEUE_KEEPALIVE * 2 / 3  # refresh a ticket row when less life than this is left
_RESERVE_AHEAD = 64  # hand-offs a durable reservation covers beyond the current queue
_PRUNE_EVERY = 256  # request rows inserted (or releases done) between two prunes
_PRUNE_BATCH = 512  # oldest rows examined by one prune
_KNOWN_MAX = 4096  # resources remembered as having a row (forgotten all at once beyond)
RECORD_LIMIT = 100_000
"""Default bound of the records table: the newest records kept (older ones are pruned)."""
RECORD_RETENTION = 30 * 24 * 3600.0
"""Default age (wall-clock seconds) after which records are pruned."""


class SQLiteBackend(WaitingQueue, Closing):
    """The embedded coordinator backend on the SQLite file at ``path`` (see the module doc).

    Creates the parent directory (``0700``) and the database (``0600``, or ``0660`` in a
    deliberately shared directory) if missing: see :mod:`.files`. ``host_clock``
    (default: the kernel's CLOCK_BOOTTIME and boot id) decides every expiry, and its ``wall()``
    dates every record and measures the record and request_id retention; tests inject a
    :class:`~fenced.core._clock.ManualClock`. ``coordinator_id_for_new`` is used only when the
    database is initialised here (restores, tests). ``marker=False`` opens a transient copy (a
    restore's staging file) without leaving the marker beside it. ``create=False`` opens an
    existing database only, for readers: a missing or empty one is refused and nothing is
    created; on a full file system its reads still work (writes raise Unavailable). Raises
    :class:`~fenced.ConfigurationError` for an unusable file (corrupt, not fenced's, newer
    schema, unwritable location), and for a database that is missing or empty where its marker
    says one lived (never a new coordinator with epochs from 1 in its place).
    """

    # The grant (known resource; upsert), release and renew statements, as class attributes so
    # that a subclass can run variants: fenced verify's seeded defects (fenced.verify._seeded) do.
    _grant_known_sql: str = _GRANT_KNOWN
    _grant_sql: str = _GRANT
    _release_sql: str = _RELEASE
    _renew_sql: str = _RENEW

    def __init__(
        self,
        path: str | Path,
        *,
        host_clock: HostClock | None = None,
        coordinator_id_for_new: str | None = None,
        record_limit: int = RECORD_LIMIT,
        record_retention: float = RECORD_RETENTION,
        marker: bool = True,
        create: bool = True,
    ) -> None:
        if isinstance(record_limit, bool) or not isinstance(record_limit, int) or record_limit < 1:
            raise ConfigurationError(
                f"record_limit must be a positive integer, got {record_limit!r}"
            )
        if not isinstance(record_retention, int | float) or not record_retention > 0:
            raise ConfigurationError(
                f"record_retention must be > 0 seconds, got {record_retention!r}"
            )
        self._record_limit = record_limit
        self._record_retention = float(record_retention)
        self._releases_since_prune = 0
        self.path = Path(path).expanduser().absolute()
        self.url = url_of_path("sqlite", str(self.path))
        self.capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})
        self._clock: HostClock = host_clock if host_clock is not None else SystemHostClock()
        self._db = Database(self.path, coordinator_id_for_new, marker=marker, create=create)
        self.coordinator_id = self._db.coordinator_id
        self._waker = Waker()
        self._tickets: set[SQLiteTicket] = set()
        self._tickets_pid = os.getpid()
        self._contended: set[str] = set()  # resources where this process recently met waiters
        self._known: set[str] = set()  # resources this process granted: their row exists
        self._requests_since_prune = 0
        self._unrecorded_told = False  # a failure to record lease ends was logged

    def __repr__(self) -> str:
        return f"SQLiteBackend({self.url!r})"

    # -- leases ---------------------------------------------------------------------------------

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant with epoch = max(last epoch, minimum epoch) + 1 if free and first in line.

        The grant is one statement (one ``BEGIN IMMEDIATE`` transaction with a ticket or a
        request_id), fsynced before this returns. A caller without a ticket is behind every live
        waiter. ``Blocked.retry_in`` is the lease's remaining time (plus a millisecond), or the
        head waiter's remaining keep-alive when waiters are ahead; for a queued caller never more
        than ``QUEUE_KEEPALIVE / 3``, so that its ticket stays live. Each call by a queued caller
        keeps its ticket alive; a ticket whose row was dropped (its keep-alive lapsed) rejoins
        at the end of the line.

        A known ``request_id`` returns its original grant (owner, epoch) while that lease lives
        and raises ``LeaseLost(REJECTED)`` once it has ended; reusing it for another resource is
        a ``ConfigurationError``.
        """
        mine = self._own_ticket(ticket, request.resource)
        name = request.resource
        if mine is not None and mine._handed is not None:
            handed = self._take_handed(mine, request)
            if handed is not None:
                return handed
        blocked = None
        notified = mine is not None and mine._notified
        if mine is not None:
            mine._notified = False
        # A caller that is probably not first in line (a queued one woken by its timer, not by a
        # wake-up, or one that recently met waiters here) looks before it writes: a blocked look
        # takes no write lock, the lock the head needs to take its grant. (A request_id may have
        # been granted already: only the grant transaction can tell.)
        look_first = request.request_id is None and (
            (mine is not None and not notified) or (mine is None and name in self._contended)
        )
        for _ in range(MAX_ATTEMPTS):
            if look_first:
                blocked, head = self._blocked(request, mine)
                if isinstance(blocked, Granted):
                    return blocked
                if blocked is not None:
                    if head is not None and self._wake_waiter(name, head) is Delivery.DEAD:
                        continue  # the head waiter is gone (its row is deleted now): again
                    return blocked
            granted = self._grant(request, mine)
            if granted is not None:
                self._contended.discard(name)
                return granted
            blocked, head = self._blocked(request, mine)
            if isinstance(blocked, Granted):
                return blocked
            if blocked is None:
                continue  # free again already: try again at once
            self._contended.add(name)
            if head is None or self._wake_waiter(name, head) is not Delivery.DEAD:
                return blocked
        return blocked or Blocked(None, self.last_epoch(name), 0.0, EXPIRY_MARGIN)

    def _take_handed(self, ticket: SQLiteTicket, request: GrantRequest) -> Granted | None:
        """The lease a datagram said a release handed to ``ticket``, once confirmed.

        The datagram is only a hint: anyone on the host can send one to a waiter's address.
        One read (a primary-key lookup) confirms the live lease of that epoch in this ticket's
        owner's name; the lease returned is the database's (its expiry by the host's boot-time
        clock). Unconfirmed (forged, or the lease expired while the waiter was stopped): None,
        and the caller asks the usual way.
        """
        epoch, ticket._handed = ticket._handed, None
        if epoch is None or ticket.owner is None:
            return None
        now, params = self._params(name=ticket.resource, epoch=epoch, owner=ticket.owner)
        rows = self._db.read(_HANDED, params, f"acquiring {ticket.resource}")
        if not rows:
            return None
        self._forget_ticket(ticket)
        return Granted(epoch, request.owner, request.holder, request.ttl, rows[0][0] - now)

    def _grant(self, request: GrantRequest, ticket: SQLiteTicket | None) -> Granted | None:
        """One grant step; None if not granted (a live lease, or a live waiter ahead)."""
        grant = self._grant_sql
        doing = f"acquiring {request.resource}"
        wall = self._clock.wall()
        now, params = self._params(
            name=request.resource,
            owner=request.owner,
            holder=request.holder,
            ttl=request.ttl,
            value=request.value,
            ticket=ticket.waiter_id if ticket is not None else 0,
            wall=wall,
        )
        replayed = None
        if request.request_id is None and ticket is None:
            rows = []
            if request.resource in self._known:
                rows = self._db.write(self._grant_known_sql, params, doing, durable=True)
            if not rows:  # a new resource, or not grantable now (the upsert says which)
                rows = self._db.write(grant, params, doing, durable=True)
        else:
            with self._db.transaction(doing, durable=True) as conn:
                if request.request_id is not None:
                    replayed = self._replay(conn, request, now, params)
                rows = [] if replayed is not None else conn.execute(grant, params).fetchall()
                if rows and request.request_id is not None:
                    self._remember(conn, request, rows[0][0], wall)
                if ticket is not None and (rows or replayed is not None):
                    conn.execute("DELETE FROM waiters WHERE id = ?", (ticket.waiter_id,))
            if ticket is not None and (rows or replayed is not None):
                self._forget_ticket(ticket)
        if replayed is not None:
            return replayed
        if not rows:
            return None
        if len(self._known) >= _KNOWN_MAX:
            self._known.clear()
        self._known.add(request.resource)
        epoch, watched = rows[0]
        if watched:
            self._wake_watchers(request.resource, flagged=True)
        return Granted(epoch, request.owner, request.holder, request.ttl, request.ttl)

    def _blocked(
        self, request: GrantRequest, ticket: SQLiteTicket | None
    ) -> tuple[Blocked | Granted | None, _Peer | None]:
        """Why ``request`` would not be granted now, and the head waiter to wake if waiters are
        ahead; ``(None, None)`` if it would be. Keeps the caller's ticket alive when due. If a
        release has already handed the lease to the caller's ticket (its datagram not read
        yet, or lost), that grant.

        Reads only (and a keep-alive write every ``QUEUE_KEEPALIVE / 3`` or so).
        """
        now, params = self._params(
            name=request.resource,
            ticket=ticket.waiter_id if ticket is not None else 0,
            owner=ticket.owner if ticket is not None else None,
        )
        doing = f"acquiring {request.resource}"
        epoch, holder, expires_at, live, minimum, own_row, mine = self._db.read(
            _STATE, params, doing
        )[0]
        if live and mine and ticket is not None:
            ticket._handed = None
            self._forget_ticket(ticket)
            lease = Granted(epoch, request.owner, request.holder, request.ttl, expires_at - now)
            return lease, None
        if ticket is not None and (own_row is None or own_row - now < _REFRESH_BELOW):
            self._keep_alive(ticket, request)
            params["ticket"] = ticket.waiter_id  # a new row if the old one was dropped
        cap = _RETRY_CAP if ticket is not None else None
        if live:
            remaining = max(0.0, expires_at - now)
            return Blocked(holder, epoch, remaining, _cap(remaining + EXPIRY_MARGIN, cap)), None
        heads = self._db.read(_HEAD_AHEAD, params, doing)
        if not heads:
            return None, None
        head_id, addr, netns, head_expires = heads[0]
        retry_in = _cap(max(0.0, head_expires - now) + EXPIRY_MARGIN, cap)
        return Blocked(None, max(epoch, minimum), 0.0, retry_in), _Peer(head_id, addr, netns)

    def _replay(
        self, conn: sqlite3.Connection, request: GrantRequest, now: float, params: dict[str, object]
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
                f"this request_id was already used to acquire {name}, not {request.resource}"
            )
        live = conn.execute(
            f"SELECT expires_at FROM resources WHERE name = :name AND epoch = :epoch "
            f"AND owner = :found AND {_LIVE}",
            {**params, "epoch": epoch, "found": owner},
        ).fetchone()
        if live is None:
            raise LeaseLost(LossReason.REJECTED, "the lease granted for this request_id has ended")
        return Granted(epoch, owner, holder, ttl, max(0.0, live[0] - now))

    def _remember(
        self, conn: sqlite3.Connection, request: GrantRequest, epoch: int, wall: float
    ) -> None:
        """Record a grant's request_id (inside the grant transaction); prune now and then."""
        conn.execute(
            "INSERT INTO requests (request_id, name, epoch, owner, holder, ttl, created_wall) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (request.request_id, request.resource, epoch, request.owner, request.holder,
             request.ttl, wall),
        )  # fmt: skip
        self._requests_since_prune += 1
        if self._requests_since_prune >= _PRUNE_EVERY:
            self._requests_since_prune = 0
            # Oldest first, a bounded batch. Retention is by wall clock: a step forward can only
            # shorten it (a very late retry may then get a new epoch, never a duplicate one).
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
        _, params = self._params(name=resource, epoch=epoch, owner=owner, ttl=ttl)
        if not self._db.write(self._renew_sql, params, f"renewing {resource}", durable=False):
            raise LeaseLost(
                LossReason.REJECTED,
                f"the coordinator has no live lease of {resource} at epoch {epoch} for this owner",
            )
        return ttl

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        """End the live lease of this owner and epoch; serve the head waiter. True if ended now.

        Compare and delete in one statement: a delayed release from an older owner, or of a
        lease that already expired, changes nothing and returns False. Commits without fsync: a
        release lost to an OS crash is moot, because the reboot expires the lease anyway. With a
        head waiter, the lease is handed to it (granted in its name, see the module doc): in the
        same commit when this process expected waiters (it met some recently) and the epoch is
        within the reservation, else in a transaction of its own (fsynced if not reserved).
        """
        hand_off = resource in self._contended
        ended, handed = self._end(resource, epoch, owner, hand_off=hand_off)
        self._releases_since_prune += 1
        if self._releases_since_prune >= _PRUNE_EVERY:
            self.prune_records()
        if ended is None:
            return False
        watched, head, takes = ended
        if head is None:
            self._contended.discard(resource)
        else:
            self._contended.add(resource)
            if handed is None and takes:
                handed = self._hand_off_alone(resource, head)
            self._serve(resource, head, handed)
        if watched:
            self._wake_watchers(resource, flagged=True)
        return True

    def _end(
        self, resource: str, epoch: int, owner: str, *, hand_off: bool
    ) -> tuple[tuple[bool, _Peer | None, bool] | None, _Handed | None]:
        """Run the release statement (no fsync): (watched, head waiter, head takes a hand-off),
        or None if the lease was not live; with ``hand_off``, also hand the lease to the head in
        the same transaction if its epoch is reserved, and return that grant."""
        _, params = self._params(name=resource, epoch=epoch, owner=owner, wall=self._clock.wall())
        doing = f"releasing {resource}"
        handed = None
        if not hand_off:
            rows = self._db.write(self._release_sql, params, doing, durable=False)
        else:
            with self._db.transaction(doing, durable=False) as conn:
                rows = conn.execute(self._release_sql, params).fetchall()
                head, takes = _head(rows[0][1]) if rows else (None, False)
                if head is not None and takes:
                    handed = self._hand_off(conn, resource, head, durable=False)
        if not rows:
            return None, None
        watched, first = rows[0]
        head, takes = _head(first)
        return (bool(watched), head, takes), handed

    def _hand_off(
        self, conn: sqlite3.Connection, resource: str, head: _Peer, *, durable: bool
    ) -> _Handed | None:
        """Inside a transaction: :meth:`_prepare` the head, then :meth:`_grant_head`."""
        if not self._prepare(conn, head):
            return None
        return self._grant_head(conn, resource, head, durable=durable)

    def _prepare(self, conn: sqlite3.Connection, head: _Peer) -> bool:
        """Send the head :data:`PREPARE`: that both tells whether it is still there and wakes it
        while this transaction commits, so that it is running when the grant's datagram arrives.
        False if it is gone (its socket is unbound): its row is dropped; the caller wakes the
        next one, who grants itself."""
        try:
            delivery = self._waker.wake(head.addr, head.netns, PREPARE)
        except OSError:
            delivery = Delivery.UNREACHABLE
        if delivery is Delivery.DEAD:
            conn.execute("DELETE FROM waiters WHERE id = ? AND addr = ?", (head.row_id, head.addr))
            return False
        return True

    def _grant_head(
        self, conn: sqlite3.Connection, resource: str, head: _Peer, *, durable: bool
    ) -> _Handed | None:
        """Inside a transaction: grant free ``resource`` to waiter ``head`` in its name and drop
        its row. Unless ``durable`` (the transaction is fsynced), only an epoch reserved in
        this boot. None if not granted: the epoch is not reserved, or ``head`` is not first in
        line any more (or the resource was taken meanwhile)."""
        _, params = self._params(
            name=resource, head=head.row_id, wall=self._clock.wall(), durable=durable
        )
        row = conn.execute(_HAND_OFF, params).fetchone()
        if row is None:
            return None
        conn.execute("DELETE FROM waiters WHERE id = ?", (head.row_id,))
        return _Handed(head, row[0])

    def _hand_off_alone(self, resource: str, head: _Peer) -> _Handed | None:
        """:meth:`_hand_off` in a transaction of its own (after a release that did not hand
        over): without fsync if the epoch is reserved, else a second, fsynced transaction. Best
        effort: on failure the head is woken and grants itself."""
        doing = f"handing {resource} over"
        try:
            with self._db.transaction(doing, durable=False) as conn:
                if not self._prepare(conn, head):
                    return None
                handed = self._grant_head(conn, resource, head, durable=False)
            if handed is None:
                with self._db.transaction(doing, durable=True) as conn:
                    handed = self._grant_head(conn, resource, head, durable=True)
        except FencedError:
            return None
        return handed

    def _reserve(self, resource: str) -> None:
        """Make sure that the epochs of ``resource``'s queue are reserved durably (for
        :data:`_RESERVE_AHEAD` more hand-offs), so that releases hand over without fsync. Called
        by a waiter after it queued (it waits anyway). Best effort. The reservation is durable
        before any other process can see it: a release that sees it hands out a token without
        an fsync of its own."""
        doing = f"reserving epochs of {resource}"
        _, params = self._params(name=resource, ahead=_RESERVE_AHEAD)
        with suppress(FencedError):
            rows = self._db.read(_COVERAGE, params, doing)
            if rows and not rows[0][0]:
                with self._db.transaction(doing, durable=True) as conn:
                    conn.execute(_RESERVE, params)

    def _serve(self, resource: str, head: _Peer, handed: _Handed | None) -> None:
        """After a release's commit: tell the waiter the lease handed to it, or wake ``head``.

        A refused datagram is not a sign that the waiter is gone: it may already have found the
        lease in its name (a ``try_grant`` woken by its timer) and closed its socket. So nothing
        is undone; a waiter that died between the grant and the datagram (its socket was bound
        when the grant was made) leaves its lease to expire by its ttl, like any holder that
        dies.
        """
        if handed is None:
            self._wake_first(resource, head)
            return
        with suppress(OSError):  # best effort: the waiter also finds its lease in the database
            self._waker.wake(handed.peer.addr, handed.peer.netns, handed.message())

    def prune_records(self) -> int:
        """Delete a bounded batch of the oldest records beyond the limit or the retention age.

        Runs now and then from :meth:`release` (no fsync of its own); returns the rows deleted.
        The newest record is never deleted, so a ``seq`` is never reused.
        """
        self._releases_since_prune = 0
        params: dict[str, object] = {
            "batch": _PRUNE_BATCH,
            "keep": self._record_limit,
            "oldest": self._clock.wall() - self._record_retention,
        }
        with self._db.transaction("pruning records", durable=False) as conn:
            return conn.execute(_PRUNE_RECORDS, params).rowcount

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        """Replace the advertised value of this owner's live lease (same epoch); record it.

        Raises ``LeaseLost(REJECTED)`` if the lease is not live or not this owner's.
        """
        with self._db.transaction(f"proclaiming on {resource}", durable=False) as conn:
            _, params = self._params(name=resource, epoch=epoch, owner=owner, value=value)
            row = conn.execute(_PROCLAIM, params).fetchone()
            if row is not None:
                detail = json.dumps({"value": value})
                conn.execute(
                    _RECORD, (self._clock.wall(), "proclaimed", resource, epoch, row[0], detail)
                )
        if row is None:
            raise LeaseLost(
                LossReason.REJECTED,
                f"the coordinator has no live lease of {resource} at epoch {epoch} for this owner",
            )
        self._wake_watchers(resource)

    def current(self, resource: str) -> LeaseInfo | None:
        """The live lease of ``resource``, or None (expired and released leases are not live)."""
        now, params = self._params(name=resource)
        rows = self._db.read(_LEASE, params, f"reading {resource}")
        if not rows:
            return None
        epoch, holder, ttl, expires_at, value = rows[0]
        return LeaseInfo(resource, epoch, holder, expires_at - now, ttl, self.coordinator_id, value)

    def last_epoch(self, resource: str) -> int:
        """The last epoch granted or reserved for ``resource``: the next grant gets this + 1."""
        rows = self._db.read(
            f"SELECT max(coalesce((SELECT epoch FROM resources WHERE name = :name), 0), "
            f"{_MINIMUM})",
            {"name": resource},
            f"reading the epoch of {resource}",
        )
        return int(rows[0][0])

    def resources(self) -> list[str]:
        """Every resource ever granted (or given a floor by a restore), sorted."""
        rows = self._db.read("SELECT name FROM resources ORDER BY name", (), "listing resources")
        return [str(row[0]) for row in rows]

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        """Restore safety: no later grant of any resource gets an epoch ≤ ``minimum``.

        In one durable transaction: record pending lease ends, raise the coordinator-wide
        minimum epoch (never lower it) and each resource's last epoch to its floor where higher,
        end every live lease, and append a RESTORED record per resource. Then wakes every waiter
        and watcher. Returns the new minimum.
        """
        with self._db.transaction("advancing epochs", durable=True) as conn:
            _, params = self._params(name=None, wall=self._clock.wall())
            conn.execute(_END_EXPIRED, params)
            conn.execute(_RECORD_ENDS, params)
            conn.execute("UPDATE minimum_epoch SET epoch = max(epoch, ?) WHERE id = 1", (minimum,))
            (new_minimum,) = conn.execute(f"SELECT {_MINIMUM}").fetchone()
            conn.execute(
                "UPDATE resources SET owner = NULL, ended = 'restored', ended_at = :wall", params
            )
            conn.executemany(
                "INSERT INTO resources (name, epoch, ended, ended_at) "
                "VALUES (?, ?, 'restored', ?) "
                "ON CONFLICT (name) DO UPDATE SET epoch = max(epoch, excluded.epoch)",
                [(name, floor, params["wall"]) for name, floor in sorted(floors.items())],
            )
            conn.execute(RECOMPUTE_WATCHED)  # rows added above start unflagged
            recorded = json.dumps({**detail, "minimum": new_minimum}, default=str)
            names = conn.execute("SELECT name, epoch FROM resources ORDER BY name").fetchall()
            conn.executemany(
                _RECORD,
                [
                    (params["wall"], "restored", name, max(epoch, new_minimum), None, recorded)
                    for name, epoch in names
                ],
            )
        for name, _ in names:
            self._wake_all(name)
        return int(new_minimum)

    # -- records --------------------------------------------------------------------------------

    def _settle(self, resource: str | None, *, reading: bool = False) -> None:
        """Record the lease ends of ``resource`` (or all) not recorded yet; wake their waiters.

        ``reading`` (before records are read): a failure to write them (a full disk, a
        read-only file) is logged (one warning per backend) and the read goes on without them.
        """
        _, params = self._params(name=resource)
        pending = self._db.read(_UNSETTLED, params, "reading records")
        if not pending:
            return
        try:
            with self._db.transaction("recording lease ends", durable=False) as conn:
                _, params = self._params(name=resource, wall=self._clock.wall())
                conn.execute(_END_EXPIRED, params)
                conn.execute(_RECORD_ENDS, params)
        except FencedError as error:
            if not reading:
                raise
            if not self._unrecorded_told:
                self._unrecorded_told = True
                log.warning("the records shown lack lease ends not recorded yet (%s)", error)
            return
        for (name,) in pending:
            self._wake_all(name)

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        """Records with ``seq > after`` (of ``resource``, or of all), oldest first.

        Lease ends not recorded yet (releases, unnoticed expiries) are recorded first, so the
        answer is current; if that write fails (a full disk, a read-only file), the answer is
        what is recorded, and a warning says how many ends it lacks.
        """
        self._settle(resource, reading=True)
        where = "" if resource is None else "resource = :name AND "
        rows = self._db.read(
            "SELECT seq, at, kind, resource, epoch, holder, detail FROM records "
            f"WHERE {where}seq > :after ORDER BY seq LIMIT :limit",
            {"name": resource, "after": after, "limit": limit},
            "reading records",
        )
        return [
            Record(seq, at, RecordKind(kind), name, epoch, holder, json.loads(detail))
            for seq, at, kind, name, epoch, holder, detail in rows
        ]

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        """Append a record reported by a holder (renewal failure, loss). Not fsynced."""
        self._settle(resource)  # a pending release of this lease comes first
        recorded = json.dumps(detail, default=str)
        row = (self._clock.wall(), kind.value, resource, epoch, holder, recorded)
        with self._db.transaction(f"recording {kind.value} of {resource}", durable=False) as conn:
            conn.execute(_RECORD, row)
        self._wake_watchers(resource)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Leave every open ticket's queue (best effort), close the connection and sockets.

        A thread blocked in :meth:`wait` is woken; its next call raises ConfigurationError, as
        does any later call. Idempotent.
        """
        for ticket in list(self._open_tickets()):
            with suppress(OSError):  # a thread waiting on it returns now, then finds us closed
                self._waker.wake(ticket._socket.address, NETNS)
            with suppress(FencedError):
                self.leave(ticket)
            self._forget_ticket(ticket)
        self._db.close()
        self._waker.close()


def _cap(value: float, cap: float | None) -> float:
    return value if cap is None else min(value, cap)

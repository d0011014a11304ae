"""The PostgreSQL coordinator backend: ``postgresql://user:pass@host:port/db?schema=fenced``.

Guarantees
----------
- **Expiry by the server's clock.** Every decision reads ``clock_timestamp()`` on the server; the
  client never sends a time. (PostgreSQL has no monotonic clock in SQL: a step of the *server's*
  wall clock moves every expiry with it — run the server with a slewing NTP daemon. Holders are
  still safe: their local deadlines are on the deadline clock and stores reject stale tokens.)
- **Epochs never repeat, and are durable before acquire returns.** A grant is one transaction
  that locks the resource's row, increments its epoch and commits with ``synchronous_commit`` on
  (raised for the transaction even if the server or role has it off). ``advance`` raises a
  coordinator-wide minimum epoch, and every granted resource's own epoch to it, in a
  transaction that excludes grants.
- **One round trip per operation.** The uncontended grant and release are one statement each
  (``_FAST_GRANT``, ``_FAST_RELEASE`` in :mod:`~fenced.coordinator.backends.postgres._statements`: a
  conditional ``UPDATE`` of the resource's row and the ``INSERT`` of its record), sent as libpq
  prepared statements; when their condition does not hold (a new resource, a live or expired lease,
  someone queued or watching, a request_id, a ticket) the same statement calls the PL/pgSQL
  function that decides everything else. Every other operation is one function call.
- **Renewals are durable** (a lost renewal could let the server grant again before the holder's
  deadline). **Releases are not** (``synchronous_commit = off`` for the transaction): a release
  lost in a server crash only delays the next grant until the lease's expiry, and any later
  durable commit (the next grant) flushes it anyway — except a release that hands the resource
  to a waiter: that transaction contains a grant, and commits durably.
- **First come, first served: the release grants the first waiter.** A waiter takes a row in
  ``waiters`` (its id is its place in line) with its owner secret, ttl and value, and the key of
  its listener's session lock (see :mod:`~fenced.coordinator.backends.postgres._listener`). The
  transaction that releases the resource grants it, in the same transaction, to the first live
  waiter whose listener still holds that lock, and notifies it
  ``<id>:<resource>:<epoch>:<seconds>``; the waiter returns from ``acquire`` without another round
  trip (:meth:`PostgresBackend._handed_over`). A waiter whose lock is free is gone (killed: its
  sessions ended): its row is dropped and the next one considered. A waiter without a usable
  listener (``listen=off``, an unproven listener, a request_id) is only woken, and
  grants itself. A detected expiry or the head's leave wakes the first live waiter. A waiter that
  gives up (its wait ran out) after a lease was handed to it takes that lease (``leave_taking``:
  ``acquire`` returns it); one that leaves for another reason releases it and passes the
  resource on. A waiter's row stays live for :data:`QUEUE_KEEPALIVE` seconds after its last
  ``try_grant``; a waiter that stopped (SIGSTOP) or was cut off without its sessions ending can be
  handed the resource within that time, which then stays blocked until that lease expires — as
  if it had stopped right after its own acquire. A waiter blocked by a live lease retries at the
  lease's expiry (a timer, not a poll) and at least every ``QUEUE_KEEPALIVE / 3`` (its
  keep-alive).
- **A lost notification is recovered, never waited on forever.** The listener pings its
  connection every :data:`LISTEN_PING` seconds; when the connection fails it reconnects,
  re-LISTENs, proves delivery with a probe NOTIFY, then wakes every local waiter to try again at
  once (a handoff it missed is then found by the waiter's own ``try_grant``: the resource is held
  by its owner secret). While it is not proven to work, waits are capped at :data:`RECHECK`
  seconds.
- **PgBouncer in transaction mode works**: lease operations use no session state (no advisory
  locks, no temporary tables, no ``SET`` outside a transaction); prepared statements are turned
  off for good the first time a pooler is seen to lose one (the statement, which had not run,
  is sent again; the hot statements' names are derived from their text, so a pooled server
  session can never run another statement under the same name). LISTEN needs a real session:
  give the listener a direct connection with ``?listen_url=postgresql://…`` (percent-encoded).
  Without it, the probe fails and waiting degrades to expiry timers plus re-checks every
  :data:`RECHECK` seconds.
- **Records** (granted, released, expired, proclaimed, restored, holder reports) are written in
  the same transaction as the change, under the resource's row lock: the records of one resource
  are in commit order. A record's ``at`` is the server's ``clock_timestamp()``, never a client's
  clock (so this backend takes no injected clock). Across resources, ``records(None, after)``
  holds back records that follow a gap in ``seq`` younger than :data:`GAP_SETTLE` seconds (a
  concurrent transaction may still commit the missing one).

Race timeline (release → handoff)::

    holder A                          waiter B (head, LISTENing)          waiter C
    release(): lock row, owner=NULL
      record 'released'
      B's listen lock is held: grant B
      epoch+1, owner=B's secret,
      record 'granted', delete B's row
      pg_notify('fenced_x', 'B:res:7:0.31')
    COMMIT (synchronous) ─ NOTIFY ──▶ listener: B's handoff=(7, 0.31), event.set()
                                      try_grant(ticket B): no round trip
                                        epoch 7 > every epoch B was told
                                        → Granted(7), expiry counted from
                                          B's last keep-alive + 0.31 s      (C: now first in line,
                                                                          granted by B's release)

Failure behaviour: connection failures before a request is sent → :class:`~fenced.Unavailable`
(reconnecting while the server restarts, up to ``connect_timeout``); a broken connection after a
mutating request was sent, or no reply within ``?timeout=`` seconds (the socket is then cut) →
:class:`~fenced.OutcomeUnknown`; bad URL, authentication, missing database or privileges, a
schema of a newer fenced → :class:`~fenced.ConfigurationError`. Nothing here logs or raises
with an owner secret or a password.

URL query parameters (all optional): ``schema`` (default ``fenced``), ``listen_url`` (a direct
URL for LISTEN), ``listen`` (``off``: never LISTEN), ``pool_size`` (default 10), ``timeout``
(seconds, default 10), ``prepare`` (``off``: never use server-side prepared statements); every other
parameter goes to libpq (``sslmode``, ``connect_timeout``, ``application_name``, …).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from fenced._drivers.postgres import (
    DEFAULT_OP_TIMEOUT,
    connect_listening,
    dedicated,
    migrate,
    parse_url,
    translate,
)
from fenced._drivers.postgres_borrowed import lender
from fenced.coordinator.backend import (
    CAP_RECORDS,
    CAP_REQUEST_ID,
    CAP_WAIT_NOTIFY,
    Blocked,
    Granted,
    GrantRequest,
    Ticket,
    owned_ticket,
)
from fenced.coordinator.backends.postgres import _schema as postgres_schema
from fenced.coordinator.backends.postgres._listener import (
    LISTEN_PING,
    PROBE_TIMEOUT,
    RECHECK,
    Listener,
    Subscription,
)
from fenced.coordinator.backends.postgres._statements import StatementRunner
from fenced.core._clock import Clock, SystemClock
from fenced.core._closing import Closing
from fenced.core._errors import (
    ConfigurationError,
    FencedError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo
from fenced.core._names import validate_resource
from fenced.core._records import Record, RecordKind
from fenced.core._token import MAX_EPOCH, validate_coordinator_id

__all__ = [
    "GAP_SETTLE",
    "LISTEN_PING",
    "QUEUE_KEEPALIVE",
    "RECHECK",
    "PostgresBackend",
    "PostgresTicket",
]

log = logging.getLogger("fenced.coordinator.postgres")

QUEUE_KEEPALIVE = 2.0
"""Seconds a waiter keeps its place after its last ``try_grant`` (a dead waiter is skipped)."""
GAP_SETTLE = 2.0
"""Seconds after which a gap in ``records(None, …)`` is taken as a rolled-back transaction."""
WATCH_KEEPALIVE = 6.0
"""Seconds a watcher's row lives after its last refresh (refreshed every third of that)."""
_URL_KEYS = ("listen_url", "listen", "pool_size", "timeout", "prepare")
_PRUNE_CHANCE = 0.005
"""The share of grants that also prune (the ``try_grant`` function): up to 1000 records past
``records_retention`` and 512 request ids older than 24 h, more than a grant ever adds."""


# -- tickets ----------------------------------------------------------------------------------


class PostgresTicket:
    """A place in one resource's queue: a ``waiters`` row plus the waiter's subscription.

    Used by one thread at a time. It ends when granted or left; :meth:`PostgresBackend.wait` on
    an ended ticket returns at once. ``sent_at`` is when the last request that kept the row
    alive was sent (on the deadline clock, ``Clock.now``), ``seen_epoch`` the largest epoch a
    blocked answer reported: a grant handed over by a releaser is newer than that, and came
    after that send.
    """

    __slots__ = (
        "_backend",
        "_sub",
        "ended",
        "owner",
        "resource",
        "seen_epoch",
        "sent_at",
        "waiter_id",
    )

    def __init__(
        self, backend: PostgresBackend, resource: str, waiter_id: int, owner: str, sent_at: float
    ) -> None:
        self._backend = backend
        self.resource = resource
        self.waiter_id = waiter_id
        self.owner = owner
        self.sent_at = sent_at
        self.seen_epoch = 0
        self.ended = False
        self._sub: Subscription | None = None

    def __repr__(self) -> str:
        return f"PostgresTicket({self.resource!r}, waiter_id={self.waiter_id})"


# -- the backend ------------------------------------------------------------------------------


class PostgresBackend(Closing):
    """The coordinator backend on PostgreSQL (see the module docstring). Thread-safe.

    Creates the schema and its tables on first use (or migrates them). Raises
    :class:`~fenced.ConfigurationError` for a bad URL, an unusable database or schema, a schema
    of a newer fenced; :class:`~fenced.Unavailable` if the server cannot be reached.
    ``coordinator_id_for_new`` is used only when the schema is created here (restores, tests).
    """

    def __init__(
        self,
        url: object,
        *,
        coordinator_id_for_new: str | None = None,
        options: Mapping[str, object] | None = None,
    ) -> None:
        parsed, self._pool = lender(url, _URL_KEYS, options)
        self._parsed = parsed
        self.url = parsed.display
        self.schema = parsed.schema
        self.capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})
        try:
            self._op_timeout = parsed.option_float("timeout", DEFAULT_OP_TIMEOUT, minimum=0.01)
            listen = parsed.options.get("listen_url")
            self._listen_enabled = parsed.option_flag("listen", True)
            self._listen_connect: Callable[[], tuple[psycopg.Connection[Any], Callable[[], None]]]
            if listen is not None:
                self._listen_connect = partial(connect_listening, parse_url(listen, ()).conninfo)
            else:
                if self._listen_enabled:
                    self._pool.check_listen()
                self._listen_connect = self._pool.listen_connection
        except BaseException:
            self._pool.close()
            raise
        self._connect_budget = min(parsed.connect_timeout, self._op_timeout)
        self._clock: Clock = SystemClock()  # the deadline clock: counts a suspended host
        if coordinator_id_for_new is not None:
            validate_coordinator_id(coordinator_id_for_new)
        self._channel = postgres_schema.channel(self.schema)
        self._statements = StatementRunner(
            self._pool,
            self.url,
            sql.Identifier(self.schema).as_string(None),
            self._channel,
            op_timeout=self._op_timeout,
            connect_budget=self._connect_budget,
        )
        self._direct = self._statements.direct
        self.coordinator_id = self._initialise(coordinator_id_for_new)
        self._listener_obj: Listener | None = None
        self._listener_lock = threading.Lock()
        self._tickets: set[PostgresTicket] = set()
        self._tickets_lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"PostgresBackend({self.url!r})"

    # -- set-up -------------------------------------------------------------------------------

    def _initialise(self, new_id: str | None) -> str:
        where = f"{self.url} (schema {self.schema})"
        try:
            # a connection of its own: a failure here (wrong password, missing database, newer
            # schema) is reported at once and starts no pool threads
            with dedicated(self._pool, self._connect_budget) as conn:
                meta = migrate(
                    conn,
                    schema=self.schema,
                    meta_table="meta",
                    fmt=postgres_schema.FORMAT,
                    migrations=postgres_schema.migrations(self.schema),
                    initial={
                        "coordinator_id": new_id or secrets.token_hex(16),
                        "minimum_epoch": "0",
                        "records_retention": str(7 * 24 * 3600),
                        "created_at": repr(time.time()),
                    },
                    where=where,
                )
        except psycopg.Error as error:
            raise translate(
                error, "initialising the coordinator schema", sent=False, where=where
            ) from error
        except BaseException:
            self._pool.close()
            raise
        try:
            return validate_coordinator_id(meta.get("coordinator_id"))
        except ConfigurationError as error:
            raise ConfigurationError(f"{where}: damaged meta table: {error}") from None

    def _call(
        self,
        doing: str,
        name: str,
        params: Sequence[object],
        *,
        mutation: bool,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> list[tuple[Any, ...]]:
        """Run one statement (see :meth:`StatementRunner.call`); ConfigurationError once closed."""
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed")
        return self._statements.call(
            doing, name, params, mutation=mutation, timeout=timeout, idempotent=idempotent
        )

    # -- leases -------------------------------------------------------------------------------

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant with epoch = max(last epoch, minimum) + 1 if free and first in line.

        One round trip; a grant commits synchronously. Without a ticket or request_id, one
        statement grants a free, known resource nobody queues for (``_FAST_GRANT``) and calls
        the ``try_grant`` function otherwise. The call is idempotent: if the resource is held
        by ``request.owner`` (this very request, granted with its reply lost), that lease is
        returned; so a request cut off by a server restart is sent once more on a new
        connection rather than failing with OutcomeUnknown. A caller without a ticket is behind
        every live waiter. Each call by a queued caller keeps its ticket alive (a ticket whose
        row was dropped rejoins at the end of the line). A queued caller to whom a releaser
        handed the resource (the NOTIFY said so) gets it without a round trip
        (:meth:`_handed_over`). ``Blocked.retry_in`` is the live lease's remaining time (plus
        1 ms), or the first waiter's remaining keep-alive; for a queued caller at most
        ``QUEUE_KEEPALIVE / 3``. A known ``request_id`` returns its grant while that lease
        lives and raises ``LeaseLost(REJECTED)`` once it ended; reused for another resource it
        is a ``ConfigurationError``.
        """
        mine = self._own_ticket(ticket, request.resource)
        if mine is not None and (handed := self._handed_over(mine, request)) is not None:
            return handed
        prune = random.random() < _PRUNE_CHANCE
        fast = mine is None and request.request_id is None and not prune
        name = "grant" if fast else "grant_queued"
        params = self._direct[name].bind(
            name=request.resource,
            owner=request.owner,
            holder=request.holder,
            ttl=float(request.ttl),
            value=request.value,
            keepalive=QUEUE_KEEPALIVE,
            retry_cap=QUEUE_KEEPALIVE / 3,
            request_id=request.request_id,
            ticket=None if mine is None else mine.waiter_id,
            listen_key=None if fast else self._handoff_key(request),
            prune=prune,
        )
        sent = self._clock.now()
        rows = self._call(
            f"acquiring {request.resource}",
            name,
            params,
            mutation=True,
            idempotent=True,  # the owner secret identifies this request's grant
        )
        status, epoch, owner, holder, ttl, remaining, retry_in, new_ticket = rows[0]
        if status == "granted":
            if mine is not None:
                self._end_ticket(mine)
            return Granted(int(epoch), str(owner), str(holder), float(ttl), float(remaining))
        if status == "lost":
            raise LeaseLost(LossReason.REJECTED, "the lease granted for this request_id has ended")
        if status == "foreign":
            raise ConfigurationError(
                f"this request_id was already used to acquire {holder}, not {request.resource}"
            )
        if mine is not None:
            mine.sent_at = sent
            mine.seen_epoch = max(mine.seen_epoch, int(epoch))
            if new_ticket is not None and new_ticket != mine.waiter_id:
                mine.waiter_id = int(new_ticket)
                if mine._sub is not None:
                    self._listener().update(mine._sub, mine.waiter_id)
        return Blocked(
            None if holder is None else str(holder),
            int(epoch),
            float(remaining or 0.0),
            None if retry_in is None else float(retry_in),
        )

    def _handed_over(self, mine: PostgresTicket, request: GrantRequest) -> Granted | None:
        """The grant a releaser handed to ``mine`` (announced by NOTIFY), or None.

        The grant was made after the server answered the ticket's last request (which reported
        only older epochs), ``since_keep`` seconds (server clock) after that request kept the
        row alive; that request was sent at ``mine.sent_at``. So the lease expires no earlier
        than ``sent_at + since_keep + ttl`` here, and ``expires_in`` counts from that. A grant
        that arrives with less than half its ttl left is left to a round trip (which returns
        it with its exact expiry if it still lives).
        """
        sub = mine._sub
        handoff = None if sub is None else sub.handoff
        if sub is None or handoff is None:
            return None
        sub.handoff = None
        epoch, since_keep = handoff
        if epoch <= mine.seen_epoch or request.owner != mine.owner:
            return None  # stale: a later answer of the server already knew a newer epoch
        elapsed = self._clock.now() - mine.sent_at
        left = request.ttl - elapsed + min(since_keep, elapsed)
        if left < request.ttl / 2:
            return None
        self._end_ticket(mine)
        return Granted(epoch, request.owner, request.holder, request.ttl, left)

    def _handoff_key(self, request: GrantRequest) -> int | None:
        """The listen key a queued ``request`` offers to releasers (None: wake it instead).

        Requests with a ``request_id`` grant themselves: their id must be recorded with the
        grant, which a releaser does not do.
        """
        if request.request_id is not None:
            return None
        return self._listener().handoff_key

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        """Extend this owner's live lease to ``ttl`` from now (server clock); return ``ttl``.

        Raises ``LeaseLost(REJECTED)`` if that lease is not live: an expired lease is never
        revived. Commits synchronously. Gives up after a third of ``ttl`` (at least 0.2 s) so
        that a hung connection makes the lease UNCERTAIN, not silently HELD.
        """
        remaining = self._call(
            f"renewing {resource}",
            "renew",
            (resource, epoch, owner, float(ttl)),
            mutation=True,
            timeout=max(ttl / 3, 0.2),
        )[0][0]
        if remaining is None:
            raise LeaseLost(
                LossReason.REJECTED,
                f"the coordinator has no live lease of {resource} at epoch {epoch} for this owner",
            )
        return float(remaining)

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        """End this owner's live lease and wake the first waiter; True if it ended now.

        Compare and delete in one transaction: a delayed release of an older owner changes
        nothing. Committed with ``synchronous_commit = off`` — unless it hands the resource to
        the first waiter, which is a grant (see the module docstring).
        """
        params = self._direct["release"].bind(name=resource, epoch=epoch, owner=owner)
        released = self._call(f"releasing {resource}", "release", params, mutation=True)[0][0]
        return bool(released)

    def current(self, resource: str) -> LeaseInfo | None:
        rows = self._call(f"reading {resource}", "current", (resource,), mutation=False)
        if not rows or rows[0][0] is None:
            return None
        epoch, holder, remaining, ttl, value = rows[0]
        return LeaseInfo(
            resource,
            int(epoch),
            str(holder),
            float(remaining),
            float(ttl),
            self.coordinator_id,
            None if value is None else str(value),
        )

    def last_epoch(self, resource: str) -> int:
        rows = self._call("reading epochs", "last_epoch", (resource,), mutation=False)
        return int(rows[0][0] or 0)

    def resources(self) -> list[str]:
        rows = self._call("listing resources", "resources", (), mutation=False)
        return [str(row[0]) for row in rows]

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        done = self._call(
            f"proclaiming on {resource}", "proclaim", (resource, epoch, owner, value), mutation=True
        )[0][0]
        if not done:
            raise LeaseLost(
                LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
            )

    # -- records ------------------------------------------------------------------------------

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        """Records with ``seq > after`` (of ``resource`` or of all), oldest first.

        Due expiries are detected and recorded first. For all resources, the answer stops
        before the first gap in ``seq`` that is younger than :data:`GAP_SETTLE` (see the
        module docstring), so a reader paging with ``after`` misses nothing.
        """
        rows = self._call(
            "reading records", "records", (resource, max(int(after), 0), int(limit)), mutation=False
        )
        found: list[Record] = []
        expected = max(int(after), 0) + 1
        for seq, at, kind, name, epoch, holder, detail, age in rows:
            if resource is None and seq > expected and age < GAP_SETTLE:
                break  # a younger gap: its transaction may still commit (module docstring)
            found.append(
                Record(
                    int(seq),
                    float(at),
                    RecordKind(kind),
                    str(name),
                    int(epoch),
                    None if holder is None else str(holder),
                    dict(detail or {}),
                )
            )
            expected = int(seq) + 1
        return found

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        self._call(
            f"recording {kind.value} of {resource}",
            "report",
            (resource, epoch, holder, kind.value, Jsonb(detail, dumps=_dumps)),
            mutation=True,
        )

    def watch(self, resource: str, after: int, timeout: float) -> None:
        """Block until ``resource`` has a record with ``seq > after``, or ``timeout`` passed.

        Woken by NOTIFY (a watcher row tells writers to send one), at the live lease's expiry
        (to detect and record it), and at least every third of :data:`WATCH_KEEPALIVE`.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        listener = self._listener()
        listener.start(PROBE_TIMEOUT + 1)
        sub = listener.subscribe(resource, None)
        watcher: int | None = None
        try:
            watcher = int(
                self._call(
                    f"watching {resource}",
                    "watch_start",
                    (resource, WATCH_KEEPALIVE),
                    mutation=True,
                )[0][0]
            )
            while True:
                changed, watcher, remaining = self._call(
                    f"watching {resource}",
                    "watch_poll",
                    (resource, max(int(after), 0), watcher, WATCH_KEEPALIVE),
                    mutation=True,
                    idempotent=True,
                )[0]
                if changed:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                pause = min(left, WATCH_KEEPALIVE / 3)
                if remaining is not None:
                    pause = min(pause, max(float(remaining), 0.0) + 0.001)
                if not listener.healthy:
                    pause = min(pause, RECHECK)
                sub.event.wait(pause)
                sub.event.clear()
        finally:
            listener.unsubscribe(sub)
            if watcher is not None:
                with contextlib.suppress(FencedError):
                    self._call(f"watching {resource}", "unwatch", (watcher,), mutation=True)

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        """Restore safety: no later grant gets an epoch ≤ ``minimum`` (see the contract).

        One transaction that excludes grants (``LOCK TABLE … SHARE ROW EXCLUSIVE``), committed
        synchronously; records the expiries that are due, ends every live lease, a RESTORED
        record per resource; wakes everyone.
        """
        for value in (minimum, *floors.values()):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_EPOCH:
                raise ConfigurationError(
                    f"epochs must be integers in 0..{MAX_EPOCH}, got {value!r}"
                )
        for name in floors:
            validate_resource(name)
        rows = self._call(
            "advancing epochs",
            "advance",
            (minimum, Jsonb({k: str(v) for k, v in floors.items()}), Jsonb(detail, dumps=_dumps)),
            mutation=True,
        )
        return int(rows[0][0])

    # -- waiting ------------------------------------------------------------------------------

    def _listener(self) -> Listener:
        with self._listener_lock:
            listener = self._listener_obj
            if listener is None or listener._pid != os.getpid():
                listener = Listener(
                    self._listen_connect,
                    self.url,
                    self._channel,
                    self._probe,
                    enabled=self._listen_enabled,
                )
                self._listener_obj = listener
            return listener

    def _probe(self, nonce: str) -> None:
        self._call(
            "probing notifications", "probe", (self._channel, f"probe:{nonce}"), mutation=True
        )

    def enqueue(self, request: GrantRequest) -> PostgresTicket:
        """Take a place at the end of ``request.resource``'s queue (and start listening)."""
        listener = self._listener()
        listener.start(PROBE_TIMEOUT + 1)
        sent = self._clock.now()
        rows = self._call(
            f"queueing for {request.resource}",
            "enqueue",
            (
                request.resource,
                request.holder,
                QUEUE_KEEPALIVE,
                request.owner,
                float(request.ttl),
                request.value,
                self._handoff_key(request),
            ),
            mutation=True,
            idempotent=True,
        )
        ticket = PostgresTicket(self, request.resource, int(rows[0][0]), request.owner, sent)
        ticket._sub = listener.subscribe(request.resource, ticket.waiter_id)
        with self._tickets_lock:
            self._tickets.add(ticket)
        return ticket

    def wait(self, ticket: Ticket, timeout: float) -> None:
        """Block until notified for ``ticket`` or ``timeout`` passed (no database access).

        Returns at once for an ended ticket; at most :data:`RECHECK` seconds while the listener
        is not proven to receive notifications.
        """
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine.ended or mine._sub is None:
            return
        if not self._listener().healthy:
            timeout = min(timeout, RECHECK)
        mine._sub.event.wait(max(timeout, 0.0))
        mine._sub.event.clear()

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue (idempotent, best effort: a row left behind lapses after
        :data:`QUEUE_KEEPALIVE`). If the leaver was first in line and the resource is free, the
        next waiter is woken. If a releaser had handed the resource to this ticket (before or
        after it gave up), that lease is returned with ``take`` (``leave_taking``, under the
        resource's row lock), else released and the resource passed on."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine.ended:
            return None
        try:
            rows = self._call(
                f"leaving the queue of {mine.resource}",
                "leave_taking" if take else "leave",
                (mine.resource, mine.waiter_id, mine.owner),
                mutation=True,
                idempotent=True,
            )
        except (Unavailable, OutcomeUnknown) as error:
            log.debug("leaving the queue of %s: %s", mine.resource, error)
            return None
        finally:
            self._end_ticket(mine)
        if not take or not rows:
            return None
        epoch, holder, ttl, remaining = rows[0]
        return Granted(int(epoch), mine.owner, str(holder), float(ttl), float(remaining))

    def _own_ticket(self, ticket: Ticket | None, resource: str) -> PostgresTicket | None:
        return owned_ticket(self, ticket, resource, PostgresTicket)

    def _end_ticket(self, ticket: PostgresTicket) -> None:
        ticket.ended = True
        if ticket._sub is not None:
            self._listener().unsubscribe(ticket._sub)
            ticket._sub.event.set()
        with self._tickets_lock:
            self._tickets.discard(ticket)

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def listener_state(self) -> str:
        """``starting`` / ``listening`` / ``unreliable`` / ``down`` / ``off`` (diagnostics)."""
        listener = self._listener_obj
        return "idle" if listener is None else listener.state

    def close(self) -> None:
        """Leave every open ticket's queue (best effort), stop the listener, close connections.

        Idempotent. Any later call raises ConfigurationError.
        """
        if self._closed:
            return
        with self._tickets_lock:
            tickets = list(self._tickets)
        for ticket in tickets:
            with contextlib.suppress(FencedError):
                self.leave(ticket)
        self._closed = True
        with self._listener_lock:
            listener, self._listener_obj = self._listener_obj, None
        if listener is not None:
            listener.close()
        self._statements.close()


def _dumps(value: object) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))

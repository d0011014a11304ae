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
import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import psycopg

from fenced._drivers.postgres import Lender, connect_listening, dedicated, migrate, translate
from fenced._drivers.postgres_borrowed import lender
from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.postgres import _plans as plans
from fenced.coordinator.backends.postgres import _schema as postgres_schema
from fenced.coordinator.backends.postgres._listener import (
    LISTEN_PING,
    PROBE_TIMEOUT,
    RECHECK,
    Listener,
    Subscription,
)
from fenced.coordinator.backends.postgres._plans import GAP_SETTLE, QUEUE_KEEPALIVE
from fenced.coordinator.backends.postgres._statements import Call, Rows, StatementRunner
from fenced.core._closing import Closing
from fenced.core._errors import ConfigurationError, FencedError
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._token import validate_coordinator_id

__all__ = [
    "GAP_SETTLE",
    "LISTEN_PING",
    "QUEUE_KEEPALIVE",
    "RECHECK",
    "PostgresBackend",
    "PostgresTicket",
    "initialise_schema",
]

log = logging.getLogger("fenced.coordinator.postgres")


def initialise_schema(
    pool: Lender, schema: str, display: str, budget: float, new_id: str | None
) -> str:
    """Create or migrate the coordinator's tables in ``schema`` on a connection of its own
    (:func:`~fenced._drivers.postgres.dedicated`) and return the coordinator id.

    ``new_id`` is the id of a schema created here (else a random one). Raises
    :class:`~fenced.ConfigurationError` (authentication, missing database or privileges, a
    schema of a newer fenced, a damaged meta table) or :class:`~fenced.Unavailable`.
    """
    where = f"{display} (schema {schema})"
    try:
        # a connection of its own: a failure here (wrong password, missing database, newer
        # schema) is reported at once and starts no pool threads
        with dedicated(pool, budget) as conn:
            meta = migrate(
                conn,
                schema=schema,
                meta_table="meta",
                fmt=postgres_schema.FORMAT,
                migrations=postgres_schema.migrations(schema),
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
    try:
        return validate_coordinator_id(meta.get("coordinator_id"))
    except ConfigurationError as error:
        raise ConfigurationError(f"{where}: damaged meta table: {error}") from None


# -- tickets ----------------------------------------------------------------------------------


class PostgresTicket(plans.QueueTicket[Subscription]):
    """A place in one resource's queue: a ``waiters`` row plus the waiter's subscription (see
    :class:`~fenced.coordinator.backends.postgres._plans.QueueTicket`). Used by one thread at a
    time; :meth:`PostgresBackend.wait` on an ended ticket returns at once."""

    __slots__ = ()


# -- the backend ------------------------------------------------------------------------------


class PostgresBackend(plans.Face[PostgresTicket, Listener], Closing):
    """The coordinator backend on PostgreSQL (see the module docstring). Thread-safe.

    Creates the schema and its tables on first use (or migrates them). Raises
    :class:`~fenced.ConfigurationError` for a bad URL, an unusable database or schema, a schema
    of a newer fenced; :class:`~fenced.Unavailable` if the server cannot be reached.
    ``coordinator_id_for_new`` is used only when the schema is created here (restores, tests).
    What it shares with the asyncio backend (every statement, answer and I/O-free step) is in
    :mod:`~fenced.coordinator.backends.postgres._plans`.
    """

    _ticket_type = PostgresTicket

    def __init__(
        self,
        url: object,
        *,
        coordinator_id_for_new: str | None = None,
        options: Mapping[str, object] | None = None,
    ) -> None:
        parsed, self._pool = lender(url, plans.URL_KEYS, options)
        self._parsed = parsed
        try:
            found = plans.settings(parsed)
            self._listen_connect: Callable[[], tuple[psycopg.Connection[Any], Callable[[], None]]]
            if found.listen_conninfo is not None:
                self._listen_connect = partial(connect_listening, found.listen_conninfo)
            else:
                if found.listen_enabled:
                    self._pool.check_listen()
                self._listen_connect = self._pool.listen_connection
        except BaseException:
            self._pool.close()
            raise
        self._connect_budget = found.connect_budget
        if coordinator_id_for_new is not None:
            validate_coordinator_id(coordinator_id_for_new)
        self._statements = StatementRunner(self._pool, parsed.display, parsed.schema, found)
        super().__init__(self._statements, listen_enabled=found.listen_enabled)
        self.coordinator_id = self._initialise(coordinator_id_for_new)

    # -- set-up -------------------------------------------------------------------------------

    def _initialise(self, new_id: str | None) -> str:
        try:
            return initialise_schema(
                self._pool, self.schema, self.url, self._connect_budget, new_id
            )
        except BaseException:
            self._pool.close()
            raise

    def _call(
        self,
        doing: str,
        name: str,
        params: Sequence[object],
        *,
        mutation: bool,
        timeout: float | None = None,
        idempotent: bool = False,
    ) -> Rows:
        """Run one statement (see :meth:`StatementRunner.call`); ConfigurationError once closed."""
        self._check_open()
        return self._statements.call((doing, name, params, mutation, timeout, idempotent))

    def _send(self, call: Call) -> Rows:
        """Run ``call`` (through :meth:`_call`, where every statement passes)."""
        doing, name, params, mutation, timeout, idempotent = call
        return self._call(
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
        mine, step = self._attempt(request, ticket)
        if isinstance(step, Granted):
            return step
        sent = self._clock.now()
        return self._answered(request, mine, sent, self._send(step))

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        """Extend this owner's live lease to ``ttl`` from now (server clock); return ``ttl``.

        Raises ``LeaseLost(REJECTED)`` if that lease is not live: an expired lease is never
        revived. Commits synchronously. Gives up after a third of ``ttl`` (at least 0.2 s) so
        that a hung connection makes the lease UNCERTAIN, not silently HELD.
        """
        rows = self._send(plans.renew_call(resource, epoch, owner, ttl))
        return plans.renewed(rows, resource, epoch)

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        """End this owner's live lease and wake the first waiter; True if it ended now.

        Compare and delete in one transaction: a delayed release of an older owner changes
        nothing. Committed with ``synchronous_commit = off`` — unless it hands the resource to
        the first waiter, which is a grant (see the module docstring).
        """
        rows = self._send(plans.release_call(self._direct, resource, epoch, owner))
        return bool(rows[0][0])

    def current(self, resource: str) -> LeaseInfo | None:
        rows = self._send(plans.current_call(resource))
        return plans.lease_info(rows, resource, self.coordinator_id)

    def last_epoch(self, resource: str) -> int:
        rows = self._send(plans.last_epoch_call(resource))
        return int(rows[0][0] or 0)

    def resources(self) -> list[str]:
        return [str(row[0]) for row in self._send(plans.RESOURCES_CALL)]

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        rows = self._send(plans.proclaim_call(resource, epoch, owner, value))
        plans.proclaimed(rows, resource, epoch)

    # -- records ------------------------------------------------------------------------------

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        """Records with ``seq > after`` (of ``resource`` or of all), oldest first.

        Due expiries are detected and recorded first. For all resources, the answer stops
        before the first gap in ``seq`` that is younger than :data:`GAP_SETTLE` (see the
        module docstring), so a reader paging with ``after`` misses nothing.
        """
        rows = self._send(plans.records_call(resource, after, limit))
        return plans.records_of(rows, resource, after)

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        self._send(plans.report_call(resource, epoch, holder, kind, detail))

    def watch(self, resource: str, after: int, timeout: float) -> None:
        """Block until ``resource`` has a record with ``seq > after``, or ``timeout`` passed.

        Woken by NOTIFY (a watcher row tells writers to send one), at the live lease's expiry
        (to detect and record it), and at least every third of :data:`~._plans.WATCH_KEEPALIVE`
        (:func:`~fenced.coordinator.backends.postgres._plans.watch_pause`).
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        listener = self._listener()
        listener.start(PROBE_TIMEOUT + 1)
        sub = listener.subscribe(resource, None)
        watcher: int | None = None
        try:
            watcher = int(self._send(plans.watch_start_call(resource))[0][0])
            while True:
                changed, watcher, remaining = self._send(
                    plans.watch_poll_call(resource, after, watcher)
                )[0]
                pause = plans.watch_pause(changed, remaining, deadline, listener.healthy)
                if pause is None:
                    return
                sub.wait(pause)
        finally:
            listener.unsubscribe(sub)
            if watcher is not None:
                with contextlib.suppress(FencedError):
                    self._send(plans.unwatch_call(resource, watcher))

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        """Restore safety: no later grant gets an epoch ≤ ``minimum`` (see the contract).

        One transaction that excludes grants (``LOCK TABLE … SHARE ROW EXCLUSIVE``), committed
        synchronously; records the expiries that are due, ends every live lease, a RESTORED
        record per resource; wakes everyone.
        """
        return int(self._send(plans.advance_call(minimum, floors, detail))[0][0])

    # -- waiting ------------------------------------------------------------------------------

    def _new_listener(self) -> Listener:
        return Listener(
            self._listen_connect, self.url, self._channel, self._probe, enabled=self._listen_enabled
        )

    def _probe(self, nonce: str) -> None:
        self._send(plans.probe_call(self._channel, nonce))

    def enqueue(self, request: GrantRequest) -> PostgresTicket:
        """Take a place at the end of ``request.resource``'s queue (and start listening)."""
        listener = self._listener()
        listener.start(PROBE_TIMEOUT + 1)
        sent = self._clock.now()
        rows = self._send(plans.enqueue_call(request, self._handoff_key(request)))
        return self._queued(request, rows, sent, listener)

    def wait(self, ticket: Ticket, timeout: float) -> None:
        """Block until notified for ``ticket`` or ``timeout`` passed (no database access).

        Returns at once for an ended ticket; at most :data:`RECHECK` seconds while the listener
        is not proven to receive notifications.
        """
        sub, timeout = self._waiting(ticket, timeout)
        if sub is not None:
            sub.wait(timeout)

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue (idempotent, best effort: a row left behind lapses after
        :data:`QUEUE_KEEPALIVE`). If the leaver was first in line and the resource is free, the
        next waiter is woken. If a releaser had handed the resource to this ticket (before or
        after it gave up), that lease is returned with ``take`` (``leave_taking``, under the
        resource's row lock), else released and the resource passed on."""
        mine = self._leaving(ticket)
        rows: Rows = []
        if mine is not None:
            with self._left(mine):
                rows = self._send(plans.leave_call(mine, take))
        return plans.taken(rows, mine.owner) if mine is not None and take else None

    # -- life cycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave every open ticket's queue (best effort), stop the listener, close connections.

        Idempotent. Any later call raises ConfigurationError.
        """
        if self._closed:
            return
        for ticket in self._open_tickets():
            with contextlib.suppress(FencedError):
                self.leave(ticket)
        self._closed = True
        listener = self._detach_listener()
        if listener is not None:
            listener.close()
        self._statements.close()

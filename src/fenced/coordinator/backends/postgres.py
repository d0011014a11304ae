"""The PostgreSQL coordinator backend: ``postgresql://user:pass@host:port/db?schema=fenced``.

Guarantees
----------
- **Expiry by the server's clock.** Every decision reads ``clock_timestamp()`` on the server; the
  client never sends a time. (PostgreSQL has no monotonic clock in SQL: a step of the *server's*
  wall clock moves every expiry with it — run the server with a slewing NTP daemon. Holders are
  still safe: their local deadlines are monotonic and stores reject stale tokens.)
- **Epochs never repeat, and are durable before acquire returns.** A grant is one transaction
  that locks the resource's row, increments its epoch and commits with ``synchronous_commit`` on
  (raised for the transaction even if the server or role has it off). ``advance`` raises a
  coordinator-wide minimum epoch in a transaction that excludes grants.
- **Renewals are durable** (a lost renewal could let the server grant again before the holder's
  deadline). **Releases are not** (``synchronous_commit = off`` for the transaction): a release
  lost in a server crash only delays the next grant until the lease's expiry, and any later
  durable commit (the next grant) flushes it anyway.
- **First come, first served, woken by LISTEN/NOTIFY.** A waiter takes a row in ``waiters`` (its
  id is its place in line) and is woken by ``NOTIFY`` sent, in the transaction that frees the
  resource (release, the head's leave, a detected expiry), to the first live waiter only. Waiters
  LISTEN on one dedicated connection per backend (the *listener*). A waiter's row stays live for
  :data:`QUEUE_KEEPALIVE` seconds after its last ``try_grant``; a dead (killed, stopped) waiter is
  skipped once that passes. A waiter blocked by a live lease retries at the lease's expiry (a
  timer, not a poll) and at least every ``QUEUE_KEEPALIVE / 3`` (its keep-alive).
- **A lost notification is recovered, never waited on forever.** The listener pings its
  connection every :data:`LISTEN_PING` seconds; when the connection fails it reconnects,
  re-LISTENs, proves delivery with a probe NOTIFY, then wakes every local waiter to try again at
  once. While it is not proven to work, waits are capped at :data:`RECHECK` seconds.
- **PgBouncer in transaction mode works**: lease operations use no session state (no advisory
  locks, no temporary tables, no ``SET`` outside a transaction); prepared statements are turned
  off for good the first time a pooler is seen to lose one (the statement, which had not run,
  is sent again). LISTEN needs a real session: give the listener a direct connection with
  ``?listen_url=postgresql://…`` (percent-encoded). Without it, the probe fails and waiting
  degrades to expiry timers plus re-checks every :data:`RECHECK` seconds.
- **Records** (granted, released, expired, proclaimed, restored, holder reports) are written in
  the same transaction as the change, under the resource's row lock: the records of one resource
  are in commit order. Across resources, ``records(None, after)`` holds back records that follow
  a gap in ``seq`` younger than :data:`GAP_SETTLE` seconds (a concurrent transaction may still
  commit the missing one).

Race timeline (release → handoff)::

    holder A                        waiter B (head, LISTENing)          waiter C
    release(): lock row, owner=NULL
      record 'released'
      pg_notify('fenced_x', 'B:res')
    COMMIT (async) ──── NOTIFY ───▶ listener: B's event.set()
                                    try_grant(ticket B): lock row
                                      free, no live waiter ahead of B
                                      epoch+1, delete B's row
                                    COMMIT (synchronous) → Granted     (C: now first in line,
                                                                        woken by the next release)

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
import secrets
import select
import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import pq, sql
from psycopg.types.json import Jsonb

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
from fenced.coordinator.backends import postgres_schema
from fenced.core.errors import (
    ConfigurationError,
    FencedError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core.lease import LeaseInfo
from fenced.core.names import validate_resource
from fenced.core.records import Record, RecordKind
from fenced.core.token import MAX_EPOCH, validate_coordinator_id
from fenced.fence.postgres_conn import (
    DEFAULT_OP_TIMEOUT,
    DEFAULT_POOL_SIZE,
    Pool,
    execute,
    guarded,
    migrate,
    parse_url,
    translate,
)

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
RECHECK = 0.2
"""Seconds a wait lasts at most while notifications are not known to arrive."""
LISTEN_PING = 2.0
"""Seconds of silence after which the listener checks its connection (with the same timeout)."""
GAP_SETTLE = 2.0
"""Seconds after which a gap in ``records(None, …)`` is taken as a rolled-back transaction."""
WATCH_KEEPALIVE = 6.0
"""Seconds a watcher's row lives after its last refresh (refreshed every third of that)."""
_PROBE_TIMEOUT = 2.0
_RESEND_CONNECT = 3.0  # seconds spent reconnecting before an idempotent request is re-sent
_URL_KEYS = ("listen_url", "listen", "pool_size", "timeout", "prepare")


# -- the listener -----------------------------------------------------------------------------


class _Subscription:
    """What one waiting thread listens for: its waiter id (None: a watcher of ``resource``)."""

    __slots__ = ("event", "resource", "waiter_id")

    def __init__(self, resource: str, waiter_id: int | None) -> None:
        self.resource = resource
        self.waiter_id = waiter_id
        self.event = threading.Event()


class _Listener:
    """One LISTEN session in a daemon thread; dispatches notifications to subscriptions.

    States: ``starting`` (first connect not finished), ``listening`` (delivery proven by a
    probe), ``unreliable`` (connected, but the probe never arrived: a transaction-pooling
    PgBouncer), ``down`` (reconnecting), ``off`` (``?listen=off``). Only ``listening`` lets
    waits run to their full timeout.
    """

    def __init__(
        self,
        conninfo: str,
        display: str,
        channel: str,
        probe: Any,
        *,
        enabled: bool,
    ) -> None:
        self._conninfo = conninfo
        self._display = display
        self._channel = channel
        self._probe = probe
        self._lock = threading.Lock()
        self._subs: dict[str, set[_Subscription]] = {}
        self._state = "starting" if enabled else "off"
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._nonce = ""
        self._probe_seen = threading.Event()
        self._pid = os.getpid()
        if not enabled:
            self._ready.set()

    @property
    def healthy(self) -> bool:
        return self._state == "listening"

    @property
    def state(self) -> str:
        return self._state

    def start(self, timeout: float) -> None:
        """Start the thread (once) and wait up to ``timeout`` for its first attempt to end."""
        if self._state == "off":
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"fenced-pg-listen:{self._channel}", daemon=True
                )
                self._thread.start()
        self._ready.wait(timeout)

    def subscribe(self, resource: str, waiter_id: int | None) -> _Subscription:
        sub = _Subscription(resource, waiter_id)
        with self._lock:
            self._subs.setdefault(resource, set()).add(sub)
        return sub

    def update(self, sub: _Subscription, waiter_id: int) -> None:
        with self._lock:
            sub.waiter_id = waiter_id

    def unsubscribe(self, sub: _Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.resource)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.resource]

    def wake_all(self) -> None:
        with self._lock:
            for subs in self._subs.values():
                for sub in subs:
                    sub.event.set()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)
        if thread is None or not thread.is_alive():
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.wake_all()

    # -- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.05
        while not self._stop.is_set():
            try:
                self._session()
                backoff = 0.05
            except Exception as error:  # any failure: reconnect (the thread must not die)
                log.debug("listener of %s: %s", self._display, error)
            if self._stop.is_set():
                break
            self._state = "down"  # waits are capped at RECHECK from their next round on
            self._ready.set()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 1.0)

    def _session(self) -> None:
        name = psycopg.conninfo.conninfo_to_dict(self._conninfo).get("application_name")
        conn = psycopg.Connection.connect(
            self._conninfo, autocommit=True, application_name=f"{name or 'fenced'}-listen"
        )
        try:
            pgconn = conn.pgconn
            self._query(pgconn, f"LISTEN {_quote_ident(self._channel)}".encode(), 5.0)
            self._nonce = secrets.token_hex(8)
            self._probe_seen.clear()
            sent = time.monotonic()
            try:
                self._probe(self._nonce)
            except FencedError as error:
                log.debug("listener probe of %s failed: %s", self._display, error)
            while not self._probe_seen.is_set() and time.monotonic() - sent < _PROBE_TIMEOUT:
                self._pump(pgconn, _PROBE_TIMEOUT - (time.monotonic() - sent))
                if self._stop.is_set():
                    return
            if self._probe_seen.is_set():
                self._state = "listening"
            else:
                if self._state != "unreliable":
                    log.warning(
                        "%s: NOTIFY does not reach the listener (a transaction-pooling "
                        "PgBouncer?); waiting falls back to re-checks every %ss. Give a direct "
                        "connection with ?listen_url=",
                        self._display,
                        RECHECK,
                    )
                self._state = "unreliable"
            self._ready.set()
            self.wake_all()  # whatever was missed while disconnected: try again now
            while not self._stop.is_set():
                if not self._pump(pgconn, LISTEN_PING):
                    self._query(pgconn, b"SELECT 1", LISTEN_PING)
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def _pump(self, pgconn: pq.abc.PGconn, timeout: float) -> bool:
        """Wait up to ``timeout`` for input and dispatch notifications; False on silence."""
        readable, _, _ = select.select([pgconn.socket, self._wake_r], [], [], max(timeout, 0))
        if self._wake_r in readable:
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 64)
            return True
        if not readable:
            return False
        pgconn.consume_input()
        self._drain(pgconn)
        if pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError("the listening connection was closed")
        return True

    def _query(self, pgconn: pq.abc.PGconn, query: bytes, timeout: float) -> None:
        """Run ``query`` on the raw connection; give up (raise) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        pgconn.send_query(query)
        while pgconn.flush():
            self._wait_socket(pgconn, deadline, write=True)
        while True:
            while pgconn.is_busy():
                self._wait_socket(pgconn, deadline, write=False)
                pgconn.consume_input()
                self._drain(pgconn)
            result = pgconn.get_result()
            if result is None:
                break
            if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
                message = result.error_message.decode(errors="replace").strip()
                raise psycopg.OperationalError(f"listener query failed: {message}")
        self._drain(pgconn)

    def _wait_socket(self, pgconn: pq.abc.PGconn, deadline: float, *, write: bool) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or self._stop.is_set():
            raise psycopg.OperationalError("the listening connection did not answer in time")
        fd = pgconn.socket
        rlist, wlist = ([], [fd]) if write else ([fd], [])
        select.select(rlist, wlist, [], min(remaining, 0.5))

    def _drain(self, pgconn: pq.abc.PGconn) -> None:
        while (notify := pgconn.notifies()) is not None:
            self._dispatch(notify.extra.decode(errors="replace"))

    def _dispatch(self, payload: str) -> None:
        head, _, resource = payload.partition(":")
        if head == "probe":
            if resource == self._nonce:
                self._probe_seen.set()
            return
        try:
            waiter = int(head)
        except ValueError:
            return
        with self._lock:
            if not resource:
                targets = [sub for subs in self._subs.values() for sub in subs]
            else:
                targets = [
                    sub
                    for sub in self._subs.get(resource, ())
                    if sub.waiter_id is None or (waiter != 0 and sub.waiter_id == waiter)
                ]
        for sub in targets:
            sub.event.set()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# -- tickets ----------------------------------------------------------------------------------


class PostgresTicket:
    """A place in one resource's queue: a ``waiters`` row plus the waiter's subscription.

    Used by one thread at a time. It ends when granted or left; :meth:`PostgresBackend.wait` on
    an ended ticket returns at once.
    """

    __slots__ = ("_backend", "_sub", "ended", "resource", "waiter_id")

    def __init__(self, backend: PostgresBackend, resource: str, waiter_id: int) -> None:
        self._backend = backend
        self.resource = resource
        self.waiter_id = waiter_id
        self.ended = False
        self._sub: _Subscription | None = None

    def __repr__(self) -> str:
        return f"PostgresTicket({self.resource!r}, waiter_id={self.waiter_id})"


# -- the backend ------------------------------------------------------------------------------


class PostgresBackend:
    """The coordinator backend on PostgreSQL (see the module docstring). Thread-safe.

    Creates the schema and its tables on first use (or migrates them). Raises
    :class:`~fenced.ConfigurationError` for a bad URL, an unusable database or schema, a schema
    of a newer fenced; :class:`~fenced.Unavailable` if the server cannot be reached.
    ``coordinator_id_for_new`` is used only when the schema is created here (restores, tests).
    """

    def __init__(self, url: str, *, coordinator_id_for_new: str | None = None) -> None:
        parsed = parse_url(url, _URL_KEYS)
        self._parsed = parsed
        self.url = parsed.display
        self.schema = parsed.schema
        self.capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})
        self._op_timeout = parsed.option_float("timeout", DEFAULT_OP_TIMEOUT, minimum=0.01)
        self._connect_budget = min(parsed.connect_timeout, self._op_timeout)
        self._pool = Pool(
            parsed.conninfo,
            display=parsed.display,
            size=parsed.option_int("pool_size", DEFAULT_POOL_SIZE),
            connect_timeout=parsed.connect_timeout,
            prepare=parsed.option_flag("prepare", True),
        )
        if coordinator_id_for_new is not None:
            validate_coordinator_id(coordinator_id_for_new)
        self._q = self._statements(sql.Identifier(self.schema).as_string(None))
        self._channel = postgres_schema.channel(self.schema)
        listen = parsed.options.get("listen_url")
        self._listen_conninfo = (
            parsed.conninfo if listen is None else parse_url(listen, ()).conninfo
        )
        self._listen_enabled = parsed.option_flag("listen", True)
        self.coordinator_id = self._initialise(coordinator_id_for_new)
        self._listener_obj: _Listener | None = None
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
            with self._pool.open_connection(self._connect_budget) as conn:
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

    @staticmethod
    def _statements(s: str) -> dict[str, bytes]:
        def q(text: str) -> bytes:
            return text.replace("{s}", s).encode()

        return {
            "grant": q("SELECT * FROM {s}.try_grant(%s, %s, %s, %s, %s, %s, %s, %s, %s)"),
            "renew": q("SELECT {s}.renew(%s, %s, %s, %s)"),
            "release": q("SELECT {s}.release(%s, %s, %s)"),
            "current": q("SELECT * FROM {s}.current_lease(%s)"),
            "last_epoch": q(
                "SELECT greatest(coalesce((SELECT r.epoch FROM {s}.resources r "
                "WHERE r.name = %s), 0), (SELECT m.value::bigint FROM {s}.meta m "
                "WHERE m.key = 'minimum_epoch'))"
            ),
            "resources": q(
                'SELECT r.name FROM {s}.resources r WHERE r.epoch > 0 ORDER BY r.name COLLATE "C"'
            ),
            "proclaim": q("SELECT {s}.proclaim(%s, %s, %s, %s)"),
            "report": q("SELECT {s}.report(%s, %s, %s, %s, %s)"),
            "records": q("SELECT * FROM {s}.records_after(%s, %s, %s)"),
            "enqueue": q("SELECT {s}.enqueue(%s, %s, %s)"),
            "leave": q("SELECT {s}.leave(%s, %s)"),
            "watch_start": q("SELECT {s}.watch_start(%s, %s)"),
            "watch_poll": q("SELECT * FROM {s}.watch_poll(%s, %s, %s, %s)"),
            "unwatch": q("DELETE FROM {s}.watchers WHERE id = %s"),
            "advance": q("SELECT {s}.advance(%s, %s, %s)"),
            "probe": q("SELECT pg_notify(%s, %s)"),
        }

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
        """Run one statement of :meth:`_statements` (one transaction, one round trip).

        ``idempotent``: the statement may be sent again. When the connection breaks under it
        (a server restart terminates the session) it is re-sent once on a new connection
        instead of reporting :class:`OutcomeUnknown` — never after a timeout.
        """
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed")
        budget = self._op_timeout if timeout is None else min(timeout, self._op_timeout)
        try:
            return self._send(doing, name, params, mutation, budget, self._connect_budget)
        except OutcomeUnknown as unknown:
            if not idempotent or getattr(unknown, "timed_out", False):
                raise
            log.debug("%s: %s; sending it again", doing, unknown)
            try:
                return self._send(doing, name, params, mutation, budget, _RESEND_CONNECT)
            except Unavailable:
                raise unknown from None  # the first attempt's outcome is still unknown

    def _send(
        self,
        doing: str,
        name: str,
        params: Sequence[object],
        mutation: bool,
        budget: float,
        connect_budget: float,
    ) -> list[tuple[Any, ...]]:
        with (
            self._pool.connection(min(connect_budget, budget)) as conn,
            guarded(conn, budget) as fired,
        ):
            try:
                return execute(self._pool, conn, self._q[name], params)
            except psycopg.Error as error:
                if conn.broken:
                    self._pool.discard_idle()  # they probably share the same fate
                sent = mutation and not isinstance(error, psycopg.InterfaceError)
                if fired():
                    raise _timed_out(doing, self.url, budget, sent=sent) from error
                raise translate(error, doing, sent=sent, where=self.url) from error

    # -- leases -------------------------------------------------------------------------------

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant with epoch = max(last epoch, minimum) + 1 if free and first in line.

        One round trip (the ``try_grant`` function); a grant commits synchronously. The call is
        idempotent: if the resource is held by ``request.owner`` (this very request, granted
        with its reply lost), that lease is returned; so a request cut off by a server restart
        is sent once more on a new connection rather than failing with OutcomeUnknown. A caller
        without a ticket is behind every live waiter. Each call by a queued caller keeps its
        ticket alive (a ticket whose row was dropped rejoins at the end of the line).
        ``Blocked.retry_in`` is the live lease's remaining time (plus 1 ms), or the first
        waiter's remaining keep-alive; for a queued caller at most ``QUEUE_KEEPALIVE / 3``.
        A known ``request_id`` returns its grant while that lease lives and raises
        ``LeaseLost(REJECTED)`` once it ended; reused for another resource it is a
        ``ConfigurationError``.
        """
        mine = self._own_ticket(ticket, request.resource)
        rows = self._call(
            f"acquiring {request.resource}",
            "grant",
            (
                request.resource,
                request.owner,
                request.holder,
                float(request.ttl),
                request.request_id,
                mine.waiter_id if mine is not None else None,
                request.value,
                QUEUE_KEEPALIVE,
                QUEUE_KEEPALIVE / 3,
            ),
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
                f"request_id {request.request_id!r} was already used to acquire {holder}, "
                f"not {request.resource}"
            )
        if mine is not None and new_ticket is not None and new_ticket != mine.waiter_id:
            mine.waiter_id = int(new_ticket)
            if mine._sub is not None:
                self._listener().update(mine._sub, mine.waiter_id)
        return Blocked(
            None if holder is None else str(holder),
            int(epoch),
            float(remaining or 0.0),
            None if retry_in is None else float(retry_in),
        )

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
        nothing. Committed with ``synchronous_commit = off`` (see the module docstring).
        """
        released = self._call(
            f"releasing {resource}", "release", (resource, epoch, owner), mutation=True
        )[0][0]
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
        listener.start(_PROBE_TIMEOUT + 1)
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
        synchronously; ends every live lease; a RESTORED record per resource; wakes everyone.
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

    def _listener(self) -> _Listener:
        with self._listener_lock:
            listener = self._listener_obj
            if listener is None or listener._pid != os.getpid():
                listener = _Listener(
                    self._listen_conninfo,
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
        listener.start(_PROBE_TIMEOUT + 1)
        rows = self._call(
            f"queueing for {request.resource}",
            "enqueue",
            (request.resource, request.holder, QUEUE_KEEPALIVE),
            mutation=True,
            idempotent=True,
        )
        ticket = PostgresTicket(self, request.resource, int(rows[0][0]))
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

    def leave(self, ticket: Ticket) -> None:
        """Leave the queue (idempotent, best effort: a row left behind lapses after
        :data:`QUEUE_KEEPALIVE`). If the leaver was first in line and the resource is free, the
        next waiter is woken."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine.ended:
            return
        try:
            self._call(
                f"leaving the queue of {mine.resource}",
                "leave",
                (mine.resource, mine.waiter_id),
                mutation=True,
                idempotent=True,
            )
        except (Unavailable, OutcomeUnknown) as error:
            log.debug("leaving the queue of %s: %s", mine.resource, error)
        finally:
            self._end_ticket(mine)

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
        self._pool.close()

    def __enter__(self) -> PostgresBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _dumps(value: object) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))


def _timed_out(doing: str, url: str, budget: float, *, sent: bool) -> FencedError:
    if sent:
        unknown = OutcomeUnknown(
            f"{doing} ({url}): no reply within {budget:g}s, the connection was cut; the request "
            "may or may not have taken effect"
        )
        unknown.timed_out = True  # type: ignore[attr-defined]
        return unknown
    return Unavailable(f"{doing} ({url}): no reply within {budget:g}s; nothing was changed")

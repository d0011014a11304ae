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
  (:data:`_FAST_GRANT`, :data:`_FAST_RELEASE`: a conditional ``UPDATE`` of the resource's row
  and the ``INSERT`` of its record), sent as libpq prepared statements; when their condition
  does not hold (a new resource, a live or expired lease, someone queued or watching, a
  request_id, a ticket) the same statement calls the PL/pgSQL function that decides everything
  else. Every other operation is one function call.
- **Renewals are durable** (a lost renewal could let the server grant again before the holder's
  deadline). **Releases are not** (``synchronous_commit = off`` for the transaction): a release
  lost in a server crash only delays the next grant until the lease's expiry, and any later
  durable commit (the next grant) flushes it anyway — except a release that hands the resource
  to a waiter: that transaction contains a grant, and commits durably.
- **First come, first served: the release grants the first waiter.** A waiter takes a row in
  ``waiters`` (its id is its place in line) with its owner secret, ttl and value, and the key of
  its listener's session lock (see :class:`_Listener`). The transaction that releases the
  resource grants it, in the same transaction, to the first live waiter whose listener still
  holds that lock, and notifies it ``<id>:<resource>:<epoch>:<seconds>``; the waiter returns
  from ``acquire`` without another round trip (:meth:`PostgresBackend._handed_over`). A waiter
  whose lock is free is gone (killed: its sessions ended): its row is dropped and the next one
  considered. A waiter without a usable listener (``listen=off``, an unproven listener, a
  request_id, an older fenced) is only woken, and grants itself. A detected expiry or the head's
  leave wakes the first live waiter. A waiter that gives up (``leave``) after a lease was handed
  to it releases that lease and passes the resource on. A waiter's row stays live for
  :data:`QUEUE_KEEPALIVE` seconds after its last ``try_grant``; a waiter that stopped (SIGSTOP)
  or was cut off without its sessions ending can be handed the resource within that time, which
  then stays blocked until that lease expires — as if it had stopped right after its own
  acquire. A waiter blocked by a live lease retries at the lease's expiry (a timer, not a poll)
  and at least every ``QUEUE_KEEPALIVE / 3`` (its keep-alive).
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
import operator
import os
import random
import re
import secrets
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import psycopg
from psycopg import pq, sql
from psycopg.types.json import Jsonb

from fenced._drivers.postgres import (
    DEFAULT_OP_TIMEOUT,
    DEFAULT_POOL_SIZE,
    Pool,
    checked,
    execute,
    guarded,
    migrate,
    parse_url,
    statement_name,
    translate,
)
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
from fenced.coordinator.backends.postgres import schema as postgres_schema
from fenced.core.clock import Clock, SystemClock
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
_MAX_KEY = (1 << 31) - 2  # listen keys are 1 .. 2**31 - 1 (the second int4 of the lock)
_PRUNE_CHANCE = 0.005
"""The share of grants that also prune (the ``try_grant`` function): up to 1000 records past
``records_retention`` and 512 request ids older than 24 h, more than a grant ever adds."""


_NAMED = re.compile(r"%\((\w+)\)s")


class _Direct:
    """A hot statement, run as libpq's own prepared statement (:meth:`PostgresBackend._direct`).

    ``query`` has one ``$n`` per distinct ``%(key)s`` of the source text (``keys``, in order of
    first appearance). ``name`` is derived from the text: the same name always means the same
    statement, even on a server session that a pooler shares between clients.
    """

    __slots__ = ("_get", "keys", "name", "query")

    def __init__(self, text: str) -> None:
        keys: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in keys:
                keys.append(match.group(1))
            return f"${keys.index(match.group(1)) + 1}"

        self.query = _NAMED.sub(number, text).encode()
        self.keys = tuple(keys)
        self._get = operator.itemgetter(*keys)
        self.name = statement_name(self.query)

    def bind(self, **values: object) -> tuple[object, ...]:
        """The parameters, in ``$n`` order (other keys are ignored)."""
        params = self._get(values)
        return cast(tuple[object, ...], params) if len(self.keys) > 1 else (params,)


_DUMPERS: dict[type, Callable[[Any, str], bytes | None]] = {
    str: lambda value, encoding: value.encode(encoding),
    float: lambda value, _: repr(value).encode(),
    int: lambda value, _: str(value).encode(),
    bool: lambda value, _: b"t" if value else b"f",
    type(None): lambda value, _: None,
}
"""Parameters in PostgreSQL's text format, by type (None is NULL)."""


_LOADERS: dict[int, Callable[[bytes], object]] = {
    16: lambda data: data == b"t",  # bool
    20: int,  # int8
    23: int,  # int4
    701: float,  # float8
}


_Kept = tuple[
    contextlib.AbstractContextManager[psycopg.Connection[Any]], psycopg.Connection[Any], int
]
"""A connection the backend keeps lent: how it was lent, the connection, the process's pid."""


def _reusable(conn: psycopg.Connection[Any]) -> bool:
    """True if ``conn`` is open, idle and has nothing to read (EOF: the server closed it)."""
    if conn.closed or conn.info.transaction_status != pq.TransactionStatus.IDLE:
        return False
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return not readable


def _rows(result: pq.abc.PGresult, encoding: str) -> list[tuple[Any, ...]]:
    """The rows of a text-format ``result`` (bool, integers and float8 as such, else str)."""
    columns = range(result.nfields)
    loaders = [_LOADERS.get(result.ftype(i)) for i in columns]
    rows: list[tuple[Any, ...]] = []
    for row in range(result.ntuples):
        values: list[object] = []
        for i in columns:
            data = result.get_value(row, i)
            load = loaders[i]
            values.append(None if data is None else load(data) if load else data.decode(encoding))
        rows.append(tuple(values))
    return rows


_FAST_GRANT = """
WITH granted AS (
    UPDATE {s}.resources r SET epoch = r.epoch + 1, owner = %(owner)s, holder = %(holder)s,
        ttl = %(ttl)s, expires_at = clock_timestamp() + %(ttl)s * interval '1 second',
        value = %(value)s
    WHERE r.name = %(name)s AND r.owner IS NULL AND r.epoch > 0
      AND NOT EXISTS (SELECT 1 FROM {s}.waiters w
                      WHERE w.name = %(name)s AND w.expires_at > clock_timestamp())
      AND NOT EXISTS (SELECT 1 FROM {s}.watchers x
                      WHERE x.name = %(name)s AND x.expires_at > clock_timestamp())
    RETURNING r.name, r.epoch, r.holder, r.ttl, r.value, r.ended,
        r.expires_at - r.ttl * interval '1 second' AS at,
        CASE WHEN current_setting('synchronous_commit') = 'off'
             THEN set_config('synchronous_commit', 'on', true) END AS durable),
rec AS (
    INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
    SELECT g.at, 'granted', g.name, g.epoch, g.holder,
           jsonb_build_object('after', g.ended) || CASE WHEN g.value IS NULL THEN '{}'::jsonb
                                                   ELSE jsonb_build_object('value', g.value) END
    FROM granted g)
SELECT 'granted', g.epoch, %(owner)s, g.holder, g.ttl, g.ttl, NULL::float8, NULL::bigint
FROM granted g
UNION ALL
SELECT * FROM {s}.try_grant(%(name)s, %(owner)s, %(holder)s, %(ttl)s, NULL, NULL, %(value)s,
                            %(keepalive)s, %(retry_cap)s, NULL, false)
WHERE NOT EXISTS (SELECT 1 FROM granted)
"""
"""The uncontended grant in one statement, else (nothing granted) the ``try_grant`` function in
the same statement. It grants a known resource (epoch > 0: ``advance`` raised it to the minimum
epoch, so the row lock alone orders this grant after any restore) that is free, with no live
waiter or watcher; ``ended`` keeps how the previous lease ended (for the record) until the next
ending sets it. The new epoch, the lease and the record are written together; the commit is
synchronous (raised here if the server runs with it off: ``durable`` in RETURNING is evaluated
for the granted row)."""

_TRY_GRANT = """
SELECT * FROM {s}.try_grant(%(name)s, %(owner)s, %(holder)s, %(ttl)s, %(request_id)s, %(ticket)s,
                            %(value)s, %(keepalive)s, %(retry_cap)s, %(listen_key)s, %(prune)s)
"""
"""An acquire attempt of a queued caller or with a request_id: the ``try_grant`` function."""

_FAST_RELEASE = """
WITH rel AS (
    SELECT r.name, r.epoch, r.holder, clock_timestamp() AS now FROM {s}.resources r
    WHERE r.name = %(name)s AND r.epoch = %(epoch)s AND r.owner = %(owner)s
      AND r.expires_at > clock_timestamp()
    FOR UPDATE),
head AS MATERIALIZED (
    SELECT w.id FROM {s}.waiters w
    WHERE w.name = %(name)s AND w.expires_at > clock_timestamp() ORDER BY w.id LIMIT 1),
gone AS (
    DELETE FROM {s}.waiters w USING rel, head h
    WHERE w.id = h.id AND w.expires_at > clock_timestamp() AND w.owner IS NOT NULL
      AND NOT pg_try_advisory_xact_lock({k}, w.listen_key)
    RETURNING w.id, w.owner, w.holder, w.ttl, w.value, w.refreshed_at),
done AS (
    UPDATE {s}.resources r SET epoch = r.epoch + CASE WHEN g.id IS NULL THEN 0 ELSE 1 END,
        owner = g.owner, holder = coalesce(g.holder, r.holder), ttl = coalesce(g.ttl, r.ttl),
        expires_at = CASE WHEN g.id IS NULL THEN r.expires_at
                          ELSE rel.now + g.ttl * interval '1 second' END,
        value = g.value, ended = 'released'
    FROM rel LEFT JOIN gone g ON true
    WHERE r.name = rel.name AND (g.id IS NOT NULL OR NOT EXISTS (SELECT 1 FROM head))
    RETURNING rel.now, rel.epoch AS old_epoch, rel.holder AS old_holder, r.epoch, r.holder,
        r.value, g.id AS waiter,
        CASE WHEN g.id IS NOT NULL THEN pg_notify('{c}', g.id::text || ':' || r.name || ':'
            || r.epoch::text || ':'
            || coalesce(extract(epoch FROM rel.now - g.refreshed_at)::float8, 0)::text)
        END AS handed,
        CASE WHEN EXISTS (SELECT 1 FROM {s}.watchers x
                          WHERE x.name = r.name AND x.expires_at > rel.now)
             THEN pg_notify('{c}', '0:' || r.name) END AS watched,
        set_config('synchronous_commit', CASE WHEN g.id IS NULL THEN 'off'
            WHEN current_setting('synchronous_commit') = 'off' THEN 'on'
            ELSE current_setting('synchronous_commit') END, true) AS durability),
rec AS (
    INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
    SELECT d.now, 'released', %(name)s, d.old_epoch, d.old_holder, '{}'::jsonb FROM done d
    UNION ALL
    SELECT d.now, 'granted', %(name)s, d.epoch, d.holder,
           jsonb_build_object('after', 'released') || CASE WHEN d.value IS NULL THEN '{}'::jsonb
                                                      ELSE jsonb_build_object('value', d.value) END
    FROM done d WHERE d.waiter IS NOT NULL)
SELECT true FROM done
UNION ALL
SELECT {s}.release(%(name)s, %(epoch)s, %(owner)s) WHERE NOT EXISTS (SELECT 1 FROM done)
"""
"""The release in one statement, and the handoff with it: it locks this owner's live lease
(``rel``), then takes the first live waiter's row (``gone``) if that waiter left what a grant
needs and its listen lock is held (its process lives) — a row a concurrent ``leave`` deleted
first is not taken — and ends the lease or grants it to that waiter (epoch + 1, durable commit,
NOTIFY ``<id>:<resource>:<epoch>:<seconds since its last keep-alive>``), with the records of
both. Committed without waiting for the disk when it grants nothing. Anything else (not this
owner's live lease, a first waiter that is gone or cannot be granted here) is the ``release``
function's, in the same statement."""


# -- the listener -----------------------------------------------------------------------------


class _Subscription:
    """What one waiting thread listens for: its waiter id (None: a watcher of ``resource``).

    ``handoff`` is ``(epoch, seconds from the waiter's last keep-alive to the grant)`` once a
    releaser granted the resource to this waiter (set before ``event``).
    """

    __slots__ = ("event", "handoff", "resource", "waiter_id")

    def __init__(self, resource: str, waiter_id: int | None) -> None:
        self.resource = resource
        self.waiter_id = waiter_id
        self.event = threading.Event()
        self.handoff: tuple[int, float] | None = None


class _Listener:
    """One LISTEN session in a daemon thread; dispatches notifications to subscriptions.

    States: ``starting`` (first connect not finished), ``listening`` (delivery proven by a
    probe), ``unreliable`` (connected, but the probe never arrived: a transaction-pooling
    PgBouncer), ``down`` (reconnecting), ``off`` (``?listen=off``). Only ``listening`` lets
    waits run to their full timeout.

    The session holds the advisory lock ``(LISTEN_LOCK_CLASS, key)`` for as long as it lives, a
    random ``key`` kept across reconnections (another one if it was taken meanwhile). While
    ``listening``, :attr:`handoff_key` offers it to releasers (see ``_handoff`` in
    :mod:`~fenced.coordinator.backends.postgres.schema`): a free lock means this process is gone.
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
        self._key = secrets.randbelow(_MAX_KEY) + 1
        self._key_held = False
        if not enabled:
            self._ready.set()

    @property
    def healthy(self) -> bool:
        return self._state == "listening"

    @property
    def state(self) -> str:
        return self._state

    @property
    def handoff_key(self) -> int | None:
        """The listen key a releaser may check, while notifications are known to arrive."""
        return self._key if self._state == "listening" and self._key_held else None

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
            self._lock_key(pgconn)
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

    def _lock_key(self, pgconn: pq.abc.PGconn) -> None:
        """Take the session's listen lock (:attr:`handoff_key`); a new key if ours is taken."""
        self._key_held = False
        for _ in range(4):
            query = f"SELECT pg_try_advisory_lock({postgres_schema.LISTEN_LOCK_CLASS}, {self._key})"
            if self._query(pgconn, query.encode(), 5.0) == b"t":
                self._key_held = True
                return
            self._key = secrets.randbelow(_MAX_KEY) + 1

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

    def _query(self, pgconn: pq.abc.PGconn, query: bytes, timeout: float) -> bytes | None:
        """Run ``query`` on the raw connection; give up (raise) after ``timeout`` seconds.

        Returns the first value of the first row of the last result (None if none).
        """
        deadline = time.monotonic() + timeout
        value: bytes | None = None
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
            value = result.get_value(0, 0) if result.ntuples and result.nfields else None
        self._drain(pgconn)
        return value

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
        """``<waiter id>:<resource>[:<epoch>:<seconds>]`` (a grant handed to that waiter),
        ``0:<resource>`` (watchers), ``0:`` (everyone), ``probe:<nonce>``."""
        head, _, rest = payload.partition(":")
        if head == "probe":
            if rest == self._nonce:
                self._probe_seen.set()
            return
        resource, _, grant = rest.partition(":")
        try:
            waiter = int(head)
            epoch, _, seconds = grant.partition(":")
            handoff = (int(epoch), float(seconds)) if grant and waiter else None
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
                if handoff is not None and sub.waiter_id == waiter:
                    sub.handoff = handoff
        for sub in targets:
            sub.event.set()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


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
        self._clock: Clock = SystemClock()  # the deadline clock: counts a suspended host
        self._pool = Pool(
            parsed.conninfo,
            display=parsed.display,
            size=parsed.option_int("pool_size", DEFAULT_POOL_SIZE),
            connect_timeout=parsed.connect_timeout,
            prepare=parsed.option_flag("prepare", True),
        )
        if coordinator_id_for_new is not None:
            validate_coordinator_id(coordinator_id_for_new)
        quoted = sql.Identifier(self.schema).as_string(None)
        self._q = self._statements(quoted)
        self._channel = postgres_schema.channel(self.schema)
        self._direct = {
            name: _Direct(
                text.replace("{s}", quoted)
                .replace("{c}", self._channel)
                .replace("{k}", str(postgres_schema.LISTEN_LOCK_CLASS))
            )
            for name, text in (
                ("grant", _FAST_GRANT),
                ("grant_queued", _TRY_GRANT),
                ("release", _FAST_RELEASE),
            )
        }
        self._prepared: weakref.WeakKeyDictionary[pq.abc.PGconn, set[bytes]] = (
            weakref.WeakKeyDictionary()
        )
        self._prepared_lock = threading.Lock()
        self._kept: _Kept | None = None
        self._kept_lock = threading.Lock()
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
            "renew": q("SELECT {s}.renew(%s, %s, %s, %s)"),
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
            "enqueue": q("SELECT {s}.enqueue(%s, %s, %s, %s, %s, %s, %s)"),
            "leave": q("SELECT {s}.leave(%s, %s, %s)"),
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
        """One attempt within ``budget`` seconds: a connection (waiting at most
        ``connect_budget`` for it), then the statement with the time left, so that connecting
        never makes the call outlast its budget."""
        deadline = time.monotonic() + budget
        wait = min(connect_budget, budget)
        if self._pool.size > 1 and self._kept_lock.acquire(blocking=False):
            try:
                conn = self._kept_connection(wait)
                try:
                    return self._run(conn, doing, name, params, mutation, budget, deadline)
                except BaseException:
                    self._drop_kept()  # closed unless it is idle, else back to the pool
                    raise
            finally:
                self._kept_lock.release()
        with self._pool.connection(wait) as conn:
            return self._run(conn, doing, name, params, mutation, budget, deadline)

    def _run(
        self,
        conn: psycopg.Connection[Any],
        doing: str,
        name: str,
        params: Sequence[object],
        mutation: bool,
        budget: float,
        deadline: float,
    ) -> list[tuple[Any, ...]]:
        """The statement on ``conn``, cut at ``deadline`` (the end of the call's ``budget``)."""
        with guarded(conn, _left(doing, self.url, deadline, budget)) as fired:
            try:
                direct = self._direct.get(name)
                if direct is not None:
                    return self._run_direct(conn, direct, params)
                return execute(self._pool, conn, self._q[name], params)
            except psycopg.Error as error:
                if conn.broken:
                    self._pool.discard_idle()  # they probably share the same fate
                sent = mutation and not isinstance(error, psycopg.InterfaceError)
                if fired():
                    raise _timed_out(doing, self.url, budget, sent=sent) from error
                raise translate(error, doing, sent=sent, where=self.url) from error

    def _kept_connection(self, wait: float) -> psycopg.Connection[Any]:
        """The pooled connection this backend keeps lent between its statements (under
        ``_kept_lock``): borrowing and returning one costs more client time than a lease
        statement on the server.

        One thread at a time uses it (the others borrow from the pool as usual, so a single
        thread uses one connection for everything, as it did through the pool); it is checked
        without a round trip before each use, like the pool's, and given back when a call on it
        failed, when the backend closes, and never used by a forked child.
        """
        kept = self._kept
        if kept is not None:
            _, conn, pid = kept
            if pid != os.getpid():
                self._kept = None  # the parent's: the child's pool never touches it either
            elif _reusable(conn):
                return conn
            else:
                self._drop_kept()
        lending = self._pool.connection(wait)
        conn = lending.__enter__()
        self._kept = (lending, conn, os.getpid())
        return conn

    def _drop_kept(self) -> None:
        """Give the kept connection back to the pool (which closes it unless it is idle)."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[2] == os.getpid():
            with contextlib.suppress(Exception):
                kept[0].__exit__(None, None, None)

    def _run_direct(
        self, conn: psycopg.Connection[Any], direct: _Direct, params: Sequence[object]
    ) -> list[tuple[Any, ...]]:
        """Run a hot statement through libpq: Bind/Execute of a statement prepared once per
        server session, text parameters and results (a fraction of psycopg's client time).

        With prepared statements off (``?prepare=off``, or a pooler lost one: then the
        statement had not run and is sent again), the same text goes through psycopg,
        unprepared. Errors are psycopg's (translated by the caller).
        """
        if not self._pool.prepare:
            return psycopg.RawCursor(conn).execute(direct.query, params, prepare=False).fetchall()
        pgconn = conn.pgconn
        encoding = conn.info.encoding
        with self._prepared_lock:
            names = self._prepared.setdefault(pgconn, set())
        try:
            if direct.name not in names:
                try:
                    checked(conn, pgconn.prepare(direct.name, direct.query))
                except psycopg.OperationalError as error:  # the statement never ran
                    raise psycopg.InterfaceError(f"preparing a statement: {error}") from error
                names.add(direct.name)
            values = [_DUMPERS[type(value)](value, encoding) for value in params]
            result = checked(conn, pgconn.exec_prepared(direct.name, cast(list[bytes], values)))
        except psycopg.Error as error:
            if not self._pool.lost_prepared_statement(error, conn):
                raise
            names.discard(direct.name)
            return psycopg.RawCursor(conn).execute(direct.query, params, prepare=False).fetchall()
        return _rows(result, encoding)

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

    def leave(self, ticket: Ticket) -> None:
        """Leave the queue (idempotent, best effort: a row left behind lapses after
        :data:`QUEUE_KEEPALIVE`). If the leaver was first in line and the resource is free, the
        next waiter is woken. If a releaser had handed the resource to this ticket (before or
        after it gave up), that lease is released and the resource passed on."""
        mine = self._own_ticket(ticket, ticket.resource)
        assert mine is not None
        if mine.ended:
            return
        try:
            self._call(
                f"leaving the queue of {mine.resource}",
                "leave",
                (mine.resource, mine.waiter_id, mine.owner),
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
        if self._kept_lock.acquire(timeout=self._op_timeout):  # a call in flight ends first
            try:
                self._drop_kept()
            finally:
                self._kept_lock.release()
        self._pool.close()

    def __enter__(self) -> PostgresBackend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _dumps(value: object) -> str:
    return json.dumps(value, default=str, separators=(",", ":"))


def _left(doing: str, url: str, deadline: float, budget: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic()``) for the statement, once
    connected; :class:`Unavailable` (nothing was sent) if connecting took them all."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Unavailable(f"{doing} ({url}): no connection within {budget:g}s; nothing was changed")
    return left


def _timed_out(doing: str, url: str, budget: float, *, sent: bool) -> FencedError:
    if sent:
        unknown = OutcomeUnknown(
            f"{doing} ({url}): no reply within {budget:g}s, the connection was cut; the request "
            "may or may not have taken effect"
        )
        unknown.timed_out = True  # type: ignore[attr-defined]
        return unknown
    return Unavailable(f"{doing} ({url}): no reply within {budget:g}s; nothing was changed")

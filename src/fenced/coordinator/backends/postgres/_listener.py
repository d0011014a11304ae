"""Waiting on the PostgreSQL coordinator: one LISTEN session per process and its subscriptions.

A :class:`Listener` runs one LISTEN session in a daemon thread and dispatches the coordinator's
notifications (see :mod:`~fenced.coordinator.backends.postgres._schema`) to the
:class:`Subscription` of each waiting thread: a wake-up, or the epoch a releaser granted the
waiter directly. A lost notification is recovered, never waited on forever: the listener pings
its connection every :data:`LISTEN_PING` seconds; when the connection fails it reconnects,
re-LISTENs, proves delivery with a probe NOTIFY, then wakes every subscription to try again at
once. While delivery is not proven (reconnecting, or a transaction-pooling PgBouncer that never
delivers the probe), callers cap their waits at :data:`RECHECK` seconds. The session holds a
session-level advisory lock while it lives, which tells releasers that this process's waiters
are alive. Nothing here logs a password.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq

from fenced.coordinator.backends.postgres import _schema as postgres_schema
from fenced.core._errors import FencedError

__all__ = ["LISTEN_PING", "PROBE_TIMEOUT", "RECHECK", "Listener", "Subscription"]

log = logging.getLogger("fenced.coordinator.postgres")

RECHECK = 0.2
"""Seconds a wait lasts at most while notifications are not known to arrive."""
LISTEN_PING = 2.0
"""Seconds of silence after which the listener checks its connection (with the same timeout)."""
PROBE_TIMEOUT = 2.0
"""Seconds the listener waits for its probe NOTIFY before it reports ``unreliable``."""
_MAX_KEY = (1 << 31) - 2  # listen keys are 1 .. 2**31 - 1 (the second int4 of the lock)


class Subscription:
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


class Listener:
    """One LISTEN session in a daemon thread; dispatches notifications to subscriptions.

    States: ``starting`` (first connect not finished), ``listening`` (delivery proven by a
    probe), ``unreliable`` (connected, but the probe never arrived: a transaction-pooling
    PgBouncer), ``down`` (reconnecting), ``off`` (``?listen=off``). Only ``listening`` lets
    waits run to their full timeout.

    The session holds the advisory lock ``(LISTEN_LOCK_CLASS, key)`` for as long as it lives, a
    random ``key`` kept across reconnections (another one if it was taken meanwhile). While
    ``listening``, :attr:`handoff_key` offers it to releasers (see ``_handoff`` in
    :mod:`~fenced.coordinator.backends.postgres._schema`): a free lock means this process is gone.

    ``connect`` returns an autocommit connection for the session and the function that gives it
    back (a connection of its own, or one held from a user's pool: see
    :mod:`fenced._drivers.postgres_borrowed`); it is called again after each failure.
    """

    def __init__(
        self,
        connect: Callable[[], tuple[psycopg.Connection[Any], Callable[[], None]]],
        display: str,
        channel: str,
        probe: Any,
        *,
        enabled: bool,
    ) -> None:
        self._connect = connect
        self._display = display
        self._channel = channel
        self._probe = probe
        self._lock = threading.Lock()
        self._subs: dict[str, set[Subscription]] = {}
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

    def subscribe(self, resource: str, waiter_id: int | None) -> Subscription:
        sub = Subscription(resource, waiter_id)
        with self._lock:
            self._subs.setdefault(resource, set()).add(sub)
        return sub

    def update(self, sub: Subscription, waiter_id: int) -> None:
        with self._lock:
            sub.waiter_id = waiter_id

    def unsubscribe(self, sub: Subscription) -> None:
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
        conn, give_back = self._connect()
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
            while not self._probe_seen.is_set() and time.monotonic() - sent < PROBE_TIMEOUT:
                self._pump(pgconn, PROBE_TIMEOUT - (time.monotonic() - sent))
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
                give_back()

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

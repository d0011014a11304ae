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
are alive. Nothing here logs a password. The states, subscriptions, listen key, probe and
dispatch are :class:`Listening`'s, shared with the asyncio listener (a task instead of a thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import psycopg
from psycopg import pq

from fenced.coordinator.backends.postgres import _schema as postgres_schema
from fenced.core._errors import FencedError

__all__ = [
    "LISTEN_PING",
    "LISTEN_QUERY_TIMEOUT",
    "PROBE_TIMEOUT",
    "RECHECK",
    "Listener",
    "Listening",
    "Notification",
    "Subscription",
    "Waiting",
    "listen_query",
    "lock_query",
    "new_listen_key",
    "parse_notification",
    "targets",
]

log = logging.getLogger("fenced.coordinator.postgres")

RECHECK = 0.2
"""Seconds a wait lasts at most while notifications are not known to arrive."""
LISTEN_PING = 2.0
"""Seconds of silence after which the listener checks its connection (with the same timeout)."""
PROBE_TIMEOUT = 2.0
"""Seconds the listener waits for its probe NOTIFY before it reports ``unreliable``."""
LISTEN_QUERY_TIMEOUT = 5.0
"""Seconds the listener's LISTEN and lock statements may take."""
_MAX_KEY = (1 << 31) - 2  # listen keys are 1 .. 2**31 - 1 (the second int4 of the lock)


# -- what the sync and the asyncio listeners share --------------------------------------------


class Notification(NamedTuple):
    """One notification of the coordinator's channel (see :func:`parse_notification`)."""

    nonce: str | None
    """The nonce of a listener's probe (then nothing else is set), else None."""
    resource: str
    """The resource whose subscriptions it wakes; ``""``: every subscription."""
    waiter: int
    """The waiter it is for; 0: the resource's watchers only (or everyone, without resource)."""
    handoff: tuple[int, float] | None
    """``(epoch, seconds since the waiter's last keep-alive)`` of a grant handed to ``waiter``."""


def parse_notification(payload: str) -> Notification | None:
    """``<waiter id>:<resource>[:<epoch>:<seconds>]`` (a grant handed to that waiter),
    ``0:<resource>`` (watchers), ``0:`` (everyone), ``probe:<nonce>``; None if malformed."""
    head, _, rest = payload.partition(":")
    if head == "probe":
        return Notification(rest, "", 0, None)
    resource, _, grant = rest.partition(":")
    try:
        waiter = int(head)
        epoch, _, seconds = grant.partition(":")
        handoff = (int(epoch), float(seconds)) if grant and waiter else None
    except ValueError:
        return None
    return Notification(None, resource, waiter, handoff)


class _Subscribed(Protocol):
    @property
    def waiter_id(self) -> int | None: ...


_Sub = TypeVar("_Sub", bound=_Subscribed)


def targets(subs: Mapping[str, Iterable[_Sub]], note: Notification) -> list[_Sub]:
    """The subscriptions ``note`` wakes: of its resource, its waiter and the watchers (waiter
    id None); without a resource, every one."""
    if not note.resource:
        return [sub for group in subs.values() for sub in group]
    return [
        sub
        for sub in subs.get(note.resource, ())
        if sub.waiter_id is None or (note.waiter != 0 and sub.waiter_id == note.waiter)
    ]


def listen_query(channel: str) -> bytes:
    """``LISTEN`` on ``channel`` (the coordinator's, :func:`~.._schema.channel`)."""
    return f"LISTEN {_quote_ident(channel)}".encode()


def lock_query(key: int) -> bytes:
    """Try to take the listen lock of ``key`` (one row: true if taken)."""
    return f"SELECT pg_try_advisory_lock({postgres_schema.LISTEN_LOCK_CLASS}, {key})".encode()


def new_listen_key() -> int:
    """A random listen key (the second int4 of the listen lock)."""
    return secrets.randbelow(_MAX_KEY) + 1


class _Flag(Protocol):
    """A ``threading.Event`` or an ``asyncio.Event``: what the shared code sets and reads."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...


_Ev = TypeVar("_Ev", bound=_Flag)


class Waiting(Generic[_Ev]):
    """What one waiting thread or task listens for: its waiter id (None: a watcher of
    ``resource``), and ``event`` (a ``threading.Event`` or an ``asyncio.Event``), set when it
    is notified.

    ``handoff`` is ``(epoch, seconds from the waiter's last keep-alive to the grant)`` once a
    releaser granted the resource to this waiter (set before ``event``).
    """

    __slots__ = ("event", "handoff", "resource", "waiter_id")

    def __init__(self, resource: str, waiter_id: int | None, event: _Ev) -> None:
        self.resource = resource
        self.waiter_id = waiter_id
        self.event = event
        self.handoff: tuple[int, float] | None = None


class Subscription(Waiting[threading.Event]):
    """What one waiting thread listens for (:class:`Waiting`, with a ``threading.Event``)."""

    __slots__ = ()

    def __init__(self, resource: str, waiter_id: int | None) -> None:
        super().__init__(resource, waiter_id, threading.Event())

    def wait(self, timeout: float) -> None:
        """Block until notified (at once if notified since the last wait) or ``timeout``."""
        self.event.wait(max(timeout, 0.0))
        self.event.clear()


_S = TypeVar("_S", bound=Waiting[Any])


class Listening(Generic[_S]):
    """What the sync and the asyncio listeners share: the states, the subscriptions, the
    listen key, the probe and the dispatch of notifications. No I/O: :class:`Listener` (a
    thread) and the asyncio listener of :mod:`~fenced.coordinator.backends.postgres._aio` (a
    task) connect, read and wait.

    States: ``starting`` (first connect not finished), ``listening`` (delivery proven by a
    probe), ``unreliable`` (connected, but the probe never arrived: a transaction-pooling
    PgBouncer), ``down`` (reconnecting), ``off`` (``?listen=off``). Only ``listening`` lets
    waits run to their full timeout.

    The session holds the advisory lock ``(LISTEN_LOCK_CLASS, key)`` for as long as it lives, a
    random ``key`` kept across reconnections (another one if it was taken meanwhile). While
    ``listening``, :attr:`handoff_key` offers it to releasers (see ``_handoff`` in
    :mod:`~fenced.coordinator.backends.postgres._schema`): a free lock means this process is gone.
    """

    def __init__(
        self,
        display: str,
        channel: str,
        new_subscription: Callable[[str, int | None], _S],
        new_flag: Callable[[], _Flag],
        *,
        enabled: bool,
    ) -> None:
        self._display = display
        self._channel = channel
        self._new_subscription = new_subscription
        self._lock = threading.Lock()
        self._subs: dict[str, set[_S]] = {}
        self._state = "starting" if enabled else "off"
        self._ready = new_flag()
        self._probe_seen = new_flag()
        self._nonce = ""
        self._probe_sent = 0.0
        self._key = new_listen_key()
        self._key_held = False
        self._pid = os.getpid()
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

    @property
    def inherited(self) -> bool:
        """True in a child forked after it was made (the parent's: never used here)."""
        return self._pid != os.getpid()

    def subscribe(self, resource: str, waiter_id: int | None) -> _S:
        sub = self._new_subscription(resource, waiter_id)
        with self._lock:
            self._subs.setdefault(resource, set()).add(sub)
        return sub

    def update(self, sub: _S, waiter_id: int) -> None:
        with self._lock:
            sub.waiter_id = waiter_id

    def unsubscribe(self, sub: _S) -> None:
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

    # -- a session's steps --------------------------------------------------------------------

    def _took_key(self, taken: bool) -> bool:
        """After an attempt to take the listen lock: True if it is held, else the next attempt
        tries another key."""
        self._key_held = taken
        if not taken:
            self._key = new_listen_key()
        return taken

    def _probing(self) -> str:
        """A new nonce for the session's probe NOTIFY (its sending time counts from now)."""
        self._nonce = secrets.token_hex(8)
        self._probe_seen.clear()
        self._probe_sent = time.monotonic()
        return self._nonce

    def _probe_failed(self, error: FencedError) -> None:
        log.debug("listener probe of %s failed: %s", self._display, error)

    def _probe_left(self) -> float:
        """Seconds left to wait for the probe (0 once it arrived, or gave up)."""
        if self._probe_seen.is_set():
            return 0.0
        return PROBE_TIMEOUT - (time.monotonic() - self._probe_sent)

    def _proven(self) -> None:
        """The probe arrived (``listening``) or not (``unreliable``, said once); wake every
        subscription: whatever was missed while disconnected, try again now."""
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
        self.wake_all()

    def _failed(self, error: Exception) -> None:
        log.debug("listener of %s: %s", self._display, error)

    def _down(self) -> None:
        """The session ended: waits are capped at RECHECK from their next round on."""
        self._state = "down"
        self._ready.set()

    def _drain(self, pgconn: pq.abc.PGconn) -> None:
        """Dispatch the notifications libpq has read on the session's connection."""
        while (notify := pgconn.notifies()) is not None:
            self._dispatch(notify.extra.decode(errors="replace"))

    @staticmethod
    def _answer(result: pq.abc.PGresult) -> bytes | None:
        """The first value of the first row of a result of the session's statements (None if
        none); raises if the statement failed."""
        if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
            message = result.error_message.decode(errors="replace").strip()
            raise psycopg.OperationalError(f"listener query failed: {message}")
        return result.get_value(0, 0) if result.ntuples and result.nfields else None

    def _dispatch(self, payload: str) -> None:
        """Wake the subscriptions a notification is for (:func:`parse_notification`)."""
        note = parse_notification(payload)
        if note is None:
            return
        if note.nonce is not None:
            if note.nonce == self._nonce:
                self._probe_seen.set()
            return
        with self._lock:
            woken = targets(self._subs, note)
            for sub in woken:
                if note.handoff is not None and sub.waiter_id == note.waiter:
                    sub.handoff = note.handoff
        for sub in woken:
            sub.event.set()


class Listener(Listening[Subscription]):
    """One LISTEN session in a daemon thread; dispatches notifications to subscriptions (see
    :class:`Listening`).

    ``connect`` returns an autocommit connection for the session and the function that gives it
    back (a connection of its own, or one held from a user's pool: see
    :mod:`fenced._drivers.postgres_borrowed`); it is called again after each failure.
    """

    _ready: threading.Event

    def __init__(
        self,
        connect: Callable[[], tuple[psycopg.Connection[Any], Callable[[], None]]],
        display: str,
        channel: str,
        probe: Any,
        *,
        enabled: bool,
    ) -> None:
        super().__init__(display, channel, Subscription, threading.Event, enabled=enabled)
        self._connect = connect
        self._probe = probe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()

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
                self._failed(error)
            if self._stop.is_set():
                break
            self._down()
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 1.0)

    def _session(self) -> None:
        conn, give_back = self._connect()
        try:
            pgconn = conn.pgconn
            self._query(pgconn, listen_query(self._channel), LISTEN_QUERY_TIMEOUT)
            self._lock_key(pgconn)
            try:
                self._probe(self._probing())
            except FencedError as error:
                self._probe_failed(error)
            while (left := self._probe_left()) > 0:
                self._pump(pgconn, left)
                if self._stop.is_set():
                    return
            self._proven()
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
            if self._took_key(
                self._query(pgconn, lock_query(self._key), LISTEN_QUERY_TIMEOUT) == b"t"
            ):
                return

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
            value = self._answer(result)
        self._drain(pgconn)
        return value

    def _wait_socket(self, pgconn: pq.abc.PGconn, deadline: float, *, write: bool) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or self._stop.is_set():
            raise psycopg.OperationalError("the listening connection did not answer in time")
        fd = pgconn.socket
        rlist, wlist = ([], [fd]) if write else ([fd], [])
        select.select(rlist, wlist, [], min(remaining, 0.5))


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'

"""PostgreSQL connections shared by the coordinator backend, the store and the guard.

* :class:`Pool` — autocommit connections from a :class:`psycopg_pool.ConnectionPool` (one worker
  thread), checked without a round trip before they are lent (a dead one — the server restarted,
  a proxy cut it — is readable at EOF and is discarded with every idle one). :class:`Pool` tells
  "all connections busy" from "cannot connect" and, for the latter, tries a direct connection
  whose error is translated (wrong password versus server restarting) or which, if it connects,
  serves the operation — never waiting past the caller's budget, although libpq's
  ``connect_timeout`` counts whole seconds. Nothing is ever sent twice: once a statement has gone
  out, failures are reported, never retried here.
* :class:`Deadlines` — one watchdog thread per process that shuts down the socket of an
  operation that outlived its deadline (a blackholed network, a hung server): the blocked call
  then fails instead of hanging forever.
* :func:`execute` and :class:`Statement` — one statement on a lent connection, sent again
  unprepared if a pooler lost its prepared form.
* :class:`Lender` — what the backends need of a source of connections: :class:`Pool` for a URL,
  or :class:`~fenced._drivers.postgres_borrowed.Borrowed` for a user's pool or engine (chosen by
  :func:`~fenced._drivers.postgres_borrowed.lender`).

This module is also the import point of the rest of the PostgreSQL plumbing: URLs
(:mod:`.postgres_url`), error translation (:mod:`.postgres_errors`) and migrations
(:mod:`.postgres_migrate`, :class:`~fenced._drivers.migrations.Migration`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import math
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol

import psycopg
from psycopg import errors, generators, pq
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from fenced._drivers.migrations import Migration
from fenced._drivers.postgres_errors import is_config_message, translate
from fenced._drivers.postgres_migrate import migrate
from fenced._drivers.postgres_url import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_OP_TIMEOUT,
    DEFAULT_POOL_SIZE,
    DEFAULT_SCHEMA,
    ParsedURL,
    parse_url,
)
from fenced.core._errors import ConfigurationError, Unavailable

log = logging.getLogger("fenced.postgres")

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_OP_TIMEOUT",
    "DEFAULT_POOL_SIZE",
    "DEFAULT_SCHEMA",
    "Deadlines",
    "Lender",
    "Migration",
    "ParsedURL",
    "Pool",
    "PreparedSwitch",
    "Statement",
    "Watchdog",
    "checked",
    "connect_listening",
    "deadlines",
    "dedicated",
    "execute",
    "migrate",
    "parse_url",
    "server_error",
    "statement_name",
    "translate",
]


# -- deadlines ------------------------------------------------------------------------------


class _Armed:
    __slots__ = ("deadline", "done", "fd", "fired")

    def __init__(self, deadline: float, fd: int) -> None:
        self.deadline = deadline
        self.fd = fd
        self.fired = False
        self.done = False


class Deadlines:
    """Cuts the connection of an operation that outlived its deadline (see the module doc).

    :meth:`arm` before sending, :meth:`disarm` after the reply. One daemon thread; it ticks every
    :attr:`TICK` seconds while operations are in flight and parks when idle; an operation takes
    its lock twice (arm, disarm) and never waits for the thread. A deadline fires up to ``TICK``
    late.
    """

    TICK = 0.05

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active: dict[int, _Armed] = {}
        self._ids = itertools.count()
        self._parked = True
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def arm(self, fd: int, timeout: float) -> tuple[int, _Armed]:
        armed = _Armed(time.monotonic() + timeout, fd)
        with self._cond:
            key = next(self._ids)
            self._active[key] = armed
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="fenced-pg-deadlines", daemon=True
                )
                self._thread.start()
            if self._parked:
                self._parked = False
                self._cond.notify()
        return key, armed

    def disarm(self, key: int, armed: _Armed) -> None:
        with self._cond:
            armed.done = True
            self._active.pop(key, None)

    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            with self._cond:
                now = time.monotonic()
                if self._active:
                    idle_since = now
                elif now - idle_since > 1.0:
                    self._parked = True
                    while self._parked:
                        self._cond.wait()
                    idle_since = time.monotonic()
                    continue
                due = [a for a in self._active.values() if a.deadline <= now and not a.fired]
                for armed in due:
                    armed.fired = True
                    _cut(armed.fd)
                self._cond.wait(self.TICK)


def _cut(fd: int) -> None:
    """Shut down the socket behind ``fd`` (a blocked recv on it then returns EOF)."""
    with contextlib.suppress(OSError):
        dup = socket.socket(fileno=os.dup(fd))
        with dup:
            dup.shutdown(socket.SHUT_RDWR)


_deadlines: Deadlines | None = None
_deadlines_lock = threading.Lock()


def deadlines() -> Deadlines:
    """The process's :class:`Deadlines` (a new one after ``fork``)."""
    global _deadlines  # noqa: PLW0603 - one watchdog per process
    with _deadlines_lock:
        if _deadlines is None or _deadlines._pid != os.getpid():
            _deadlines = Deadlines()
        return _deadlines


class Watchdog(Protocol):
    """What cuts the connection of a statement past its deadline: the process's
    :class:`Deadlines` thread (sync code), or timers of the event loop (green code, see
    :mod:`fenced._drivers.postgres_green`). ``arm`` returns a key and a handle whose ``fired``
    says whether the deadline cut the connection."""

    def arm(self, fd: int, timeout: float) -> tuple[int, Any]: ...

    def disarm(self, key: int, armed: Any) -> None: ...


# -- the pool -------------------------------------------------------------------------------


def _idle(conn: psycopg.Connection[Any]) -> bool:
    """True if ``conn`` is open, not broken and outside a transaction."""
    # conn.closed (a broken one is closed too) and conn.info.transaction_status, without
    # building a ConnectionInfo
    pgconn = conn.pgconn
    return (
        pgconn.status != pq.ConnStatus.BAD
        and pgconn.transaction_status == pq.TransactionStatus.IDLE
    )


def _dead(conn: psycopg.Connection[Any]) -> bool:
    """True if an idle connection is unusable: closed, or readable (EOF or an error pending)."""
    if not _idle(conn):
        return True
    try:
        readable, _, _ = select.select([conn.fileno()], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


_TRANSIENT_CONNECT = (
    "connection refused",
    "starting up",
    "shutting down",
    "in recovery",
    "not yet accepting connections",
    "terminating connection",
    "server closed the connection",
    "timeout expired",
    "connection timeout",
    "could not receive data",
    "no route to host",
    "connection reset",
)

_PROBE_AFTER = 0.1
"""Seconds to wait for the pool before trying a direct connection (the pool backs off)."""


def _transient(error: psycopg.Error) -> bool:
    """True if a failed connect may succeed if tried again soon (the server is restarting)."""
    message = str(error).lower()
    return any(text in message for text in _TRANSIENT_CONNECT) and not is_config_message(message)


_inherited: list[Any] = []
"""Pools (and spare connections) inherited through ``fork()``: kept referenced so that a child
never finalises them."""

_SPARES = 4
"""Idle connections a :class:`Pool` keeps at hand instead of returning them to psycopg_pool."""


class _Attempt:
    """One direct connection attempt, in a daemon thread of its own, that callers wait for with
    deadlines of their own (see :meth:`Pool._connect_within`).

    libpq's ``connect_timeout`` counts whole seconds, at least 2, and psycopg's ``connect`` has
    no shorter bound: a connect to a blackholed server would hold a caller for that long,
    whatever the caller's own budget. The attempt itself still ends by ``connect_timeout``.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[tuple[Any, ...]]]) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0
        self.done = False
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
        self._error: BaseException | None = None
        threading.Thread(
            target=self._run, args=(connect,), name="fenced-pg-connect", daemon=True
        ).start()

    def _run(self, connect: Callable[[], psycopg.Connection[tuple[Any, ...]]]) -> None:
        conn: psycopg.Connection[tuple[Any, ...]] | None = None
        error: BaseException | None = None
        try:
            conn = connect()
        except BaseException as caught:  # raised to every caller that waits
            error = caught
        with self._cond:
            self.done = True
            self._error = error
            if self._waiting:
                self._conn, conn = conn, None
            self._cond.notify_all()
        if conn is not None:  # every caller gave up before it connected: nobody will use it
            _close_quietly(conn)

    def take(self, timeout: float) -> psycopg.Connection[tuple[Any, ...]] | None:
        """The connection if the attempt connected within ``timeout`` seconds and no other
        caller took it first, else None; raises the attempt's error if it failed."""
        give_up = time.monotonic() + timeout
        with self._cond:
            self._waiting += 1
            try:
                while not self.done:
                    left = give_up - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
            finally:
                self._waiting -= 1
            if self._error is not None:
                raise self._error
            conn, self._conn = self._conn, None
            return conn


class PreparedSwitch:
    """Whether a lender's connections run hot statements as named prepared statements; turned
    off for good when a pooler is seen to lose one (shared by :class:`Pool` and the lender of a
    user's pool, :class:`~fenced._drivers.postgres_borrowed.Borrowed`)."""

    display: str
    direct = True
    """Whether hot statements may use libpq's blocking calls (:class:`Statement`)."""

    def __init__(self, prepare: bool) -> None:
        self._prepare = prepare

    def watchdog(self) -> Watchdog:
        """The deadlines of this lender's statements: the process's :class:`Deadlines`."""
        return deadlines()

    @property
    def prepare(self) -> bool:
        return self._prepare

    def lost_prepared_statement(
        self, error: psycopg.Error, conn: psycopg.Connection[tuple[Any, ...]]
    ) -> bool:
        """True (and prepared statements off from now on) if ``error`` says a pooler lost one.

        Such an error happens at Parse/Bind, before anything executed: re-sending is safe. The
        lender's other connections stop using prepared statements too (:attr:`prepare` is read
        before each hot statement).
        """
        if getattr(error, "sqlstate", None) not in ("26000", "42P05") or conn.broken:
            return False
        if self._prepare:
            log.warning(
                "%s: prepared statements do not survive between transactions here (a "
                "transaction-pooling PgBouncer?); not using them any more (?prepare=off)",
                self.display,
            )
        self._prepare = False
        return True


class Lender(Protocol):
    """Where the coordinator backend and the store get their connections: fenced's
    own :class:`Pool` (a URL) or a user's pool or engine
    (:class:`~fenced._drivers.postgres_borrowed.Borrowed`). Every connection lent is in
    autocommit mode, prepares nothing by itself and returns tuples."""

    display: str
    direct: bool
    """False: no blocking libpq call on its connections (green code: :class:`Statement` takes
    psycopg's path)."""

    @property
    def prepare(self) -> bool: ...

    def watchdog(self) -> Watchdog:
        """Where statements on its connections arm their deadlines."""
        ...

    @property
    def may_keep(self) -> bool:
        """Whether a user of the lender may keep one connection lent between operations."""
        ...

    def connection(
        self, budget: float
    ) -> contextlib.AbstractContextManager[psycopg.Connection[tuple[Any, ...]]]: ...

    def lend_dedicated(
        self, budget: float
    ) -> tuple[psycopg.Connection[tuple[Any, ...]], Callable[[], None]]:
        """A connection for a longer use (set-up, a snapshot read) and the function that gives
        it back (closes or returns it)."""
        ...

    def listen_connection(self) -> tuple[psycopg.Connection[tuple[Any, ...]], Callable[[], None]]:
        """A connection for LISTEN, held while it works, and the function that gives it back."""
        ...

    def check_listen(self) -> None:
        """Raise :class:`ConfigurationError` if the lender cannot spare a listening session."""
        ...

    def lost_prepared_statement(
        self, error: psycopg.Error, conn: psycopg.Connection[tuple[Any, ...]]
    ) -> bool: ...

    def discard_idle(self) -> None: ...

    def close(self) -> None: ...


@contextlib.contextmanager
def dedicated(lender: Lender, budget: float) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
    """:meth:`Lender.lend_dedicated` as a context manager: given back at exit."""
    conn, give_back = lender.lend_dedicated(budget)
    try:
        yield conn
    finally:
        give_back()


def connect_listening(
    conninfo: str,
) -> tuple[psycopg.Connection[tuple[Any, ...]], Callable[[], None]]:
    """A new autocommit connection to ``conninfo`` for LISTEN (``application_name`` gets
    ``-listen``) and the function that closes it."""
    name = psycopg.conninfo.conninfo_to_dict(conninfo).get("application_name")
    conn: psycopg.Connection[tuple[Any, ...]] = psycopg.Connection.connect(
        conninfo, autocommit=True, application_name=f"{name or 'fenced'}-listen"
    )
    return conn, partial(_close_quietly, conn)


class Pool(PreparedSwitch):
    """Autocommit connections to one server, at most ``size`` lent at once; thread-safe;
    fork-aware. A :class:`psycopg_pool.ConnectionPool` plus fenced's errors.

    The psycopg pool is opened on first use (a scheduler and one worker thread) and closed by
    :meth:`close`. It connects on demand and replaces lost connections in the background (for
    up to ``connect_timeout`` seconds of failures; the next demand tries again). Before a
    connection is lent it is checked without a round trip: a dead one (the server restarted, a
    proxy cut it — it is readable at EOF) is closed together with every idle one (they share its
    fate), and the pool connects anew.

    The pool alone reports every failure to connect as the same ``PoolTimeout`` after the whole
    wait. So when it lends nothing within :data:`_PROBE_AFTER` seconds while some of the
    ``size`` connections are free, :meth:`connection` tries a direct connection: if it connects
    (the server is back while the pool still backs off), the operation runs on it and it is
    closed afterwards; a refused or starting-up server is tried again, between further waits for
    the pool, until the budget is spent, then :class:`Unavailable`; any other failure (a wrong
    password, a missing database: :class:`ConfigurationError`) is reported at once. With all
    ``size`` connections lent it only waits, then :class:`Unavailable` (raise ``?pool_size=``).
    No caller waits for a connect past its budget: libpq's ``connect_timeout`` counts whole
    seconds (at least 2), so the direct connection is made in a thread of its own, one attempt
    at a time shared by the callers that need one (see :meth:`_connect_within`); a caller whose
    budget ends first gets :class:`Unavailable`, nothing sent. Nothing is ever sent twice: once a
    statement has gone out, failures are reported, never retried here.

    ``prepare``: run the hot statements (:class:`Statement`, the coordinator's direct ones) as
    prepared statements named after their text (on by default). A transaction-pooling PgBouncer
    before 1.21 loses them between transactions; the first such failure (``prepared statement …
    does not exist`` / ``already exists``, raised before anything executed) turns them off for
    the pool for good and the statement is sent again, unprepared.

    psycopg's own automatic preparation is never used (``prepare_threshold=None``): it names
    statements ``_pg3_0``, ``_pg3_1``, … per client connection, so behind a transaction pooler a
    server session can hold *another client's* ``_pg3_0`` for another query, and running it
    returns that query's rows without any error. A name derived from the text always means the
    same statement, on any session.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        display: str,
        size: int = DEFAULT_POOL_SIZE,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        prepare: bool = True,
    ) -> None:
        self.conninfo = conninfo
        self.display = display
        self.size = size
        self.connect_timeout = connect_timeout
        super().__init__(prepare)
        self._lock = threading.Lock()
        self._inner: ConnectionPool[psycopg.Connection[tuple[Any, ...]]] | None = None
        self._lent = 0
        # Up to _SPARES idle connections kept out of psycopg_pool and lent without it, last
        # returned first lent; only while nobody waits for the pool (_waiting), which would
        # otherwise wait for them in vain.
        self._spare: list[psycopg.Connection[tuple[Any, ...]]] = []
        self._waiting = 0
        self._attempt: _Attempt | None = None  # the direct connection attempt in flight
        self._pid = os.getpid()
        self._closed = False

    def _forget_parent(self) -> None:
        """In a forked child: drop the parent's pool, spares, lock and connect attempt (its
        connections are never used or closed here; its threads do not exist here)."""
        if self._pid != os.getpid():
            if self._inner is not None:
                _inherited.append(self._inner)
            _inherited.extend(self._spare)
            self._lock = threading.Lock()
            self._inner, self._lent, self._pid = None, 0, os.getpid()
            self._spare, self._waiting, self._attempt = [], 0, None

    def _live(self) -> ConnectionPool[psycopg.Connection[tuple[Any, ...]]]:
        """This process's psycopg pool, opened on first use."""
        self._forget_parent()
        with self._lock:
            if self._closed:
                raise ConfigurationError(f"the connection pool of {self.display} is closed")
            if self._inner is None:
                self._inner = ConnectionPool(
                    self.conninfo,
                    kwargs={"autocommit": True, "prepare_threshold": None},  # see the docstring
                    min_size=0,
                    max_size=self.size,
                    open=True,
                    check=self._check,
                    name=f"fenced-pg:{self.display}",
                    timeout=self.connect_timeout,
                    reconnect_timeout=self.connect_timeout,
                    num_workers=1,
                )
            return self._inner

    def _check(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        """The psycopg pool's check of a connection it is about to lend (no round trip)."""
        if _dead(conn):
            conn.close()  # the pool replaces a closed connection instead of keeping it
            self.discard_idle()
            raise psycopg.OperationalError("the idle connection was closed by the server")

    def open_connection(self, budget: float) -> psycopg.Connection[tuple[Any, ...]]:
        """A new connection outside the pool within ``budget`` seconds, retrying
        refused/starting-up connects until it is spent; a failure is translated
        (:func:`translate`), no connection within ``budget`` is :class:`Unavailable`."""
        deadline = time.monotonic() + budget
        delay = 0.02
        while True:
            try:
                conn = self._connect_within(deadline)
            except psycopg.Error as error:
                if not _transient(error) or time.monotonic() + delay >= deadline:
                    raise translate(error, "connecting", sent=False, where=self.display) from error
            else:
                if conn is None:
                    raise self._no_connection(budget)
                return conn
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def _connect_within(self, deadline: float) -> psycopg.Connection[tuple[Any, ...]] | None:
        """A new connection by ``deadline`` (``time.monotonic()``), or None: a caller never
        waits for a connect past its own deadline (see :class:`_Attempt`).

        At most one attempt of this pool is in flight; every caller that needs a connection
        meanwhile waits for it, the first to ask once it connected takes it (the others start
        the next attempt), and its failure (psycopg's error) is raised to each of them. An
        attempt that connects after all its callers gave up is closed.
        """
        self._forget_parent()
        while (left := deadline - time.monotonic()) > 0:
            with self._lock:
                attempt = self._attempt
                if attempt is None or attempt.done:
                    attempt = self._attempt = _Attempt(self._connect)
            conn = attempt.take(left)
            if conn is not None:
                return conn
        return None

    def _no_connection(self, budget: float) -> Unavailable:
        return Unavailable(
            f"connecting ({self.display}): no connection within {budget:g}s; nothing was "
            "changed, retry"
        )

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        conn: psycopg.Connection[tuple[Any, ...]] = psycopg.Connection.connect(
            self.conninfo, autocommit=True, prepare_threshold=None
        )
        return conn

    @contextlib.contextmanager
    def connection(self, budget: float) -> Iterator[psycopg.Connection[tuple[Any, ...]]]:
        """Lend a live connection for one operation; it returns to the pool if still idle.

        Waits up to ``budget`` seconds, then raises :class:`Unavailable` or
        :class:`ConfigurationError` with the reason (see the class doc). A connection left in a
        transaction, broken or closed is closed, never rolled back or reused.
        """
        pool = self._live()
        conn = self._take_spare(pool)
        pooled = True
        if conn is None:
            try:
                conn, pooled = self._borrow(pool, budget)
            finally:
                with self._lock:
                    self._waiting -= 1
        if not pooled:
            try:
                yield conn
            finally:
                _close_quietly(conn)
            return
        with self._lock:
            self._lent += 1
        try:
            yield conn
        finally:
            idle = _idle(conn)
            if not idle:
                _close_quietly(conn)
            with self._lock:
                self._lent -= 1
                keep = (
                    idle
                    and not self._waiting
                    and len(self._spare) < _SPARES
                    and self._inner is pool
                    and getattr(conn, "_expire_at", math.inf) > time.monotonic()
                )
                if keep:
                    self._spare.append(conn)
            if not keep:
                pool.putconn(conn)

    def _take_spare(
        self, pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]]
    ) -> psycopg.Connection[tuple[Any, ...]] | None:
        """A spare connection checked as psycopg_pool would (:meth:`_check`), or None — and
        then this caller counts as waiting for the pool until it has a connection."""
        while True:
            with self._lock:
                if not self._spare:
                    self._waiting += 1
                    return None
                conn = self._spare.pop()
            try:
                self._check(conn)
            except psycopg.Error:
                pool.putconn(conn)  # closed by the check: the pool replaces it
                continue
            return conn

    def _borrow(
        self, pool: ConnectionPool[psycopg.Connection[tuple[Any, ...]]], budget: float
    ) -> tuple[psycopg.Connection[tuple[Any, ...]], bool]:
        """A pooled connection (True), or a direct one (False) while the pool cannot connect."""
        deadline = time.monotonic() + budget
        wait = min(budget, _PROBE_AFTER)
        while True:
            try:
                return pool.getconn(wait), True
            except PoolTimeout:
                pass
            except PoolClosed as error:
                raise ConfigurationError(
                    f"the connection pool of {self.display} is closed"
                ) from error
            remaining = deadline - time.monotonic()
            with self._lock:
                busy = self._lent >= self.size
            if busy:  # only waiting helps
                if remaining <= 0:
                    raise Unavailable(
                        f"{self.display}: all {self.size} pooled connections stayed busy for "
                        f"{budget:g}s; nothing was sent (raise ?pool_size=)"
                    )
                wait = remaining
                continue
            try:
                conn = self._connect_within(deadline)
            except psycopg.Error as error:
                remaining = deadline - time.monotonic()
                if not _transient(error) or remaining <= 0:
                    raise translate(error, "connecting", sent=False, where=self.display) from error
            else:
                if conn is None:
                    raise self._no_connection(budget)
                return conn, False
            wait = min(remaining, wait * 2, 0.5)

    @property
    def may_keep(self) -> bool:
        return self.size > 1

    def lend_dedicated(
        self, budget: float
    ) -> tuple[psycopg.Connection[tuple[Any, ...]], Callable[[], None]]:
        """A new connection outside the pool (:meth:`open_connection`) and its ``close``."""
        conn = self.open_connection(budget)
        return conn, partial(_close_quietly, conn)

    def listen_connection(self) -> tuple[psycopg.Connection[tuple[Any, ...]], Callable[[], None]]:
        """A new connection of its own for LISTEN (see :func:`connect_listening`)."""
        return connect_listening(self.conninfo)

    def check_listen(self) -> None:
        """Nothing to check: LISTEN uses a connection of its own, outside the pool."""

    def discard_idle(self) -> None:
        """Close every idle connection (after a failure suggests they are all stale); lent ones
        are closed when they come back. The pool connects anew."""
        inner = self._inner
        if inner is not None and not inner.closed and self._pid == os.getpid():
            inner.drain()
            with self._lock:
                spare, self._spare = self._spare, []
            for conn in spare:  # older than the drain: the pool closes and replaces them
                inner.putconn(conn)

    def close(self) -> None:
        """Close idle connections and stop the pool's threads; lent connections are closed when
        they come back. Idempotent."""
        with self._lock:
            self._closed = True
            inner, self._inner = self._inner, None
            spare, self._spare = self._spare, []
        if inner is None:
            return
        if self._pid != os.getpid():
            _inherited.append(inner)
            _inherited.extend(spare)
            return
        for conn in spare:
            inner.putconn(conn)
        inner.close(timeout=1.0)


def _close_quietly(conn: psycopg.Connection[tuple[Any, ...]]) -> None:
    with contextlib.suppress(Exception):
        conn.close()


def execute(
    pool: Lender,
    conn: psycopg.Connection[tuple[Any, ...]],
    query: bytes,
    params: Sequence[object],
) -> list[tuple[Any, ...]]:
    """One autocommit statement; sent again unprepared if a pooler lost its prepared form."""
    try:
        return conn.execute(query, params).fetchall()
    except psycopg.Error as error:
        if not pool.lost_prepared_statement(error, conn):
            raise
        return conn.execute(query, params, prepare=False).fetchall()


def statement_name(query: bytes) -> bytes:
    """The name of a prepared statement, derived from its text: the same name always means the
    same statement, even on a server session that a pooler shares between clients."""
    return b"fenced_" + hashlib.sha256(query).hexdigest()[:24].encode()


def checked(conn: psycopg.Connection[Any], result: pq.abc.PGresult) -> pq.abc.PGresult:
    """``result`` of a libpq call on ``conn`` if it succeeded, else raise the psycopg error
    psycopg would have raised (:class:`psycopg.OperationalError` for a lost connection)."""
    if result.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
        return result
    if conn.pgconn.status == pq.ConnStatus.BAD:
        message = pq.error_message(conn.pgconn).strip()
        raise psycopg.OperationalError(message or "the connection was lost")
    raise server_error(result, conn.info.encoding)


def server_error(result: pq.abc.PGresult, encoding: str) -> psycopg.Error:
    """The psycopg exception of a failed ``result``, built with documented API only: the class
    :func:`psycopg.errors.lookup` gives for its SQLSTATE (:class:`psycopg.DatabaseError` for a
    code psycopg does not know, such as fenced's own ``FN…``), with the message of
    :func:`psycopg.pq.error_message` and ``sqlstate`` set."""
    state = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode("ascii", "replace")
    message = pq.error_message(result, encoding).strip()
    try:
        kind: type[psycopg.Error] = errors.lookup(state)
    except KeyError:
        kind = psycopg.DatabaseError
    error = kind(message or f"the server reported an error (SQLSTATE {state or 'none'})")
    if state and error.sqlstate != state:
        error.sqlstate = state
    return error


class Statement:
    """One hot statement run through libpq directly, without psycopg's cursors: prepared once
    per connection, then one Bind/Execute.

    Parameters (``None``, ``str``, ``int``, ``float``) are sent as text, ``bytes`` as binary (for
    ``bytea``); their types are those the server infers from the statement. The result is not
    read (a function returning ``void``). Any other parameter, or one psycopg would refuse (a
    ``str`` with a NUL), sends the call through psycopg instead; a connection that does not prepare
    (``?prepare=off``, a pooler that lost a prepared statement, see :meth:`Pool.lost_prepared_
    statement`) takes psycopg's path or an unnamed statement: the same errors as :func:`execute`.
    Blocking libpq calls release the GIL; the :class:`Deadlines` watchdog cuts them as any other.
    """

    def __init__(self, query: bytes, fallback: bytes) -> None:
        self.name = statement_name(query)
        self.query = query  # with $1, $2, …
        self.fallback = fallback  # the same with %s, for psycopg
        self._on: weakref.WeakKeyDictionary[psycopg.Connection[Any], str] = (
            weakref.WeakKeyDictionary()
        )  # connection -> its client encoding, for those where it is prepared

    def run(
        self, pool: Lender, conn: psycopg.Connection[tuple[Any, ...]], params: Sequence[object]
    ) -> None:
        encoding = self._on.get(conn)
        prepared = encoding is not None
        if encoding is None:
            encoding = conn.info.encoding
        values: list[bytes | None] = []
        formats: list[int] = []
        for value in params:
            if value is None:
                values.append(None)
                formats.append(0)
            elif type(value) is str:
                if "\x00" in value:  # psycopg's error
                    execute(pool, conn, self.fallback, params)
                    return
                values.append(value.encode(encoding))
                formats.append(0)
            elif type(value) is int or type(value) is float:  # str(): PostgreSQL's syntax, exact
                values.append(str(value).encode())
                formats.append(0)
            elif isinstance(value, bytes | bytearray | memoryview):
                values.append(bytes(value))
                formats.append(1)
            else:  # anything else as psycopg sends it (its errors too)
                execute(pool, conn, self.fallback, params)
                return
        pgconn = conn.pgconn
        if not pool.direct:  # green code: libpq's sending calls, and the connection's own wait
            self._sent(pool, conn, values, formats, prepared, encoding)
            return
        if pool.prepare:
            try:
                if not prepared:
                    checked(conn, pgconn.prepare(self.name, self.query))
                    self._on[conn] = encoding
                checked(conn, pgconn.exec_prepared(self.name, values, formats))  # type: ignore[arg-type]
                return
            except psycopg.Error as error:
                if not pool.lost_prepared_statement(error, conn):
                    raise
                self._on.pop(conn, None)
        checked(conn, pgconn.exec_params(self.query, values, None, formats))

    def _sent(
        self,
        pool: Lender,
        conn: psycopg.Connection[tuple[Any, ...]],
        values: list[bytes | None],
        formats: list[int],
        prepared: bool,
        encoding: str,
    ) -> None:
        """:meth:`run` without libpq's blocking calls: each message is sent with libpq's
        ``send_*`` and its reply awaited through ``conn.wait`` (psycopg's generators), which a
        green connection awaits on the event loop (:mod:`fenced._drivers.postgres_green`)."""
        pgconn = conn.pgconn

        def reply() -> None:
            for result in conn.wait(generators.execute(pgconn)):
                checked(conn, result)

        if pool.prepare:
            try:
                if not prepared:
                    pgconn.send_prepare(self.name, self.query)
                    reply()
                    self._on[conn] = encoding
                pgconn.send_query_prepared(self.name, values, formats)
                reply()
                return
            except psycopg.Error as error:
                if not pool.lost_prepared_statement(error, conn):
                    raise
                self._on.pop(conn, None)
        pgconn.send_query_params(self.query, values, None, formats)
        reply()


@contextlib.contextmanager
def guarded(
    conn: psycopg.Connection[tuple[Any, ...]], timeout: float, watchdog: Watchdog | None = None
) -> Iterator[Callable[[], bool]]:
    """Arm a deadline for the statements run inside (on ``watchdog``, by default the process's
    :class:`Deadlines`); yields "did the deadline fire?"."""
    if watchdog is None:
        watchdog = deadlines()
    key, armed = watchdog.arm(conn.fileno(), timeout)
    try:
        yield lambda: armed.fired
    finally:
        watchdog.disarm(key, armed)

"""The PostgreSQL coordinator backend for asyncio: ``await open_async_postgres(url)``.

:class:`AsyncPostgresBackend` implements :class:`~fenced.coordinator.aio_backend.
AsyncCoordinatorBackend` over psycopg 3's ``AsyncConnection`` and a ``psycopg_pool.
AsyncConnectionPool``. It is the asyncio face of :class:`~fenced.coordinator.backends.postgres.
_backend.PostgresBackend`, and shares with it everything but the I/O:

- **The same server-side decisions.** Every operation sends the statement the sync backend
  sends, built by the same function, and reads its answer with the same function (both in
  :mod:`~fenced.coordinator.backends.postgres._plans`, with every step of queueing and waiting
  that needs no I/O: both backends are a ``Face``). Statements run through the same
  ``Statements`` of :mod:`~fenced.coordinator.backends.postgres._statements` (budgets,
  re-sending, error translation), the listener is the same ``Listening`` of
  :mod:`~fenced.coordinator.backends.postgres._listener`; only sending and waiting differ. So
  every guarantee of the sync module docstring holds here too: expiry by
  the server's clock, epochs durable before a grant returns, first come first served with the
  release handing the resource to the first live waiter, records in commit order. The two faces
  work on the same schema at the same time (a sync release wakes, or hands the lease to, an
  asyncio waiter and the other way round): same tables, channel and payloads.
- **The same URL.** Parsed by the sync backend's code (``lender``, ``_plans.settings``): ``schema``,
  ``timeout``, ``listen``, ``listen_url``, ``pool_size``, ``prepare``, every other parameter
  goes to libpq. Only a URL is accepted (an ``AsyncConnectionPool`` or anything else is a
  :class:`~fenced.ConfigurationError`).
- **The same errors.** :class:`~fenced.Unavailable` when nothing was sent (no connection within
  the budget, a server error on a live connection); :class:`~fenced.OutcomeUnknown` when a
  mutating statement was sent and its connection broke, or its reply did not come within
  ``?timeout=`` (the socket is then shut down, as the sync watchdog does, so a hung server never
  holds a task longer); :class:`~fenced.LeaseLost` from ``renew``, ``proclaim`` and a retried
  request_id; :class:`~fenced.ConfigurationError` for a bad URL, authentication, a missing
  database or privileges, a schema of a newer fenced, and any call after :meth:`aclose`.
  Messages show the URL with its password masked (:func:`fenced.core._urls.redacted`) and never
  an owner secret. An idempotent statement (a grant attempt, enqueue, leave) whose connection
  broke is sent once more on a new connection, never after a timeout.

Set-up: the schema is created or migrated once, by :func:`open_async_postgres`, with the sync
backend's own code (``initialise_schema``: ``migrate`` on a short-lived sync connection) run in
one thread of its own that has ended when the coroutine returns (a second copy of the migration
logic in async statements would be a second place to get it wrong). After that, no thread: the
pool's workers, the listener and the deadlines are tasks and timers of the event loop that
opened the backend, the only loop it may be used from.

Waiting: one LISTEN connection per backend, opened by the first ``enqueue`` or ``watch``, read
by a reader callback of the loop (libpq's own ``consume_input``/``notifies``, as the sync
listener reads) that wakes the waiting tasks of the notified resource (:class:`asyncio.Event`
s) at once, and run by one task that wakes only for the session's own statements. Like the
sync listener it holds its listen lock (a releaser hands the
resource only to a waiter whose listener lives), pings after :data:`LISTEN_PING` seconds of
silence, reopens a dropped connection, proves delivery with a probe NOTIFY and then wakes every
waiting task, which re-checks with ``try_grant``; until delivery is proven, waits last at most
:data:`RECHECK` seconds. A wake-up is never lost: a ticket's event exists from ``enqueue`` on,
so a notification between a blocked ``try_grant`` and the next ``wait`` makes that ``wait``
return at once.

Cancellation: a task cancelled in a call gets :class:`asyncio.CancelledError` and the step
happened or did not. A statement in flight is cancelled on the server (psycopg's
``cancel_safe``; the task waits for the connection to be idle again, up to a few seconds, as
psycopg itself does); a connection that is not idle, outside a transaction, is closed, never
returned to the pool, so no later call sees a transaction left open or aborted. A cancelled
``wait`` or ``watch`` leaves no task behind.

Hot statements: with ``prepare`` on (the default) the grant and release statements are libpq
prepared statements named after their text, as in the sync backend (psycopg's own automatic
preparation is never used, see :class:`~fenced._drivers.postgres.Pool`), sent with libpq's
``send_query_prepared`` and their reply read by a reader callback of the loop
(:class:`_Replies`: the task is woken once, no generator, no timer per statement). As the sync
runner does, the runner keeps one pooled connection lent between statements for one task at a
time (the others borrow from the pool), checked without a round trip before each use; the
deadlines of all statements share one timer of the loop (:class:`LoopDeadlines`). ``?prepare=off``,
or a pooler seen to lose one, sends them unprepared through psycopg.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from types import TracebackType
from typing import Any, Self, TypeVar, cast

import psycopg
from psycopg import generators, pq
from psycopg_pool import AsyncConnectionPool

from fenced._drivers.postgres import (
    Pool,
    checked,
)
from fenced._drivers.postgres_aio import (
    AsyncConn,
    AsyncPool,
    LoopDeadlines,
    async_pool,
    close_quietly,
    dead,
)
from fenced._drivers.postgres_borrowed import lender
from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.postgres import _plans as plans
from fenced.coordinator.backends.postgres._backend import initialise_schema
from fenced.coordinator.backends.postgres._listener import (
    LISTEN_PING,
    LISTEN_QUERY_TIMEOUT,
    PROBE_TIMEOUT,
    Listening,
    Waiting,
    listen_query,
    lock_query,
)
from fenced.coordinator.backends.postgres._statements import (
    _RESEND_CONNECT,
    Call,
    DirectStatement,
    Rows,
    Statements,
    _left,
    _rows,
    never_ran,
    text_params,
)
from fenced.core._errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._token import validate_coordinator_id

__all__ = ["AsyncPostgresBackend", "AsyncPostgresTicket", "open_async_postgres"]

log = logging.getLogger("fenced.coordinator.postgres")

_UNWATCH_TIMEOUT = 1.0  # the best-effort removal of a watcher's row

T = TypeVar("T")


# -- opening ----------------------------------------------------------------------------------


async def open_async_postgres(
    url: str,
    *,
    options: Mapping[str, object] | None = None,
    coordinator_id_for_new: str | None = None,
) -> AsyncPostgresBackend:
    """Open the asyncio PostgreSQL coordinator backend of ``url`` (already resolved).

    The URL and its query parameters are read by the sync backend's code (see the module
    docstring); ``options`` must be None (a URL carries its options in its query string: the
    same error as the sync backend's). Creates or migrates the schema first (one short-lived
    thread, ended when this returns). ``coordinator_id_for_new`` is used only when the schema is
    created here (restores, tests).

    Raises :class:`~fenced.ConfigurationError` for anything but a ``postgresql://`` URL (an
    ``AsyncConnectionPool`` too), a bad URL or option, authentication, a missing database or
    privileges, a schema of a newer fenced; :class:`~fenced.Unavailable` if the server cannot be
    reached within ``connect_timeout``. Cancelling it leaves no connection open (a migration
    already under way finishes in its thread).
    """
    if not isinstance(url, str):
        kind = type(url)
        if isinstance(url, AsyncConnectionPool):
            raise ConfigurationError(
                f"a {kind.__name__} cannot be used by the asyncio PostgreSQL backend (not "
                "supported yet): pass a postgresql:// URL"
            )
        raise ConfigurationError(
            "the asyncio PostgreSQL backend takes a postgresql:// URL, got "
            f"{kind.__module__}.{kind.__qualname__}"
        )
    parsed, sync_lender = lender(url, plans.URL_KEYS, options)
    assert isinstance(sync_lender, Pool)  # a URL's lender; it never opens its pool here
    try:
        found = plans.settings(parsed)
        if coordinator_id_for_new is not None:
            validate_coordinator_id(coordinator_id_for_new)
    except BaseException:
        sync_lender.close()
        raise

    def initialise() -> str:
        try:
            return initialise_schema(
                sync_lender,
                parsed.schema,
                parsed.display,
                found.connect_budget,
                coordinator_id_for_new,
            )
        finally:
            sync_lender.close()

    coordinator_id = await _in_thread(initialise, "fenced-pg-aio-init")
    pool = async_pool(parsed, sync_lender)
    await pool.open()
    listen_conninfo = found.listen_conninfo or parsed.conninfo
    return AsyncPostgresBackend(
        parsed.display,
        parsed.schema,
        coordinator_id,
        found,
        pool,
        partial(_connect_listening, listen_conninfo),
    )


async def _in_thread(fn: Callable[[], T], name: str) -> T:
    """``fn()`` in a thread of its own (not the loop's executor, whose threads outlive the
    call); the thread has ended when this returns or raises. Cancelled, it stops waiting and
    the thread ends by itself."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(cast(T, result))

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as caught:  # raised to the awaiting task
            error = caught
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        return await done
    finally:
        if not done.cancelled():
            while thread.is_alive():  # it is returning: a matter of microseconds
                await asyncio.sleep(0.001)


async def _connect_listening(conninfo: str) -> AsyncConn:
    """A new autocommit connection for LISTEN (``application_name`` gets ``-listen``, as the
    sync listener's)."""
    name = psycopg.conninfo.conninfo_to_dict(conninfo).get("application_name")
    conn: AsyncConn = await psycopg.AsyncConnection.connect(
        conninfo, autocommit=True, application_name=f"{name or 'fenced'}-listen"
    )
    return conn


# -- statements -------------------------------------------------------------------------------


def _result(conn: AsyncConn, results: Sequence[pq.abc.PGresult]) -> pq.abc.PGresult:
    """The last of ``results`` if all succeeded, else the psycopg error psycopg would raise
    (:func:`~fenced._drivers.postgres.checked`)."""
    if not results:
        raise psycopg.OperationalError("the server sent no result")
    for result in results:
        checked(cast(Any, conn), result)
    return results[-1]


_CANCEL_WAIT = 5.0
"""Seconds a cancelled hot statement waits for the server to cancel it (as psycopg waits)."""


class _Replies:
    """The replies of hot statements on one connection, read by a reader callback of the loop:
    no task, no generator, no timer; the awaiting task is woken once, when the reply is
    complete (or the connection failed: the psycopg error).

    On the connection a runner keeps, the callback stays registered between statements
    (:meth:`stop` before psycopg uses the connection or it is given back): input while idle is
    consumed there, and a connection the server closed stops it (it is then dead). A task
    cancelled while waiting does what psycopg does: it asks the server to cancel the statement
    and waits up to :data:`_CANCEL_WAIT` seconds for the connection to be idle again before the
    ``CancelledError`` goes on (a connection still busy is then closed when given back).
    """

    __slots__ = ("_fd", "_loop", "_pgconn", "_reading", "_results", "_waiter", "encoding", "names")

    def __init__(self, conn: AsyncConn, encoding: str, names: set[bytes]) -> None:
        self._loop = asyncio.get_running_loop()
        self._pgconn = conn.pgconn
        try:
            self._fd = conn.pgconn.socket
        except psycopg.Error:  # lost: reply() says so
            self._fd = -1
        self._reading = False
        self._results: list[pq.abc.PGresult] = []
        self._waiter: asyncio.Future[list[pq.abc.PGresult]] | None = None
        self.encoding = encoding
        """The connection's client encoding."""
        self.names = names
        """The names of the hot statements prepared on its server session."""

    def stop(self) -> None:
        """Stop reading (before psycopg uses the connection, or it is given back)."""
        if self._reading:
            self._reading = False
            with contextlib.suppress(OSError, ValueError):
                self._loop.remove_reader(self._fd)

    async def reply(self, conn: AsyncConn) -> list[pq.abc.PGresult]:
        """The results of the statement just sent (libpq's ``send_*``) on ``conn``."""
        pgconn = self._pgconn
        if pgconn.flush():  # rare: it did not fit in the socket's buffer
            self.stop()
            await conn.wait(generators.send(pgconn))
        waiter: asyncio.Future[list[pq.abc.PGresult]] = self._loop.create_future()
        self._waiter = waiter
        if not self._reading:
            try:
                self._loop.add_reader(self._fd, self._input)
            except (OSError, ValueError) as error:  # a closed socket (fd -1: lost already)
                raise psycopg.OperationalError(f"the connection is lost: {error}") from error
            self._reading = True
        if not pgconn.is_busy():  # already read (while flushing)
            self._input()
        try:
            return await waiter
        except asyncio.CancelledError:
            await self._cancelled(conn)
            raise
        finally:
            self._waiter = None

    def _input(self) -> None:
        pgconn = self._pgconn
        try:
            pgconn.consume_input()
            results = self._results
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    break
                results.append(result)
            else:
                return  # the rest of the reply is still to come
        except Exception as error:  # consuming input failed: the connection is lost
            self.stop()
            self._settle(
                error
                if isinstance(error, psycopg.Error)
                else psycopg.OperationalError(f"reading from the server failed: {error}")
            )
            return
        self._results = []
        if results:
            self._settle(results)

    def _settle(self, outcome: list[pq.abc.PGresult] | psycopg.Error) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if isinstance(outcome, psycopg.Error):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)

    async def _cancelled(self, conn: AsyncConn) -> None:
        if self._pgconn.transaction_status != pq.TransactionStatus.ACTIVE or not self._reading:
            return
        self._waiter = self._loop.create_future()
        with contextlib.suppress(Exception):
            await conn.cancel_safe(timeout=_CANCEL_WAIT)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_CANCEL_WAIT):
                await self._waiter


class _AsyncStatements(Statements[AsyncPool]):
    """Runs the coordinator's statements, one transaction and one round trip each, within a
    budget: the asyncio twin of :class:`~fenced.coordinator.backends.postgres._statements.
    StatementRunner`, the same :class:`~fenced.coordinator.backends.postgres._statements.
    Statements` (statements, budgets, re-sending, error translation, prepared statements).

    As the sync runner does, it keeps one pooled connection lent between statements (when the
    pool has more than one): one task at a time runs on it, neither borrowing nor returning a
    connection, the others borrow from the pool. It is checked without a round trip before each
    use, and given back to the pool (closed unless idle outside a transaction) when a statement
    on it failed or was cancelled, and when the runner closes.
    """

    def __init__(self, pool: AsyncPool, url: str, schema: str, found: plans.Settings) -> None:
        super().__init__(pool, url, schema, found)
        self._kept: tuple[AsyncConn, bool, _Replies] | None = None
        self._kept_busy = False
        self._closed = False
        self._deadlines = LoopDeadlines()

    async def call(self, call: Call) -> Rows:
        """Run one statement (see :meth:`StatementRunner.call <fenced.coordinator.backends.
        postgres._statements.StatementRunner.call>`)."""
        doing, _name, _params, _mutation, timeout, idempotent = call
        budget = self.budget(timeout)
        try:
            return await self._send(call, budget, self.connect_budget)
        except OutcomeUnknown as unknown:
            if not self.resend(doing, unknown, idempotent):
                raise
            try:
                return await self._send(call, budget, _RESEND_CONNECT)
            except Unavailable:
                raise unknown from None  # the first attempt's outcome is still unknown

    async def _send(self, call: Call, budget: float, connect_budget: float) -> Rows:
        """One attempt within ``budget`` seconds: a connection (the kept one if no other task
        uses it, else one borrowed for the statement, waiting at most ``connect_budget``), then
        the statement with the time left."""
        deadline = time.monotonic() + budget
        wait = min(connect_budget, budget)
        if not self._kept_busy and self.pool.may_keep and not self._closed:
            self._kept_busy = True
            try:
                kept = self._kept
                if kept is None or dead(kept[0]):
                    kept = await self._keep(wait)
                try:
                    return await self._run(kept[0], call, budget, deadline, kept[2])
                except BaseException:
                    await self._drop_kept()  # closed unless it is idle, else back to the pool
                    raise
            finally:
                self._kept_busy = False
                if self._closed:
                    await self._drop_kept()
        conn, pooled = await self.pool.take(wait)
        try:
            return await self._run(conn, call, budget, deadline, None)
        finally:
            await self.pool.give(conn, pooled)

    async def _keep(self, wait: float) -> tuple[AsyncConn, bool, _Replies]:
        """A connection to keep lent (instead of a dead one, given back first)."""
        await self._drop_kept()
        conn, pooled = await self.pool.take(wait)
        try:
            kept = self._kept = (conn, pooled, _Replies(conn, *self.session(conn)[1:]))
        except BaseException:
            await self.pool.give(conn, pooled)
            raise
        return kept

    async def _drop_kept(self) -> None:
        """Give the kept connection back (the pool closes it unless it is idle)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept[2].stop()
            await self.pool.give(kept[0], kept[1])

    async def aclose(self) -> None:
        """Give back the kept connection (a call in flight on it gives it back when it ends)."""
        self._closed = True
        if not self._kept_busy:
            await self._drop_kept()
        self._deadlines.close()

    async def _run(
        self, conn: AsyncConn, call: Call, budget: float, deadline: float, kept: _Replies | None
    ) -> Rows:
        """The statement on ``conn``, cut at ``deadline`` (the end of the call's ``budget``);
        ``kept``: the replies of the kept connection (None: a borrowed one)."""
        doing, name, params, mutation, _timeout, _idempotent = call
        armed = self._deadlines.arm(conn, _left(doing, self.url, deadline, budget))
        try:
            direct = self.direct.get(name)
            if direct is not None:
                return await self._run_direct(conn, direct, params, kept)
            if kept is not None:
                kept.stop()  # psycopg reads this one
            cursor = await conn.execute(self.queries[name], params)
            return await cursor.fetchall()
        except psycopg.Error as error:
            if conn.broken:
                await self.pool.discard_idle()  # they probably share the same fate
            fired = armed.fired
            raise self.failure(error, doing, budget, mutation=mutation, fired=fired) from error
        finally:
            self._deadlines.disarm(armed)

    async def _run_direct(
        self,
        conn: AsyncConn,
        direct: DirectStatement,
        params: Sequence[object],
        kept: _Replies | None,
    ) -> Rows:
        """A hot statement as libpq's prepared statement named after its text (prepared once
        per server session), text parameters and results, its reply read by :class:`_Replies`
        (``kept``, else one for this statement); unprepared through psycopg with ``prepare``
        off or once a pooler lost one (the statement had not run: sent again)."""
        if not self.pool.prepare:
            if kept is not None:
                kept.stop()
            return await self._unprepared(conn, direct, params)
        replies = kept or _Replies(conn, *self.session(conn)[1:])
        pgconn, names = conn.pgconn, replies.names
        try:
            if direct.name not in names:
                try:
                    pgconn.send_prepare(direct.name, direct.query)
                    _result(conn, await replies.reply(conn))
                except psycopg.OperationalError as error:
                    raise never_ran(error) from error
                names.add(direct.name)
            pgconn.send_query_prepared(direct.name, text_params(params, replies.encoding))
            result = _result(conn, await replies.reply(conn))
        except psycopg.Error as error:
            if not self.lost(error, conn, names, direct):
                raise
            replies.stop()
            return await self._unprepared(conn, direct, params)
        finally:
            if kept is None:
                replies.stop()
        return _rows(result, replies.encoding)

    @staticmethod
    async def _unprepared(
        conn: AsyncConn, direct: DirectStatement, params: Sequence[object]
    ) -> Rows:
        cursor = psycopg.AsyncRawCursor(conn)
        await cursor.execute(direct.query, params, prepare=False)
        return await cursor.fetchall()


# -- the listener -----------------------------------------------------------------------------


class _Subscription(Waiting[asyncio.Event]):
    """What one waiting task listens for (:class:`~fenced.coordinator.backends.postgres.
    _listener.Waiting`, with an ``asyncio.Event``)."""

    __slots__ = ()

    def __init__(self, resource: str, waiter_id: int | None) -> None:
        super().__init__(resource, waiter_id, asyncio.Event())

    async def wait(self, timeout: float) -> None:
        """Until notified (at once if notified since the last wait) or ``timeout`` seconds
        passed (no task is created)."""
        if not self.event.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(timeout, 0.0)):
                    await self.event.wait()
        self.event.clear()


class _AsyncListener(Listening[_Subscription]):
    """One LISTEN connection; wakes the subscriptions of notified resources.

    The asyncio twin of :class:`~fenced.coordinator.backends.postgres._listener.Listener`, the
    same :class:`~fenced.coordinator.backends.postgres._listener.Listening` (states, queries,
    payloads, listen lock and probe), and like it on the raw libpq connection: a reader
    callback of the loop consumes the input and dispatches the notifications at once (no task
    in between), and one task runs the session (LISTEN, the lock, the probe, a ping after
    :data:`LISTEN_PING` seconds of silence), waking only for those. Any failure of the
    connection (terminated, cut, silent past a ping) closes it, and the task connects again
    (backing off up to 1 s, at once after a session that worked), re-LISTENs, proves delivery,
    then wakes every subscription.
    """

    _ready: asyncio.Event

    def __init__(
        self,
        connect: Callable[[], Awaitable[AsyncConn]],
        display: str,
        channel: str,
        probe: Callable[[str], Awaitable[None]],
        *,
        enabled: bool,
    ) -> None:
        super().__init__(display, channel, _Subscription, asyncio.Event, enabled=enabled)
        self._connect = connect
        self._probe = probe
        self._task: asyncio.Task[None] | None = None
        self._established = False
        self._closed = False
        self._stirred = asyncio.Event()  # input came, or the connection failed
        self._broken = asyncio.Event()  # the connection failed (``_lost`` says how)
        self._lost: psycopg.Error | None = None
        self._heard = 0.0  # time.monotonic() of the last input

    async def start(self, timeout: float) -> None:
        """Start the task (once) and wait up to ``timeout`` for its first attempt to end."""
        if self._state == "off" or self._closed:
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"fenced-pg-listen:{self._channel}"
            )
        if not self._ready.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._ready.wait()

    async def aclose(self) -> None:
        """Cancel the task and wait for it to end (its connection closed); wake everyone."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])
        self.wake_all()

    # -- the task -----------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            self._established = False
            try:
                await self._session()
            except Exception as error:  # any failure: reconnect (the task must not die)
                self._failed(error)
            if self._established:  # it worked for a while: reconnect at once
                backoff = 0.05
            self._down()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def _session(self) -> None:
        conn = await self._connect()
        loop = asyncio.get_running_loop()
        pgconn = conn.pgconn
        self._lost = None
        self._broken.clear()
        self._heard = time.monotonic()
        fd = pgconn.socket
        loop.add_reader(fd, self._readable, pgconn, fd)
        try:
            await self._query(pgconn, listen_query(self._channel), LISTEN_QUERY_TIMEOUT)
            await self._lock_key(pgconn)
            try:
                await self._probe(self._probing())
            except FencedError as error:
                self._probe_failed(error)
            while (left := self._probe_left()) > 0:
                await self._input(pgconn, time.monotonic() + left, stop=False)
            self._proven()
            self._established = True
            while True:
                await self._silent(LISTEN_PING)
                await self._query(pgconn, b"SELECT 1", LISTEN_PING)
        finally:
            with contextlib.suppress(OSError, ValueError):
                loop.remove_reader(fd)
            await close_quietly(conn)

    def _readable(self, pgconn: pq.abc.PGconn, fd: int) -> None:
        """The reader callback: consume the input, dispatch its notifications."""
        try:
            pgconn.consume_input()
            self._drain(pgconn)
            if pgconn.status != pq.ConnStatus.OK:
                raise psycopg.OperationalError("the listening connection was closed")
        except Exception as error:  # the connection failed: the session ends
            with contextlib.suppress(OSError, ValueError):
                asyncio.get_running_loop().remove_reader(fd)
            self._lost = (
                error if isinstance(error, psycopg.Error) else psycopg.OperationalError(str(error))
            )
            self._broken.set()
        self._heard = time.monotonic()
        self._stirred.set()

    async def _input(self, pgconn: pq.abc.PGconn, deadline: float, *, stop: bool = True) -> None:
        """Wait for input (read by :meth:`_readable`) until ``deadline``; raise if the
        connection failed, or (``stop``) at the deadline."""
        self._stirred.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                await self._stirred.wait()
        if self._lost is not None:
            raise self._lost
        if stop and time.monotonic() >= deadline and pgconn.is_busy():
            raise psycopg.OperationalError("the listening connection did not answer in time")

    async def _silent(self, seconds: float) -> None:
        """Return after ``seconds`` without input (raise if the connection failed)."""
        while (left := self._heard + seconds - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._broken.wait()
            if self._lost is not None:
                raise self._lost

    async def _query(self, pgconn: pq.abc.PGconn, query: bytes, timeout: float) -> bytes | None:
        """Run ``query`` on the raw connection (as :meth:`Listener._query <fenced.coordinator.
        backends.postgres._listener.Listener._query>`); give up (raise) after ``timeout``
        seconds. The first value of the first row of the last result (None if none)."""
        deadline = time.monotonic() + timeout
        value: bytes | None = None
        pgconn.send_query(query)
        while pgconn.flush():  # rare: a few bytes that did not fit in the socket's buffer
            if time.monotonic() >= deadline:
                raise psycopg.OperationalError("the listening connection did not answer in time")
            await asyncio.sleep(0.001)
        while True:
            while pgconn.is_busy():
                await self._input(pgconn, deadline)
            result = pgconn.get_result()
            if result is None:
                break
            value = self._answer(result)
        self._drain(pgconn)
        return value

    async def _lock_key(self, pgconn: pq.abc.PGconn) -> None:
        """Take the session's listen lock (:attr:`handoff_key`); a new key if ours is taken."""
        self._key_held = False
        for _ in range(4):
            if self._took_key(
                await self._query(pgconn, lock_query(self._key), LISTEN_QUERY_TIMEOUT) == b"t"
            ):
                return


# -- tickets ----------------------------------------------------------------------------------


class AsyncPostgresTicket(plans.QueueTicket[_Subscription]):
    """A place in one resource's queue: a ``waiters`` row plus the waiter's subscription (see
    :class:`~fenced.coordinator.backends.postgres._plans.QueueTicket`). Used by one task at a
    time."""

    __slots__ = ()


# -- the backend ------------------------------------------------------------------------------


class AsyncPostgresBackend(plans.Face[AsyncPostgresTicket, _AsyncListener]):
    """The asyncio coordinator backend on PostgreSQL (see the module docstring).

    Made by :func:`open_async_postgres`; used from the event loop that opened it, by any number
    of its tasks at once. ``async with backend:`` closes it at the end of the block. Every
    statement, answer and I/O-free step is the sync backend's
    (:mod:`~fenced.coordinator.backends.postgres._plans`).
    """

    _ticket_type = AsyncPostgresTicket

    def __init__(
        self,
        url: str,
        schema: str,
        coordinator_id: str,
        found: plans.Settings,
        pool: AsyncPool,
        listen_connect: Callable[[], Awaitable[AsyncConn]],
    ) -> None:
        self._pool = pool
        self._listen_connect = listen_connect
        self._statements = _AsyncStatements(pool, url, schema, found)
        super().__init__(self._statements, listen_enabled=found.listen_enabled)
        self.coordinator_id = coordinator_id

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _send(self, call: Call) -> Rows:
        """Run ``call`` (:meth:`_AsyncStatements.call`); ConfigurationError once closed."""
        self._check_open()
        return await self._statements.call(call)

    # -- leases -------------------------------------------------------------------------------

    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant with epoch = max(last epoch, minimum) + 1 if free and first in line.

        As :meth:`PostgresBackend.try_grant <fenced.coordinator.backends.postgres._backend.
        PostgresBackend.try_grant>`: one round trip (none for a lease a releaser handed to the
        ticket), the same statement, idempotent (sent once more if the connection broke),
        LeaseLost for a request_id whose grant ended, ConfigurationError for one used for
        another resource or a ticket of another backend.
        """
        mine, step = self._attempt(request, ticket)
        if isinstance(step, Granted):
            return step
        sent = self._clock.now()
        return self._answered(request, mine, sent, await self._send(step))

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        """Extend this owner's live lease to ``ttl`` from now (server clock); return ``ttl``.

        LeaseLost(REJECTED) if that lease is not live. Durable. Gives up after a third of
        ``ttl`` (at least 0.2 s): OutcomeUnknown, so a hung connection makes the lease
        UNCERTAIN, not silently HELD.
        """
        rows = await self._send(plans.renew_call(resource, epoch, owner, ttl))
        return plans.renewed(rows, resource, epoch)

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        """End this owner's live lease and hand the resource to the first live waiter (or wake
        it); True if it ended now, False (nothing changed) otherwise."""
        rows = await self._send(plans.release_call(self._direct, resource, epoch, owner))
        return bool(rows[0][0])

    async def current(self, resource: str) -> LeaseInfo | None:
        """The live lease of ``resource`` or None."""
        rows = await self._send(plans.current_call(resource))
        return plans.lease_info(rows, resource, self.coordinator_id)

    async def last_epoch(self, resource: str) -> int:
        """The largest epoch granted or reserved for ``resource`` (0: never)."""
        rows = await self._send(plans.last_epoch_call(resource))
        return int(rows[0][0] or 0)

    async def resources(self) -> list[str]:
        """Every resource that has ever been granted, sorted."""
        return [str(row[0]) for row in await self._send(plans.RESOURCES_CALL)]

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        """Replace the advertised value of this owner's live lease, same epoch; record it.
        LeaseLost(REJECTED) if that lease is not live."""
        rows = await self._send(plans.proclaim_call(resource, epoch, owner, value))
        plans.proclaimed(rows, resource, epoch)

    # -- records ------------------------------------------------------------------------------

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        """Records with ``seq > after`` (of ``resource`` or of all), oldest first; due expiries
        recorded first; for all resources, only up to a gap in ``seq`` that may still fill."""
        rows = await self._send(plans.records_call(resource, after, limit))
        return plans.records_of(rows, resource, after)

    async def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        """Append a record reported by a holder (renewal failure, loss)."""
        await self._send(plans.report_call(resource, epoch, holder, kind, detail))

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        """Suspend until ``resource`` has a record with ``seq > after``, or ``timeout`` passed.

        Woken by NOTIFY (a watcher row tells writers to send one), at the live lease's expiry
        (to detect and record it), and at least every third of the watcher row's keep-alive.
        The row is removed at the end (best effort: it lapses by itself), cancelled or not.
        """
        deadline = time.monotonic() + max(timeout, 0.0)
        listener = self._listener()
        await listener.start(PROBE_TIMEOUT + 1)
        sub = listener.subscribe(resource, None)
        watcher: int | None = None
        try:
            watcher = int((await self._send(plans.watch_start_call(resource)))[0][0])
            while True:
                poll = plans.watch_poll_call(resource, after, watcher)
                changed, watcher, remaining = (await self._send(poll))[0]
                pause = plans.watch_pause(changed, remaining, deadline, listener.healthy)
                if pause is None:
                    return
                await sub.wait(pause)
        finally:
            listener.unsubscribe(sub)
            if watcher is not None:
                with contextlib.suppress(FencedError):
                    await self._send(plans.unwatch_call(resource, watcher, _UNWATCH_TIMEOUT))

    # -- waiting ------------------------------------------------------------------------------

    def _new_listener(self) -> _AsyncListener:
        return _AsyncListener(
            self._listen_connect,
            self.url,
            self._channel,
            self._probe,
            enabled=self._listen_enabled and not self._closed,
        )

    async def _probe(self, nonce: str) -> None:
        await self._send(plans.probe_call(self._channel, nonce))

    async def enqueue(self, request: GrantRequest) -> AsyncPostgresTicket:
        """Take a place at the end of ``request.resource``'s queue (and start listening: the
        first call waits for the listener's first attempt, up to a few seconds)."""
        listener = self._listener()
        await listener.start(PROBE_TIMEOUT + 1)
        sent = self._clock.now()
        rows = await self._send(plans.enqueue_call(request, self._handoff_key(request)))
        return self._queued(request, rows, sent, listener)

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        """Suspend until notified for ``ticket`` or ``timeout`` passed (no database access, no
        thread). Returns at once for an ended ticket, or if a notification came since the last
        wait; at most :data:`RECHECK` seconds while the listener is not proven to receive
        notifications. Cancelled, it leaves nothing behind."""
        sub, timeout = self._waiting(ticket, timeout)
        if sub is not None:
            await sub.wait(timeout)

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue (idempotent, best effort: a row left behind lapses after
        ``QUEUE_KEEPALIVE``); with ``take``, return a lease a releaser handed to this ticket,
        else release it and pass the resource on. None when nothing was handed over, and when
        the step failed (Unavailable, OutcomeUnknown: a handed lease then expires)."""
        mine = self._leaving(ticket)
        rows: Rows = []
        if mine is not None:
            with self._left(mine):
                rows = await self._send(plans.leave_call(mine, take))
        return plans.taken(rows, mine.owner) if mine is not None and take else None

    # -- life cycle ---------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Leave every open ticket's queue (best effort), stop the listener task, close the
        pool and its tasks; afterwards this backend has no task and no thread, and any call
        raises ConfigurationError. Idempotent; a cancelled ``aclose`` may be called again to
        finish."""
        if not self._closed:
            for ticket in self._open_tickets():
                with contextlib.suppress(FencedError):
                    await self.leave(ticket)
            self._closed = True
        listener = self._detach_listener()
        if listener is not None:
            await listener.aclose()
        await self._statements.aclose()
        await self._pool.close()

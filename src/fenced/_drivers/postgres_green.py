"""PostgreSQL connections for sync code run by the event loop (:mod:`fenced._drivers.green`).

:class:`GreenConnection` is a psycopg ``Connection`` whose one waiting point,
``Connection.wait`` (every query, fetch, transaction and COPY of psycopg's sync API goes
through it), awaits psycopg's own ``waiting.wait_async`` on the running loop instead of
blocking the thread: the sync store's statements, unchanged, become non-blocking I/O of the
loop. :class:`GreenLender` lends such connections from an :class:`~fenced._drivers.
postgres_aio.AsyncPool` (psycopg's ``AsyncConnectionPool`` and its tasks), each one wrapping the
``libpq`` connection of a pooled ``AsyncConnection``; the deadlines of its statements are timers
of the loop (:class:`~fenced._drivers.postgres_aio.LoopDeadlines`), never the sync watchdog's
thread, and it declines libpq's blocking calls (:attr:`GreenLender.direct` is False: hot
statements go through psycopg). So a store opened by ``fenced.aio.open_store`` on a
``postgresql://`` URL starts no thread.

Every method must be called from code run by :func:`~fenced._drivers.green.greenlet_spawn` on
the loop the lender was made on; a connection is used by one caller at a time (the lender
lends it to one; psycopg's connection lock is not reentrant across greenlets).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import waiting
from psycopg.abc import PQGen
from psycopg.rows import tuple_row

from fenced._drivers.green import await_only, in_green
from fenced._drivers.postgres import Pool
from fenced._drivers.postgres_aio import (
    Armed,
    AsyncConn,
    AsyncPool,
    LoopDeadlines,
    async_pool,
    close_quietly,
    dead,
    idle,
)
from fenced._drivers.postgres_borrowed import lender
from fenced._drivers.postgres_url import ParsedURL
from fenced.core._errors import ConfigurationError

__all__ = ["GreenConnection", "GreenLender", "green_lender"]

Connection = psycopg.Connection[tuple[Any, ...]]

_SPARES = 2
"""Idle connections a :class:`GreenLender` keeps at hand instead of returning them to the pool
(a store's calls run one at a time: one is in use, one may serve an open reader)."""


class GreenConnection(psycopg.Connection[tuple[Any, ...]]):
    """A sync psycopg connection whose waits are awaited on the loop (see the module doc).

    Made on the ``libpq`` connection of a pooled ``AsyncConnection``, which keeps it open and
    goes back to its pool: the two are never used at once."""

    def wait(
        self, gen: PQGen[Any], interval: float | None = None, timeout: float | None = None
    ) -> Any:
        if timeout is None:
            return await_only(waiting.wait_async(gen, self.pgconn.socket))
        return await_only(waiting.wait_async(gen, self.pgconn.socket, timeout=timeout))


class _Watch:
    """The :class:`~fenced._drivers.postgres.Watchdog` face of a :class:`LoopDeadlines`."""

    def __init__(self) -> None:
        self._deadlines = LoopDeadlines()

    def arm(self, fd: int, timeout: float) -> tuple[int, Armed]:
        return 0, self._deadlines.arm_fd(fd, timeout)

    def disarm(self, key: int, armed: Armed) -> None:
        self._deadlines.disarm(armed)

    def close(self) -> None:
        self._deadlines.close()


class GreenLender:
    """The :class:`~fenced._drivers.postgres.Lender` of green code: an :class:`AsyncPool` whose
    connections are lent as :class:`GreenConnection` s (see the module docstring)."""

    direct = False
    """No blocking libpq call: hot statements go through psycopg (and so through ``wait``)."""
    may_keep = False

    def __init__(self, pool: AsyncPool) -> None:
        self._pool = pool
        self.display = pool.display
        self._faces: weakref.WeakKeyDictionary[AsyncConn, GreenConnection] = (
            weakref.WeakKeyDictionary()
        )
        self._watch = _Watch()
        self._loop = asyncio.get_running_loop()
        self._spares: list[AsyncConn] = []  # idle pooled connections at hand (_SPARES at most)
        self._closed = False

    @property
    def prepare(self) -> bool:
        return self._pool.prepare

    def lost_prepared_statement(self, error: psycopg.Error, conn: Connection) -> bool:
        return self._pool.lost_prepared_statement(error, conn)

    def watchdog(self) -> _Watch:
        return self._watch

    def _face(self, conn: AsyncConn) -> GreenConnection:
        face = self._faces.get(conn)
        if face is None:
            face = GreenConnection(conn.pgconn, tuple_row)
            face.autocommit = True  # as its AsyncConnection (a new face starts with False)
            face.prepare_threshold = None  # as the pool's: see Pool's docstring
            face._pool = conn._pool  # pooled (or not) as its AsyncConnection: never warned of
            self._faces[conn] = face
        return face

    def _lend(self, budget: float) -> tuple[Connection, Callable[[], None]]:
        if not in_green():
            raise ConfigurationError(f"{self.display}: used outside its event loop's store calls")
        conn, pooled = self._spare() or await_only(self._pool.take(budget))
        returned = False

        def give_back() -> None:
            nonlocal returned
            if returned:
                return
            returned = True
            if pooled and len(self._spares) < _SPARES and idle(conn) and not self._closed:
                self._spares.append(conn)  # at hand for the next call, no pool round
            elif in_green():
                await_only(self._pool.give(conn, pooled))
            elif not self._loop.is_closed():  # a reader dropped unclosed: later, on the loop
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._give_later, conn, pooled)

        return self._face(conn), give_back

    def _spare(self) -> tuple[AsyncConn, bool] | None:
        """An idle connection kept at hand, checked without a round trip (a dead one is given
        back to the pool, closed, with every other spare: they share its fate)."""
        while self._spares:
            conn = self._spares.pop()
            if not dead(conn):
                return conn, True
            self._drop_spares(conn)
        return None

    def _drop_spares(self, *more: AsyncConn) -> None:
        dropped, self._spares = [*more, *self._spares], []
        for conn in dropped:
            await_only(close_quietly(conn))
            await_only(self._pool.give(conn, True))

    def _give_later(self, conn: AsyncConn, pooled: bool) -> None:
        self._loop.create_task(self._pool.give(conn, pooled))

    @contextlib.contextmanager
    def connection(self, budget: float) -> Iterator[Connection]:
        conn, give_back = self._lend(budget)
        try:
            yield conn
        finally:
            give_back()

    def lend_dedicated(self, budget: float) -> tuple[Connection, Callable[[], None]]:
        return self._lend(budget)

    def listen_connection(self) -> tuple[Connection, Callable[[], None]]:
        raise ConfigurationError(f"{self.display}: no listening session on the event loop")

    def check_listen(self) -> None:
        raise ConfigurationError(f"{self.display}: no listening session on the event loop")

    def discard_idle(self) -> None:
        self._drop_spares()
        await_only(self._pool.discard_idle())

    def close(self) -> None:
        self._closed = True
        spares, self._spares = self._spares, []
        for conn in spares:
            await_only(self._pool.give(conn, True))
        await_only(self._pool.close())
        self._watch.close()


def green_lender(
    url: object, fenced_keys: Sequence[str], options: Mapping[str, object] | None
) -> tuple[ParsedURL, GreenLender]:
    """:func:`~fenced._drivers.postgres_borrowed.lender` for green code: a URL only (its query
    read by the same code), its pool opened on the running loop. Called inside
    :func:`~fenced._drivers.green.greenlet_spawn`."""
    if not isinstance(url, str):
        raise ConfigurationError("the asyncio face opens a PostgreSQL store from a URL only")
    parsed, sync = lender(url, fenced_keys, options)
    assert isinstance(sync, Pool)  # a URL's; it has opened nothing
    sync.close()
    pool = async_pool(parsed, sync)
    await_only(pool.open())
    return parsed, GreenLender(pool)

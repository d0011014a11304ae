"""asyncio plumbing shared by the PostgreSQL coordinator's asyncio face and the stores' green
runner: a pool of ``AsyncConnection`` s with fenced's errors (:class:`AsyncPool`) and the
deadlines of statements as one timer of the loop (:class:`LoopDeadlines`)."""

from __future__ import annotations

import asyncio
import contextlib
import select
import time
from typing import Any

import psycopg
from psycopg import pq
from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout

from fenced._drivers.postgres import (
    _PROBE_AFTER,
    Pool,
    PreparedSwitch,
    _cut,
    _transient,
    translate,
)
from fenced._drivers.postgres_url import ParsedURL
from fenced.core._errors import ConfigurationError, Unavailable

__all__ = ["Armed", "AsyncConn", "AsyncPool", "LoopDeadlines", "close_quietly", "dead", "idle"]

AsyncConn = psycopg.AsyncConnection[tuple[Any, ...]]


def idle(conn: AsyncConn) -> bool:
    """True if ``conn`` is open, not broken and outside a transaction."""
    pgconn = conn.pgconn
    return (
        pgconn.status != pq.ConnStatus.BAD
        and pgconn.transaction_status == pq.TransactionStatus.IDLE
    )


def dead(conn: AsyncConn) -> bool:
    """True if an idle connection is unusable: closed, or readable (EOF or an error pending).
    No round trip."""
    if not idle(conn):
        return True
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


async def close_quietly(conn: AsyncConn) -> None:
    with contextlib.suppress(Exception):
        await conn.close()


class Armed:
    """One statement's deadline (:meth:`LoopDeadlines.arm`); :attr:`fired`: its socket was cut."""

    __slots__ = ("fd", "fired", "when")

    def __init__(self, fd: int, when: float) -> None:
        self.fd = fd
        self.when = when
        self.fired = False


class LoopDeadlines:
    """Shuts down the socket of a statement still running at its deadline (a blackholed
    network, a hung server): the statement then fails at once, as under the sync backend's
    watchdog (:class:`~fenced._drivers.postgres.Deadlines`). One timer of the loop for all the
    statements of a runner, armed at the earliest deadline (not one timer per statement); no
    task."""

    def __init__(self) -> None:
        self._armed: set[Armed] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._when = float("inf")

    def arm(self, conn: AsyncConn, seconds: float) -> Armed:
        """Arm a deadline ``seconds`` from now for the statement about to run on ``conn``;
        :meth:`disarm` it when the statement is over."""
        try:
            fd = conn.pgconn.socket
        except psycopg.Error:  # already lost: the statement fails by itself
            fd = -1
        return self.arm_fd(fd, seconds)

    def arm_fd(self, fd: int, seconds: float) -> Armed:
        """:meth:`arm` for the connection whose socket is ``fd`` (-1: none)."""
        loop = asyncio.get_running_loop()
        armed = Armed(fd, loop.time() + max(seconds, 0.0))
        self._armed.add(armed)
        if armed.when < self._when:
            self._schedule(loop, armed.when)
        return armed

    def disarm(self, armed: Armed) -> None:
        self._armed.discard(armed)

    def close(self) -> None:
        """Cancel the timer if no statement is armed (else it ends after their deadlines)."""
        if not self._armed and self._timer is not None:
            self._timer.cancel()
            self._timer, self._when = None, float("inf")

    def _schedule(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._when = when
        self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer, self._when = None, float("inf")
        loop = asyncio.get_running_loop()
        now = loop.time()
        for armed in [armed for armed in self._armed if armed.when <= now]:
            self._armed.discard(armed)
            armed.fired = True
            if armed.fd >= 0:
                _cut(armed.fd)
        if self._armed:
            self._schedule(loop, min(armed.when for armed in self._armed))


class AsyncPool(PreparedSwitch):
    """Autocommit connections to one server, at most ``size`` lent at once: a
    ``psycopg_pool.AsyncConnectionPool`` (its scheduler and worker are tasks) plus fenced's
    errors, as :class:`~fenced._drivers.postgres.Pool` does for threads.

    A connection is checked without a round trip before it is lent (a dead one is closed with
    every idle one). When the pool lends nothing within a moment while some connections are
    free, a direct connection is tried: it serves the operation if it connects, its error is
    translated if it fails for good (a wrong password: ConfigurationError), a refused or
    starting server is tried again until the budget is spent (then Unavailable). With every
    connection lent it only waits, then Unavailable. A connection given back that is not idle
    outside a transaction (cut, cancelled, broken) is closed: the pool replaces it.
    """

    def __init__(
        self, conninfo: str, *, display: str, size: int, connect_timeout: float, prepare: bool
    ) -> None:
        super().__init__(prepare)
        self.conninfo = conninfo
        self.display = display
        self.size = size
        self.connect_timeout = connect_timeout
        self._inner: AsyncConnectionPool[AsyncConn] | None = None
        self._lent = 0
        self._closed = False

    @property
    def may_keep(self) -> bool:
        """Whether the runner may keep one connection lent between statements (as
        :attr:`Pool.may_keep <fenced._drivers.postgres.Pool.may_keep>`: not the only one)."""
        return self.size > 1

    async def open(self) -> None:
        inner: AsyncConnectionPool[AsyncConn] = AsyncConnectionPool(
            self.conninfo,
            kwargs={"autocommit": True, "prepare_threshold": None},  # see Pool's docstring
            min_size=0,
            max_size=self.size,
            open=False,
            check=self._check,
            name=f"fenced-pg-aio:{self.display}",
            timeout=self.connect_timeout,
            reconnect_timeout=self.connect_timeout,
            num_workers=1,
        )
        await inner.open(wait=False)
        self._inner = inner

    async def _check(self, conn: AsyncConn) -> None:
        if dead(conn):
            await close_quietly(conn)  # the pool replaces a closed connection
            await self.discard_idle()
            raise psycopg.OperationalError("the idle connection was closed by the server")

    async def take(self, budget: float) -> tuple[AsyncConn, bool]:
        """A connection within ``budget`` seconds: pooled (True) or direct (False)."""
        inner = self._inner
        if inner is None or self._closed:
            raise ConfigurationError(f"the connection pool of {self.display} is closed")
        deadline = time.monotonic() + budget
        wait = min(budget, _PROBE_AFTER)
        while True:
            try:
                conn = await inner.getconn(timeout=max(wait, 0.001))
            except PoolTimeout:
                pass
            except PoolClosed as error:
                raise ConfigurationError(
                    f"the connection pool of {self.display} is closed"
                ) from error
            else:
                self._lent += 1
                return conn, True
            remaining = deadline - time.monotonic()
            if self._lent >= self.size:  # only waiting helps
                if remaining <= 0:
                    raise Unavailable(
                        f"{self.display}: all {self.size} pooled connections stayed busy for "
                        f"{budget:g}s; nothing was sent (raise ?pool_size=)"
                    )
                wait = remaining
                continue
            if remaining <= 0:
                raise self._no_connection(budget)
            try:
                async with asyncio.timeout(remaining):
                    direct: AsyncConn = await psycopg.AsyncConnection.connect(
                        self.conninfo, autocommit=True, prepare_threshold=None
                    )
            except TimeoutError:
                raise self._no_connection(budget) from None
            except psycopg.Error as error:
                if not _transient(error) or deadline - time.monotonic() <= 0:
                    raise translate(error, "connecting", sent=False, where=self.display) from error
            else:
                return direct, False
            wait = min(max(deadline - time.monotonic(), 0.0), wait * 2, 0.5)

    def _no_connection(self, budget: float) -> Unavailable:
        return Unavailable(
            f"connecting ({self.display}): no connection within {budget:g}s; nothing was "
            "changed, retry"
        )

    async def give(self, conn: AsyncConn, pooled: bool) -> None:
        """Give back what :meth:`take` lent: a direct connection is closed; a pooled one goes
        back to the pool, closed first unless it is idle outside a transaction."""
        if not pooled:
            await close_quietly(conn)
            return
        self._lent -= 1
        if not idle(conn):
            await close_quietly(conn)
        if self._inner is not None:
            await self._inner.putconn(conn)  # a closed pool closes it

    async def discard_idle(self) -> None:
        """Close every idle connection (a failure suggests they are all stale); lent ones are
        closed when they come back."""
        inner = self._inner
        if inner is not None and not self._closed:
            await inner.drain()

    async def close(self) -> None:
        """Close the pool: idle connections now, lent ones when they come back; its tasks
        end. Idempotent."""
        self._closed = True
        if self._inner is not None:
            await self._inner.close(timeout=1.0)


def async_pool(parsed: ParsedURL, sync: Pool) -> AsyncPool:
    """The :class:`AsyncPool` of a URL, sized and configured as the sync :class:`Pool` that
    :func:`~fenced._drivers.postgres_borrowed.lender` made of it (never opened); not opened."""
    return AsyncPool(
        parsed.conninfo,
        display=parsed.display,
        size=sync.size,
        connect_timeout=parsed.connect_timeout,
        prepare=sync.prepare,
    )

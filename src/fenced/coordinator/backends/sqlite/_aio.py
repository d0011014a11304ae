"""The asyncio face of the embedded coordinator (``sqlite:``).

**Statements on the loop, or on one worker thread.** SQLite has no asynchronous interface. Every
step is the sync :class:`~.SQLiteBackend`'s (the same statements, hand-offs and wake-ups), run
in the order the tasks asked for them:

- by default **on the event loop's thread**, as a sync call would run: a step blocks the loop
  for its statement, a grant for its commit and fsync (about 0.2-0.5 ms on a local SSD; a
  slow or network disk makes that its flush time), and a step that meets another process's
  write transaction waits for it (they are short). A cycle then costs what the sync face's
  costs: handing each statement to a thread and back costs more than the statement itself
  (about 175 µs per hand-over on the 2-core machine of benchmarks/RESULTS.md).
- with ``offload=True`` (``fenced.aio.connect(url, offload=True)``) **on one worker thread**
  owned by this backend: the loop is never blocked by a statement or a disk flush, at the
  price of that hand-over per step. Choose it where the loop's latency matters more than the
  lease cycle's (a web server on a slow disk).

**Waiting holds no thread.** A waiter's ticket has its datagram socket (:mod:`._wakeup`), as in
the sync face; here the socket is registered with the event loop's selector
(``loop.add_reader``), so the loop's one epoll wakes every waiting task of the process —
1,000 waiting tasks cost 1,000 sockets and no thread. The same holds for ``watch``. A wait's
datagrams are read by the selector's callback as they arrive (:class:`_Waiting`): a hand-off
being prepared keeps the wait going without waking the task, which runs once, when its grant has
come; the reader is removed after the task has run (off the hand-off's path), from a duplicate
of the socket's descriptor, so a ticket that ended meanwhile cannot lose a later wait's reader.

Cancellation: a step is never interrupted (SQLite statements are not): on the loop it is over
before the cancellation can arrive; on the worker thread the cancelled task gets
``CancelledError`` at once while the step runs to its end, so it happened or not exactly as with
a lost reply. ``aclose`` leaves every open ticket's queue, closes the database and ends the
thread, if any.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
from fenced.coordinator.backends.sqlite._waiting import SQLiteTicket, WaitingQueue
from fenced.coordinator.backends.sqlite._wakeup import WakeSocket
from fenced.core._errors import ConfigurationError
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._tasks import Worker, completed

__all__ = ["AsyncSQLiteBackend", "open_async_sqlite"]

T = TypeVar("T")


async def open_async_sqlite(
    path: str | Path, *, create: bool = True, offload: bool = False
) -> AsyncSQLiteBackend:
    """Open (or create) the embedded coordinator at ``path`` for asyncio use; with ``offload``
    its statements (and the opening) run on a worker thread of its own."""
    if not offload:
        return AsyncSQLiteBackend(SQLiteBackend(path, create=create), None)
    worker = Worker(f"fenced-sqlite:{path}")
    try:
        sync = await worker.run(lambda: SQLiteBackend(path, create=create))
    except BaseException:
        worker.stop()
        raise
    return AsyncSQLiteBackend(sync, worker)


class AsyncSQLiteBackend:
    """:class:`~fenced.coordinator.aio_backend.AsyncCoordinatorBackend` of ``sqlite:`` (see the
    module docstring). Use it on one event loop."""

    def __init__(self, sync: SQLiteBackend, worker: Worker | None) -> None:
        self._sync = sync
        self._worker = worker
        self.url = sync.url
        self.coordinator_id = sync.coordinator_id
        self.capabilities = sync.capabilities
        self.inline = worker is None
        """True when the steps run on the loop's thread: each runs to its end without suspending
        (the waits aside), so none can be cancelled half way."""
        self._closed = False

    def __repr__(self) -> str:
        return f"AsyncSQLiteBackend({self.url!r})"

    async def _run(self, step: Callable[[], T]) -> T:
        if self._closed:
            raise ConfigurationError(f"{self.url}: the coordinator is closed")
        if self._worker is None:
            return step()
        return await self._worker.run(step)

    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        return await self._run(lambda: self._sync.try_grant(request, ticket))

    async def enqueue(self, request: GrantRequest) -> Ticket:
        return await self._run(lambda: self._sync.enqueue(request))

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        """Suspend until the ticket's socket is woken or ``timeout`` passed (no thread).

        The datagrams are read by the selector's callback, as they arrive: a hand-off being
        prepared keeps the wait going (for its grant, as the sync face's second wait does)
        without waking the task, so the task runs once, when there is something to do."""
        mine = self._sync.waiting(ticket)
        if mine is None:
            return
        try:
            await _Waiting(self._sync, mine, timeout).done
        finally:
            mine._prepared = False

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        return await self._run(lambda: self._sync.leave(ticket, take))

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return await self._run(lambda: self._sync.renew(resource, epoch, owner, ttl))

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        return await self._run(lambda: self._sync.release(resource, epoch, owner))

    async def current(self, resource: str) -> LeaseInfo | None:
        return await self._run(lambda: self._sync.current(resource))

    async def last_epoch(self, resource: str) -> int:
        return await self._run(lambda: self._sync.last_epoch(resource))

    async def resources(self) -> list[str]:
        return await self._run(self._sync.resources)

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        await self._run(lambda: self._sync.proclaim(resource, epoch, owner, value))

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        return await self._run(lambda: self._sync.records(resource, after, limit))

    async def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        await self._run(lambda: self._sync.report(resource, epoch, holder, kind, detail))

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        """Suspend until ``resource`` has a record after ``after`` or ``timeout`` passed; woken
        by a datagram on a socket the event loop watches (and at the live lease's expiry)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        sock = WakeSocket()
        try:
            row_id = await self._run(lambda: self._sync.start_watching(resource, sock, timeout))
            try:
                while True:
                    left = deadline - loop.time()
                    pause = await self._run(
                        functools.partial(self._sync.watch_pause, resource, after, left)
                    )
                    if pause <= 0:
                        return
                    await _readable(sock, pause)
            finally:
                if not self._closed:
                    await completed(
                        self._run(lambda: self._sync.stop_watching(resource, row_id)), "unwatching"
                    )
        finally:
            sock.close()

    async def aclose(self) -> None:
        """Leave open tickets' queues, close the database, end the worker thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._worker is None:
            self._sync.close()
            return
        try:
            await self._worker.run(self._sync.close)
        finally:
            await self._worker.aclose()


class _Waiting:
    """One wait of a ticket: the sync face's two waits (:meth:`SQLiteBackend.wait`) as selector
    and timer callbacks; :attr:`done` is completed once, when the wait is over."""

    def __init__(self, sync: SQLiteBackend, ticket: SQLiteTicket, timeout: float) -> None:
        self._sync = sync
        self._ticket = ticket
        self._loop = loop = asyncio.get_running_loop()
        self._deadline = loop.time() + timeout
        self._first = True
        self.done: asyncio.Future[None] = loop.create_future()
        self._fd = fd = ticket._socket.fileno()
        if fd < 0:
            self._timer = loop.call_soon(self._over, False)
            return
        # The loop watches a duplicate of the socket's descriptor, closed by _stop: the ticket
        # may end (its socket closed) before _stop runs, and its number be reused meanwhile.
        self._fd = fd = os.dup(fd)
        loop.add_reader(fd, self._over, True)
        self._timer = loop.call_later(max(timeout, 0.0), self._over, False)
        self.done.add_done_callback(self._cancelled)

    def _over(self, woken: bool) -> None:
        if self.done.done():
            return
        ticket = self._ticket
        if woken:
            ticket._socket.drain()
        if not self._first:
            WaitingQueue._read_messages(ticket)
            self._finish()
            return
        self._first = False
        ticket._notified = woken
        patience = self._sync.woken(ticket)
        if patience is None:
            self._finish()
            return
        self._timer.cancel()
        left = self._deadline - self._loop.time()
        self._timer = self._loop.call_later(max(0.0, min(left, patience)), self._over, False)

    def _finish(self) -> None:
        # The task runs first; the reader and the timer go after it (off the hand-off's path):
        # a readable socket meanwhile finds the wait over and leaves its datagrams queued.
        self.done.set_result(None)
        self._loop.call_soon(self._stop)

    def _cancelled(self, done: asyncio.Future[None]) -> None:
        if done.cancelled():
            self._stop()

    def _stop(self) -> None:
        self._timer.cancel()
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1


async def _readable(sock: WakeSocket, timeout: float) -> bool:
    """Wait until ``sock`` has a datagram (consumed) or ``timeout``; True if one came.

    The selector's callback completes the future the task awaits, so a wake-up reaches the task
    in one turn of the loop (``asyncio.wait_for`` would add two)."""
    fd = sock.fileno()
    if fd < 0:
        return False
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[bool] = loop.create_future()
    loop.add_reader(fd, _answer, ready, True)
    timer = loop.call_later(max(timeout, 0.0), _answer, ready, False)
    try:
        woken = await ready
    finally:
        timer.cancel()
        loop.remove_reader(fd)
    if woken:
        sock.drain()
    return woken


def _answer(future: asyncio.Future[bool], woken: bool) -> None:
    if not future.done():
        future.set_result(woken)

"""The asyncio face of stores: ``await fenced.aio.open_store(url)`` and :class:`AsyncStore`.

An :class:`AsyncStore` is the sync :class:`~fenced.fence.Store` run on **one worker thread of
its own** (PostgreSQL: on the loop, see below): every call is handed to that thread, in the
order it was made, and awaited. So every SQLite statement and every ``fsync`` of the ``file:``
store happens off the event loop, calls of one store never overlap (the worker runs them one
after the other, in order), and the behaviour is the sync store's, not a second copy of it.
Before a call is handed over, its arguments are checked **on the loop** by the same functions
the sync store uses (:func:`fenced.fence._store.check_put` and its siblings), so bad input raises
the same exception, with the same message, without touching the thread.

``publish`` takes what the sync one takes (bytes, an ``os.PathLike`` path — a ``str`` is
refused, as there — or a binary stream, read on the worker) and also an **async iterator of
bytes**: that is consumed on the loop, and its chunks are handed to the worker through a
bounded queue (:data:`PIPE_CHUNKS` chunks at most; the loop waits for room), where they feed the
sync publish as a stream read in the sync store's 1 MiB pieces. The data is never buffered
whole.

Cancellation: a call cancelled before the worker started it never runs. A call that had
started runs to its end (or fails) on the worker; the awaiting task gets
:class:`asyncio.CancelledError` at once, and the store's own atomicity means nothing is
half-written: a cancelled ``publish`` from an async iterator stops reading, its staging fails,
the staged bytes are removed and the pointer never moves. Calls made after it run after it.

:meth:`AsyncStore.aclose` (or ``async with``) runs the sync ``close`` on the worker after the
calls already made, then ends the thread and joins it; it is idempotent, and later calls raise
:class:`~fenced.ConfigurationError`. A store that is dropped unclosed is closed by its worker
when it is garbage collected.

**PostgreSQL** stores (a ``postgresql://`` URL) run on the event loop instead, with no thread:
a :class:`GreenRunner` runs each call of the sync store in a greenlet
(:mod:`fenced._drivers.green`) whose every wait for the server is awaited on the loop, over
psycopg ``AsyncConnection`` s (:mod:`fenced._drivers.postgres_green`); statement deadlines are
timers of the loop. The calls keep the rules above: one at a time, in order, a started call runs
to its end (in a task of its own), a call cancelled before it started never runs. A store's calls
queue behind one another where the sync store would let threads run them side by side on its
connection pool: open several stores for parallel PostgreSQL writes. A user's psycopg pool or
SQLAlchemy engine (not a URL) runs on a worker thread, as the local stores do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import os
import queue
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable, Coroutine, Mapping
from functools import partial
from typing import IO, Any, BinaryIO, Final, Protocol, TypeVar, cast

from fenced._drivers.green import await_only, greenlet_spawn
from fenced.core._clock import Clock
from fenced.core._closing import AsyncClosing
from fenced.core._errors import ConfigurationError
from fenced.core._names import validate_resource
from fenced.core._records import Record
from fenced.core._tasks import Worker
from fenced.core._token import FencingToken
from fenced.fence import _registry as registry
from fenced.fence import _store as sync
from fenced.fence._source import CHUNK_SIZE, Source
from fenced.fence._values import Item, Mode, Publication, Version
from fenced.fence.backend import DEFAULT_RECORD_LIMIT, DEFAULT_RECORD_RETENTION

__all__ = [
    "PIPE_CHUNKS",
    "THREAD_PREFIX",
    "AsyncPublishData",
    "AsyncReader",
    "AsyncStore",
    "GreenRunner",
    "Runner",
    "open_store",
]

AsyncPublishData = (
    bytes
    | bytearray
    | memoryview
    | os.PathLike[str]
    | IO[bytes]
    | AsyncIterable[bytes | bytearray | memoryview]
)
"""What :meth:`AsyncStore.publish` accepts: the sync ``publish``'s data, or an async iterator
(or iterable) of bytes."""

PIPE_CHUNKS: Final = 8
"""At most this many chunks of an async iterator wait for the worker thread (back-pressure)."""

_T = TypeVar("_T")
_names = itertools.count(1)
THREAD_PREFIX: Final = "fenced-aio-store-"
"""The name of every worker thread starts with this (then a number)."""


async def open_store(
    url: str | object,
    mode: Mode | None = None,
    *,
    op_retention: float = sync.DEFAULT_OP_RETENTION,
    gc_grace: float = sync.DEFAULT_GC_GRACE,
    busy_timeout: float = sync.DEFAULT_BUSY_TIMEOUT,
    clock: Clock | None = None,
    record_retention: float = DEFAULT_RECORD_RETENTION,
    record_limit: int = DEFAULT_RECORD_LIMIT,
    options: Mapping[str, object] | None = None,
    create: bool = True,
) -> AsyncStore:
    """:func:`fenced.open_store`, awaited: the same arguments, checks and errors.

    The options are checked on the loop (a bad one starts no thread); the store is opened on
    the new store's worker thread. Close it with ``await store.aclose()`` or ``async with``.
    """
    validated = sync.check_open(
        url,
        mode,
        op_retention=op_retention,
        gc_grace=gc_grace,
        busy_timeout=busy_timeout,
        clock=clock,
        record_retention=record_retention,
        record_limit=record_limit,
        options=options,
        create=create,
    )
    green = registry.kind_of(url)[1].runs_green(url)
    worker: Runner = GreenRunner() if green else Worker(f"{THREAD_PREFIX}{next(_names)}")
    opening = worker.submit(partial(sync.open_checked, url, mode, validated, green=green))
    try:
        store = await asyncio.wrap_future(opening)
    except BaseException as error:
        # failed, or cancelled (an open that had started ends on the worker): close what it
        # opened, if anything, and end the thread
        worker.submit(partial(_close_opened, opening))
        worker.stop()
        if not isinstance(error, asyncio.CancelledError):
            worker.join()  # idle: the open is over
        raise
    return AsyncStore(store, worker)


class Runner(Protocol):
    """Where an :class:`AsyncStore` runs the sync store's calls, one at a time, in order: a
    :class:`~fenced.core._tasks.Worker` thread, or a :class:`GreenRunner`."""

    def submit(self, call: Callable[[], _T]) -> concurrent.futures.Future[_T]: ...

    async def run(self, call: Callable[[], _T]) -> _T: ...

    def stop(self) -> None: ...

    def join(self) -> None: ...


class GreenRunner:
    """The :class:`Runner` of a store whose backend does its I/O on the event loop (PostgreSQL,
    :mod:`fenced._drivers.green`): each call is run by :func:`~fenced._drivers.green.
    greenlet_spawn` in a task of its own, after the calls submitted before it (one at a time:
    an ``asyncio.Lock``, first come first served). No thread.

    As with the worker thread, a call cancelled before it started never runs, and one that
    started runs to its end (its task is not the caller's: the caller's cancellation does not
    reach it). Made and used on one event loop; :meth:`submit` from another thread (a
    finalizer) is handed to the loop, or dropped if the loop is closed.
    """

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._turn = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def submit(self, call: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        if here:
            self._start(call, future)
        else:
            try:
                self._loop.call_soon_threadsafe(self._start, call, future)
            except RuntimeError:  # the loop is closed: nothing can run it
                future.cancel()
        return future

    def _start(self, call: Callable[[], _T], future: concurrent.futures.Future[_T]) -> None:
        def settle(value: _T | None, error: BaseException | None) -> None:
            if error is None:
                future.set_result(cast(_T, value))
            else:
                future.set_exception(error)

        self._spawn(self._job(call, future.set_running_or_notify_cancel, settle))

    async def run(self, call: Callable[[], _T]) -> _T:
        """``call()`` after the calls submitted before it, awaited: :meth:`submit` without its
        thread-safe future (the caller's future is the job's; cancelling the caller cancels
        it, which the job sees before it starts, and ignores once it has)."""
        result: asyncio.Future[_T] = self._loop.create_future()

        def settle(value: _T | None, error: BaseException | None) -> None:
            if result.done():  # its caller was cancelled meanwhile
                return
            if error is None:
                result.set_result(cast(_T, value))
            else:
                result.set_exception(error)

        self._spawn(self._job(call, lambda: not result.cancelled(), settle))
        return await result

    def _spawn(self, job: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _job(
        self,
        call: Callable[[], _T],
        begin: Callable[[], bool],
        settle: Callable[[_T | None, BaseException | None], None],
    ) -> None:
        """Run ``call`` in its turn unless ``begin()`` says it was cancelled before; hand its
        outcome to ``settle``."""
        async with self._turn:
            if not begin():
                return
            try:
                value = await greenlet_spawn(call)
            except BaseException as error:  # handed to the caller
                settle(None, error)
                if isinstance(error, asyncio.CancelledError):
                    raise
            else:
                settle(value, None)

    def stop(self) -> None:
        """Nothing to end: the calls are tasks of the loop."""

    def join(self) -> None:
        """Nothing to wait for (no thread)."""


class AsyncStore(AsyncClosing, sync.StoreIdentity):
    """A fenced store for asyncio: :class:`fenced.fence.Store`'s methods, awaited (see the
    module docstring). Made by :func:`open_store`. Any number of tasks may use it at once.
    ``url``, ``mode`` and ``capabilities`` are the sync store's."""

    _shown_as = "fenced.aio.AsyncStore"

    def __init__(self, store: sync.Store, worker: Runner) -> None:
        self._store = store
        self._worker = worker
        self._closed = False
        self._closing: concurrent.futures.Future[None] | None = None
        self._readers: weakref.WeakSet[AsyncReader] = weakref.WeakSet()
        self._finalizer = weakref.finalize(self, _abandon, worker, store)

    def _described(self) -> sync.Store:
        return self._store

    # -- mutations -------------------------------------------------------------------------

    async def fence(self, token: FencingToken) -> int:
        """:meth:`fenced.fence.Store.fence`: install ``token.epoch``; return the floor."""
        token = sync.check_fence(token)
        return await self._run(partial(self._store.fence, token))

    async def put(
        self,
        token: FencingToken,
        key: str,
        value: bytes | bytearray | memoryview,
        *,
        op_id: str | None = None,
        if_version: int | None = None,
    ) -> Version:
        """:meth:`fenced.fence.Store.put`. The value is copied when the call is made."""
        token, key, data, op_id, if_version = sync.check_put(token, key, value, op_id, if_version)
        return await self._run(
            partial(self._store.put, token, key, data, op_id=op_id, if_version=if_version)
        )

    async def publish(
        self,
        token: FencingToken,
        data: AsyncPublishData,
        *,
        name: str = "",
        op_id: str | None = None,
    ) -> Publication:
        """:meth:`fenced.fence.Store.publish`; ``data`` may also be an async iterator (or
        iterable) of bytes, consumed on the loop and streamed to the worker with back-pressure.

        Do not change a ``bytearray`` (or what a ``memoryview`` shows) before this returns: it
        is read on the worker. Chunks of an async iterator are copied as they are taken.
        """
        token, name, op_id = sync.check_publish(token, name, op_id)
        if not isinstance(data, AsyncIterable):  # anything with __aiter__
            Source(data)  # the sync store's check of the data's type; opens nothing
            return await self._run(
                partial(self._store.publish, token, data, name=name, op_id=op_id)
            )
        self._check_open()
        pipe = _Pipe(asyncio.get_running_loop(), green=isinstance(self._worker, GreenRunner))
        reader = cast(BinaryIO, pipe)  # what the sync publish reads: read(n) -> bytes
        work = asyncio.wrap_future(
            self._worker.submit(partial(self._store.publish, token, reader, name=name, op_id=op_id))
        )
        feeding = asyncio.ensure_future(pipe.feed(aiter(data)))
        both: list[asyncio.Future[Any]] = [work, feeding]
        try:
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if not feeding.done():  # the publish ended without all the data: a refusal
                feeding.cancel()
                await asyncio.wait({feeding})
                return await work
            failure = feeding.exception()
            if failure is not None:  # the data failed: the publish fails reading it
                pipe.abort()
                await asyncio.wait({work})
                if not work.cancelled():
                    work.exception()  # retrieved: the data's own error is the one reported
                raise failure
            return await work
        except asyncio.CancelledError:
            feeding.cancel()
            pipe.abort()  # a started publish fails reading; its staged bytes are removed
            work.cancel()  # one that had not started never runs
            raise

    async def gc(self, keep: int = 1, grace: float | None = None) -> int:
        """:meth:`fenced.fence.Store.gc`: remove unreferenced objects; return how many."""
        keep, checked = sync.check_gc(keep, grace)
        return await self._run(partial(self._store.gc, keep, checked))

    async def rebind(
        self, resource: str, coordinator_id: str, *, previous: str | None = None, ceiling: int
    ) -> str | None:
        """:meth:`fenced.fence.Store.rebind` (an operator's step; see there)."""
        sync.check_rebind(resource, coordinator_id, previous, ceiling)
        return await self._run(
            partial(
                self._store.rebind, resource, coordinator_id, previous=previous, ceiling=ceiling
            )
        )

    # -- reads -----------------------------------------------------------------------------

    async def binding(self, resource: str) -> str | None:
        """:meth:`fenced.fence.Store.binding`: the coordinator ``resource`` is bound to."""
        validate_resource(resource)
        return await self._run(partial(self._store.binding, resource))

    async def get(self, resource: str, key: str) -> Item | None:
        """:meth:`fenced.fence.Store.get`: the current item of ``key``, or None."""
        sync.check_get(resource, key)
        return await self._run(partial(self._store.get, resource, key))

    async def latest(self, resource: str, name: str = "") -> Publication | None:
        """:meth:`fenced.fence.Store.latest`: the current publication, or None."""
        sync.check_publication(resource, name)
        return await self._run(partial(self._store.latest, resource, name))

    async def read(self, resource: str, name: str = "") -> bytes:
        """:meth:`fenced.fence.Store.read`: the current publication's checked bytes, read
        whole on the worker (use :meth:`open` for large ones)."""
        sync.check_publication(resource, name)
        return await self._run(partial(self._store.read, resource, name))

    async def open(self, resource: str, name: str = "") -> AsyncReader:
        """:meth:`fenced.fence.Store.open`: an :class:`AsyncReader` of the current publication
        (a snapshot, checked as it is read; ``async with``). Raises :class:`~fenced.NotFound`
        if nothing is published under that name."""
        sync.check_publication(resource, name)
        stream = await self._run(partial(self._store.open, resource, name))
        reader = AsyncReader(self, stream)
        self._readers.add(reader)
        return reader

    async def floor(self, resource: str) -> int | None:
        """:meth:`fenced.fence.Store.floor`: the largest epoch accepted or installed."""
        validate_resource(resource)
        return await self._run(partial(self._store.floor, resource))

    async def floors(self) -> dict[str, int]:
        """:meth:`fenced.fence.Store.floors`: every resource with its floor."""
        return await self._run(self._store.floors)

    async def history(self, resource: str, after: int = 0) -> list[Record]:
        """:meth:`fenced.fence.Store.history`: the retained records after ``after``."""
        sync.check_history(resource, after)
        return await self._run(partial(self._store.history, resource, after))

    # -- life cycle ------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the store after the calls already made, end its thread and join it.

        Idempotent; later calls raise :class:`~fenced.ConfigurationError`. Readers still open
        are closed first. Cancelling ``aclose`` does not stop the closing.
        """
        if self._closing is None:
            self._closed = True
            self._finalizer.detach()
            readers = list(self._readers)
            self._closing = self._worker.submit(partial(_close, self._store, readers))
            self._worker.stop()
        closing = self._closing
        try:
            await asyncio.shield(asyncio.wrap_future(closing))
        finally:
            if closing.done():
                self._worker.join()  # its last job is done: it is ending

    # -- the worker ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigurationError(f"the store {self.url} is closed")

    async def _run(self, call: Callable[[], _T]) -> _T:
        """Run ``call`` on the worker (or the green runner), after the calls made before it, and
        await its result."""
        self._check_open()
        return await self._worker.run(call)


class AsyncReader(AsyncClosing):
    """A publication opened by :meth:`AsyncStore.open`: the sync store's checked stream, read
    on the store's worker thread. ``async with`` closes it; ``async for`` yields its bytes in
    chunks of up to 1 MiB. Reads raise :class:`~fenced.CorruptData` as the sync stream does."""

    def __init__(self, store: AsyncStore, stream: BinaryIO) -> None:
        self._store = store
        self._stream = stream

    @property
    def closed(self) -> bool:
        """Whether the reader is closed (by :meth:`aclose`, or by its store's)."""
        return self._stream.closed

    async def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all the rest if negative); ``b""`` at the end. Raises what
        the sync stream's ``read`` raises (ValueError once closed)."""
        return await self._store._run(partial(self._stream.read, size))

    async def aclose(self) -> None:
        """Close the reader (on the worker, after the calls made before). Idempotent."""
        if self._stream.closed or self._store._closed:
            return
        await self._store._run(self._stream.close)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        while chunk := await self.read(CHUNK_SIZE):
            yield chunk


def _close(store: sync.Store, readers: list[AsyncReader]) -> None:
    """On the worker: close the readers still open, then the store."""
    for reader in readers:
        with contextlib.suppress(Exception):  # a reader's close error does not stop the store's
            reader._stream.close()
    store.close()


def _close_opened(opening: concurrent.futures.Future[sync.Store]) -> None:
    """On the worker, after an open whose caller went away: close what it opened."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _abandon(worker: Runner, store: sync.Store) -> None:
    """An unclosed store was garbage collected: its worker closes it and ends."""
    worker.submit(store.close)
    worker.stop()


class _Aborted(Exception):
    """The data of a publish stopped arriving (its caller was cancelled or the data failed)."""


_END: Final = b""


class _Pipe:
    """An async iterator's chunks as a binary stream for the sync publish on the worker.

    The loop puts chunks (:meth:`feed`); a slot of :data:`PIPE_CHUNKS` is taken for each and
    given back when the worker takes the chunk, so at most that many wait. ``read(n)`` on the
    worker blocks until it has ``n`` bytes or the end, as a file's would.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, green: bool = False) -> None:
        self._loop = loop
        self._slots = asyncio.Semaphore(PIPE_CHUNKS)
        self._pending = memoryview(_END)
        self._ended = False
        self._put: Callable[[bytes | _Aborted], None]
        self._take: Callable[[], bytes | _Aborted]
        self._freed: Callable[[], None]
        if green:  # the reader is green code on the loop: it awaits the queue
            waiting: asyncio.Queue[bytes | _Aborted] = asyncio.Queue()
            self._put = waiting.put_nowait
            self._take = lambda: await_only(waiting.get())
            self._freed = self._slots.release
        else:
            chunks: queue.SimpleQueue[bytes | _Aborted] = queue.SimpleQueue()
            self._put, self._take = chunks.put, chunks.get
            self._freed = self._freed_threadsafe

    # -- the loop's side -------------------------------------------------------------------

    async def feed(self, chunks: AsyncIterator[bytes | bytearray | memoryview]) -> None:
        """Hand every chunk of ``chunks`` over, then the end."""
        async for chunk in chunks:
            if not isinstance(chunk, bytes | bytearray | memoryview):
                raise ConfigurationError(
                    f"publish takes an async iterator of bytes; it yielded {type(chunk).__name__}"
                )
            data = bytes(chunk)  # a copy: the caller may reuse its buffer
            if not data:
                continue  # an empty chunk is not the end
            await self._slots.acquire()
            self._put(data)
        self._put(_END)

    def abort(self) -> None:
        """Make the worker's next read fail (nothing more will come)."""
        self._put(_Aborted("the data of this publish stopped: it was cancelled"))

    def _freed_threadsafe(self) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody feeds any more
            self._loop.call_soon_threadsafe(self._slots.release)

    # -- the worker's side -----------------------------------------------------------------

    def read(self, size: int = -1) -> bytes:
        parts: list[bytes] = []
        wanted = size if size >= 0 else -1
        while wanted != 0:
            if not self._pending:
                if self._ended:
                    break
                item = self._take()
                if isinstance(item, _Aborted):
                    self._put(item)  # every later read fails too
                    raise item
                if not item:
                    self._ended = True
                    break
                self._freed()
                self._pending = memoryview(item)
            take = len(self._pending) if wanted < 0 else min(wanted, len(self._pending))
            parts.append(bytes(self._pending[:take]))
            self._pending = self._pending[take:]
            if wanted > 0:
                wanted -= take
        return b"".join(parts)

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return False

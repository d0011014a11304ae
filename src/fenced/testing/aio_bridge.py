"""Run sync test code against the asyncio face: :class:`SyncStore` is a sync
:class:`fenced.fence.Store` look-alike over an :class:`fenced.aio.AsyncStore`, each of whose
methods submits a coroutine to an event loop running in a background thread
(:class:`LoopThread`, :func:`asyncio.run_coroutine_threadsafe`) and waits for it.

With it the store conformance suites run **unchanged** on the async face: a store's test module
makes its ``make_store`` fixture open :class:`SyncStore`\\ s::

    @pytest.fixture
    def make_store(self, store_url):
        with LoopThread() as loop:
            opened = []

            def make(mode=None, **options):
                opened.append(open_sync_store(loop, store_url, mode, **options))
                return opened[-1]

            yield make
            for store in opened:
                store.close()

Calls from several threads are fine: each one's coroutine runs on the one loop, and the
store's worker thread runs them in the order they reached it.
"""

from __future__ import annotations

import asyncio
import functools
import io
import threading
from collections.abc import Callable, Coroutine
from typing import Any, BinaryIO, Concatenate, ParamSpec, Self, TypeVar, cast

from fenced.aio._store import AsyncReader, AsyncStore, open_store
from fenced.core._closing import Closing
from fenced.fence import Store
from fenced.fence._store import StoreIdentity
from fenced.fence._values import Mode

__all__ = ["LoopThread", "SyncStore", "open_sync_store"]

_T = TypeVar("_T")
_P = ParamSpec("_P")


class LoopThread:
    """An event loop running in a daemon thread of its own; :meth:`call` runs a coroutine on it
    from any other thread and returns its result (or raises its exception)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="fenced-aio-bridge", daemon=True
        )
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` on the loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        """Stop the loop, join its thread and close it. Idempotent."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _bridged(
    method: Callable[Concatenate[AsyncStore, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[SyncStore, _P], _T]:
    """The :class:`SyncStore` method of an :class:`AsyncStore` coroutine method: the same
    parameters, the coroutine run on the bridge's loop and waited for."""

    @functools.wraps(method)
    def bridged(self: SyncStore, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self._loop.call(method(self.async_store, *args, **kwargs))

    return bridged


class SyncStore(StoreIdentity, Closing):
    """:class:`fenced.fence.Store`'s methods over an :class:`~fenced.aio.AsyncStore` (see the
    module docstring): each the async store's method, with its parameters, waited for.
    ``close`` is ``aclose``; ``open`` returns a sync binary stream over an
    :class:`~fenced.aio.AsyncReader`."""

    def __init__(self, loop: LoopThread, store: AsyncStore) -> None:
        self._loop = loop
        self.async_store = store

    def as_store(self) -> Store:
        """This facade, typed as the :class:`~fenced.fence.Store` whose methods it has (for
        suites annotated with ``Store``)."""
        return cast(Store, self)

    def _described(self) -> AsyncStore:
        return self.async_store

    def __repr__(self) -> str:
        return f"<fenced.testing.aio_bridge.SyncStore over {self.async_store!r}>"

    fence = _bridged(AsyncStore.fence)
    put = _bridged(AsyncStore.put)
    publish = _bridged(AsyncStore.publish)
    gc = _bridged(AsyncStore.gc)
    rebind = _bridged(AsyncStore.rebind)
    binding = _bridged(AsyncStore.binding)
    get = _bridged(AsyncStore.get)
    latest = _bridged(AsyncStore.latest)
    read = _bridged(AsyncStore.read)
    floor = _bridged(AsyncStore.floor)
    floors = _bridged(AsyncStore.floors)
    history = _bridged(AsyncStore.history)
    close = _bridged(AsyncStore.aclose)

    def open(self, resource: str, name: str = "") -> BinaryIO:
        reader = self._loop.call(self.async_store.open(resource, name))
        return cast(BinaryIO, io.BufferedReader(_RawReader(self._loop, reader)))


def open_sync_store(
    loop: LoopThread, url: str | object, mode: Mode | None = None, **options: Any
) -> SyncStore:
    """``await fenced.aio.open_store(url, mode, **options)`` on ``loop``, wrapped (the same
    keyword arguments)."""
    return SyncStore(loop, loop.call(open_store(url, mode, **options)))


class _RawReader(io.RawIOBase):
    """A sync raw stream over an :class:`AsyncReader`."""

    def __init__(self, loop: LoopThread, reader: AsyncReader) -> None:
        super().__init__()
        self._loop = loop
        self._reader = reader

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._loop.call(self._reader.read(len(memoryview(buffer).cast("B"))))
        memoryview(buffer).cast("B")[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self.closed:
            return
        try:
            if not self._loop.loop.is_closed():
                self._loop.call(self._reader.aclose())
        finally:
            super().close()

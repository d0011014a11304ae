"""Small asyncio helpers shared by the asyncio face and its backends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import TypeVar, cast

__all__ = ["Worker", "completed", "settle"]

log = logging.getLogger("fenced")

T = TypeVar("T")


def settle(future: asyncio.Future[None]) -> None:
    """Complete ``future`` unless it is done already (a wake-up that may come twice)."""
    if not future.done():
        future.set_result(None)


async def completed(step: Awaitable[object], what: str) -> None:
    """Run a clean-up ``step`` to its end even if the caller is cancelled meanwhile (the
    caller's ``CancelledError`` then propagates once the step is done). The step's own errors
    are logged at debug level and dropped: a clean-up that fails is left to expiry."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await asyncio.wait({task})
        raise
    except Exception as error:
        log.debug("%s failed: %s", what, error)


class Worker:
    """One daemon thread that runs the calls submitted to it, one at a time, in order: where
    the asyncio face runs what has no asynchronous interface (SQLite statements, fsyncs).

    A call cancelled before it started is skipped; one that started runs to its end (its
    caller already got ``CancelledError``). :meth:`aclose` ends the thread after the calls
    submitted so far and waits for it without blocking the loop (and without another thread).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._work, name=name, daemon=True)
        self.thread.start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        """Queue ``call``; its future is cancelled (and the call skipped) if cancelled in time."""
        future: Future[T] = Future()
        self._jobs.put((call, cast("Future[object]", future)))
        return future

    async def run(self, call: Callable[[], T]) -> T:
        """``call()`` on the thread, awaited."""
        return await asyncio.wrap_future(self.submit(call))

    def stop(self) -> None:
        """End the thread once the calls submitted so far are done (returns at once)."""
        self._jobs.put(None)

    def join(self) -> None:
        """Wait for the thread to end (after :meth:`stop`)."""
        self.thread.join()

    async def aclose(self) -> None:
        """:meth:`stop`, then wait (polling the loop, no thread) until the thread has ended."""
        self.stop()
        while self.thread.is_alive():
            await asyncio.sleep(0.001)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            if future.set_running_or_notify_cancel():  # False: cancelled before it started
                try:
                    result = call()
                except BaseException as error:  # handed to the caller; the worker goes on
                    future.set_exception(error)
                else:
                    future.set_result(result)
            del job, call, future  # hold no result or exception between jobs

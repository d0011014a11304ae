"""The process's helper threads: blocking work that overlaps the caller's own, or that nobody
waits for.

One daemon thread per *lane* and process, started by the lane's first job and kept for the
process's life; jobs of a lane run one at a time, in the order they were queued. A forked child
forgets its parent's threads, queues and lock, and starts its own when it needs one. Used by
publishing (hashing, the directory sync of a staged object: :data:`HELPER`) and by the file
store's gc (unlinking removed objects: :data:`REAPER`).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["DRAIN_AT_EXIT", "HELPER", "REAPER", "Background", "drain", "lane_queue", "later"]

HELPER = "helper"
"""The lane of the jobs a caller waits for (hashing, the directory sync of a publish)."""
REAPER = "reaper"
"""The lane of work nobody waits for (unlinking objects gc has already moved out of sight)."""
DRAIN_AT_EXIT = 5.0
"""Seconds the interpreter's exit waits for the reaper's queued jobs."""


class Background:
    """``call()`` running on ``lane``'s helper thread, after the jobs queued there before it.

    For a blocking system call (an ``fsync``) that can overlap one of the caller's own:
    :meth:`wait` returns once it has finished, or raises what it raised. The thread lives on
    whatever the call raises.
    """

    def __init__(self, call: Callable[[], object], *, lane: str = HELPER) -> None:
        self._call = call
        self._error: BaseException | None = None
        self._done = threading.Lock()
        self._done.acquire()
        lane_queue(lane).put(self._run)

    def _run(self) -> None:
        try:
            self._call()
        except BaseException as error:  # raised by wait(); the helper thread lives on
            self._error = error
        finally:
            self._done.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the call has finished (False if ``timeout`` ran out); raise its exception."""
        if not self._done.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._done.release()
        if self._error is not None:
            raise self._error
        return True


def later(call: Callable[[], object], *, lane: str = REAPER) -> None:
    """Run ``call()`` on ``lane``'s helper thread; nobody waits for it, its errors are dropped.

    Jobs still queued when the interpreter exits are given :data:`DRAIN_AT_EXIT` seconds to
    finish (see :func:`drain`); the rest is left undone, so a job must be one that a later run
    can redo.
    """
    Background(call, lane=lane)


def drain(lane: str = REAPER, timeout: float | None = None) -> bool:
    """Wait until the jobs queued on ``lane`` so far have run; False if ``timeout`` ran out."""
    if lane not in _lanes:
        return True
    return Background(lambda: None, lane=lane).wait(timeout)


_lanes: dict[str, queue.SimpleQueue[Callable[[], None]]] = {}
_starting = threading.Lock()


def lane_queue(lane: str = HELPER) -> queue.SimpleQueue[Callable[[], None]]:
    """The job queue of this process's helper thread for ``lane``, started by its first job.

    Every job must catch its own exceptions (:class:`Background` does).
    """
    jobs = _lanes.get(lane)
    if jobs is None:
        with _starting:
            jobs = _lanes.get(lane)
            if jobs is None:
                jobs = queue.SimpleQueue()
                threading.Thread(
                    target=_run_jobs, args=(jobs,), name=f"fenced-{lane}", daemon=True
                ).start()
                _lanes[lane] = jobs
    return jobs


def _run_jobs(jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
    while True:
        jobs.get()()


def _forget_lanes() -> None:
    global _starting  # noqa: PLW0603 - reset in a forked child
    _lanes.clear()
    _starting = threading.Lock()


os.register_at_fork(after_in_child=_forget_lanes)
atexit.register(drain, REAPER, DRAIN_AT_EXIT)

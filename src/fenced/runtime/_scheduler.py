"""One thread for every held lease of a coordinator: renewal times and local deadlines.

:class:`LeaseScheduler` keeps a heap of what is due next across all the leases a coordinator
holds (as kazoo and tooz keep one thread per client, not one per lock): each lease's next
renewal and its local deadline. At a deadline it signals the loss itself, on its own thread, so
a loss is never late because a renewal call hangs. Renewal *calls* go to a few worker threads
(:data:`RENEWAL_WORKERS`, started on demand), so one renewal that hangs holds up neither other
leases' renewals nor any loss. A process holding 1,000 leases runs one scheduler thread and at
most :data:`RENEWAL_WORKERS` renewal threads per coordinator.

Time is the injected clock's: the scheduler waits with ``clock.wait`` until the soonest entry,
and marks each renewal in flight with ``clock.busy()``, so under a
:class:`~fenced.core._clock.ManualClock` a test's ``settle`` returns only once every renewal it
let run has come back and the scheduler waits again.

Callbacks that run on the scheduler's thread (``on_lost`` at a deadline) hold up the other
leases' deadlines while they run: they must return quickly (set a flag, signal a process).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fenced.core._clock import Clock

__all__ = ["RENEWAL_WORKERS", "LeaseScheduler", "Scheduled"]

log = logging.getLogger("fenced.runtime")

RENEWAL_WORKERS = 4
"""Renewal calls in flight at once per coordinator (each on a thread started when needed)."""

_DEADLINE, _RENEWAL = 0, 1  # at the same instant the deadline is looked at first


class Scheduled(Protocol):
    """What the scheduler asks of a held lease (:class:`~fenced.runtime._keeper.HeldLease`)."""

    def deadline_due(self) -> float | None:
        """Called at (or after) the lease's local deadline: signal the loss if it is lost and
        return None, else return the deadline to look at next (a renewal moved it)."""
        ...

    def renew(self, sent: float) -> float | None:
        """Renew once (on a renewal thread), ``sent`` being when the call was handed over;
        return when to renew next, or None when the lease is lost or being stopped."""
        ...

    @property
    def deadline(self) -> float: ...

    @property
    def active(self) -> bool:
        """False once the lease is stopping or lost: nothing more is scheduled for it."""
        ...


@dataclass
class _Entry:
    """A lease's place in the scheduler: the stamps of its current heap entries (an entry whose
    stamp is not current is skipped), and whether a renewal of it is in flight."""

    lease: Scheduled
    deadline_stamp: int = 0
    renewal_stamp: int = 0
    in_flight: bool = False
    settled: threading.Condition = field(default_factory=threading.Condition)


class _Workers:
    """Daemon threads that run submitted calls, started on demand up to ``limit`` (daemon: a
    renewal hanging at interpreter exit does not hold the exit up, as a
    ``ThreadPoolExecutor``'s worker would)."""

    def __init__(self, limit: int, name: str) -> None:
        self._limit = limit
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # an idle thread takes it
            elif len(self._threads) < self._limit:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads) + 1}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            # else every thread is busy: the call waits in the queue for the first one free
        self._queue.put(call)

    def _run(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                call()
            except Exception:  # a renewal reports its own failures; this is a bug's last net
                log.exception("a renewal task raised")
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._threads)


class LeaseScheduler:
    """The renewal times and local deadlines of many held leases, on one thread (module
    docstring). Thread-safe; the thread starts with the first lease and ends at :meth:`close`.
    """

    def __init__(
        self, clock: Clock, *, workers: int = RENEWAL_WORKERS, name: str = "fenced-leases"
    ) -> None:
        self._clock = clock
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, int, _Entry, int]] = []
        self._order = itertools.count()
        self._entries: dict[int, _Entry] = {}
        self._finished: list[tuple[_Entry, float | None, Callable[[], None]]] = []
        self._workers = _Workers(workers, f"{name}-renewal")
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- what held leases call --------------------------------------------------------------
    def add(self, lease: Scheduled, first_renewal: float) -> None:
        """Keep ``lease``: renew it at ``first_renewal``, look at its deadline when it comes."""
        entry = _Entry(lease)
        with self._cond:
            if self._closed:
                raise RuntimeError("the coordinator's lease scheduler is closed")
            self._entries[id(lease)] = entry
            self._push_deadline(entry)
            self._push_renewal(entry, first_renewal)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def remove(self, lease: Scheduled, timeout: float) -> None:
        """Forget ``lease`` (already not :attr:`~Scheduled.active`), after waiting up to
        ``timeout`` seconds of real time for a renewal of it still in flight."""
        with self._cond:
            entry = self._entries.pop(id(lease), None)
            self._cond.notify_all()
        if entry is not None:
            with entry.settled:
                entry.settled.wait_for(lambda: not entry.in_flight, timeout)

    def close(self) -> None:
        """End the thread and the renewal threads; leases still kept are no longer renewed and
        their deadlines no longer watched. Idempotent."""
        with self._cond:
            self._closed = True
            self._entries.clear()
            self._cond.notify_all()
        self._workers.close()

    @property
    def threads(self) -> int:
        """Threads started so far: the scheduler's (0 or 1) and the renewal threads."""
        return (self._thread is not None) + self._workers.count

    # -- the heap -----------------------------------------------------------------------------
    def _push_deadline(self, entry: _Entry) -> None:
        entry.deadline_stamp += 1
        when = entry.lease.deadline
        heapq.heappush(
            self._heap, (when, _DEADLINE, next(self._order), entry, entry.deadline_stamp)
        )

    def _push_renewal(self, entry: _Entry, when: float) -> None:
        entry.renewal_stamp += 1
        heapq.heappush(self._heap, (when, _RENEWAL, next(self._order), entry, entry.renewal_stamp))

    def _current(self, item: tuple[float, int, int, _Entry, int]) -> bool:
        _, kind, _, entry, stamp = item
        if self._entries.get(id(entry.lease)) is not entry or not entry.lease.active:
            return False
        return stamp == (entry.deadline_stamp if kind == _DEADLINE else entry.renewal_stamp)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                finished, self._finished = self._finished, []
                for entry, next_at, done in finished:
                    if next_at is not None and self._entries.get(id(entry.lease)) is entry:
                        self._push_deadline(entry)  # the renewal moved it
                        self._push_renewal(entry, next_at)
                    done()
                while self._heap and not self._current(self._heap[0]):
                    heapq.heappop(self._heap)
                now = self._clock.now()
                if self._heap and self._heap[0][0] <= now:
                    item = heapq.heappop(self._heap)
                    self._cond.release()
                    try:
                        self._due(item)
                    finally:
                        self._cond.acquire()
                    continue
                soonest = self._heap[0][0] if self._heap else math.inf
                self._clock.wait(self._cond, soonest)

    def _due(self, item: tuple[float, int, int, _Entry, int]) -> None:
        """One heap entry whose time came (called without the scheduler's lock)."""
        _, kind, _, entry, _ = item
        if kind == _DEADLINE:
            again = entry.lease.deadline_due()
            if again is not None:
                with self._cond:
                    if self._current(item):
                        self._push_deadline(entry)
            return
        with entry.settled:
            entry.in_flight = True
        sent = self._clock.now()
        done = self._clock.busy()
        self._workers.submit(lambda: self._renew(entry, sent, done))

    def _renew(self, entry: _Entry, sent: float, done: Callable[[], None]) -> None:
        next_at: float | None = None
        try:
            next_at = entry.lease.renew(sent)
        finally:
            with entry.settled:
                entry.in_flight = False
                entry.settled.notify_all()
            with self._cond:
                self._finished.append((entry, next_at, done))
                self._cond.notify_all()

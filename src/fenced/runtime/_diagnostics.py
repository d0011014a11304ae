"""A bounded background sender: diagnostics that can never delay a renewal or a loss signal.

The runtime reports a holder's failed renewals and losses to the coordinator, where they become
records (``fenced timeline``, metrics). Such a report is a backend write, and with the network
down it blocks for the backend's whole timeout (PostgreSQL 10 s, etcd 5 s). So reports are not
sent by the renewer or at the loss: they are queued here and sent in order by one thread per
coordinator (whatever the number of leases it holds).

The queue is bounded. When it is full (the coordinator is slow or unreachable and reports keep
coming), a new report is **dropped and counted** (:attr:`DiagnosticSender.dropped`), never waited
for; a report whose send fails is logged at DEBUG and not retried. Diagnostics are best effort:
a missing record never means a renewal was missed, and a lease's safety never depends on one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["DiagnosticSender"]

log = logging.getLogger("fenced.runtime")

T = TypeVar("T")

_SENDERS: weakref.WeakSet[DiagnosticSender[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for sender in list(_SENDERS):
        sender._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DiagnosticSender(Generic[T]):
    """Sends the items given to :meth:`submit` with ``send``, in order, from one daemon thread.

    ``send`` is called with no lock held; what it raises is logged (DEBUG) and the item is gone.
    The thread starts at the first :meth:`submit`. A forked child starts empty: what its parent
    had queued is the parent's to send. Thread-safe.
    """

    def __init__(self, send: Callable[[T], object], *, capacity: int, name: str) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self._send = send
        self._capacity = capacity
        self._name = name
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[T] = deque()
        self._sending = False
        self._closed = False
        self._dropped = 0
        self._warned = False
        self._thread: threading.Thread | None = None
        _SENDERS.add(self)

    @property
    def dropped(self) -> int:
        """Items dropped so far: the queue was full, or the sender closed before sending them."""
        with self._cond:
            return self._dropped

    @property
    def pending(self) -> int:
        """Items queued or being sent right now."""
        with self._cond:
            return len(self._queue) + self._sending

    def submit(self, item: T) -> bool:
        """Queue ``item``; returns at once. False if it was dropped (queue full, or closed)."""
        with self._cond:
            if self._closed or len(self._queue) >= self._capacity:
                self._drop(1)
                return False
            self._queue.append(item)
            self._start_locked()
            self._cond.notify()
            return True

    def close(self, timeout: float) -> None:
        """Stop taking items; give what is queued up to ``timeout`` seconds (real time) to be
        sent, then drop (and count) the rest. Idempotent; a send in flight is not interrupted."""
        give_up = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._thread is not None and (self._queue or self._sending):
                left = give_up - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            self._drop(len(self._queue))
            self._queue.clear()

    def _drop(self, count: int) -> None:
        if count <= 0:
            return
        self._dropped += count
        if not self._warned:
            self._warned = True  # once per overload: the queue emptying re-arms it
            log.warning(
                "%s: dropped %d diagnostic report(s) the coordinator could not take in time "
                "(%d dropped in all)",
                self._name,
                count,
                self._dropped,
            )

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def _forked(self) -> None:
        """In a forked child: the parent's thread and lock state are not ours."""
        self._cond = threading.Condition(threading.Lock())
        self._queue.clear()
        self._sending = False
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue.popleft()
                self._sending = True
            try:
                self._send(item)
            except Exception as error:
                log.debug("%s: could not send a diagnostic report: %s", self._name, error)
            finally:
                with self._cond:
                    self._sending = False
                    if not self._queue:
                        self._warned = False
                    self._cond.notify_all()

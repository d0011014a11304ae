"""Injectable clocks: what fenced asks of time, and the only way it waits for time to pass.

Deadlines are on :meth:`Clock.now`, a clock that never jumps (a wall-clock step by NTP or an
operator neither expires nor extends a lease) and **keeps counting while the host is
suspended**, as the coordinators do: the embedded backend's CLOCK_BOOTTIME, PostgreSQL's and
etcd's server clocks. A holder whose deadline stood still during a suspend would believe its lease
HELD for as long after the coordinator expired it. :meth:`Clock.wall` is for display and records
only.

Waiting for time is the clock's job too (:meth:`Clock.sleep`, :meth:`Clock.wait`, as
``trio.testing.MockClock`` owns sleeping): code that waits runs unchanged under
:class:`ManualClock`, where time passes only when a test moves it.

What :class:`SystemClock` reads (``SystemClock.source``):

=========  ====================================  ============================================
Linux      ``clock_gettime(CLOCK_BOOTTIME)``     counts suspend
macOS      ``clock_gettime(CLOCK_MONOTONIC)``    counts sleep (``time.monotonic()``, Mach
                                                 absolute time, does not)
others     ``time.monotonic()``                  may stop while the host is suspended:
                                                 ``SystemClock.counts_suspend`` is False, and a
                                                 holder may believe a lease HELD for up to the
                                                 length of a suspend after it expired
=========  ====================================  ============================================

Python's timed waits (``Condition.wait``, ``time.sleep``) measure CLOCK_MONOTONIC, which stops
during a suspend: a wait of 20 s begun before a suspend of an hour ends 20 s after the resume.
Where ``now()`` counts suspend, :class:`SystemClock` therefore waits in slices of at most
:data:`RECHECK` seconds and reads ``now()`` after each, so a deadline that passed during a
suspend is acted on within :data:`RECHECK` of the resume.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["RECHECK", "Clock", "HostClock", "ManualClock", "SystemClock"]

RECHECK = 0.25
"""Seconds of CLOCK_MONOTONIC a :class:`SystemClock` wait sleeps at most before reading the clock
again: the longest a deadline that passed while the host was suspended goes unnoticed after the
resume."""


class Clock(Protocol):
    """What fenced asks of time: read it, and wait for it.

    A scheduler serving many deadlines (one thread for all the leases of a coordinator) waits
    with ``wait(cond, soonest)`` and is notified on ``cond`` whenever its set of deadlines changes.
    """

    def now(self) -> float:
        """Seconds on the deadline clock: never jumps, counts suspend (see the module docstring).
        Only differences between two readings mean anything."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, for display and records only."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block until :meth:`now` has advanced by ``seconds`` (>= 0, else :class:`ValueError`)."""
        ...

    def wait(self, cond: threading.Condition, until: float) -> bool:
        """Wait on ``cond`` (held by the caller, as with ``Condition.wait``) until it is notified
        or :meth:`now` reaches ``until`` (``math.inf``: no deadline).

        Returns False once ``until`` is reached (at once if it already was), True otherwise.
        True does not prove a notification: as with ``Condition.wait``, wake-ups may be spurious
        and the caller re-checks what it waits for.
        """
        ...

    def busy(self) -> Callable[[], None]:
        """Note that another thread now does work for a waiter of this clock (a renewal call
        handed to a worker); call the returned function once it is done. Real clocks ignore it;
        :meth:`ManualClock.settle` waits until no such work is left."""
        ...


class HostClock(Clock, Protocol):
    """The coordinator's clock on one host: time since boot, and which boot it is.

    The embedded backend decides expiry with it: a lease stores ``(boot_id, boottime expiry)``;
    a lease from another boot is expired by definition. Wall-clock steps do not move it.
    """

    def boottime(self) -> float:
        """Seconds since boot, counting suspend (CLOCK_BOOTTIME on Linux)."""
        ...

    def boot_id(self) -> str:
        """An id that changes at every boot of the host."""
        ...


def _check_seconds(seconds: float) -> float:
    if not seconds >= 0:  # also NaN
        raise ValueError(f"cannot sleep for {seconds!r} seconds")
    return seconds


def _deadline_source(platform: str) -> tuple[str, Callable[[], float], bool]:
    """The clock behind :meth:`SystemClock.now` on ``platform``: (name, reader, counts suspend)."""
    if platform.startswith("linux"):
        boottime = time.CLOCK_BOOTTIME
        return "CLOCK_BOOTTIME", lambda: time.clock_gettime(boottime), True
    if platform == "darwin":
        monotonic = time.CLOCK_MONOTONIC
        return "CLOCK_MONOTONIC", lambda: time.clock_gettime(monotonic), True
    return "time.monotonic", time.monotonic, False


class SystemClock:
    """The host's real clocks; see the module docstring for what :meth:`now` reads where."""

    def __init__(self) -> None:
        name, reader, counts_suspend = _deadline_source(sys.platform)
        self.source: str = name
        """The OS clock :meth:`now` reads."""
        self.counts_suspend: bool = counts_suspend
        """False where :meth:`now` may stop while the host is suspended."""
        self._read = reader
        self._slice = RECHECK if counts_suspend else math.inf

    def now(self) -> float:
        return self._read()

    def monotonic(self) -> float:
        """``time.monotonic()``: stops while the host is suspended, so never for deadlines.
        Where :attr:`counts_suspend`, ``now() - monotonic()`` grows by the length of each
        suspend (how a recorder notices one)."""
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        until = self.now() + _check_seconds(seconds)
        while (left := until - self.now()) > 0:
            time.sleep(min(left, self._slice))

    def wait(self, cond: threading.Condition, until: float) -> bool:
        left = until - self.now()
        if left <= 0:
            return False
        cond.wait(min(left, self._slice))
        return self.now() < until

    def busy(self) -> Callable[[], None]:
        return _nothing

    def __repr__(self) -> str:
        return f"<SystemClock {self.source}>"


def _nothing() -> None:
    pass


@dataclass(eq=False)
class _Waiter:
    cond: threading.Condition
    until: float
    generation: int


class ManualClock:
    """A clock that only moves when told to, for tests of time (like trio's MockClock).

    It is a :class:`Clock` and a :class:`HostClock`. :meth:`advance` moves every reading;
    :meth:`suspend` moves :meth:`now`, :meth:`boottime` and :meth:`wall` but not
    :meth:`monotonic` (what ``time.monotonic()`` does over a host suspend); :meth:`jump_wall`
    moves only the wall clock, as an NTP step would; :meth:`reboot` changes the boot id.

    Waits (:meth:`wait`, :meth:`sleep`) never time out in real time: they end when notified or
    when a test moves the clock to their deadline. Moving the clock wakes every waiter, which
    re-reads it. To step threads deterministically, call :meth:`settle` (block until every thread
    that waits on this clock has seen the last move and waits again) before each move.
    Thread-safe.
    """

    def __init__(self, now: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._state = threading.Condition(threading.Lock())
        self._now = now
        self._suspended = 0.0
        self._wall = wall
        self._boot = 1
        self._generation = 0
        self._waiters: list[_Waiter] = []
        self._busy = 0

    # -- readings ---------------------------------------------------------------------------
    def now(self) -> float:
        with self._state:
            return self._now

    def boottime(self) -> float:
        """The manual clock's time since "boot": equal to :meth:`now`."""
        return self.now()

    def monotonic(self) -> float:
        """What ``time.monotonic()`` would read: :meth:`now` minus the time spent suspended."""
        with self._state:
            return self._now - self._suspended

    def wall(self) -> float:
        with self._state:
            return self._wall

    def boot_id(self) -> str:
        with self._state:
            return f"manual-boot-{self._boot}"

    # -- moving it --------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        """Move every reading forward by ``seconds`` (>= 0) and wake every waiter."""
        self._move(_check_forward(seconds), suspended=False)

    def advance_to(self, when: float) -> None:
        """Move :meth:`now` (and the others with it) forward to ``when``; no-op if already there."""
        with self._state:
            step = max(when - self._now, 0.0)
        self._move(step, suspended=False)

    def suspend(self, seconds: float) -> None:
        """Pretend the host was suspended for ``seconds`` (>= 0): :meth:`now`, :meth:`boottime`
        and :meth:`wall` move, :meth:`monotonic` does not. Wakes every waiter."""
        self._move(_check_forward(seconds), suspended=True)

    def jump_wall(self, seconds: float) -> None:
        """Step only the wall clock (either direction), as an NTP correction would."""
        with self._state:
            self._wall += seconds

    def reboot(self) -> None:
        """Pretend the host rebooted: the boot id changes."""
        with self._state:
            self._boot += 1

    def _move(self, seconds: float, *, suspended: bool) -> None:
        with self._state:
            self._now += seconds
            self._wall += seconds
            if suspended:
                self._suspended += seconds
            self._generation += 1
            conds = {id(w.cond): w.cond for w in self._waiters}
        for cond in conds.values():  # never while holding _state: a waiter holds its cond first
            with cond:
                cond.notify_all()

    # -- waiting ----------------------------------------------------------------------------
    def sleep(self, seconds: float) -> None:
        cond = threading.Condition(threading.Lock())
        with cond:
            until = self.now() + _check_seconds(seconds)
            while self.wait(cond, until):
                pass

    def wait(self, cond: threading.Condition, until: float) -> bool:
        with self._state:
            if self._now >= until:
                return False
            waiter = _Waiter(cond, until, self._generation)
            self._waiters.append(waiter)
            self._state.notify_all()
        try:
            cond.wait()
        finally:
            with self._state:
                self._waiters.remove(waiter)
        return self.now() < until

    def busy(self) -> Callable[[], None]:
        with self._state:
            self._busy += 1
        ended = threading.Event()

        def done() -> None:
            if ended.is_set():
                return
            ended.set()
            with self._state:
                self._busy -= 1
                self._state.notify_all()

        return done

    def settle(self, count: int, *, timeout: float = 10.0) -> list[float]:
        """Block until ``count`` waits are pending on this clock, each begun after its last move,
        and no work noted with :meth:`busy` is left; return their deadlines, soonest first.

        ``timeout`` is real time (a test that expected more waiters than there are fails with
        :class:`TimeoutError` instead of hanging).
        """
        give_up = time.monotonic() + timeout
        with self._state:
            while True:
                fresh = sorted(w.until for w in self._waiters if w.generation == self._generation)
                if len(fresh) >= count and self._busy == 0:
                    return fresh
                left = give_up - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{len(fresh)} of {count} expected waits are pending on the clock "
                        f"({self._busy} noted work not done)"
                    )
                self._state.wait(left)


def _check_forward(seconds: float) -> float:
    if not seconds >= 0:
        raise ValueError("a monotonic clock cannot go backwards")
    return seconds

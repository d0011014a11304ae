"""Injectable clocks. Pure: the system clock only reads the OS's clocks.

Deadlines use :meth:`Clock.monotonic`; :meth:`Clock.wall` is for display only. A wall-clock step
(NTP, an operator) therefore neither expires nor extends a lease.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """What fenced asks of time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (for local deadlines)."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, for display and records only."""
        ...


class SystemClock:
    """The process's real clocks: ``time.monotonic`` and ``time.time``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to: for tests of time (like trio's MockClock).

    ``advance`` moves both clocks; ``jump_wall`` moves only the wall clock, as NTP would.
    Thread-safe.
    """

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._monotonic = monotonic
        self._wall = wall

    def monotonic(self) -> float:
        with self._lock:
            return self._monotonic

    def wall(self) -> float:
        with self._lock:
            return self._wall

    def advance(self, seconds: float) -> None:
        """Move both clocks forward by ``seconds`` (≥ 0)."""
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        with self._lock:
            self._monotonic += seconds
            self._wall += seconds

    def jump_wall(self, seconds: float) -> None:
        """Step only the wall clock (either direction), as an NTP correction would."""
        with self._lock:
            self._wall += seconds

"""Injectable clocks. Pure: the system clock only reads the OS's clocks.

Deadlines use :meth:`Clock.monotonic`; :meth:`Clock.wall` is for display only. A wall-clock step
(NTP, an operator) therefore neither expires nor extends a lease.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "HostClock", "ManualClock", "SystemClock"]


class Clock(Protocol):
    """What fenced asks of time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps (for local deadlines)."""
        ...

    def wall(self) -> float:
        """Seconds since the Unix epoch, for display and records only."""
        ...


class HostClock(Protocol):
    """The coordinator's clock on one host: time since boot, and which boot it is.

    The embedded backend decides expiry with it: a lease stores ``(boot_id, boottime expiry)``;
    a lease from another boot is expired by definition. Wall-clock steps do not move it.
    """

    def boottime(self) -> float:
        """Seconds since boot, counting suspend (CLOCK_BOOTTIME)."""
        ...

    def boot_id(self) -> str:
        """An id that changes at every boot of the host."""
        ...


class SystemClock:
    """The process's real clocks: ``time.monotonic`` and ``time.time``."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to: for tests of time (like trio's MockClock).

    It is both a :class:`Clock` and a :class:`HostClock`.

    ``advance`` moves both clocks; ``jump_wall`` moves only the wall clock, as NTP would.
    Thread-safe.
    """

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._monotonic = monotonic
        self._wall = wall
        self._boot = 1

    def boottime(self) -> float:
        """The manual clock's time since "boot" (equal to :meth:`monotonic`)."""
        return self.monotonic()

    def boot_id(self) -> str:
        with self._lock:
            return f"manual-boot-{self._boot}"

    def reboot(self) -> None:
        """Pretend the host rebooted: the boot id changes."""
        with self._lock:
            self._boot += 1

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

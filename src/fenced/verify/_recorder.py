"""One recorder: every event of a verification run as a JSON line in one history file.

Every process of a run (the verify process itself and each worker) opens the same history file
with ``O_APPEND`` and writes each event as one line with one ``write(2)``: the kernel appends each
write atomically at the end of the file, so lines of different processes never interleave and a
process killed with SIGKILL leaves at most its last line incomplete (:func:`read_history` drops
such a line).

Every event carries ``t``: the deadline clock of :class:`~fenced.core._clock.SystemClock` read *in
the emitting process* at the moment of the event — the clock of the holders' local deadlines, so
the two compare directly. On Linux that is CLOCK_BOOTTIME, one clock for every process of the
host, so times of different processes compare directly too (the checker relies on it; it is why
verification runs its workers on one host). Also ``pid``, ``w`` (the emitter: a worker name, or
``verify``) and ``ev`` (the kind of event; see :mod:`fenced.verify._history` for the vocabulary).

A suspend of the host stops every process at once; the deadline clock counts it, CLOCK_MONOTONIC
does not. The recorder reads both around each event, and when the gap between them has grown
since its previous event it first writes a ``suspend`` event: ``t0`` (its previous event, before
the suspend), ``t`` (now, after it) and ``seconds`` (at least how long the host slept). The
checker treats that span as a pause of every worker.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from fenced.core._clock import SystemClock

__all__ = ["Event", "HistoryTail", "Recorder", "read_history"]

Event = dict[str, Any]
"""One recorded event (a JSON object)."""

SUSPEND_MIN = 0.001
"""Seconds the deadline clock must have gained on CLOCK_MONOTONIC to be recorded as a suspend."""


class RecorderClock(Protocol):
    """The recorder's clocks: :class:`~fenced.core._clock.SystemClock` (a ManualClock in tests)."""

    def now(self) -> float: ...

    def monotonic(self) -> float: ...


class Recorder:
    """Appends events to the history file ``path``; thread-safe; one ``write`` per event."""

    def __init__(
        self, path: str | os.PathLike[str], emitter: str, *, clock: RecorderClock | None = None
    ) -> None:
        self.path = Path(path)
        self.emitter = emitter
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._clock: RecorderClock = clock if clock is not None else SystemClock()
        self._gap: float | None = None  # the largest (deadline clock - CLOCK_MONOTONIC) so far
        self._last = 0.0  # the latest t recorded at that gap

    def now(self) -> float:
        """The time ``t`` of an event happening now (for the ``t0`` fields of events)."""
        return self._clock.now()

    def emit(self, ev: str, **fields: Any) -> Event:
        """Record event ``ev`` now (its ``t`` is read here); returns the event."""
        before = self._clock.monotonic()
        t = self._clock.now()
        after = self._clock.monotonic()
        low, high = t - after, t - before  # the gap between the two clocks at t lies in between
        slept, since = 0.0, 0.0
        with self._lock:
            if self._gap is not None and low > self._gap + SUSPEND_MIN:
                slept, since = low - self._gap, self._last
                self._gap, self._last = high, t
            else:
                self._gap = high if self._gap is None else max(self._gap, high)
                self._last = max(self._last, t)
        if slept:
            self.write(
                {"t": t, "pid": self._pid, "w": self.emitter, "ev": "suspend", "t0": since,
                 "seconds": round(slept, 6)}
            )  # fmt: skip
        event: Event = {"t": t, "pid": self._pid, "w": self.emitter, "ev": ev}
        event.update(fields)
        self.write(event)
        return event

    def write(self, event: Event) -> None:
        """Append a complete event (with its own ``t``) as one line."""
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        """Close the file descriptor; idempotent."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _parse(lines: Iterator[str]) -> Iterator[Event]:
    for line in lines:
        if not line.endswith("\n"):
            return  # the incomplete last line of a killed process
        try:
            event = json.loads(line)
        except ValueError:
            continue  # a torn line: only possible for the last write of a killed process
        if isinstance(event, dict):
            yield event


def read_history(path: str | os.PathLike[str]) -> list[Event]:
    """Every complete event of the history file, in file order."""
    with open(path, encoding="utf-8", errors="replace") as stream:
        return list(_parse(iter(stream)))


class HistoryTail:
    """Reads the events appended to a history file since the last call (for case drivers)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self.events: list[Event] = []

    def poll(self) -> list[Event]:
        """The complete events appended since the last poll (also kept in :attr:`events`)."""
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self._offset)
                chunk = stream.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        complete, newline, self._partial = data.rpartition(b"\n")
        if not newline:
            return []
        lines = (line.decode("utf-8", "replace") + "\n" for line in complete.split(b"\n") if line)
        fresh = list(_parse(lines))
        self.events.extend(fresh)
        return fresh

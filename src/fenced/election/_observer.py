"""Who leads, and every change of leadership in order: ``coord.leader()``, ``coord.observe()``.

``coord.leader(name)`` is one read: the live term's holder, value, term and remaining time
(:class:`LeaderInfo`), or None.

``coord.observe(name)`` returns an :class:`Observer`: an iterator of :class:`LeaderChange` values
derived from the coordinator's **records** of that name (granted, proclaimed, released, expired,
restored), never from polling ``current()``. Guarantees, to a live observer:

* **every term exactly once, in term order**: an ELECTED change per granted term, even for a term
  that was granted and ended between two reads (the records keep it); then at most one
  PROCLAIMED change per proclamation and one ENDED change per term (reason ``released``,
  ``expired``, ``restored``, or ``replaced`` when a newer term appeared before the end of the
  previous one was seen);
* **from now on**: the first change is the live term (ELECTED, with its latest value) if there is
  a leader when ``observe()`` is called; nothing older is delivered;
* **no polling**: between reads it blocks in the backend's ``watch`` (woken by the backend's
  notification, and at the live term's expiry, which the read then records), re-checking at least
  every :data:`RECHECK` seconds;
* **survives outages**: :class:`~fenced.Unavailable` and :class:`~fenced.OutcomeUnknown` from a
  read or a watch are retried with exponential backoff (50 ms up to 2 s, with jitter), and reading
  continues after the last record seen, so nothing is skipped or repeated. Other errors propagate.

The value of an ELECTED change is the value the term advertised when the observer read the change
(the backends record the value of a proclamation, not the value given at the grant): a term that
ended before the observer read it shows the value None unless it proclaimed one.

A coordinator restored from a backup may number its records from below the last one seen; the
observer notices at its next re-check (the name's last epoch is above every term it saw, and no
record follows its position), reads the history again, and delivers what it has not delivered
yet: terms are compared, not positions.

Timeline of a short term::

    t0  observer reads up to record 41 (term 7 live), then waits in watch(after=41)
    t1  term 7 released (42); term 8 granted (43) and released (44); term 9 granted (45)
    t2  the watch is woken; the observer reads 42..45 and delivers
        ENDED 7, ELECTED 8, ENDED 8, ELECTED 9: term 8 is not missed although it is long gone
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

from fenced.core._closing import Closing
from fenced.core._errors import OutcomeUnknown, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._token import FencingToken

__all__ = [
    "RECHECK",
    "LeaderChange",
    "LeaderChangeKind",
    "LeaderInfo",
    "Observer",
    "TermTracker",
]

log = logging.getLogger("fenced.election")

RECHECK = 5.0
"""Longest time an observer blocks in one ``watch`` before it re-checks (close, restores)."""
_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """The current leader of an election, as ``coord.leader(name)`` returns it.

    ``expires_in`` is the term's remaining time by the coordinator's clock when it answered;
    ``value`` is None for a plain lease on the same name (elections and leases share names).
    """

    name: str
    term: int
    holder: str
    value: str | None
    expires_in: float
    ttl: float
    coordinator_id: str

    @property
    def epoch(self) -> int:
        return self.term

    @property
    def token(self) -> FencingToken:
        return FencingToken(self.coordinator_id, self.name, self.term)

    @classmethod
    def from_lease(cls, info: LeaseInfo) -> LeaderInfo:
        return cls(
            info.resource,
            info.epoch,
            info.holder,
            info.value,
            info.expires_in,
            info.ttl,
            info.coordinator_id,
        )

    def to_json(self) -> dict[str, object]:
        """A JSON-able dict: name, term, holder, value, expires_in (ms precision), ttl."""
        return {
            "name": self.name,
            "term": self.term,
            "holder": self.holder,
            "value": self.value,
            "expires_in": round(self.expires_in, 3),
            "ttl": self.ttl,
        }


class LeaderChangeKind(enum.Enum):
    """What changed."""

    ELECTED = "elected"
    """A new term began: ``holder`` leads, advertising ``value``."""
    PROCLAIMED = "proclaimed"
    """The leader advertised a new ``value``; same term."""
    ENDED = "ended"
    """The term ended (``reason``); there is no leader until the next ELECTED."""


@dataclass(frozen=True, slots=True)
class LeaderChange:
    """One change of leadership, derived from the coordinator record ``seq``.

    ``holder`` and ``value`` are the term's (for ENDED: as last known). ``reason`` is set for
    ENDED only: ``released`` (resigned or released), ``expired``, ``restored`` or ``replaced``.
    ``at`` is the record's wall-clock time, for display only.
    """

    kind: LeaderChangeKind
    name: str
    term: int
    holder: str | None
    value: str | None
    seq: int
    at: float
    reason: str | None = None

    def to_json(self) -> dict[str, object]:
        """A JSON-able dict (stable shape: kind, name, term, holder, value, reason, seq, at)."""
        return {
            "kind": self.kind.value,
            "name": self.name,
            "term": self.term,
            "holder": self.holder,
            "value": self.value,
            "reason": self.reason,
            "seq": self.seq,
            "at": self.at,
        }


@dataclass
class _Term:
    number: int
    holder: str | None
    value: str | None
    value_known: bool
    seq: int
    at: float


class TermTracker:
    """Folds one election's records into :class:`LeaderChange` values. Pure, not thread-safe.

    Idempotent by term rather than by position: a grant of a term not above the last delivered
    one, and an end or proclamation of a term other than the live one, change nothing. So reading
    a history again (after a restore renumbered it) delivers only what is new.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.delivered = 0
        """The highest term delivered (or skipped as history) as ELECTED."""
        self.highest = 0
        """The highest epoch in any record seen."""
        self.live: _Term | None = None

    def feed(self, record: Record) -> list[LeaderChange]:
        """The changes ``record`` makes (often none)."""
        self.highest = max(self.highest, record.epoch)
        kind = record.kind
        if kind is RecordKind.GRANTED:
            if record.epoch <= self.delivered:
                return []
            changes = []
            if self.live is not None:
                changes.append(self._end(record, "replaced"))
            raw = record.detail.get("value")
            value = raw if isinstance(raw, str) else None
            self.live = _Term(
                record.epoch, record.holder, value, "value" in record.detail, record.seq, record.at
            )
            self.delivered = record.epoch
            changes.append(self._change(LeaderChangeKind.ELECTED, self.live, record))
            return changes
        live = self.live
        if live is None:
            return []
        if kind is RecordKind.PROCLAIMED and record.epoch == live.number:
            raw = record.detail.get("value")
            live.value = raw if isinstance(raw, str) else None
            live.value_known = True
            return [self._change(LeaderChangeKind.PROCLAIMED, live, record)]
        if kind in (RecordKind.RELEASED, RecordKind.EXPIRED) and record.epoch == live.number:
            return [self._end(record, kind.value)]
        if kind is RecordKind.RESTORED and record.epoch >= live.number:
            return [self._end(record, "restored")]
        return []

    def current(self) -> LeaderChange | None:
        """The live term as an ELECTED change (with its latest value), or None."""
        live = self.live
        if live is None:
            return None
        return LeaderChange(
            LeaderChangeKind.ELECTED,
            self.name,
            live.number,
            live.holder,
            live.value,
            live.seq,
            live.at,
        )

    def feed_all(self, records: list[Record]) -> list[LeaderChange]:
        """The changes ``records`` make, in order."""
        changes: list[LeaderChange] = []
        for record in records:
            changes.extend(self.feed(record))
        return changes

    def unknown_value(self) -> int | None:
        """The live term whose value no record said (ask the coordinator), or None."""
        live = self.live
        return None if live is None or live.value_known else live.number

    def valued(
        self, changes: list[LeaderChange], term: int, info: LeaseInfo | None
    ) -> list[LeaderChange]:
        """``changes`` once the coordinator answered ``info`` for the live ``term``'s value:
        its ELECTED change carries the value (None if the term is no longer live)."""
        value = info.value if info is not None and info.epoch == term else None
        self.learn_value(term, value)
        return [
            dataclasses.replace(c, value=value)
            if c.kind is LeaderChangeKind.ELECTED and c.term == term
            else c
            for c in changes
        ]

    @staticmethod
    def replayed(replay: list[Record], seen: int) -> list[Record]:
        """The records to deliver from a history read again after a restore renumbered it:
        what is at or below the highest epoch seen was delivered already (or is the state
        before the restore), except the RESTORED records that end it."""
        return [r for r in replay if r.epoch > seen or r.kind is RecordKind.RESTORED]

    def learn_value(self, term: int, value: str | None) -> None:
        """The value of the live ``term`` read from the coordinator (grants do not record it)."""
        if self.live is not None and self.live.number == term and not self.live.value_known:
            self.live.value = value
            self.live.value_known = True

    def _end(self, record: Record, reason: str) -> LeaderChange:
        live = self.live
        assert live is not None
        self.live = None
        return LeaderChange(
            LeaderChangeKind.ENDED,
            self.name,
            live.number,
            live.holder,
            live.value,
            record.seq,
            record.at,
            reason,
        )

    def _change(self, kind: LeaderChangeKind, term: _Term, record: Record) -> LeaderChange:
        return LeaderChange(
            kind, self.name, term.number, term.holder, term.value, record.seq, record.at
        )


class ObserveOps(Protocol):
    """What an observer reads from a coordinator (:class:`~fenced.Coordinator` has it)."""

    def current(self, resource: str) -> LeaseInfo | None: ...

    def last_epoch(self, resource: str) -> int: ...

    def history(self, resource: str | None = None, *, after: int = 0) -> list[Record]: ...


class Watcher(Protocol):
    """The blocking wait of a coordinator backend."""

    def watch(self, resource: str, after: int, timeout: float) -> None: ...


class Observer(Closing):
    """The iterator returned by ``coord.observe(name)``; see the module docstring.

    Iterate it (``for change in observer``: blocks until the next change, ends after
    :meth:`close`), or call :meth:`get` with a timeout. One consumer thread at a time;
    :meth:`close` may be called from any thread and takes effect within :data:`RECHECK` seconds.
    Use it as a context manager to close it.

    The constructor reads the history once to find "now" and the live term; it raises if that
    read fails (a wrong URL should fail loudly, not look like a quiet election).
    """

    def __init__(
        self,
        ops: ObserveOps,
        watcher: Watcher,
        name: str,
        *,
        recheck: float = RECHECK,
        rng: random.Random | None = None,
    ) -> None:
        self._ops = ops
        self._watcher = watcher
        self._name = name
        self._recheck = recheck
        self._rng = rng or random.Random()
        self._tracker = TermTracker(name)
        self._pending: collections.deque[LeaderChange] = collections.deque()
        self._seq = 0
        self._closed = threading.Event()
        self._failing = False
        self._next_recheck = time.monotonic() + recheck
        while records := self._ops.history(name, after=self._seq):
            self._tracker.feed_all(records)
            self._seq = records[-1].seq
        live_term = self._tracker.live
        if live_term is not None and not live_term.value_known:
            info = self._ops.current(name)
            if info is not None and info.epoch == live_term.number:
                self._tracker.learn_value(live_term.number, info.value)
        live = self._tracker.current()
        if live is not None:
            self._pending.append(live)

    @property
    def name(self) -> str:
        return self._name

    @property
    def position(self) -> int:
        """The seq of the last record read."""
        return self._seq

    def __iter__(self) -> Iterator[LeaderChange]:
        return self

    def __next__(self) -> LeaderChange:
        change = self.get(None)
        if change is None:
            raise StopIteration
        return change

    def get(self, timeout: float | None = None) -> LeaderChange | None:
        """The next change; waits up to ``timeout`` seconds (None: until one comes or closed).

        Returns None if none came in time, or once the observer is closed.
        """
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            if self._pending:
                return self._pending.popleft()
            if self._closed.is_set():
                return None
            read = functools.partial(self._ops.history, self._name, after=self._seq)
            records = self._call(read, deadline)
            if records is None:
                return None
            if records:
                self._absorb(records, deadline)
                continue
            now = time.monotonic()
            if now >= self._next_recheck:
                self._next_recheck = now + self._recheck
                if self._rewound(deadline):
                    continue
            left = self._recheck if deadline is None else deadline - now
            if left <= 0:
                return None
            pause = min(left, max(self._next_recheck - now, 0.001))
            if self._call(functools.partial(self._watch, self._seq, pause), deadline) is None:
                return None

    def close(self) -> None:
        """Stop: iteration ends and :meth:`get` returns None (within :data:`RECHECK` seconds)."""
        self._closed.set()

    # -- internals ------------------------------------------------------------------------
    def _watch(self, after: int, timeout: float) -> bool:
        self._watcher.watch(self._name, after, timeout)
        return True

    def _absorb(
        self, records: list[Record], deadline: float | None, *, position: int | None = None
    ) -> None:
        changes = self._tracker.feed_all(records)
        self._seq = records[-1].seq if position is None else position
        term = self._tracker.unknown_value()
        if term is not None:  # ask the coordinator; if it cannot answer in time: unknown (None)
            answer = self._call(lambda: (self._ops.current(self._name),), deadline)
            if answer is not None:
                changes = self._tracker.valued(changes, term, answer[0])
        self._pending.extend(changes)

    def _rewound(self, deadline: float | None) -> bool:
        """Read the history again if the coordinator has terms we never saw; True if it did.

        That happens when a restore from a backup renumbered the records below our position.
        """
        last = self._call(lambda: self._ops.last_epoch(self._name), deadline)
        seen = self._tracker.highest
        if last is None or last <= seen:
            return False
        # A term granted since the read that found nothing is newer, not renumbered: its
        # records (and those of the end of ours) follow our position. Only when nothing does is
        # the history read again (reading it again would skip the end of the live term).
        newer = self._call(
            functools.partial(self._ops.history, self._name, after=self._seq), deadline
        )
        if newer is None:
            return False
        if newer:
            self._absorb(newer, deadline)
            return True
        self._tracker.highest = last  # a restore may raise it without any record: check once
        replay: list[Record] = []
        while True:
            start = replay[-1].seq if replay else 0
            page = self._call(
                functools.partial(self._ops.history, self._name, after=start), deadline
            )
            if not page:
                break
            replay.extend(page)
        if not replay:
            return False
        log.warning(
            "the records of %s were renumbered (a restored coordinator?); read them again",
            self._name,
        )
        self._absorb(self._tracker.replayed(replay, seen), deadline, position=replay[-1].seq)
        return True

    def _call(self, fn: Callable[[], T], deadline: float | None) -> T | None:
        """``fn()``, retried with backoff through outages; None if closed or past ``deadline``."""
        delay = _BACKOFF_FIRST
        while True:
            try:
                result = fn()
            except (Unavailable, OutcomeUnknown) as error:
                if not self._failing:
                    log.warning("observing %s: %s; retrying", self._name, error)
                    self._failing = True
                pause = delay * self._rng.uniform(0.8, 1.2)
                if deadline is not None:
                    pause = min(pause, deadline - time.monotonic())
                if pause <= 0 or self._closed.wait(pause):
                    return None
                delay = min(delay * 2, _BACKOFF_MAX)
                continue
            if self._failing:
                log.warning("observing %s: reconnected", self._name)
                self._failing = False
            return result

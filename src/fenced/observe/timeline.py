"""Ownership timelines: who owned a resource when, the gaps without an owner, and the trouble.

:func:`build_timeline` is pure: it merges a coordinator's records (``coord.history``) with the
records of any number of stores (``store.history``) into

* **intervals** — one per granted epoch: holder, from, to, and how it ended: ``released``,
  ``expired``, ``superseded`` (a newer grant is recorded and this one's end is not: its end
  record was pruned or never written), ``restored`` (ended by a restore, ``fenced restore``) or
  ``held`` (still held now);
* **gaps** — the times between two intervals, and after the last one, without an owner;
* **rejections** — every write a store rejected, with the presented epoch, the floor, the reason
  and the holder of the presented epoch (when the coordinator's records know it);
* **events** — renewal failures and losses reported by holders, restores, proclamations, and the
  installs of each store;
* **figures** — over a window: ownership changes, time without owner, rejected writes (by
  reason), renewal failures, expiries.

Who was *waiting* during a gap is not known: no backend records waiters (a queue entry is not an
ownership event, and recording it would cost a durable write per waiter). :attr:`Gap.waiting` is
always None; the field is kept so that the JSON shape need not change when a backend records it.

Times are wall-clock seconds (``Record.at``), for display only: records of different sources
(a coordinator, stores on other hosts) are merged by time, so their clocks should be in sync for
the merged view to read well. Nothing here decides anything.

:func:`read_timeline` does the I/O: it reads every retained record of the resource from the
coordinator and the stores, then calls :func:`build_timeline`.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from fenced.core._names import validate_resource
from fenced.core._records import Record, RecordKind

__all__ = [
    "ENDINGS",
    "JSON_FORMAT",
    "Event",
    "Figures",
    "Gap",
    "Interval",
    "RecordSource",
    "Rejection",
    "StoreRecordSource",
    "Timeline",
    "build_timeline",
    "coordinator_records",
    "read_timeline",
    "store_records",
]

JSON_FORMAT = 1
"""Version of :meth:`Timeline.to_json`'s document; bumped only for incompatible changes."""

ENDINGS = ("released", "expired", "superseded", "restored", "held")
"""How an interval ends (``held``: it has not ended)."""

_ENDS = {
    RecordKind.RELEASED: "released",
    RecordKind.EXPIRED: "expired",
}


@dataclass(frozen=True, slots=True)
class Interval:
    """One granted epoch: who held it, from when to when, and how it ended.

    ``start`` is None when the grant is older than the retained records; ``end`` is None while
    it is still held (``ended == "held"``).
    """

    epoch: int
    holder: str | None
    start: float | None
    end: float | None
    ended: str
    renewal_failures: int = 0
    lost: str | None = None
    """The reason the holder reported when it considered the lease lost, if it did."""
    accepted_writes: int = 0
    """Writes the given stores accepted with this epoch."""

    def duration(self, now: float) -> float | None:
        """Seconds from start to end (or ``now``); None if the start is unknown."""
        if self.start is None:
            return None
        return max(0.0, (self.end if self.end is not None else now) - self.start)

    def to_json(self, now: float) -> dict[str, object]:
        return {
            "epoch": self.epoch,
            "holder": self.holder,
            "start": self.start,
            "end": self.end,
            "ended": self.ended,
            "duration": _rounded(self.duration(now)),
            "renewal_failures": self.renewal_failures,
            "lost": self.lost,
            "accepted_writes": self.accepted_writes,
        }


@dataclass(frozen=True, slots=True)
class Gap:
    """A time without an owner: from the end of ``after_epoch``'s interval to the next grant.

    ``end`` is None while the resource is still without an owner. ``waiting`` is always None:
    no backend records waiters (see the module docstring).
    """

    start: float
    end: float | None
    after_epoch: int
    waiting: tuple[str, ...] | None = None

    def duration(self, now: float) -> float:
        return max(0.0, (self.end if self.end is not None else now) - self.start)

    def to_json(self, now: float) -> dict[str, object]:
        return {
            "start": self.start,
            "end": self.end,
            "duration": _rounded(self.duration(now)),
            "after_epoch": self.after_epoch,
            "waiting": None if self.waiting is None else list(self.waiting),
        }


@dataclass(frozen=True, slots=True)
class Rejection:
    """A mutation a store rejected (a REJECTED store record).

    ``epoch`` is the presented epoch; ``floor`` the store's floor then (None if the store
    did not record it); ``reason`` ``stale`` / ``not-installed`` / ``foreign``; ``op`` ``put`` /
    ``publish`` / ``fence``; ``key`` or ``name`` what it wrote; ``holder`` the holder the
    coordinator granted ``epoch`` to, if its records know.
    """

    at: float
    store: str
    epoch: int
    floor: int | None
    reason: str
    op: str
    key: str | None
    name: str | None
    holder: str | None

    def to_json(self) -> dict[str, object]:
        return {
            "at": self.at,
            "store": self.store,
            "epoch": self.epoch,
            "floor": self.floor,
            "reason": self.reason,
            "op": self.op,
            "key": self.key,
            "name": self.name,
            "holder": self.holder,
        }


@dataclass(frozen=True, slots=True)
class Event:
    """Another record worth showing: a renewal failure, a loss, a restore, an install.

    ``source`` is ``"coordinator"`` or the URL of the store that recorded it.
    """

    at: float
    kind: str
    epoch: int
    holder: str | None
    source: str
    detail: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {
            "at": self.at,
            "kind": self.kind,
            "epoch": self.epoch,
            "holder": self.holder,
            "source": self.source,
            "detail": dict(self.detail),
        }


@dataclass(frozen=True, slots=True)
class Figures:
    """What happened to one resource in the window ``[since, until]``.

    ``ownership_changes`` counts the grants in the window (every grant is a new epoch, a new
    owner); ``time_without_owner`` the seconds of the window inside gaps (time before the first
    retained record does not count); ``rejected_writes`` the store rejections (all reasons, and
    by reason); ``renewal_failures`` and ``expiries`` what their names say.
    """

    since: float
    until: float
    ownership_changes: int
    time_without_owner: float
    rejected_writes: int
    rejected_by_reason: Mapping[str, int]
    renewal_failures: int
    expiries: int

    def to_json(self) -> dict[str, object]:
        return {
            "since": self.since,
            "until": self.until,
            "window": _rounded(self.until - self.since),
            "ownership_changes": self.ownership_changes,
            "time_without_owner": _rounded(self.time_without_owner),
            "rejected_writes": self.rejected_writes,
            "rejected_by_reason": dict(sorted(self.rejected_by_reason.items())),
            "renewal_failures": self.renewal_failures,
            "expiries": self.expiries,
        }


@dataclass(frozen=True, slots=True)
class Timeline:
    """The merged history of one resource, restricted to ``[since, until]`` (see the module).

    Intervals and gaps that overlap the window are kept whole; rejections and events are those
    dated inside it.
    """

    resource: str
    since: float
    until: float
    intervals: tuple[Interval, ...]
    gaps: tuple[Gap, ...]
    rejections: tuple[Rejection, ...]
    events: tuple[Event, ...]
    figures: Figures

    @property
    def current(self) -> Interval | None:
        """The interval still held, if any."""
        last = self.intervals[-1] if self.intervals else None
        return last if last is not None and last.ended == "held" else None

    def to_json(self) -> dict[str, object]:
        """The stable JSON document (format :data:`JSON_FORMAT`, see docs/operations.md)."""
        now = self.until
        return {
            "format": JSON_FORMAT,
            "resource": self.resource,
            "since": self.since,
            "until": self.until,
            "intervals": [i.to_json(now) for i in self.intervals],
            "gaps": [g.to_json(now) for g in self.gaps],
            "rejections": [r.to_json() for r in self.rejections],
            "events": [e.to_json() for e in self.events],
            "figures": self.figures.to_json(),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass(slots=True)
class _Open:
    """An interval being built."""

    epoch: int
    holder: str | None
    start: float | None
    end: float | None = None
    ended: str = "held"
    renewal_failures: int = 0
    lost: str | None = None
    accepted_writes: int = 0

    def close(self, at: float, how: str) -> None:
        if self.ended == "held":
            self.end, self.ended = at, how

    def frozen(self) -> Interval:
        return Interval(
            self.epoch,
            self.holder,
            self.start,
            self.end,
            self.ended,
            self.renewal_failures,
            self.lost,
            self.accepted_writes,
        )


def build_timeline(
    resource: str,
    coordinator: Iterable[Record],
    stores: Mapping[str, Iterable[Record]] | None = None,
    *,
    now: float,
    since: float | None = None,
) -> Timeline:
    """The timeline of ``resource`` from its coordinator records and its stores' records.

    ``coordinator``: the coordinator's records (any order: they are sorted by ``seq``; records
    of other resources are ignored). ``stores``: store URL → that store's records of the
    resource. ``now``: the wall-clock end of the view (open intervals and gaps end there).
    ``since``: the start of the window (default: the first retained record, or ``now``).
    Pure; never raises for odd record sequences (a record of an unknown epoch opens an interval
    whose start is unknown).
    """
    mine = sorted((r for r in coordinator if r.resource == resource), key=lambda r: r.seq)
    by_epoch: dict[int, _Open] = {}
    order: list[_Open] = []
    current: _Open | None = None
    events: list[Event] = []

    def interval(epoch: int, holder: str | None) -> _Open:
        found = by_epoch.get(epoch)
        if found is None:
            found = _Open(epoch, holder, None)
            by_epoch[epoch] = found
            order.append(found)
        return found

    for record in mine:
        kind = record.kind
        if kind is RecordKind.GRANTED:
            if current is not None:
                current.close(record.at, "superseded")
            current = _Open(record.epoch, record.holder, record.at)
            by_epoch[record.epoch] = current
            order.append(current)
        elif kind in _ENDS:
            ending = interval(record.epoch, record.holder)
            ending.close(record.at, _ENDS[kind])
            if current is ending:
                current = None
        elif kind is RecordKind.RESTORED:
            if current is not None:
                current.close(record.at, "restored")
                current = None
            events.append(_event(record, "coordinator"))
        elif kind in (RecordKind.RENEWAL_FAILED, RecordKind.LOST):
            troubled = by_epoch.get(record.epoch)
            if troubled is not None and kind is RecordKind.RENEWAL_FAILED:
                troubled.renewal_failures += 1
            if troubled is not None and kind is RecordKind.LOST:
                troubled.lost = str(record.detail.get("reason", "lost"))
            events.append(_event(record, "coordinator"))
        else:
            events.append(_event(record, "coordinator"))

    rejections: list[Rejection] = []
    for url, records in (stores or {}).items():
        for record in records:
            if record.resource != resource:
                continue
            if record.kind is RecordKind.REJECTED:
                owner = by_epoch.get(record.epoch)
                rejections.append(_rejection(record, url, owner.holder if owner else None))
            elif record.kind is RecordKind.ACCEPTED:
                owner = by_epoch.get(record.epoch)
                if owner is not None:
                    owner.accepted_writes += 1
            else:
                events.append(_event(record, url))

    intervals = [o.frozen() for o in order]
    gaps = _gaps(intervals)
    first = min(
        [r.at for r in mine] + [e.at for e in events] + [r.at for r in rejections], default=now
    )
    start = min(first, now) if since is None else since
    figures = _figures(intervals, gaps, rejections, events, start, now)
    return Timeline(
        resource,
        start,
        now,
        tuple(i for i in intervals if i.end is None or i.end >= start),
        tuple(g for g in gaps if g.end is None or g.end >= start),
        tuple(sorted((r for r in rejections if start <= r.at), key=lambda r: r.at)),
        tuple(sorted((e for e in events if start <= e.at), key=lambda e: e.at)),
        figures,
    )


def _event(record: Record, source: str) -> Event:
    return Event(record.at, record.kind.value, record.epoch, record.holder, source, record.detail)


def _rejection(record: Record, store: str, holder: str | None) -> Rejection:
    detail = record.detail

    def text(key: str) -> str | None:
        value = detail.get(key)
        return None if value is None else str(value)

    floor = detail.get("floor")
    return Rejection(
        record.at,
        store,
        record.epoch,
        floor if isinstance(floor, int) and not isinstance(floor, bool) else None,
        text("reason") or "unknown",
        text("op") or "unknown",
        text("key"),
        text("name"),
        holder,
    )


def _gaps(intervals: Sequence[Interval]) -> list[Gap]:
    """The times between intervals (in grant order) and after the last ended one."""
    gaps: list[Gap] = []
    timed = [i for i in intervals if i.end is not None or i.start is not None]
    for before, after in itertools.pairwise(timed):
        if before.end is not None and after.start is not None and after.start > before.end:
            gaps.append(Gap(before.end, after.start, before.epoch))
    if timed and timed[-1].end is not None:
        gaps.append(Gap(timed[-1].end, None, timed[-1].epoch))
    return gaps


def _overlap(start: float, end: float, since: float, until: float) -> float:
    return max(0.0, min(end, until) - max(start, since))


def _figures(
    intervals: Sequence[Interval],
    gaps: Sequence[Gap],
    rejections: Sequence[Rejection],
    events: Sequence[Event],
    since: float,
    until: float,
) -> Figures:
    def inside(at: float | None) -> bool:
        return at is not None and since <= at <= until

    reasons = Counter(r.reason for r in rejections if inside(r.at))
    return Figures(
        since=since,
        until=until,
        ownership_changes=sum(1 for i in intervals if inside(i.start)),
        time_without_owner=sum(
            _overlap(g.start, g.end if g.end is not None else until, since, until) for g in gaps
        ),
        rejected_writes=sum(reasons.values()),
        rejected_by_reason=dict(reasons),
        renewal_failures=sum(
            1 for e in events if e.kind == RecordKind.RENEWAL_FAILED.value and inside(e.at)
        ),
        expiries=sum(1 for i in intervals if i.ended == "expired" and inside(i.end)),
    )


# -- reading records (I/O) --------------------------------------------------------------------


class RecordSource(Protocol):
    """What the readers need of a coordinator (:class:`fenced.Coordinator` has it)."""

    def history(self, resource: str | None = None, *, after: int = 0) -> list[Record]: ...


class StoreRecordSource(Protocol):
    """What the readers need of a store (:class:`fenced.Store` has it)."""

    @property
    def url(self) -> str: ...

    def history(self, resource: str, after: int = 0) -> list[Record]: ...


def coordinator_records(
    coord: RecordSource, resource: str | None, *, after: int = 0
) -> list[Record]:
    """Every retained coordinator record (of ``resource``, or all) with ``seq > after``.

    ``coord.history`` answers in pages; this reads until a page is empty.
    """
    found: list[Record] = []
    while True:
        page = coord.history(resource, after=after)
        page = [r for r in page if r.seq > after]
        if not page:
            return found
        found.extend(page)
        after = page[-1].seq


def store_records(store: StoreRecordSource, resource: str, *, after: int = 0) -> list[Record]:
    """Every retained record of ``resource`` at ``store`` with ``seq > after``."""
    return store.history(resource, after=after)


def read_timeline(
    coord: RecordSource,
    resource: str,
    stores: Sequence[StoreRecordSource] = (),
    *,
    since: float | None = None,
    now: float | None = None,
) -> Timeline:
    """Read the records of ``resource`` from ``coord`` and ``stores``; build its timeline.

    ``now`` defaults to the current wall-clock time. Raises what the reads raise
    (:class:`~fenced.InvalidName` before any I/O, :class:`~fenced.Unavailable`, a
    :class:`~fenced.ConfigurationError` for a store that keeps no records).
    """
    name = validate_resource(resource)
    moment = time.time() if now is None else now
    coordinator = coordinator_records(coord, name)
    by_store: dict[str, list[Record]] = {}
    for store in stores:
        by_store.setdefault(store.url, []).extend(store_records(store, name))
    return build_timeline(name, coordinator, by_store, now=moment, since=since)

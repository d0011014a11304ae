"""Prometheus metrics of ownership: changes, failed renewals, rejected writes, flapping.

Use it with your own registry::

    from prometheus_client import CollectorRegistry
    from fenced.observe.metrics import register

    registry = CollectorRegistry()
    register(registry, coord, stores=[store], flap_threshold=10, flap_window=300)

or run ``fenced metrics --listen :9464``. Metric names, labels and meanings (docs/operations.md):

============================================  =======  ============================================
``fenced_ownership_changes_total``            counter  grants (each a new epoch, a new owner)
``fenced_lease_ends_total{how}``              counter  leases ended: released / expired / restored
``fenced_renewal_failures_total``             counter  renewal failures reported by holders
``fenced_rejected_writes_total{store,reason}``  counter  writes a store rejected: stale /
                                                       not-installed / foreign
``fenced_unowned_seconds_total``              counter  seconds without an owner since the first
                                                       grant seen
``fenced_current_epoch``                      gauge    the last epoch granted (or reserved by a
                                                       restore); a float64: inexact above 2**53
``fenced_current_era``                        gauge    that epoch >> 32 (exact; a restore moves to a
                                                       new era)
``fenced_current_epoch_in_era``               gauge    that epoch & 0xffffffff (exact)
``fenced_held``                               gauge    1 while a lease is held, else 0
``fenced_recent_ownership_changes``           gauge    grants within the flap window
``fenced_flapping``                           gauge    1 if recent changes > the flap threshold
``fenced_observe_up``                         gauge    1 if the last read of every source worked
============================================  =======  ============================================

Every series but ``fenced_observe_up`` carries a ``resource`` label.

Counters count the records this process has read: on the first scrape, every retained record
(so after a restart of the exporter they start again from the retained history, which
Prometheus treats as a counter reset), then only new ones. They never decrease while the process
runs, even when the sources prune old records.

**Flapping**: ``fenced_flapping`` is 1 when a resource had more than ``flap_threshold`` ownership
changes in the last ``flap_window`` seconds. Choose them above the resource's normal handover
rate: a job that runs every minute under a fresh lease changes owner 5 times in 5 minutes by
design. The defaults (more than 10 changes in 300 s) suit jobs that run every few minutes or
hold their leases for long.

:class:`MetricsModel` is the pure part (records in, metric families out; unit-testable with
synthetic records); :class:`FencedCollector` reads the records (I/O) and feeds it. A read that
fails is logged (``fenced.observe``) and shows as ``fenced_observe_up 0``; the other metrics keep
their last values.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from fenced.core._errors import ConfigurationError, FencedError
from fenced.core._records import Record, RecordKind
from fenced.observe.timeline import (
    RecordSource,
    StoreRecordSource,
    coordinator_records,
    store_records,
)

__all__ = [
    "DEFAULT_FLAP_THRESHOLD",
    "DEFAULT_FLAP_WINDOW",
    "FencedCollector",
    "MetricsModel",
    "register",
]

DEFAULT_FLAP_THRESHOLD = 10
"""More than this many ownership changes within the flap window is flapping."""
DEFAULT_FLAP_WINDOW = 300.0
"""Seconds of the flap window."""

log = logging.getLogger("fenced.observe")

_ENDS = {
    RecordKind.RELEASED: "released",
    RecordKind.EXPIRED: "expired",
    RecordKind.RESTORED: "restored",
}


@dataclass(slots=True)
class _Resource:
    grants: int = 0
    ends: Counter[str] = field(default_factory=Counter)
    renewal_failures: int = 0
    epoch: int = 0
    held_epoch: int | None = None
    unowned: float = 0.0
    unowned_since: float | None = None
    recent: deque[float] = field(default_factory=deque)
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)


def _check_flapping(threshold: object, window: object) -> tuple[int, float]:
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
        raise ConfigurationError(f"flap_threshold must be an integer >= 0, got {threshold!r}")
    if isinstance(window, bool) or not isinstance(window, int | float) or not window > 0:
        raise ConfigurationError(f"flap_window must be a number of seconds > 0, got {window!r}")
    if window == float("inf"):
        raise ConfigurationError("flap_window must be finite")
    return threshold, float(window)


class MetricsModel:
    """The metric values, computed from records. Pure: no I/O, no clock of its own.

    Feed coordinator records in ``seq`` order (:meth:`feed_coordinator`) and store records
    (:meth:`feed_store`); ask for :meth:`families` at a wall-clock instant. Not thread-safe (the
    collector serialises access).
    """

    def __init__(
        self,
        *,
        flap_threshold: int = DEFAULT_FLAP_THRESHOLD,
        flap_window: float = DEFAULT_FLAP_WINDOW,
    ) -> None:
        self.flap_threshold, self.flap_window = _check_flapping(flap_threshold, flap_window)
        self._resources: dict[str, _Resource] = {}

    @property
    def resources(self) -> list[str]:
        """Every resource seen so far, sorted."""
        return sorted(self._resources)

    def _of(self, resource: str) -> _Resource:
        return self._resources.setdefault(resource, _Resource())

    def feed_coordinator(self, records: Iterable[Record]) -> None:
        """Account for coordinator records (of any resources), oldest first."""
        for record in records:
            state = self._of(record.resource)
            kind = record.kind
            if kind is RecordKind.GRANTED:
                state.grants += 1
                state.epoch = max(state.epoch, record.epoch)
                if state.unowned_since is not None:
                    state.unowned += max(0.0, record.at - state.unowned_since)
                    state.unowned_since = None
                state.held_epoch = record.epoch
                state.recent.append(record.at)
                while state.recent and state.recent[0] < record.at - self.flap_window:
                    state.recent.popleft()
            elif kind in _ENDS:
                state.epoch = max(state.epoch, record.epoch)
                if kind is RecordKind.RESTORED and state.held_epoch is None:
                    continue  # a restore of a free resource ends nothing
                state.ends[_ENDS[kind]] += 1
                late = kind is not RecordKind.RESTORED and record.epoch != state.held_epoch
                if state.held_epoch is not None and late:
                    continue  # the end of an older lease, recorded late
                state.held_epoch = None
                if state.unowned_since is None:
                    state.unowned_since = record.at
            elif kind is RecordKind.RENEWAL_FAILED:
                state.renewal_failures += 1

    def feed_store(self, store: str, records: Iterable[Record]) -> None:
        """Account for the records of the store at URL ``store`` (only rejections count)."""
        for record in records:
            if record.kind is RecordKind.REJECTED:
                reason = str(record.detail.get("reason", "unknown"))
                self._of(record.resource).rejected[store, reason] += 1

    def unowned_seconds(self, resource: str, now: float) -> float:
        """Seconds ``resource`` was without an owner since its first grant seen, until ``now``."""
        state = self._of(resource)
        open_gap = 0.0 if state.unowned_since is None else max(0.0, now - state.unowned_since)
        return state.unowned + open_gap

    def recent_changes(self, resource: str, now: float) -> int:
        """Grants of ``resource`` within the flap window before ``now``."""
        return sum(1 for at in self._of(resource).recent if at >= now - self.flap_window)

    def flapping(self, resource: str, now: float) -> bool:
        """More than ``flap_threshold`` grants within the flap window before ``now``."""
        return self.recent_changes(resource, now) > self.flap_threshold

    def families(self, now: float, *, up: bool = True) -> list[Metric]:
        """Every metric family, with one sample per resource (and label set)."""
        per_resource = ["resource"]
        changes = CounterMetricFamily(
            "fenced_ownership_changes", "Leases granted (each a new epoch).", labels=per_resource
        )
        ends = CounterMetricFamily(
            "fenced_lease_ends",
            "Leases ended, by how: released, expired, restored.",
            labels=["resource", "how"],
        )
        failures = CounterMetricFamily(
            "fenced_renewal_failures",
            "Lease renewals that failed, as reported by holders.",
            labels=per_resource,
        )
        rejected = CounterMetricFamily(
            "fenced_rejected_writes",
            "Writes a store rejected, by store and reason: stale, not-installed, foreign.",
            labels=["resource", "store", "reason"],
        )
        unowned = CounterMetricFamily(
            "fenced_unowned_seconds",
            "Seconds without an owner since the first grant seen.",
            labels=per_resource,
        )
        epoch = GaugeMetricFamily(
            "fenced_current_epoch",
            "The last epoch granted or reserved (a restore raises it).",
            labels=per_resource,
        )
        era = GaugeMetricFamily(
            "fenced_current_era",
            "The last epoch >> 32: restores move to a new era (exact where the epoch is not).",
            labels=per_resource,
        )
        in_era = GaugeMetricFamily(
            "fenced_current_epoch_in_era",
            "The last epoch & 0xffffffff (exact where fenced_current_epoch is not).",
            labels=per_resource,
        )
        held = GaugeMetricFamily(
            "fenced_held", "1 while a lease on the resource is held, else 0.", labels=per_resource
        )
        recent = GaugeMetricFamily(
            "fenced_recent_ownership_changes",
            f"Leases granted within the last {self.flap_window:g} seconds (the flap window).",
            labels=per_resource,
        )
        flapping = GaugeMetricFamily(
            "fenced_flapping",
            f"1 if more than {self.flap_threshold} leases were granted within the last "
            f"{self.flap_window:g} seconds, else 0.",
            labels=per_resource,
        )
        for name in self.resources:
            state = self._resources[name]
            changes.add_metric([name], state.grants)
            for how in ("released", "expired", "restored"):
                ends.add_metric([name, how], state.ends[how])
            failures.add_metric([name], state.renewal_failures)
            for (store, reason), count in sorted(state.rejected.items()):
                rejected.add_metric([name, store, reason], count)
            unowned.add_metric([name], self.unowned_seconds(name, now))
            epoch.add_metric([name], state.epoch)
            era.add_metric([name], state.epoch >> 32)
            in_era.add_metric([name], state.epoch & 0xFFFFFFFF)
            held.add_metric([name], 0 if state.held_epoch is None else 1)
            count = self.recent_changes(name, now)
            recent.add_metric([name], count)
            flapping.add_metric([name], 1 if count > self.flap_threshold else 0)
        observe_up = GaugeMetricFamily(
            "fenced_observe_up", "1 if the last read of the coordinator and every store worked."
        )
        observe_up.add_metric([], 1 if up else 0)
        return [
            changes,
            ends,
            failures,
            rejected,
            unowned,
            epoch,
            era,
            in_era,
            held,
            recent,
            flapping,
            observe_up,
        ]


class FencedCollector(Collector):
    """A prometheus_client collector over a coordinator and stores (see the module docstring).

    Each scrape reads the records added since the previous scrape: the coordinator's (every
    resource) and, for every resource the coordinator knows, each store's. Thread-safe. The
    coordinator and stores stay the caller's to close.
    """

    def __init__(
        self,
        coord: RecordSource,
        stores: Sequence[StoreRecordSource] = (),
        *,
        flap_threshold: int = DEFAULT_FLAP_THRESHOLD,
        flap_window: float = DEFAULT_FLAP_WINDOW,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._model = MetricsModel(flap_threshold=flap_threshold, flap_window=flap_window)
        self._coord = coord
        self._stores = tuple(stores)
        self._wall = wall
        self._lock = threading.Lock()
        self._after = 0
        self._store_after: dict[tuple[str, str], int] = {}

    @property
    def model(self) -> MetricsModel:
        """The model behind the metrics (for tests and for callers that want the numbers)."""
        return self._model

    def _read(self) -> None:
        records = coordinator_records(self._coord, None, after=self._after)
        if records:
            self._model.feed_coordinator(records)
            self._after = records[-1].seq
        for store in self._stores:
            for resource in self._model.resources:
                key = (store.url, resource)
                found = store_records(store, resource, after=self._store_after.get(key, 0))
                if found:
                    self._model.feed_store(store.url, found)
                    self._store_after[key] = found[-1].seq

    def collect(self) -> Iterator[Metric]:
        """Read new records, then yield every metric family."""
        with self._lock:
            up = True
            try:
                self._read()
            except FencedError as error:
                log.warning("reading records for metrics failed: %s", error)
                up = False
            families = self._model.families(self._wall(), up=up)
        yield from families

    def describe(self) -> Iterator[Metric]:
        """The families without reading anything (used by the registry to check names)."""
        model = MetricsModel(
            flap_threshold=self._model.flap_threshold, flap_window=self._model.flap_window
        )
        yield from model.families(0.0)


def register(
    registry: CollectorRegistry,
    coord: RecordSource,
    *,
    stores: Sequence[StoreRecordSource] = (),
    flap_threshold: int = DEFAULT_FLAP_THRESHOLD,
    flap_window: float = DEFAULT_FLAP_WINDOW,
) -> FencedCollector:
    """Register fenced's metrics for ``coord`` (and ``stores``) in ``registry``; return the
    collector (``registry.unregister(collector)`` removes it).

    ``flap_threshold``/``flap_window``: ``fenced_flapping`` is 1 when a resource had more than
    ``flap_threshold`` ownership changes in the last ``flap_window`` seconds. Bad values are a
    :class:`~fenced.ConfigurationError`, before anything is registered.
    """
    collector = FencedCollector(
        coord, stores, flap_threshold=flap_threshold, flap_window=flap_window
    )
    registry.register(collector)
    return collector

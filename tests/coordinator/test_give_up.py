"""A waiter that gives up consumes no epoch, on every backend that hands leases over.

The real backends (sqlite, postgresql, etcd) grant a released lease to the head waiter inside the
release (a hand-off). A waiter whose wait runs out just as that happens used to leave the queue
and release the lease it never saw: one epoch granted, no acquisition. Now ``acquire`` leaves
with ``take=True``, which finds the handed lease in the same atomic step as the leave and returns
it. Shown two ways: a forced interleaving (the hand-off lands between the waiter's last
``try_grant`` and its give-up, under a manual clock), and a real race of many short waits whose
grants are counted against the acquisitions from the coordinator's records.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect, open_backend
from fenced.coordinator.backend import Blocked, CoordinatorBackend, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.etcd._backend import EtcdBackend
from fenced.core._clock import ManualClock
from fenced.core._errors import Busy
from fenced.core._records import RecordKind
from fenced.core._urls import url_of_path
from fenced.testing.conformance import wait_for
from fenced.testing.etcd import EtcdCluster
from fenced.testing.faults import FaultyBackend
from fenced.testing.postgres import PostgresServer

R = "jobs/give-up"


@pytest.fixture(params=["sqlite", "postgres", "etcd"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return url_of_path("sqlite", f"{tmp_path}/fenced.db")
    if request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        return server.url("postgres", schema="t_" + uuid.uuid4().hex[:12])
    cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
    return cluster.url(prefix="/t" + uuid.uuid4().hex[:12], timeout=2)


class _HandOverAtTheDeadline(FaultyBackend):
    """The waiter's backend: its first queued ``try_grant`` answers Blocked, then ``trigger``
    runs (the holder releases, the lease is handed to this waiter, the waiter's clock passes
    its wait) before the answer reaches the Coordinator."""

    def __init__(self, inner: CoordinatorBackend, trigger: Callable[[], None]) -> None:
        super().__init__(inner)
        self.trigger: Callable[[], None] | None = trigger

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        answer = super().try_grant(request, ticket)
        if ticket is not None and isinstance(answer, Blocked) and self.trigger is not None:
            trigger, self.trigger = self.trigger, None
            trigger()
        return answer


def _granted(coord: Coordinator) -> list[int]:
    return [r.epoch for r in coord.history(R) if r.kind is RecordKind.GRANTED]


def test_a_lease_handed_over_as_the_wait_ends_is_returned_not_wasted(url: str) -> None:
    with connect(url) as holder:
        _hand_over_as_the_wait_ends(url, holder)


def _hand_over_as_the_wait_ends(url: str, holder: Coordinator) -> None:
    first = holder.acquire(R, ttl=30, wait=0, holder="holder")
    etcd = holder.backend if isinstance(holder.backend, EtcdBackend) else None
    if etcd is not None:  # its releases hand over once it watches the line
        etcd._watch_queue(R)
    clock = ManualClock()

    def hand_over() -> None:
        if etcd is not None:
            wait_for(lambda: etcd._queue_head(R) is not None, what="the holder's view")
        assert holder.release(first)
        info = holder.current(R)
        assert info is not None and info.holder == "waiter", "the release handed it over"
        clock.advance(60)  # the waiter's wait ran out meanwhile

    backend = _HandOverAtTheDeadline(open_backend(url), hand_over)
    waiter = Coordinator(backend, clock=clock)
    try:
        lease = waiter.acquire(R, ttl=30, wait=5, holder="waiter")
        assert backend.trigger is None, "the hand-off happened between try_grant and give-up"
        assert (lease.epoch, lease.holder) == (first.epoch + 1, "waiter")
        info = holder.current(R)
        assert info is not None and info.epoch == lease.epoch  # held, not released
        records = [(r.kind, r.epoch) for r in holder.history(R) if r.epoch == lease.epoch]
        assert records == [(RecordKind.GRANTED, lease.epoch)]
        assert waiter.release(lease)  # it is the waiter's own
    finally:
        waiter.close()


@pytest.mark.parametrize("url", ["sqlite", "postgres"], indirect=True)
def test_grants_equal_acquisitions_under_a_race_of_short_waits(url: str) -> None:
    """Six threads, each with its own coordinator, acquire with waits of 1-15 ms and hold for
    up to 2 ms, for two seconds: many waits run out while a release hands the lease over.
    Every epoch the coordinator granted is one that an acquire returned."""
    connect(url).close()  # create the database before the threads race to
    acquired: list[int] = []
    busy = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = time.monotonic() + 2.0

    def work(index: int) -> None:
        rng = random.Random(index)
        try:
            coord = connect(url)
        except BaseException as error:
            errors.append(error)
            return
        try:
            while time.monotonic() < stop:
                try:
                    lease = coord.acquire(R, ttl=10, wait=rng.uniform(0.001, 0.015))
                except Busy:
                    with lock:
                        busy[0] += 1
                    continue
                with lock:
                    acquired.append(lease.epoch)
                time.sleep(rng.uniform(0, 0.002))
                assert coord.release(lease)
        except BaseException as error:
            errors.append(error)
        finally:
            coord.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert busy[0] > 0 and len(acquired) > 20  # the race was run: both outcomes happened
    with connect(url) as coord:
        granted = _granted(coord)
    assert sorted(granted) == sorted(acquired)

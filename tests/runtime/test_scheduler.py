"""One scheduler per coordinator keeps every held lease (:mod:`fenced.runtime._scheduler`).

Many leases held in one process cost one scheduler thread and a few renewal threads, not two
threads each; a renewal that hangs holds up neither the other leases' renewals nor any loss; a
closed coordinator leaves no thread of its scheduler behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

import fenced
from fenced.coordinator._client import Coordinator
from fenced.core._clock import SystemClock
from fenced.core._errors import LeaseLost, LossReason
from fenced.core._lease import Lease, LeaseState
from fenced.core._token import FencingToken
from fenced.runtime._keeper import HeldLease
from fenced.runtime._scheduler import RENEWAL_WORKERS, LeaseScheduler
from fenced.testing.conformance import wait_for

CID = "c" * 32


def _scheduler_threads(coord: Coordinator) -> list[threading.Thread]:
    """The threads of ``coord``'s scheduler (named after its URL)."""
    return [t for t in threading.enumerate() if t.name.startswith(f"fenced-leases:{coord.url}")]


@pytest.fixture
def coord() -> Iterator[Coordinator]:
    with fenced.connect(f"memory://scheduler-{uuid.uuid4().hex[:8]}") as coordinator:
        yield coordinator


def test_two_hundred_held_leases_cost_one_scheduler_and_a_few_renewal_threads(
    coord: Coordinator,
) -> None:
    """200 leases with a 1 s ttl held for three ttls: every one is renewed and none is lost,
    while the threads of the scheduler stay at one plus at most RENEWAL_WORKERS."""
    count, ttl = 200, 1.0
    before = threading.active_count()
    with contextlib.ExitStack() as stack:
        helds = [
            stack.enter_context(coord.hold(f"jobs/many-{n}", ttl=ttl, wait=0)) for n in range(count)
        ]
        first = {held.resource: held.deadline for held in helds}
        wait_for(
            lambda: all(held.deadline > first[held.resource] + ttl for held in helds),
            timeout=10,
            what="every lease renewed more than once",
        )
        assert all(held.state is LeaseState.HELD for held in helds)
        assert not any(held.lost.is_set() for held in helds)
        assert 1 <= len(_scheduler_threads(coord)) <= 1 + RENEWAL_WORKERS
        assert threading.active_count() - before <= 1 + RENEWAL_WORKERS
    assert all(info is None for info in (coord.current(f"jobs/many-{n}") for n in range(count)))


class _Ops:
    """LeaseOps whose renewals of ``hang`` block until ``gate`` opens; the others succeed."""

    def __init__(self, clock: SystemClock, hang: str) -> None:
        self.clock = clock
        self.hang = hang
        self.gate = threading.Event()
        self.renewed: dict[str, int] = {}

    def renew(self, lease: Lease) -> Lease:
        sent = self.clock.now()
        if lease.resource == self.hang:
            self.gate.wait(30)
        self.renewed[lease.resource] = self.renewed.get(lease.resource, 0) + 1
        deadline = sent + lease.ttl - lease.safety_margin
        return dataclasses.replace(lease, deadline=deadline, expires_in=lease.ttl)

    def release(self, lease: Lease) -> bool:
        return True

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        pass


def _lease(clock: SystemClock, resource: str, ttl: float) -> Lease:
    token = FencingToken(CID, resource, 1)
    return Lease(token, "o" * 32, "h", ttl, ttl / 10, clock.now() + ttl - ttl / 10, ttl)


def test_a_hanging_renewal_delays_no_other_lease_and_its_loss_comes_at_its_deadline() -> None:
    clock = SystemClock()
    ops = _Ops(clock, hang="jobs/stuck")
    scheduler = LeaseScheduler(clock, workers=2)
    lost_at: dict[str, float] = {}
    helds = [
        HeldLease(
            ops,
            _lease(clock, resource, 0.6),
            clock=clock,
            scheduler=scheduler,
            on_lost=lambda error, r=resource: lost_at.setdefault(r, clock.now()),  # type: ignore[misc]
        )
        for resource in ("jobs/stuck", "jobs/a", "jobs/b", "jobs/c")
    ]
    try:
        for held in helds:
            held.start()
        stuck = helds[0]
        assert stuck.lost.wait(5)
        assert 0 <= lost_at["jobs/stuck"] - stuck.deadline < 0.2
        loss = stuck.loss()
        assert loss is not None and loss.reason is LossReason.EXPIRED
        time.sleep(1.0)  # more than a ttl: the others keep being renewed on the free worker
        for held in helds[1:]:
            assert held.state is LeaseState.HELD, held.resource
            assert ops.renewed[held.resource] >= 4
    finally:
        ops.gate.set()
        for held in helds:
            held.stop(release=False)
        scheduler.close()


def test_check_raises_for_a_lost_lease_and_close_leaves_no_thread(coord: Coordinator) -> None:
    with pytest.raises(LeaseLost), coord.hold("jobs/short", ttl=0.5, wait=0) as held:
        held.superseded("a store saw epoch 9")
        assert held.lost.is_set()
        held.check()
    coord.close()
    wait_for(lambda: not _scheduler_threads(coord), what="the scheduler's threads to end")

"""The runtime's keeper (:class:`fenced.runtime._keeper.HeldLease`) and the coordinator's
background diagnostics.

The timing tests run under a :class:`ManualClock`: time passes only when the test moves it, and
:meth:`ManualClock.settle` lets the lease scheduler's thread see each move, the renewal it
handed over come back, and wait again before the next one, so every schedule is exact. The last
tests run against a real PostgreSQL server behind a TCP proxy that blackholes (stops forwarding,
closes nothing).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect, open_backend
from fenced.coordinator.backends.memory._backend import MemoryBackend
from fenced.core._clock import ManualClock, SystemClock
from fenced.core._errors import LeaseLost, LossReason, Unavailable
from fenced.core._lease import Lease, LeaseState
from fenced.core._records import RecordKind
from fenced.core._token import FencingToken
from fenced.runtime._diagnostics import DiagnosticSender
from fenced.runtime._keeper import HeldLease
from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer
from fenced.testing.proxy import TcpProxy

R = "jobs/keeper"
CID = "c" * 32


class _Midpoint(random.Random):
    """No jitter: every ±10 % draw is its midpoint, so schedules are exact."""

    def uniform(self, a: float, b: float) -> float:
        return (a + b) / 2


class _Ops:
    """LeaseOps of a scripted coordinator: renewals succeed (extending the lease from their send
    time) or fail with :class:`Unavailable`; every attempt and report is recorded in order."""

    def __init__(self, clock: ManualClock | SystemClock, *, fail: bool = False) -> None:
        self.clock = clock
        self.fail = fail
        self.attempts: list[float] = []
        self.order: list[str] = []

    def renew(self, lease: Lease) -> Lease:
        sent = self.clock.now()
        self.attempts.append(sent)
        self.order.append("renew")
        if self.fail:
            raise Unavailable("unreachable (test)")
        deadline = sent + lease.ttl - lease.safety_margin
        return dataclasses.replace(lease, deadline=deadline, expires_in=lease.ttl)

    def release(self, lease: Lease) -> bool:
        return True

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        self.order.append(f"report {type(error).__name__}")


def _lease(clock: ManualClock | SystemClock, ttl: float, margin: float) -> Lease:
    return Lease(
        FencingToken(CID, R, 1), "o" * 32, "h", ttl, margin, clock.now() + ttl - margin, ttl
    )


def _step(clock: ManualClock) -> float:
    """Let the scheduler wait again, then move the clock to its next wake-up (the sooner of the
    next renewal and the local deadline)."""
    soonest = clock.settle(1)[0]
    clock.advance_to(soonest)
    return soonest


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def coord(clock: ManualClock) -> Iterator[Coordinator]:
    """A memory coordinator whose expiry, records and waits, and whose holders' deadlines and
    waits, are all on the test's manual clock."""
    name = f"keeper-{uuid.uuid4().hex[:8]}"
    coordinator = Coordinator(open_backend(f"memory://{name}", host_clock=clock), clock=clock)
    yield coordinator
    coordinator.close()
    MemoryBackend.forget(name)


# -- the renewal schedule -------------------------------------------------------------------------


def test_failed_renewals_are_retried_more_often_as_the_deadline_nears(clock: ManualClock) -> None:
    """Every ttl/10 at first; then a quarter of the time left (at least 10 ms): a lease that began
    short, or lost several renewals, still gets tries."""
    ttl, margin = 1.0, 0.1
    ops = _Ops(clock, fail=True)
    lease = _lease(clock, ttl, margin)
    start, deadline = clock.now(), lease.deadline
    held = HeldLease(ops, lease, clock=clock, rng=_Midpoint())
    held.start()
    try:
        while _step(clock) < deadline:
            pass
        assert held.lost.wait(10)
    finally:
        held.stop(release=False)
    expected = []
    attempt = start + ttl / 3
    while attempt < deadline:
        expected.append(attempt)
        attempt += max(min(ttl / 10, (deadline - attempt) / 4), 0.01)
    assert ops.attempts == pytest.approx(expected)
    early = [b - a for a, b in itertools.pairwise(expected) if deadline - a >= 0.4]
    assert early and all(gap == pytest.approx(ttl / 10) for gap in early)
    assert len([t for t in expected if t >= deadline - 0.3 * ttl]) == 11  # every ttl/10: 3
    loss = held.loss()
    assert loss is not None and loss.reason is LossReason.EXPIRED


def test_renewals_every_third_of_the_ttl_keep_the_lease_held(clock: ManualClock) -> None:
    """Each renewal is sent a third of the ttl after the previous one was sent, and its deadline
    counts from that send: the lease is HELD at every instant, for as long as renewals succeed."""
    ttl, margin = 3.0, 0.3
    ops = _Ops(clock)
    held = HeldLease(ops, _lease(clock, ttl, margin), clock=clock, rng=_Midpoint())
    start = clock.now()
    held.start()
    try:
        for _ in range(30):  # ten ttls: the renewer's wake-up is always the sooner
            _step(clock)
            clock.settle(1)
            assert held.state is LeaseState.HELD
    finally:
        held.stop(release=False)
    assert ops.attempts == pytest.approx([start + n * ttl / 3 for n in range(1, 31)])
    assert held.deadline == pytest.approx(ops.attempts[-1] + ttl - margin)
    assert not held.lost.is_set()


def test_a_held_lease_runs_entirely_on_the_manual_clock(
    coord: Coordinator, clock: ManualClock
) -> None:
    """hold() against the memory backend, both on one manual clock: ten ttls pass with no real
    waiting, the coordinator still has the same epoch, and its records carry the clock's wall
    time."""
    wall = clock.wall()
    with coord.hold(R, ttl=3, wait=0) as held:
        start = clock.now()
        for _ in range(30):
            _step(clock)
            clock.settle(1)
            assert held.state is LeaseState.HELD
        info = coord.current(R)
        assert info is not None and info.epoch == held.epoch == 1
    (granted, released) = coord.history(R)
    assert (granted.kind, released.kind) == (RecordKind.GRANTED, RecordKind.RELEASED)
    assert granted.at == wall and released.at == pytest.approx(wall + clock.now() - start)


# -- a suspended host ----------------------------------------------------------------------------


def test_a_host_suspend_longer_than_the_lease_is_a_loss_at_the_resume(
    coord: Coordinator, clock: ManualClock
) -> None:
    """While the host sleeps the coordinator's clock counts and so must the holder's: after the
    resume the lease is LOST (the clock's monotonic reading, which time.monotonic() would give,
    did not move), the watchdog fires, and the coordinator agrees it expired."""
    losses: list[LeaseLost] = []
    with (
        pytest.raises(LeaseLost),
        coord.hold(R, ttl=10, wait=0, on_lost=losses.append) as held,
    ):
        clock.settle(1)
        monotonic = clock.monotonic()
        clock.suspend(30)
        assert clock.monotonic() == monotonic
        assert held.state is LeaseState.LOST
        with pytest.raises(LeaseLost) as caught:
            held.check()
        assert caught.value.reason is LossReason.EXPIRED
        assert held.lost.wait(10)
        assert [loss.reason for loss in losses] == [LossReason.EXPIRED]
        assert coord.current(R) is None


class _SuspendableClock(SystemClock):
    """The real clock, plus seconds the host "spent suspended" (added to now(), as
    CLOCK_BOOTTIME would count them, but invisible to CLOCK_MONOTONIC and its timed waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.suspended = 0.0

    def now(self) -> float:
        return super().now() + self.suspended


def test_the_watchdog_wakes_by_the_boot_clock_after_a_suspend() -> None:
    """A watchdog that slept on a real-time wait (CLOCK_MONOTONIC) would wake 54 s after the
    resume; it re-reads the boot clock at least every RECHECK seconds."""
    clock = _SuspendableClock()
    ops = _Ops(clock, fail=True)
    losses: list[LeaseLost] = []
    held = HeldLease(ops, _lease(clock, 60, 6), clock=clock, on_lost=losses.append)
    held.start()
    try:
        clock.suspended = 120.0
        assert held.lost.wait(10)
    finally:
        held.stop(release=False)
    assert [loss.reason for loss in losses] == [LossReason.EXPIRED]


# -- loss first, diagnostics after ---------------------------------------------------------------


def test_the_loss_is_signalled_before_it_is_reported(clock: ManualClock) -> None:
    ops = _Ops(clock, fail=True)
    lease = _lease(clock, 1.0, 0.1)
    seen: list[bool] = []

    def on_lost(error: LeaseLost) -> None:
        seen.append(held.lost.is_set())
        ops.order.append("on_lost")

    held = HeldLease(ops, lease, clock=clock, on_lost=on_lost, rng=_Midpoint())
    held.start()
    try:
        while _step(clock) < lease.deadline:
            pass
        wait_for(lambda: "report LeaseLost" in ops.order, what="the loss report")
    finally:
        held.stop(release=False)
    assert seen == [True]
    assert ops.order[-2:] == ["on_lost", "report LeaseLost"]
    assert ops.order.count("report LeaseLost") == 1
    assert ops.order.count("renew") == ops.order.count("report Unavailable") > 0


def test_the_diagnostic_sender_never_blocks_and_counts_what_it_drops() -> None:
    started, gate = threading.Event(), threading.Event()
    sent: list[int] = []

    def send(item: int) -> None:
        started.set()
        gate.wait(10)
        sent.append(item)

    sender: DiagnosticSender[int] = DiagnosticSender(send, capacity=3, name="test")
    assert sender.submit(0)
    assert started.wait(10)  # 0 is being sent (and hangs): the queue holds 3 more
    assert [sender.submit(item) for item in range(1, 6)] == [True, True, True, False, False]
    assert (sender.dropped, sender.pending) == (2, 4)
    gate.set()
    wait_for(lambda: sent == [0, 1, 2, 3], what="the queued reports, in order")
    sender.close(timeout=5)
    assert not sender.submit(6)
    assert sender.dropped == 3


def test_close_sends_what_is_queued_then_drops_the_rest() -> None:
    gate = threading.Event()
    sent: list[int] = []

    def send(item: int) -> None:
        gate.wait(10)
        sent.append(item)

    sender: DiagnosticSender[int] = DiagnosticSender(send, capacity=10, name="test")
    for item in range(3):
        assert sender.submit(item)
    sender.close(timeout=0.05)  # the first send hangs past the budget: 0 or 1 queued are dropped
    assert sender.dropped >= 2
    gate.set()
    wait_for(lambda: sender.pending == 0, what="the send in flight")
    assert len(sent) + sender.dropped == 3


# -- a real server behind a blackhole ------------------------------------------------------------


class _Timed:
    """The real coordinator as the keeper's LeaseOps, with when each renewal began and ended."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord
        self.began: list[float] = []
        self.ended: list[float] = []

    def renew(self, lease: Lease) -> Lease:
        self.began.append(time.monotonic())
        try:
            return self.coord.renew(lease)
        finally:
            self.ended.append(time.monotonic())

    def release(self, lease: Lease) -> bool:
        return self.coord.release(lease)

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        self.coord.report_trouble(lease, error)


@pytest.mark.slow
def test_behind_a_blackhole_loss_is_on_time_and_renewals_never_wait_for_reports(
    postgres_server: PostgresServer,
) -> None:
    """PostgreSQL with its default 10 s operation timeout, reached through a proxy that stops
    forwarding: each report of a failed renewal hangs, yet the next renewal is tried a retry
    interval after the last one failed, ``on_lost`` runs within 0.2 s of the local deadline, and
    the reports reach the coordinator once the network is back."""
    schema = "t_" + uuid.uuid4().hex[:12]
    clock = SystemClock()
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        coord = connect(f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?schema={schema}")
        try:
            ops = _Timed(coord)
            lost_at: list[float] = []
            lease = coord.acquire(R, ttl=2.0, wait=0)
            held = HeldLease(ops, lease, clock=clock, on_lost=lambda _: lost_at.append(clock.now()))
            proxy.blackhole()
            held.start()
            assert held.lost.wait(10)
            deadline = held.deadline
            wait_for(lambda: len(ops.began) >= 2, what="a second renewal attempt")
            proxy.forward()
            held.stop(release=False)
            assert lost_at and 0 <= lost_at[0] - deadline < 0.2, (lost_at, deadline)
            gap = ops.began[1] - ops.ended[0]
            assert gap < 0.2 * 1.1 + 0.3, gap  # a retry interval (ttl/10 at most), never a report
            wait_for(
                lambda: (
                    {r.kind for r in coord.history(R)}
                    >= {RecordKind.RENEWAL_FAILED, RecordKind.LOST}
                ),
                timeout=30,
                what="the reports, sent once the network is back",
            )
            assert coord.diagnostics_dropped == 0
        finally:
            proxy.forward()
            coord.close()

"""The coordinator conformance suite: docs/coordinator.md as tests, run against every backend.

A backend's test module subclasses the classes whose capability it has and provides a ``url``
fixture naming fresh, empty state::

    class TestSQLite(CoordinatorConformance, ManualClockConformance):
        @pytest.fixture
        def url(self, tmp_path):
            return f"sqlite:///{tmp_path}/fenced.db"  # four slashes: absolute

* :class:`CoordinatorConformance` — every backend.
* :class:`HistoryConformance` — records, proclaim and watch (every backend, once it keeps records).
* :class:`ManualClockConformance` — backends whose expiry clock can be injected
  (``connect(url, host_clock=ManualClock())``): exact expiry, wall-clock steps, reboots.

Nothing here skips: a backend that lacks a capability does not subclass that class, and its
test module says so.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import open_backend
from fenced.coordinator.backend import Granted, GrantRequest
from fenced.core._clock import ManualClock
from fenced.core._errors import (
    Busy,
    ConfigurationError,
    InvalidName,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    StaleToken,
)
from fenced.core._lease import LeaseState
from fenced.core._records import RecordKind
from fenced.core._token import FencingToken
from fenced.testing._threads import ResultThread
from fenced.testing.faults import FaultyBackend

__all__ = [
    "BAD_NAMES",
    "BAD_PARAMETERS",
    "CoordinatorConformance",
    "HistoryConformance",
    "ManualClockConformance",
    "wait_for",
]

R = "exports/daily"

BAD_PARAMETERS: list[dict[str, Any]] = [
    {"ttl": 0, "wait": 0},
    {"ttl": -1, "wait": 0},
    {"ttl": math.nan, "wait": 0},
    {"ttl": math.inf, "wait": 0},
    {"ttl": True, "wait": 0},
    {"ttl": "5", "wait": 0},
    {"ttl": 5, "wait": -1},
    {"ttl": 5, "wait": math.nan},
    {"ttl": 5, "wait": 0, "safety_margin": 5},
    {"ttl": 5, "wait": 0, "safety_margin": -0.1},
    {"ttl": 5, "wait": 0, "holder": ""},
    {"ttl": 5, "wait": 0, "holder": "a\nb"},
    {"ttl": 5, "wait": 0, "request_id": ""},
]
"""Parameters every acquire and hold refuses with ConfigurationError, before any I/O."""
BAD_NAMES = ["", "/a", "a/", "a//b", "a/../b", "./a", "a b", "ä", "x" * 256]
"""Resource names refused with InvalidName before any I/O."""


def wait_for(condition: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """Poll ``condition`` until truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(0.005)


def _enqueued(backend: FaultyBackend) -> Callable[[], bool]:
    """The caller has its place in line: its ``enqueue`` returned."""
    return lambda: backend.answered.get("enqueue", 0) >= 1


class _RecordingStore:
    """A Fenceable that records installs, optionally refusing with a higher floor."""

    def __init__(self, floor: int = 0) -> None:
        self.floor = floor
        self.installed: list[FencingToken] = []

    def fence(self, token: FencingToken) -> int:
        if token.epoch < self.floor:
            raise StaleToken(token.resource, token.epoch, self.floor)
        self.floor = token.epoch
        self.installed.append(token)
        return self.floor


class CoordinatorConformance:
    """The coordinator contract (docs/coordinator.md) for every backend. Subclasses provide the
    ``url`` fixture."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError("the backend's test module provides the url fixture")

    @pytest.fixture
    def coord(self, url: str) -> Iterator[Coordinator]:
        coordinator = Coordinator(open_backend(url))
        yield coordinator
        coordinator.close()

    @pytest.fixture
    def faulty(self, url: str) -> Iterator[tuple[Coordinator, FaultyBackend]]:
        backend = FaultyBackend(open_backend(url))
        coordinator = Coordinator(backend)
        yield coordinator, backend
        coordinator.close()

    @pytest.fixture
    def other(self, url: str) -> Iterator[Coordinator]:
        """A second client of the same coordinator state."""
        coordinator = Coordinator(open_backend(url))
        yield coordinator
        coordinator.close()

    # -- grants and epochs ----------------------------------------------------------------
    def test_first_grant_has_epoch_1_and_a_full_token(self, coord: Coordinator) -> None:
        lease = coord.acquire(R, ttl=5, wait=0, holder="worker-a")
        assert lease.epoch == 1
        assert lease.resource == R
        assert lease.holder == "worker-a"
        assert lease.token == FencingToken(coord.coordinator_id, R, 1)
        assert FencingToken.parse(str(lease.token)) == lease.token
        assert lease.owner not in repr(lease)
        assert 0 < lease.expires_in <= 5

    def test_epochs_strictly_increase_across_release_and_expiry(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        epochs = []
        for _ in range(3):
            lease = coord.acquire(R, ttl=5, wait=0)
            epochs.append(lease.epoch)
            assert coord.release(lease)
        short = coord.acquire(R, ttl=0.2, wait=0, safety_margin=0.01)
        epochs.append(short.epoch)
        after_expiry = other.acquire(R, ttl=5, wait=2)
        epochs.append(after_expiry.epoch)
        assert epochs == [1, 2, 3, 4, 5]
        assert coord.last_epoch(R) == 5
        assert other.acquire("exports/other", ttl=5, wait=0).epoch == 1

    def test_busy_carries_holder_epoch_and_remaining(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        held = coord.acquire(R, ttl=10, wait=0, holder="worker-a")
        with pytest.raises(Busy) as caught:
            other.acquire(R, ttl=10, wait=0, holder="worker-b")
        assert caught.value.holder == "worker-a"
        assert caught.value.epoch == held.epoch
        assert 0 < caught.value.remaining <= 10
        assert coord.last_epoch(R) == held.epoch  # a refused acquire consumes no epoch

    def test_wait_times_out_with_busy_and_the_waiter_leaves_the_queue(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        held = coord.acquire(R, ttl=10, wait=0)
        started = time.monotonic()
        with pytest.raises(Busy):
            other.acquire(R, ttl=10, wait=0.3)
        assert time.monotonic() - started >= 0.29
        assert coord.release(held)
        # the waiter that gave up is not ahead of a newcomer trying once
        assert other.acquire(R, ttl=10, wait=0).epoch == held.epoch + 1

    def test_a_waiter_is_woken_by_release_not_by_expiry(
        self, coord: Coordinator, faulty: tuple[Coordinator, FaultyBackend]
    ) -> None:
        waiter_coord, backend = faulty
        held = coord.acquire(R, ttl=30, wait=0)
        waiter = ResultThread(lambda: waiter_coord.acquire(R, ttl=5, wait=20))
        waiter.start()
        wait_for(lambda: backend.calls.get("enqueue", 0) >= 1, what="the waiter to queue")
        released_at = time.monotonic()
        assert coord.release(held)
        waiter.join(10)
        assert waiter.error is None, waiter.error
        assert waiter.result.epoch == held.epoch + 1
        assert waiter.finished_at - released_at < 2.0  # woken by the release, ttl was 30 s

    def test_a_waiter_gets_the_lease_when_it_expires(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        held = coord.acquire(R, ttl=0.4, wait=0)
        started = time.monotonic()
        lease = other.acquire(R, ttl=5, wait=5)
        assert lease.epoch == held.epoch + 1
        assert time.monotonic() - started >= 0.3

    def test_waiters_are_served_first_come_first_served(self, coord: Coordinator, url: str) -> None:
        held = coord.acquire(R, ttl=30, wait=0)
        order: list[str] = []
        lock = threading.Lock()
        clients: list[Coordinator] = []
        threads: list[ResultThread] = []
        backends: list[FaultyBackend] = []
        for name in ("b", "c", "d"):
            backend = FaultyBackend(open_backend(url))
            client = Coordinator(backend)
            clients.append(client)
            backends.append(backend)

            def work(client: Coordinator = client, name: str = name) -> None:
                lease = client.acquire(R, ttl=5, wait=20, holder=name)
                with lock:
                    order.append(name)
                client.release(lease)

            thread = ResultThread(work)
            thread.start()
            threads.append(thread)
            wait_for(_enqueued(backend), what=f"{name} to queue")
        coord.release(held)
        for thread in threads:
            thread.join(15)
            assert thread.error is None, thread.error
        assert order == ["b", "c", "d"]
        for client in clients:
            client.close()

    # -- renew ----------------------------------------------------------------------------
    def test_renew_extends_and_moves_the_local_deadline(self, coord: Coordinator) -> None:
        lease = coord.acquire(R, ttl=2, wait=0)
        time.sleep(0.3)
        sent = time.monotonic()
        renewed = coord.renew(lease)
        assert renewed.epoch == lease.epoch
        assert renewed.deadline > lease.deadline
        info = coord.current(R)
        elapsed = time.monotonic() - sent
        # Renewed at or after ``sent``: at least 2 s from then remain, however slow the two
        # requests were; the lease as first granted would have at most 2 - 0.3 - elapsed.
        assert info is not None and info.expires_in > 2 - elapsed - 0.05

    def test_renew_by_another_owner_is_rejected(self, coord: Coordinator) -> None:
        lease = coord.acquire(R, ttl=5, wait=0)
        forged = dataclasses.replace(lease, owner="0" * 32)
        with pytest.raises(LeaseLost) as caught:
            coord.renew(forged)
        assert caught.value.reason is LossReason.REJECTED
        assert coord.renew(lease).epoch == lease.epoch

    def test_renew_after_release_or_takeover_raises_lease_lost(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        lease = coord.acquire(R, ttl=5, wait=0)
        assert coord.release(lease)
        with pytest.raises(LeaseLost):
            coord.renew(lease)
        old = other.acquire(R, ttl=0.3, wait=0, safety_margin=0.01)
        new = coord.acquire(R, ttl=5, wait=5)
        assert new.epoch == old.epoch + 1
        with pytest.raises(LeaseLost):
            other.renew(old)
        assert coord.current(R) is not None and coord.current(R).epoch == new.epoch  # type: ignore[union-attr]

    # -- release --------------------------------------------------------------------------
    def test_release_is_idempotent_and_compares_owner_and_epoch(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        old = coord.acquire(R, ttl=0.3, wait=0, safety_margin=0.01)
        new = other.acquire(R, ttl=10, wait=5)
        assert coord.release(old) is False  # delayed release from the old owner
        info = coord.current(R)
        assert info is not None and info.epoch == new.epoch
        assert other.release(dataclasses.replace(new, owner="f" * 32)) is False
        assert other.release(new) is True
        assert other.release(new) is False
        assert coord.current(R) is None

    def test_current_describes_the_live_lease_only(self, coord: Coordinator) -> None:
        assert coord.current(R) is None
        lease = coord.acquire(R, ttl=0.5, wait=0, holder="worker-a", safety_margin=0.01)
        info = coord.current(R)
        assert info is not None
        assert (info.resource, info.epoch, info.holder) == (R, lease.epoch, "worker-a")
        assert 0 < info.expires_in <= 0.5
        assert info.token == lease.token
        wait_for(lambda: coord.current(R) is None, timeout=3, what="expiry")
        assert R in coord.resources()

    # -- request ids and lost replies -----------------------------------------------------
    def test_request_id_retry_returns_the_same_lease(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        first = coord.acquire(R, ttl=5, wait=0, request_id="req-1")
        again = other.acquire(R, ttl=5, wait=0, request_id="req-1")
        assert (again.epoch, again.owner) == (first.epoch, first.owner)
        assert coord.last_epoch(R) == first.epoch
        assert coord.release(first)
        with pytest.raises(LeaseLost):
            other.acquire(R, ttl=5, wait=0, request_id="req-1")
        assert coord.acquire(R, ttl=5, wait=0, request_id="req-2").epoch == first.epoch + 1

    def test_lost_grant_reply_is_recovered_by_request_id(
        self, faulty: tuple[Coordinator, FaultyBackend], other: Coordinator
    ) -> None:
        coord, backend = faulty
        backend.arm("try_grant", "lose_reply")
        with pytest.raises(OutcomeUnknown):
            coord.acquire(R, ttl=5, wait=0, request_id="lost-1")
        with pytest.raises(Busy):  # it was granted: the reply was lost, not the grant
            other.acquire(R, ttl=5, wait=0)
        lease = coord.acquire(R, ttl=5, wait=0, request_id="lost-1")
        assert lease.epoch == 1
        assert coord.last_epoch(R) == 1
        assert coord.release(lease)

    # -- validation -----------------------------------------------------------------------
    @pytest.mark.parametrize("kwargs", BAD_PARAMETERS)
    def test_bad_parameters_fail_loudly_and_grant_nothing(
        self, coord: Coordinator, kwargs: dict[str, Any]
    ) -> None:
        with pytest.raises(ConfigurationError):
            coord.acquire(R, **kwargs)
        assert coord.last_epoch(R) == 0
        with pytest.raises(ConfigurationError):
            coord.hold(R, **kwargs)

    @pytest.mark.parametrize("name", BAD_NAMES)
    def test_invalid_names_are_rejected_before_any_io(self, coord: Coordinator, name: str) -> None:
        with pytest.raises(InvalidName):
            coord.acquire(name, ttl=5, wait=0)
        with pytest.raises(InvalidName):
            coord.current(name)
        assert coord.resources() == []

    def test_a_lease_of_another_coordinator_is_refused(self, coord: Coordinator) -> None:
        lease = coord.acquire(R, ttl=5, wait=0)
        alien = dataclasses.replace(lease, token=FencingToken("a" * 32, R, lease.epoch))
        with pytest.raises(ConfigurationError):
            coord.release(alien)
        assert coord.current(R) is not None

    # -- hold -----------------------------------------------------------------------------
    def test_hold_renews_in_the_background_and_releases_on_exit(self, coord: Coordinator) -> None:
        with coord.hold(R, ttl=0.6, wait=0) as held:
            assert held.state is LeaseState.HELD
            started = time.monotonic()
            while time.monotonic() - started < 1.5:  # 2.5 x ttl: only renewals keep it
                held.check()
                time.sleep(0.05)
            info = coord.current(R)
            assert info is not None and info.epoch == held.epoch
            assert not held.lost.is_set()
        assert coord.current(R) is None

    def test_hold_failed_renewals_go_uncertain_then_lost(
        self, faulty: tuple[Coordinator, FaultyBackend]
    ) -> None:
        coord, backend = faulty
        losses: list[LeaseLost] = []
        states: list[LeaseState] = []
        with (
            pytest.raises(LeaseLost) as caught,
            coord.hold(R, ttl=0.9, wait=0, on_lost=losses.append) as held,
        ):
            backend.arm("renew", "unavailable", times=None)
            wait_for(lambda: held.state is not LeaseState.HELD, timeout=3, what="UNCERTAIN")
            states.append(held.state)
            with pytest.raises(LeaseLost):
                held.check()
            assert held.lost.wait(3)
            states.append(held.state)
        assert states == [LeaseState.UNCERTAIN, LeaseState.LOST]
        assert len(losses) == 1 and losses[0].reason is LossReason.EXPIRED
        assert caught.value.reason is LossReason.EXPIRED

    def test_hold_signals_loss_at_once_when_the_coordinator_says_no(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        losses: list[LeaseLost] = []
        with (
            pytest.raises(LeaseLost),
            coord.hold(R, ttl=1.5, wait=0, on_lost=losses.append) as held,
        ):
            assert other.release(held.lease)  # as if its lease ended at the coordinator
            assert held.lost.wait(1.4)  # before the deadline: on the next renewal
        assert [loss.reason for loss in losses] == [LossReason.REJECTED]

    def test_hold_lost_reply_on_renewal_is_only_uncertain(
        self, faulty: tuple[Coordinator, FaultyBackend]
    ) -> None:
        coord, backend = faulty
        with coord.hold(R, ttl=0.9, wait=0) as held:
            backend.arm("renew", "lose_reply", times=1)
            wait_for(lambda: backend.injected.get("renew", 0) == 1, timeout=3, what="a renewal")
            wait_for(
                lambda: held.state is LeaseState.HELD and backend.calls["renew"] >= 2,
                timeout=3,
                what="the next renewal",
            )
            assert not held.lost.is_set()

    def test_hold_installs_at_stores_before_the_body(self, coord: Coordinator) -> None:
        stores = [_RecordingStore(), _RecordingStore()]
        with coord.hold(R, ttl=5, wait=0, fence=stores) as held:
            assert [s.installed for s in stores] == [[held.token], [held.token]]

    def test_hold_refused_by_a_store_with_a_higher_floor_releases(self, coord: Coordinator) -> None:
        with (
            pytest.raises(StaleToken) as caught,
            coord.hold(R, ttl=5, wait=0, fence=[_RecordingStore(floor=99)]),
        ):
            pytest.fail("the body must not run")
        assert any("restored" in note for note in caught.value.__notes__)
        assert coord.current(R) is None

    def test_hold_does_not_mask_the_body_exception(self, coord: Coordinator) -> None:
        class Boom(Exception):
            pass

        with pytest.raises(Boom), coord.hold(R, ttl=5, wait=0):
            raise Boom
        assert coord.current(R) is None

    def test_hold_when_busy_raises_busy_and_runs_nothing(
        self, coord: Coordinator, other: Coordinator
    ) -> None:
        other.acquire(R, ttl=10, wait=0)
        with pytest.raises(Busy), coord.hold(R, ttl=5, wait=0):
            pytest.fail("the body must not run when acquisition failed")

    def test_close_is_idempotent(self, url: str) -> None:
        coordinator = Coordinator(open_backend(url))
        coordinator.close()
        coordinator.close()


class _SlowReplies:
    """Wraps a backend; advances a manual clock while a call is in flight (a slow reply)."""

    def __init__(self, inner: Any, clock: ManualClock, delay: float) -> None:
        self._inner = inner
        self._clock = clock
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def try_grant(self, request: GrantRequest, ticket: Any) -> Any:
        result = self._inner.try_grant(request, ticket)
        self._clock.advance(self._delay)
        return result

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        remaining: float = self._inner.renew(resource, epoch, owner, ttl)
        self._clock.advance(self._delay)
        return remaining


class ManualClockConformance:
    """Expiry by the coordinator's injectable clock: exact, immune to wall-clock steps."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError("the backend's test module provides the url fixture")

    @pytest.fixture
    def clock(self) -> ManualClock:
        return ManualClock()

    @pytest.fixture
    def coord(self, url: str, clock: ManualClock) -> Iterator[Coordinator]:
        coordinator = Coordinator(open_backend(url, host_clock=clock), clock=clock)
        yield coordinator
        coordinator.close()

    def test_expiry_is_decided_by_the_coordinator_clock(
        self, coord: Coordinator, clock: ManualClock
    ) -> None:
        lease = coord.acquire(R, ttl=10, wait=0)
        clock.advance(9.9)
        assert coord.current(R) is not None
        clock.advance(0.2)
        assert coord.current(R) is None
        assert coord.acquire(R, ttl=10, wait=0).epoch == lease.epoch + 1

    @pytest.mark.parametrize("step", [3600.0, -3600.0, 86400.0 * 365])
    def test_a_wall_clock_step_neither_expires_nor_extends(
        self, coord: Coordinator, clock: ManualClock, step: float
    ) -> None:
        lease = coord.acquire(R, ttl=10, wait=0)
        before = coord.current(R)
        clock.jump_wall(step)
        after = coord.current(R)
        assert before is not None and after is not None
        assert after.expires_in == pytest.approx(before.expires_in)
        assert coord.renew(lease).deadline == pytest.approx(lease.deadline)
        clock.advance(10.01)
        assert coord.current(R) is None

    def test_a_lease_from_before_a_reboot_is_expired(
        self, coord: Coordinator, clock: ManualClock
    ) -> None:
        lease = coord.acquire(R, ttl=1000, wait=0)
        clock.reboot()
        assert coord.current(R) is None
        assert coord.acquire(R, ttl=10, wait=0).epoch == lease.epoch + 1

    def test_an_expired_lease_is_never_revived_by_renew(self, url: str, clock: ManualClock) -> None:
        local = ManualClock()  # the holder's own clock stands still: only the coordinator's moves
        coordinator = Coordinator(open_backend(url, host_clock=clock), clock=local)
        lease = coordinator.acquire(R, ttl=10, wait=0)
        clock.advance(10.5)
        with pytest.raises(LeaseLost) as caught:
            coordinator.renew(lease)
        assert caught.value.reason is LossReason.REJECTED
        assert coordinator.current(R) is None
        coordinator.close()

    def test_the_local_deadline_counts_from_when_the_request_was_sent(
        self, url: str, clock: ManualClock
    ) -> None:
        slow = _SlowReplies(open_backend(url, host_clock=clock), clock, delay=3.0)
        coordinator = Coordinator(slow, clock=clock)
        sent = clock.now()
        lease = coordinator.acquire(R, ttl=10, wait=0, safety_margin=1)
        assert lease.deadline == pytest.approx(sent + 10 - 1)  # not reply time + ttl
        sent = clock.now()
        renewed = coordinator.renew(lease)
        assert renewed.deadline == pytest.approx(sent + 10 - 1)
        coordinator.close()

    def test_the_local_deadline_passes_before_the_coordinator_expiry(
        self, coord: Coordinator, clock: ManualClock
    ) -> None:
        lease = coord.acquire(R, ttl=10, wait=0, safety_margin=2)
        clock.advance(8.5)
        with pytest.raises(LeaseLost) as caught:
            coord.renew(lease)
        assert caught.value.reason is LossReason.EXPIRED
        assert coord.current(R) is not None  # the coordinator still has it: the holder stops first

    def test_granted_is_the_backend_answer(self, url: str, clock: ManualClock) -> None:
        backend = open_backend(url, host_clock=clock)
        result = backend.try_grant(GrantRequest(R, 10.0, "1" * 32, "h"), None)
        assert isinstance(result, Granted) and result.epoch == 1 and result.ttl == 10.0
        backend.close()


class HistoryConformance:
    """Records (docs/operations.md), proclaim and watch: what timelines, metrics and elections
    build on."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError("the backend's test module provides the url fixture")

    @pytest.fixture
    def coord(self, url: str) -> Iterator[Coordinator]:
        coordinator = Coordinator(open_backend(url))
        yield coordinator
        coordinator.close()

    def test_grants_releases_and_expiries_are_recorded_in_order(self, coord: Coordinator) -> None:
        first = coord.acquire(R, ttl=5, wait=0, holder="a")
        coord.release(first)
        second = coord.acquire(R, ttl=0.2, wait=0, holder="b", safety_margin=0.01)
        wait_for(lambda: coord.current(R) is None, timeout=3, what="expiry")
        third = coord.acquire(R, ttl=5, wait=0, holder="c")
        history = coord.history(R)
        assert [(r.kind, r.epoch, r.holder) for r in history] == [
            (RecordKind.GRANTED, first.epoch, "a"),
            (RecordKind.RELEASED, first.epoch, "a"),
            (RecordKind.GRANTED, second.epoch, "b"),
            (RecordKind.EXPIRED, second.epoch, "b"),
            (RecordKind.GRANTED, third.epoch, "c"),
        ]
        assert [r.detail.get("after") for r in history if r.kind is RecordKind.GRANTED] == [
            "none",
            "released",
            "expired",
        ]
        seqs = [r.seq for r in history]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert history[3].at <= history[4].at  # the expiry is dated when it happened
        assert coord.history(R, after=seqs[2]) == history[3:]
        assert all(first.owner not in str(r.to_json()) for r in history)

    def test_holder_reported_renewal_failures_are_recorded(self, url: str) -> None:
        backend = FaultyBackend(open_backend(url))
        coordinator = Coordinator(backend)
        with (
            pytest.raises(LeaseLost),
            coordinator.hold(R, ttl=0.6, wait=0, holder="flaky") as held,
        ):
            backend.arm("renew", "unavailable", times=None)
            assert held.lost.wait(3)
        wanted = {RecordKind.RENEWAL_FAILED, RecordKind.LOST}
        wait_for(  # reports are sent in the background, after the signals
            lambda: wanted <= {r.kind for r in coordinator.history(R)}, what="the reports"
        )
        coordinator.close()

    def test_a_grant_record_carries_the_advertised_value(self, coord: Coordinator) -> None:
        lease = coord.acquire(R, ttl=5, wait=0, value="10.0.0.7:8080")
        coord.release(lease)
        coord.acquire(R, ttl=5, wait=0)
        grants = [r.detail for r in coord.history(R) if r.kind is RecordKind.GRANTED]
        assert [g.get("value") for g in grants] == ["10.0.0.7:8080", None]

    def test_proclaim_changes_the_value_not_the_epoch(self, coord: Coordinator) -> None:
        lease = coord.acquire(R, ttl=5, wait=0)
        coord.backend.proclaim(R, lease.epoch, lease.owner, "10.0.0.7:8080")
        info = coord.current(R)
        assert info is not None and (info.epoch, info.value) == (lease.epoch, "10.0.0.7:8080")
        assert coord.history(R)[-1].kind is RecordKind.PROCLAIMED
        with pytest.raises(LeaseLost):
            coord.backend.proclaim(R, lease.epoch, "0" * 32, "forged")

    def test_watch_is_woken_by_a_change(self, coord: Coordinator) -> None:
        last = coord.history(R)[-1].seq if coord.history(R) else 0
        lease = coord.acquire(R, ttl=30, wait=0)
        started = time.monotonic()
        coord.backend.watch(R, last, timeout=10)  # a grant is already there: returns at once
        last = coord.history(R)[-1].seq
        waker = threading.Timer(0.2, lambda: coord.release(lease))
        waker.start()
        coord.backend.watch(R, last, timeout=10)
        waker.join()
        assert time.monotonic() - started < 5  # woken by the release, not the 10 s timeout
        assert coord.history(R, after=last)[0].kind is RecordKind.RELEASED

    def test_advance_puts_every_later_epoch_above_the_minimum(self, coord: Coordinator) -> None:
        old = coord.acquire(R, ttl=30, wait=0)
        coord.acquire("exports/weekly", ttl=30, wait=0)
        minimum = coord.backend.advance(1 << 40, {"exports/monthly": (1 << 41) + 5}, {"why": "t"})
        assert minimum == 1 << 40
        assert coord.current(R) is None  # leases of the state before the restore are gone
        assert coord.release(old) is False
        assert coord.acquire(R, ttl=5, wait=0).epoch == (1 << 40) + 1
        assert coord.acquire("exports/never-seen", ttl=5, wait=0).epoch == (1 << 40) + 1
        assert coord.acquire("exports/monthly", ttl=5, wait=0).epoch == (1 << 41) + 6
        assert coord.backend.advance(5, {}, {}) == 1 << 40  # never lowered
        restored = [r for r in coord.history(R) if r.kind is RecordKind.RESTORED]
        assert len(restored) == 2 and restored[0].detail["why"] == "t"

"""The coordinator conformance suite on the asyncio face: the same cases, awaited.

A backend's test module subclasses these next to the sync suite (:mod:`fenced.testing.
conformance`), with the same ``url`` fixture; the tests are ``async def`` and need pytest-asyncio
(``asyncio_mode = "auto"``)::

    class TestSQLiteAsync(AsyncCoordinatorConformance, AsyncHistoryConformance):
        @pytest.fixture
        def url(self, tmp_path):
            return f"sqlite:///{tmp_path}/fenced.db"

* :class:`AsyncCoordinatorConformance` — every case of ``CoordinatorConformance`` (same names),
  plus what only the asyncio face has: the loss cancels the body of ``hold``; a shielded body
  still sees ``held.lost``; ``cancel_on_loss=False``; a cancelled waiting ``acquire`` leaves the
  queue and consumes no epoch; a cancelled ``release`` never half-releases; waiting holds no
  thread; ``aclose`` leaves no task and no thread.
* :class:`AsyncHistoryConformance` — records, proclaim, watch, observe.

The expiry-clock cases (``ManualClockConformance``) are not repeated: they test decisions made
by the backends' own steps and by :mod:`fenced.coordinator._requests`, which both faces share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar

import pytest

from fenced.aio._connect import open_async_backend
from fenced.aio._coordinator import AsyncCoordinator
from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
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
from fenced.election._observer import LeaderChangeKind
from fenced.testing.conformance import BAD_NAMES, BAD_PARAMETERS
from fenced.testing.faults import AsyncFaultyBackend

__all__ = ["AsyncCoordinatorConformance", "AsyncHistoryConformance", "async_wait_for"]

R = "exports/daily"


async def async_wait_for(
    condition: Callable[[], object], timeout: float = 5.0, what: str = ""
) -> None:
    """Poll ``condition`` until truthy (yielding to the loop); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what or condition}")
        await asyncio.sleep(0.005)


async def _within(awaitable: Awaitable[Any], timeout: float) -> Any:
    return await asyncio.wait_for(awaitable, timeout)


class _RecordingStore:
    """An async Fenceable that records installs, optionally refusing with a higher floor."""

    def __init__(self, floor: int = 0) -> None:
        self.floor = floor
        self.installed: list[FencingToken] = []

    async def fence(self, token: FencingToken) -> int:
        await asyncio.sleep(0)
        if token.epoch < self.floor:
            raise StaleToken(token.resource, token.epoch, self.floor)
        self.floor = token.epoch
        self.installed.append(token)
        return self.floor


class _Clients:
    """The coordinators a test opened: all closed at its end."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url = url
        self.options = options
        self.opened: list[AsyncCoordinator] = []

    async def backend(self) -> AsyncCoordinatorBackend:
        return await open_async_backend(self.url, **self.options)

    async def open(self) -> AsyncCoordinator:
        self.opened.append(AsyncCoordinator(await self.backend()))
        return self.opened[-1]

    async def faulty(self) -> tuple[AsyncCoordinator, AsyncFaultyBackend]:
        backend = AsyncFaultyBackend(await self.backend())
        self.opened.append(AsyncCoordinator(backend))
        return self.opened[-1], backend

    async def aclose(self) -> None:
        for coord in self.opened:
            await coord.aclose()


class AsyncCoordinatorConformance:
    """The coordinator contract on the asyncio face. Subclasses provide the ``url`` fixture
    and may set ``connect_options`` (keyword arguments of ``fenced.aio.connect``, such as
    ``{"offload": True}`` for ``sqlite:``)."""

    connect_options: ClassVar[dict[str, Any]] = {}

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError("the backend's test module provides the url fixture")

    @pytest.fixture
    async def clients(self, url: str) -> AsyncIterator[_Clients]:
        clients = _Clients(url, self.connect_options)
        yield clients
        await clients.aclose()

    @pytest.fixture
    async def coord(self, clients: _Clients) -> AsyncCoordinator:
        return await clients.open()

    @pytest.fixture
    async def other(self, clients: _Clients) -> AsyncCoordinator:
        """A second client of the same coordinator state."""
        return await clients.open()

    @pytest.fixture
    async def faulty(self, clients: _Clients) -> tuple[AsyncCoordinator, AsyncFaultyBackend]:
        return await clients.faulty()

    # -- grants and epochs ----------------------------------------------------------------
    async def test_first_grant_has_epoch_1_and_a_full_token(self, coord: AsyncCoordinator) -> None:
        lease = await coord.acquire(R, ttl=5, wait=0, holder="worker-a")
        assert lease.epoch == 1
        assert lease.resource == R
        assert lease.holder == "worker-a"
        assert lease.token == FencingToken(coord.coordinator_id, R, 1)
        assert lease.owner not in repr(lease)
        assert 0 < lease.expires_in <= 5

    async def test_epochs_strictly_increase_across_release_and_expiry(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        epochs = []
        for _ in range(3):
            lease = await coord.acquire(R, ttl=5, wait=0)
            epochs.append(lease.epoch)
            assert await coord.release(lease)
        short = await coord.acquire(R, ttl=0.2, wait=0, safety_margin=0.01)
        epochs.append(short.epoch)
        after_expiry = await other.acquire(R, ttl=5, wait=2)
        epochs.append(after_expiry.epoch)
        assert epochs == [1, 2, 3, 4, 5]
        assert await coord.last_epoch(R) == 5
        assert (await other.acquire("exports/other", ttl=5, wait=0)).epoch == 1

    async def test_busy_carries_holder_epoch_and_remaining(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        held = await coord.acquire(R, ttl=10, wait=0, holder="worker-a")
        with pytest.raises(Busy) as caught:
            await other.acquire(R, ttl=10, wait=0, holder="worker-b")
        assert caught.value.holder == "worker-a"
        assert caught.value.epoch == held.epoch
        assert 0 < caught.value.remaining <= 10
        assert await coord.last_epoch(R) == held.epoch

    async def test_wait_times_out_with_busy_and_the_waiter_leaves_the_queue(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        held = await coord.acquire(R, ttl=10, wait=0)
        started = time.monotonic()
        with pytest.raises(Busy):
            await other.acquire(R, ttl=10, wait=0.3)
        assert time.monotonic() - started >= 0.29
        assert await coord.release(held)
        assert (await other.acquire(R, ttl=10, wait=0)).epoch == held.epoch + 1

    async def test_a_waiter_is_woken_by_release_not_by_expiry(
        self, coord: AsyncCoordinator, faulty: tuple[AsyncCoordinator, AsyncFaultyBackend]
    ) -> None:
        waiter_coord, backend = faulty
        held = await coord.acquire(R, ttl=30, wait=0)
        waiter = asyncio.create_task(waiter_coord.acquire(R, ttl=5, wait=20))
        await async_wait_for(lambda: backend.answered.get("enqueue", 0) >= 1, what="queued")
        released_at = time.monotonic()
        assert await coord.release(held)
        lease = await _within(waiter, 10)
        assert lease.epoch == held.epoch + 1
        assert time.monotonic() - released_at < 2.0  # woken by the release, ttl was 30 s

    async def test_a_waiter_gets_the_lease_when_it_expires(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        held = await coord.acquire(R, ttl=0.4, wait=0)
        started = time.monotonic()
        lease = await other.acquire(R, ttl=5, wait=5)
        assert lease.epoch == held.epoch + 1
        assert time.monotonic() - started >= 0.3

    async def test_waiters_are_served_first_come_first_served(
        self, coord: AsyncCoordinator, clients: _Clients
    ) -> None:
        held = await coord.acquire(R, ttl=30, wait=0)
        order: list[str] = []
        tasks = []
        for name in ("b", "c", "d"):
            client, backend = await clients.faulty()

            async def work(client: AsyncCoordinator = client, name: str = name) -> None:
                lease = await client.acquire(R, ttl=5, wait=20, holder=name)
                order.append(name)
                await client.release(lease)

            tasks.append(asyncio.create_task(work()))
            await async_wait_for(
                lambda backend=backend: backend.answered.get("enqueue", 0) >= 1,  # type: ignore[misc]
                what=f"{name} to queue",
            )
        await coord.release(held)
        await _within(asyncio.gather(*tasks), 15)
        assert order == ["b", "c", "d"]

    # -- renew ----------------------------------------------------------------------------
    async def test_renew_extends_and_moves_the_local_deadline(
        self, coord: AsyncCoordinator
    ) -> None:
        lease = await coord.acquire(R, ttl=2, wait=0)
        await asyncio.sleep(0.3)
        sent = time.monotonic()
        renewed = await coord.renew(lease)
        assert renewed.epoch == lease.epoch
        assert renewed.deadline > lease.deadline
        info = await coord.current(R)
        elapsed = time.monotonic() - sent
        # Renewed at or after ``sent``: at least 2 s from then remain, however slow the two
        # requests were; the lease as first granted would have at most 2 - 0.3 - elapsed.
        assert info is not None and info.expires_in > 2 - elapsed - 0.05

    async def test_renew_by_another_owner_is_rejected(self, coord: AsyncCoordinator) -> None:
        lease = await coord.acquire(R, ttl=5, wait=0)
        with pytest.raises(LeaseLost) as caught:
            await coord.renew(dataclasses.replace(lease, owner="0" * 32))
        assert caught.value.reason is LossReason.REJECTED
        assert (await coord.renew(lease)).epoch == lease.epoch

    async def test_renew_after_release_or_takeover_raises_lease_lost(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        lease = await coord.acquire(R, ttl=5, wait=0)
        assert await coord.release(lease)
        with pytest.raises(LeaseLost):
            await coord.renew(lease)
        old = await other.acquire(R, ttl=0.3, wait=0, safety_margin=0.01)
        new = await coord.acquire(R, ttl=5, wait=5)
        assert new.epoch == old.epoch + 1
        with pytest.raises(LeaseLost):
            await other.renew(old)
        info = await coord.current(R)
        assert info is not None and info.epoch == new.epoch

    # -- release --------------------------------------------------------------------------
    async def test_release_is_idempotent_and_compares_owner_and_epoch(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        old = await coord.acquire(R, ttl=0.3, wait=0, safety_margin=0.01)
        new = await other.acquire(R, ttl=10, wait=5)
        assert await coord.release(old) is False
        info = await coord.current(R)
        assert info is not None and info.epoch == new.epoch
        assert await other.release(dataclasses.replace(new, owner="f" * 32)) is False
        assert await other.release(new) is True
        assert await other.release(new) is False
        assert await coord.current(R) is None

    async def test_current_describes_the_live_lease_only(self, coord: AsyncCoordinator) -> None:
        assert await coord.current(R) is None
        lease = await coord.acquire(R, ttl=0.5, wait=0, holder="worker-a", safety_margin=0.01)
        info = await coord.current(R)
        assert info is not None
        assert (info.resource, info.epoch, info.holder) == (R, lease.epoch, "worker-a")
        assert 0 < info.expires_in <= 0.5
        deadline = time.monotonic() + 3
        while await coord.current(R) is not None:
            assert time.monotonic() < deadline, "the lease never expired"
            await asyncio.sleep(0.02)
        assert R in await coord.resources()

    # -- request ids and lost replies -----------------------------------------------------
    async def test_request_id_retry_returns_the_same_lease(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        first = await coord.acquire(R, ttl=5, wait=0, request_id="req-1")
        again = await other.acquire(R, ttl=5, wait=0, request_id="req-1")
        assert (again.epoch, again.owner) == (first.epoch, first.owner)
        assert await coord.last_epoch(R) == first.epoch
        assert await coord.release(first)
        with pytest.raises(LeaseLost):
            await other.acquire(R, ttl=5, wait=0, request_id="req-1")
        assert (await coord.acquire(R, ttl=5, wait=0, request_id="req-2")).epoch == first.epoch + 1

    async def test_lost_grant_reply_is_recovered_by_request_id(
        self, faulty: tuple[AsyncCoordinator, AsyncFaultyBackend], other: AsyncCoordinator
    ) -> None:
        coord, backend = faulty
        backend.arm("try_grant", "lose_reply")
        with pytest.raises(OutcomeUnknown):
            await coord.acquire(R, ttl=5, wait=0, request_id="lost-1")
        with pytest.raises(Busy):
            await other.acquire(R, ttl=5, wait=0)
        lease = await coord.acquire(R, ttl=5, wait=0, request_id="lost-1")
        assert lease.epoch == 1
        assert await coord.last_epoch(R) == 1
        assert await coord.release(lease)

    # -- validation -----------------------------------------------------------------------
    @pytest.mark.parametrize("kwargs", BAD_PARAMETERS)
    async def test_bad_parameters_fail_loudly_and_grant_nothing(
        self, faulty: tuple[AsyncCoordinator, AsyncFaultyBackend], kwargs: dict[str, Any]
    ) -> None:
        coord, backend = faulty
        with pytest.raises(ConfigurationError):
            await coord.acquire(R, **kwargs)
        with pytest.raises(ConfigurationError):
            coord.hold(R, **kwargs)
        assert backend.calls == {}  # refused before any I/O
        assert await coord.last_epoch(R) == 0

    @pytest.mark.parametrize("name", BAD_NAMES)
    async def test_invalid_names_are_rejected_before_any_io(
        self, faulty: tuple[AsyncCoordinator, AsyncFaultyBackend], name: str
    ) -> None:
        coord, backend = faulty
        with pytest.raises(InvalidName):
            await coord.acquire(name, ttl=5, wait=0)
        with pytest.raises(InvalidName):
            await coord.current(name)
        assert backend.calls == {}
        assert await coord.resources() == []

    async def test_a_lease_of_another_coordinator_is_refused(self, coord: AsyncCoordinator) -> None:
        lease = await coord.acquire(R, ttl=5, wait=0)
        alien = dataclasses.replace(lease, token=FencingToken("a" * 32, R, lease.epoch))
        with pytest.raises(ConfigurationError):
            await coord.release(alien)
        assert await coord.current(R) is not None

    # -- hold -----------------------------------------------------------------------------
    async def test_hold_renews_in_the_background_and_releases_on_exit(
        self, coord: AsyncCoordinator
    ) -> None:
        async with coord.hold(R, ttl=0.6, wait=0) as held:
            assert held.state is LeaseState.HELD
            started = time.monotonic()
            while time.monotonic() - started < 1.5:  # 2.5 x ttl: only renewals keep it
                held.check()
                await asyncio.sleep(0.05)
            info = await coord.current(R)
            assert info is not None and info.epoch == held.epoch
            assert not held.lost.is_set()
        assert await coord.current(R) is None

    async def test_hold_failed_renewals_go_uncertain_then_lost(
        self, faulty: tuple[AsyncCoordinator, AsyncFaultyBackend]
    ) -> None:
        coord, backend = faulty
        losses: list[LeaseLost] = []
        states: list[LeaseState] = []
        with pytest.raises(LeaseLost) as caught:
            async with coord.hold(
                R, ttl=0.9, wait=0, on_lost=losses.append, cancel_on_loss=False
            ) as held:
                backend.arm("renew", "unavailable", times=None)
                await async_wait_for(lambda: held.state is not LeaseState.HELD, 3, "UNCERTAIN")
                states.append(held.state)
                with pytest.raises(LeaseLost):
                    held.check()
                await _within(held.lost.wait(), 3)
                states.append(held.state)
        assert states == [LeaseState.UNCERTAIN, LeaseState.LOST]
        assert len(losses) == 1 and losses[0].reason is LossReason.EXPIRED
        assert caught.value.reason is LossReason.EXPIRED

    async def test_hold_signals_loss_at_once_when_the_coordinator_says_no(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        losses: list[LeaseLost] = []
        with pytest.raises(LeaseLost):
            async with coord.hold(
                R, ttl=1.5, wait=0, on_lost=losses.append, cancel_on_loss=False
            ) as held:
                assert await other.release(held.lease)
                await _within(held.lost.wait(), 1.4)  # before the deadline: next renewal
        assert [loss.reason for loss in losses] == [LossReason.REJECTED]

    async def test_hold_lost_reply_on_renewal_is_only_uncertain(
        self, faulty: tuple[AsyncCoordinator, AsyncFaultyBackend]
    ) -> None:
        coord, backend = faulty
        async with coord.hold(R, ttl=0.9, wait=0) as held:
            backend.arm("renew", "lose_reply", times=1)
            await async_wait_for(lambda: backend.injected.get("renew", 0) == 1, 3, "a renewal")
            await async_wait_for(
                lambda: held.state is LeaseState.HELD and backend.calls["renew"] >= 2,
                3,
                "the next renewal",
            )
            assert not held.lost.is_set()

    async def test_hold_installs_at_stores_before_the_body(self, coord: AsyncCoordinator) -> None:
        stores = [_RecordingStore(), _RecordingStore()]
        async with coord.hold(R, ttl=5, wait=0, fence=stores) as held:
            assert [s.installed for s in stores] == [[held.token], [held.token]]

    async def test_hold_refused_by_a_store_with_a_higher_floor_releases(
        self, coord: AsyncCoordinator
    ) -> None:
        with pytest.raises(StaleToken) as caught:
            async with coord.hold(R, ttl=5, wait=0, fence=[_RecordingStore(floor=99)]):
                pytest.fail("the body must not run")
        assert any("restored" in note for note in caught.value.__notes__)
        assert await coord.current(R) is None

    async def test_hold_does_not_mask_the_body_exception(self, coord: AsyncCoordinator) -> None:
        class Boom(Exception):
            pass

        with pytest.raises(Boom):
            async with coord.hold(R, ttl=5, wait=0):
                raise Boom
        assert await coord.current(R) is None

    async def test_hold_when_busy_raises_busy_and_runs_nothing(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        await other.acquire(R, ttl=10, wait=0)
        with pytest.raises(Busy):
            async with coord.hold(R, ttl=5, wait=0):
                pytest.fail("the body must not run when acquisition failed")

    async def test_close_is_idempotent(self, clients: _Clients) -> None:
        coordinator = AsyncCoordinator(await clients.backend())
        await coordinator.aclose()
        await coordinator.aclose()

    # -- what only the asyncio face has ---------------------------------------------------
    async def test_the_loss_cancels_a_body_blocked_in_a_long_sleep(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        reached: list[str] = []
        with pytest.raises(LeaseLost) as caught:
            async with coord.hold(R, ttl=1.5, wait=0) as held:
                assert await other.release(held.lease)  # the coordinator ends it
                try:
                    await asyncio.sleep(3600)
                finally:
                    reached.append("cancelled")
        assert reached == ["cancelled"]
        assert caught.value.reason is LossReason.REJECTED
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # no cancellation left behind
        await asyncio.sleep(0)  # and none delivered later

    async def test_a_shielded_body_still_sees_lost(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        async def protected() -> str:
            await _within(held.lost.wait(), 3)
            return "finished its clean-up"

        with pytest.raises(LeaseLost):
            async with coord.hold(R, ttl=1.5, wait=0) as held:
                assert await other.release(held.lease)
                inner = asyncio.ensure_future(protected())
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.shield(inner)  # the body is cancelled, the work is not
                assert await inner == "finished its clean-up"
                assert held.lost.is_set()

    async def test_cancel_on_loss_off_leaves_the_body_to_lost(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        with pytest.raises(LeaseLost):
            async with coord.hold(R, ttl=1.5, wait=0, cancel_on_loss=False) as held:
                assert await other.release(held.lease)
                await _within(held.lost.wait(), 3)
                await asyncio.sleep(0.05)  # still running: nothing cancelled it
                with pytest.raises(LeaseLost):
                    held.check()

    async def test_a_cancellation_from_elsewhere_is_never_swallowed(
        self, coord: AsyncCoordinator
    ) -> None:
        entered = asyncio.Event()

        async def body() -> None:
            async with coord.hold(R, ttl=5, wait=0):
                entered.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(body())
        await _within(entered.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await coord.current(R) is None  # released on the way out

    async def test_a_cancelled_waiting_acquire_leaves_the_queue_and_consumes_no_epoch(
        self,
        coord: AsyncCoordinator,
        other: AsyncCoordinator,
        faulty: tuple[AsyncCoordinator, AsyncFaultyBackend],
    ) -> None:
        waiter_coord, backend = faulty
        held = await coord.acquire(R, ttl=30, wait=0)
        cancelled = asyncio.create_task(waiter_coord.acquire(R, ttl=5, wait=None))
        await async_wait_for(lambda: backend.answered.get("enqueue", 0) >= 1, what="queued")
        behind = asyncio.create_task(other.acquire(R, ttl=5, wait=20))
        await asyncio.sleep(0.1)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert await coord.release(held)
        lease = await _within(behind, 10)  # not held up by the cancelled waiter
        assert lease.epoch == held.epoch + 1  # no epoch went to the cancelled one

    async def test_a_cancelled_release_never_half_releases(
        self, faulty: tuple[AsyncCoordinator, AsyncFaultyBackend], other: AsyncCoordinator
    ) -> None:
        coord, backend = faulty
        lease = await coord.acquire(R, ttl=10, wait=0)
        backend.arm("release", "delay", delay=0.3)
        releasing = asyncio.create_task(coord.release(lease))
        await async_wait_for(lambda: backend.calls.get("release", 0) >= 1, what="release sent")
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        await async_wait_for(lambda: backend.answered.get("release", 0) >= 1, 3, "release done")
        assert await other.current(R) is None  # it completed: released, not half done
        assert (await other.acquire(R, ttl=5, wait=0)).epoch == lease.epoch + 1

    async def test_many_waiting_tasks_hold_no_thread(
        self, coord: AsyncCoordinator, other: AsyncCoordinator
    ) -> None:
        held = await coord.acquire(R, ttl=30, wait=0)
        before = threading.active_count()
        order: list[int] = []

        async def wait_turn(number: int) -> None:
            lease = await other.acquire(R, ttl=5, wait=30)
            order.append(number)
            await other.release(lease)

        tasks = []
        for number in range(20):
            tasks.append(asyncio.create_task(wait_turn(number)))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert threading.active_count() <= before + 1  # at most a backend's own worker
        await coord.release(held)
        await _within(asyncio.gather(*tasks), 20)
        assert sorted(order) == list(range(20))

    async def test_aclose_leaves_no_task_and_no_thread(self, clients: _Clients) -> None:
        threads_before = {t.ident for t in threading.enumerate()}
        tasks_before = asyncio.all_tasks()
        coordinator = AsyncCoordinator(await clients.backend())
        async with coordinator.hold(R, ttl=0.6, wait=0):
            await asyncio.sleep(0.5)  # a renewal or two
        lease = await coordinator.acquire("exports/kept", ttl=5, wait=0)
        waiter = asyncio.create_task(coordinator.acquire("exports/kept", ttl=5, wait=None))
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await coordinator.release(lease)
        await coordinator.aclose()
        await asyncio.sleep(0.05)
        assert asyncio.all_tasks() - tasks_before == set()
        deadline = time.monotonic() + 5
        while True:
            extra = [t.name for t in threading.enumerate() if t.ident not in threads_before]
            if not extra or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert extra == []


class AsyncHistoryConformance:
    """Records, proclaim, watch and observe on the asyncio face."""

    @pytest.fixture
    def url(self) -> str:
        raise NotImplementedError("the backend's test module provides the url fixture")

    @pytest.fixture
    async def coord(self, url: str) -> AsyncIterator[AsyncCoordinator]:
        coordinator = AsyncCoordinator(await open_async_backend(url))
        yield coordinator
        await coordinator.aclose()

    async def test_grants_releases_and_expiries_are_recorded_in_order(
        self, coord: AsyncCoordinator
    ) -> None:
        first = await coord.acquire(R, ttl=5, wait=0, holder="a")
        await coord.release(first)
        second = await coord.acquire(R, ttl=0.2, wait=0, holder="b", safety_margin=0.01)
        deadline = time.monotonic() + 3
        while await coord.current(R) is not None:
            assert time.monotonic() < deadline, "the lease never expired"
            await asyncio.sleep(0.02)
        third = await coord.acquire(R, ttl=5, wait=0, holder="c")
        history = await coord.history(R)
        assert [(r.kind, r.epoch, r.holder) for r in history] == [
            (RecordKind.GRANTED, first.epoch, "a"),
            (RecordKind.RELEASED, first.epoch, "a"),
            (RecordKind.GRANTED, second.epoch, "b"),
            (RecordKind.EXPIRED, second.epoch, "b"),
            (RecordKind.GRANTED, third.epoch, "c"),
        ]
        seqs = [r.seq for r in history]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert await coord.history(R, after=seqs[2]) == history[3:]
        assert len(await coord.history(R, limit=2)) == 2

    async def test_holder_reported_renewal_failures_are_recorded(self, url: str) -> None:
        backend = AsyncFaultyBackend(await open_async_backend(url))
        coordinator = AsyncCoordinator(backend)
        try:
            async with coordinator.hold(R, ttl=0.9, wait=0) as held:
                backend.arm("renew", "unavailable", times=1)
                await async_wait_for(lambda: backend.injected.get("renew", 0) == 1, 3, "failure")
                await async_wait_for(lambda: held.state is LeaseState.HELD, 3, "renewed again")
            found: list[RecordKind] = []
            deadline = time.monotonic() + 5
            while RecordKind.RENEWAL_FAILED not in found and time.monotonic() < deadline:
                found = [r.kind for r in await coordinator.history(R)]
                await asyncio.sleep(0.05)
            assert RecordKind.RENEWAL_FAILED in found
        finally:
            await coordinator.aclose()

    async def test_proclaim_changes_the_value_not_the_epoch(self, coord: AsyncCoordinator) -> None:
        async with coord.campaign("leaders/db", "10.0.0.1", ttl=5, wait=0) as leadership:
            await leadership.proclaim("10.0.0.2")
            leader = await coord.leader("leaders/db")
            assert leader is not None
            assert (leader.term, leader.value) == (leadership.term, "10.0.0.2")
            assert await leadership.resign()
        assert await coord.leader("leaders/db") is None

    async def test_watch_is_woken_by_a_change(self, coord: AsyncCoordinator) -> None:
        after = (await coord.history(R))[-1].seq if await coord.history(R) else 0
        watching = asyncio.create_task(coord.backend.watch(R, after, 10))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await coord.acquire(R, ttl=5, wait=0)
        await _within(watching, 5)
        assert time.monotonic() - started < 2.0

    async def test_observe_delivers_every_term_in_order(self, coord: AsyncCoordinator) -> None:
        seen: list[tuple[LeaderChangeKind, int]] = []
        observer = coord.observe("leaders/db")
        async with observer:

            async def read(count: int) -> None:
                async for change in observer:
                    seen.append((change.kind, change.term))
                    if len(seen) == count:
                        return

            reading = asyncio.create_task(read(4))
            await asyncio.sleep(0.1)
            for value in ("a", "b"):
                async with coord.campaign("leaders/db", value, ttl=5, wait=5) as leadership:
                    await asyncio.sleep(0.01)
                    await leadership.resign()
            await _within(reading, 10)
        assert seen == [
            (LeaderChangeKind.ELECTED, 1),
            (LeaderChangeKind.ENDED, 1),
            (LeaderChangeKind.ELECTED, 2),
            (LeaderChangeKind.ENDED, 2),
        ]

    async def test_a_lost_term_cancels_the_campaign_body(self, coord: AsyncCoordinator) -> None:
        with pytest.raises(LeaseLost):
            async with coord.campaign("leaders/db", "x", ttl=1.5, wait=0) as leadership:
                lease = leadership.lease
                assert await coord.backend.release(lease.resource, lease.epoch, lease.owner)
                await asyncio.sleep(3600)
        assert leadership.ended.is_set()

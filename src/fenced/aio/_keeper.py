"""Held leases of the asyncio face: renewal and loss as tasks of the event loop.

An :class:`AsyncHeldLease` is what ``async with coord.hold(...) as held`` yields. It keeps the
guarantees of the sync :class:`~fenced.HeldLease` with the same state machine
(:class:`~fenced.core._lease.LeaseTracker`) and the same renewal schedule
(:mod:`fenced.runtime._keeper`'s ``ttl/3`` with jitter; after a failure a tenth of the ttl, or a
quarter of the time left): renewed every ``ttl/3``, each new local deadline counted from when
the renewal was *sent*; the loss fired at the deadline even while a renewal hangs; ``lost`` set
and ``on_lost`` called once; ``check()`` raises unless HELD.

:class:`AsyncLeaseScheduler` keeps the renewal times and the local deadlines of every lease the
coordinator holds in one heap, served by **one task** (no thread): at a deadline it fires the
loss itself; a renewal runs as a task of its own, so one that hangs delays no other lease and
no loss. The task sleeps until the soonest entry, at most :data:`~fenced.core._clock.RECHECK`
seconds at a time, so a deadline that passed while the host was suspended (the loop's clock
stops, the deadline clock does not) is acted on within that much of the resume.

**Loss cancels the body**: the :class:`AsyncHold` that created the lease registers the task
that entered it; at the loss that task is cancelled (``CancelledError`` at its next ``await``)
and the ``async with`` ends with :class:`~fenced.LeaseLost`. ``cancel_on_loss=False`` leaves the
body running: it then learns of the loss from ``held.lost`` / ``check()`` only.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fenced.core._clock import RECHECK, Clock
from fenced.core._errors import LeaseLost, LossReason
from fenced.core._lease import Lease, LeaseTracker
from fenced.runtime._keeper import HeldView, loss_log, renewal_interval, retry_interval

__all__ = ["AsyncHeldLease", "AsyncLeaseOps", "AsyncLeaseScheduler", "OnLost"]

log = logging.getLogger("fenced.runtime")

OnLost = Callable[[LeaseLost], object]


class AsyncLeaseOps(Protocol):
    """What a held lease needs of an :class:`~fenced.aio.AsyncCoordinator`."""

    async def renew(self, lease: Lease) -> Lease: ...

    async def release(self, lease: Lease) -> bool: ...

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        """Queue a record of a failed renewal or a loss; returns at once, never raises."""
        ...


class AsyncHeldLease(HeldView):
    """A lease kept alive by the coordinator's scheduler task until :meth:`stop`.

    ``state`` is HELD only while the last renewal succeeded and the local deadline has not
    passed; ``lost`` (an :class:`asyncio.Event`) is set and ``on_lost`` called exactly once as
    soon as the lease is lost; ``check()`` raises :class:`~fenced.LeaseLost` unless HELD.
    Use it from the loop it was created on.
    """

    def __init__(
        self,
        ops: AsyncLeaseOps,
        lease: Lease,
        *,
        clock: Clock,
        scheduler: AsyncLeaseScheduler,
        on_lost: OnLost | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._ops = ops
        self._lease = lease
        self._clock = clock
        self._scheduler = scheduler
        self._on_lost = on_lost
        self._rng = rng or random.Random()
        self._tracker = LeaseTracker(lease.deadline)
        self._stopping = False
        self._fired = False
        self._renewal: asyncio.Task[None] | None = None
        self._releasing: asyncio.Future[bool] | None = None
        self._body: asyncio.Task[object] | None = None
        self.cancelled_body = False
        """True once the loss cancelled the task running the body."""
        self.lost = asyncio.Event()
        """Set once the lease is lost (never cleared)."""

    # -- what the holder reads ------------------------------------------------------------
    @property
    def lease(self) -> Lease:
        """The lease as last renewed."""
        return self._lease

    def was_lost(self) -> bool:
        """True if the lease was lost before :meth:`stop` (released does not count)."""
        return self.lost.is_set()

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, body: asyncio.Task[object] | None = None) -> None:
        """Have the scheduler renew the lease and watch its deadline; at a loss, cancel
        ``body`` (the task running the ``async with`` block), if given."""
        self._body = body
        self._scheduler.add(self, self._clock.now() + renewal_interval(self._lease.ttl, self._rng))

    def keep_body(self) -> None:
        """Cancel no task at a loss from now on (the block is exiting)."""
        self._body = None

    async def stop(self, *, release: bool = True) -> bool:
        """Stop renewing and (by default) release the lease. Returns the release's result.

        A renewal in flight is waited for (up to the ttl) first. The release is shielded: if
        the caller is cancelled meanwhile, it still completes (or the lease expires by its
        ttl), never half done. A failed release is logged and returns False.
        """
        self._stopping = True
        self._body = None
        self._scheduler.remove(self)
        renewal = self._renewal
        if renewal is not None and not renewal.done():
            await asyncio.wait({renewal}, timeout=self._lease.ttl)
        if not release:
            return False
        if self._releasing is None:  # once, even if stop is called again after a cancellation
            self._releasing = asyncio.ensure_future(self._ops.release(self._lease))
        try:
            released = await asyncio.shield(self._releasing)
        except Exception as error:
            log.warning("release of %s epoch %s failed: %s", self.resource, self.epoch, error)
            return False
        self._tracker.mark_lost(LeaseLost(LossReason.RELEASED, "released by its holder"))
        return released

    # -- internals ------------------------------------------------------------------------
    def _fire(self, error: LeaseLost) -> None:
        """Signal the loss once: ``lost``, ``on_lost``, the body's cancellation; then log it
        and hand it to the diagnostics (which never blocks)."""
        if self._fired:
            return
        self._fired = True
        self.lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:
                log.exception("on_lost callback for %s raised", self.resource)
        body, self._body = self._body, None
        if body is not None and not body.done():
            self.cancelled_body = True
            body.cancel(f"fenced: the lease on {self.resource} epoch {self.epoch} was lost")
        loss_log.warning("lease on %s epoch %s lost: %s", self.resource, self.epoch, error)
        self._ops.report_trouble(self._lease, error)

    # -- what the scheduler calls -----------------------------------------------------------
    @property
    def active(self) -> bool:
        """False once stopping or lost: the scheduler keeps nothing more of it."""
        return not self._stopping and not self._fired

    def deadline_due(self) -> float | None:
        """At the local deadline: fire the loss, or return the deadline a renewal moved it to."""
        if not self.active:
            return None
        error = self._tracker.loss(self._clock.now())
        if error is None:
            return self._tracker.deadline
        self._fire(error)
        return None

    def begin_renewal(self, done: Callable[[float | None], None]) -> None:
        """Start one renewal as a task; ``done(next_at)`` when it is over."""
        sent = self._clock.now()
        self._renewal = asyncio.get_running_loop().create_task(
            self._renew(sent, done), name=f"fenced-renewal:{self.resource}"
        )

    async def _renew(self, sent: float, done: Callable[[float | None], None]) -> None:
        next_at: float | None = None
        try:
            next_at = await self._renew_once(sent)
        finally:
            done(next_at)

    async def _renew_once(self, sent: float) -> float | None:
        if not self.active:
            return None
        try:
            renewed = await self._ops.renew(self._lease)
        except LeaseLost as error:
            self._lose(error)
            return None
        except Exception as error:
            self._tracker.renewal_failed()
            log.warning("renewal of %s epoch %s failed: %s", self.resource, self.epoch, error)
            self._ops.report_trouble(self._lease, error)
            left = self._tracker.deadline - self._clock.now()
            return self._clock.now() + retry_interval(self._lease.ttl, left, self._rng)
        now = self._clock.now()
        self._tracker.renewed(now, renewed.deadline)
        if self._tracker.loss(now) is not None:
            self._lose(LeaseLost(LossReason.EXPIRED, "the renewal came back too late"))
            return None
        self._lease = renewed
        return sent + renewal_interval(self._lease.ttl, self._rng)


_DEADLINE, _RENEWAL = 0, 1  # at the same instant the deadline is looked at first


@dataclass
class _Entry:
    lease: AsyncHeldLease
    deadline_stamp: int = 0
    renewal_stamp: int = 0
    in_flight: bool = field(default=False)


class AsyncLeaseScheduler:
    """Renewal times and local deadlines of every lease an async coordinator holds, served by
    one task of the loop (module docstring). The task starts with the first lease."""

    def __init__(self, clock: Clock, *, name: str = "fenced-leases") -> None:
        self._clock = clock
        self._name = name
        self._heap: list[tuple[float, int, int, _Entry, int]] = []
        self._order = itertools.count()
        self._entries: dict[int, _Entry] = {}
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self._renewals: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def leases(self) -> int:
        """Leases kept now."""
        return len(self._entries)

    def add(self, lease: AsyncHeldLease, first_renewal: float) -> None:
        """Keep ``lease``: renew it at ``first_renewal``, look at its deadline when it comes."""
        if self._closed:
            raise RuntimeError("the coordinator's lease scheduler is closed")
        entry = _Entry(lease)
        self._entries[id(lease)] = entry
        self._push(entry, _DEADLINE, lease.deadline)
        self._push(entry, _RENEWAL, first_renewal)
        if self._task is None:
            self._changed = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)
        self._poke()

    def remove(self, lease: AsyncHeldLease) -> None:
        """Forget ``lease`` (its entries are skipped from now on)."""
        self._entries.pop(id(lease), None)

    async def aclose(self) -> None:
        """End the task and every renewal in flight; idempotent."""
        self._closed = True
        self._entries.clear()
        tasks = [t for t in (self._task, *self._renewals) if t is not None and not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._task = None

    def _poke(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _push(self, entry: _Entry, kind: int, when: float) -> None:
        if kind == _DEADLINE:
            entry.deadline_stamp += 1
            stamp = entry.deadline_stamp
        else:
            entry.renewal_stamp += 1
            stamp = entry.renewal_stamp
        heapq.heappush(self._heap, (when, kind, next(self._order), entry, stamp))

    def _current(self, item: tuple[float, int, int, _Entry, int]) -> bool:
        _, kind, _, entry, stamp = item
        if self._entries.get(id(entry.lease)) is not entry or not entry.lease.active:
            return False
        return stamp == (entry.deadline_stamp if kind == _DEADLINE else entry.renewal_stamp)

    async def _run(self) -> None:
        changed = self._changed
        assert changed is not None
        step = RECHECK if _counts_real_time(self._clock) else 0.005
        while not self._closed:
            while self._heap and not self._current(self._heap[0]):
                heapq.heappop(self._heap)
            now = self._clock.now()
            if self._heap and self._heap[0][0] <= now:
                self._due(heapq.heappop(self._heap))
                continue
            soonest = self._heap[0][0] - now if self._heap else RECHECK
            changed.clear()
            await _wait(changed, min(soonest, step))

    def _due(self, item: tuple[float, int, int, _Entry, int]) -> None:
        _, kind, _, entry, _ = item
        if kind == _DEADLINE:
            again = entry.lease.deadline_due()
            if again is not None:
                self._push(entry, _DEADLINE, again)
            return
        entry.in_flight = True

        def done(next_at: float | None) -> None:
            entry.in_flight = False
            if next_at is not None and self._entries.get(id(entry.lease)) is entry:
                self._push(entry, _DEADLINE, entry.lease.deadline)  # the renewal moved it
                self._push(entry, _RENEWAL, next_at)
                self._poke()

        entry.lease.begin_renewal(done)
        task = entry.lease._renewal
        if task is not None:
            self._renewals.add(task)
            task.add_done_callback(self._renewals.discard)


def _counts_real_time(clock: Clock) -> bool:
    """True for the system clock; a test's manual clock moves only when told, so the
    scheduler looks at it every few milliseconds instead."""
    return type(clock).__name__ == "SystemClock"


async def _wait(event: asyncio.Event, timeout: float) -> None:
    if timeout <= 0:
        await asyncio.sleep(0)
        return
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        if not waiter.done():
            waiter.cancel()

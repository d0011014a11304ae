"""The asyncio :class:`AsyncCoordinator`: the sync :class:`~fenced.Coordinator`'s operations,
awaited, over an :class:`~fenced.coordinator.aio_backend.AsyncCoordinatorBackend`.

Every decision is the sync face's (:mod:`fenced.coordinator._requests`): parameters are
validated before any I/O with the same exceptions, deadlines count from the send time, waiting
is first come first served with the same give-up rule. What is particular to asyncio:

* **Cancelling a waiting** ``acquire`` leaves the queue (the next waiter is not held up) and
  consumes no epoch: the ticket is left in a shielded step; a lease a release handed to the
  ticket meanwhile is released in that same step.
* **Cancelling** ``release`` never half-releases: the release is shielded; it completes, or the
  lease expires by its ttl.
* Held leases are renewed by one scheduler task per coordinator
  (:class:`~fenced.aio._keeper.AsyncLeaseScheduler`), renewals as tasks: no thread.
* Holder reports (renewal failures, losses) go to one sender task with a bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from fenced.aio._election import AsyncCampaign, AsyncObserver
from fenced.aio._hold import AsyncHold
from fenced.aio._keeper import AsyncLeaseScheduler, OnLost
from fenced.coordinator._requests import (
    AcquireSteps,
    BackendIdentity,
    HistoryQuery,
    Report,
    Step,
    busy,
    check_lease,
    lease_of,
    plan_acquire,
    renewable,
    renewed_lease,
    trouble_report,
    validate_fence,
)
from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.coordinator.backend import Granted, Ticket
from fenced.core._clock import Clock, SystemClock
from fenced.core._closing import AsyncClosing
from fenced.core._errors import ConfigurationError
from fenced.core._lease import Lease, LeaseInfo
from fenced.core._names import validate_resource
from fenced.core._records import Record
from fenced.core._tasks import completed
from fenced.core._token import validate_coordinator_id
from fenced.election._campaign import validate_value
from fenced.election._observer import LeaderInfo

__all__ = ["AsyncCoordinator"]

log = logging.getLogger("fenced.coordinator")

REPORT_QUEUE = 256
"""Holder reports an async coordinator queues before it drops new ones."""
REPORT_DRAIN = 2.0
"""Seconds :meth:`AsyncCoordinator.aclose` gives queued reports before dropping them."""


class AsyncCoordinator(BackendIdentity, AsyncClosing):
    """Grants leases with fencing tokens, for asyncio programs. Use it on one event loop.

    Create with ``await fenced.aio.connect(url)``; use ``async with`` or ``await aclose()``.
    """

    _backend: AsyncCoordinatorBackend

    def __init__(self, backend: AsyncCoordinatorBackend, *, clock: Clock | None = None) -> None:
        validate_coordinator_id(backend.coordinator_id)
        self._backend = backend
        self._inline = getattr(backend, "inline", False) is True
        self._clock: Clock = clock or SystemClock()
        self._scheduler = AsyncLeaseScheduler(self._clock, name=f"fenced-leases:{backend.url}")
        self._reports: asyncio.Queue[Report] | None = None
        self._sender: asyncio.Task[None] | None = None
        self.diagnostics_dropped = 0
        """Holder reports dropped: the queue was full, or :meth:`aclose` could not send them."""
        self._closed = False

    # -- identity (url, coordinator_id, capabilities, require: BackendIdentity) ------------
    @property
    def backend(self) -> AsyncCoordinatorBackend:
        """The backend (for tools and tests; not needed for normal use)."""
        return self._backend

    # -- leases ---------------------------------------------------------------------------
    async def acquire(
        self,
        resource: str,
        ttl: float,
        wait: float | None,
        holder: str | None = None,
        request_id: str | None = None,
        *,
        safety_margin: float | None = None,
        value: str | None = None,
    ) -> Lease:
        """:meth:`fenced.Coordinator.acquire`, awaited (same parameters, errors, guarantees).

        Waiting suspends the task, holding no thread. Cancelled while waiting, it leaves the
        queue before the ``CancelledError`` propagates (shielded), so no epoch is consumed and
        the next waiter is not held up.
        """
        plan = plan_acquire(
            resource, ttl, wait, holder, request_id, safety_margin, value,
            self._backend.capabilities, self.url,
        )  # fmt: skip
        backend, clock = self._backend, self._clock
        steps = AcquireSteps(plan, clock.now())
        ticket: Ticket | None = None
        try:
            while True:
                sent = clock.now()
                result = await backend.try_grant(plan.request, ticket)
                if isinstance(result, Granted):
                    ticket = None
                    log.info("%s: granted epoch %d to %s", plan.request.resource,
                             result.epoch, result.holder)  # fmt: skip
                    return lease_of(self.coordinator_id, plan, result, sent)
                step = steps.next_step(result, clock.now())
                if step is Step.WAIT:
                    assert ticket is not None
                    await backend.wait(ticket, steps.timeout)
                elif step is Step.ENQUEUE:
                    ticket = await backend.enqueue(plan.request)
                else:
                    if ticket is not None:
                        sent = clock.now()
                        handed, ticket = await _take(backend, ticket), None
                        if handed is not None:
                            return lease_of(self.coordinator_id, plan, handed, sent)
                    raise busy(plan.request.resource, result)
        finally:
            if ticket is not None:
                await completed(backend.leave(ticket), "leaving the queue")

    async def renew(self, lease: Lease) -> Lease:
        """:meth:`fenced.Coordinator.renew`, awaited."""
        check_lease(lease, self.coordinator_id, self.url)
        sent = self._clock.now()
        renewable(lease, sent)
        remaining = await self._backend.renew(lease.resource, lease.epoch, lease.owner, lease.ttl)
        return renewed_lease(lease, sent, remaining)

    async def release(self, lease: Lease) -> bool:
        """:meth:`fenced.Coordinator.release`, awaited. Shielded: a cancelled caller gets
        ``CancelledError`` while the release completes (or the lease expires by its ttl)."""
        check_lease(lease, self.coordinator_id, self.url)
        step = self._backend.release(lease.resource, lease.epoch, lease.owner)
        # A step that runs to its end without suspending cannot be cancelled half way: only
        # one that suspends is shielded (a task of its own, and a turn of the loop).
        released = await (step if self._inline else asyncio.shield(step))
        if released:
            log.info("%s: released epoch %d by %s", lease.resource, lease.epoch, lease.holder)
        return released

    async def current(self, resource: str) -> LeaseInfo | None:
        """The live lease of ``resource``, or None."""
        return await self._backend.current(validate_resource(resource))

    async def last_epoch(self, resource: str) -> int:
        """The largest epoch ever granted for ``resource`` (0 if none)."""
        return await self._backend.last_epoch(validate_resource(resource))

    async def resources(self) -> list[str]:
        """Every resource that was ever granted, sorted."""
        return await self._backend.resources()

    async def history(
        self, resource: str | None = None, *, after: int = 0, limit: int | None = None
    ) -> list[Record]:
        """:meth:`fenced.Coordinator.history`, awaited (same paging and validation)."""
        query = HistoryQuery(resource, after, limit)
        want = query.want()
        while query.take(await self._backend.records(query.resource, query.after, want), want):
            want = query.want()
        return query.found

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        """Queue a record of a renewal failure or a loss for the sender task; never blocks,
        never raises (a full queue drops the report and counts it)."""
        if self._closed:
            self.diagnostics_dropped += 1
            return
        if self._reports is None:
            self._reports = asyncio.Queue(REPORT_QUEUE)
            self._sender = asyncio.get_running_loop().create_task(
                self._send_reports(self._reports), name=f"fenced-diagnostics:{self.url}"
            )
        try:
            self._reports.put_nowait(trouble_report(lease, error))
        except asyncio.QueueFull:
            self.diagnostics_dropped += 1

    async def _send_reports(self, reports: asyncio.Queue[Report]) -> None:
        while True:
            resource, epoch, holder, kind, detail = await reports.get()
            try:
                await self._backend.report(resource, epoch, holder, kind, detail)
            except Exception as failure:
                log.debug("could not record %s for %s: %s", kind.value, resource, failure)
            finally:
                reports.task_done()

    def hold(
        self,
        resource: str,
        ttl: float,
        *,
        wait: float | None,
        fence: Iterable[object] = (),
        on_lost: OnLost | None = None,
        holder: str | None = None,
        request_id: str | None = None,
        safety_margin: float | None = None,
        value: str | None = None,
        cancel_on_loss: bool = True,
    ) -> AsyncHold:
        """``async with coord.hold(...) as held``: acquire, install at ``fence`` stores (async or
        sync), renew as a loop task, signal loss, release. At a loss the task running the body
        is cancelled and the block ends with :class:`~fenced.LeaseLost` (see
        :mod:`fenced.aio._hold`); ``cancel_on_loss=False`` leaves the body to ``held.lost``.
        Parameters are validated here, before any I/O."""
        plan_acquire(
            resource, ttl, wait, holder, request_id, safety_margin, value,
            self._backend.capabilities, self.url,
        )  # fmt: skip
        stores = validate_fence(fence, on_lost)
        if not isinstance(cancel_on_loss, bool):
            raise ConfigurationError("cancel_on_loss must be True or False")

        async def acquire() -> Lease:
            return await self.acquire(
                resource, ttl, wait, holder, request_id, safety_margin=safety_margin, value=value
            )

        return AsyncHold(
            acquire,
            self,
            clock=self._clock,
            scheduler=self._scheduler,
            fence=stores,
            on_lost=on_lost,
            cancel_on_loss=cancel_on_loss,
        )

    # -- election -------------------------------------------------------------------------
    def campaign(
        self,
        name: str,
        value: str,
        ttl: float,
        *,
        wait: float | None = None,
        fence: Iterable[object] = (),
        on_lost: OnLost | None = None,
        holder: str | None = None,
        safety_margin: float | None = None,
        cancel_on_loss: bool = True,
    ) -> AsyncCampaign:
        """``async with coord.campaign(name, value, ttl) as leadership``: wait to be elected
        (see :meth:`fenced.Coordinator.campaign`); the loss of the term cancels the body."""
        advertised = validate_value(value)
        if on_lost is not None and not callable(on_lost):
            raise ConfigurationError("on_lost must be callable")

        def hold(signal_loss: OnLost) -> AsyncHold:
            return self.hold(
                name,
                ttl,
                wait=wait,
                fence=fence,
                on_lost=signal_loss,
                holder=holder,
                safety_margin=safety_margin,
                value=advertised,
                cancel_on_loss=cancel_on_loss,
            )

        return AsyncCampaign(hold, self._backend, advertised, on_lost=on_lost)

    async def leader(self, name: str) -> LeaderInfo | None:
        """The current leader of election ``name``, or None."""
        info = await self.current(name)
        return None if info is None else LeaderInfo.from_lease(info)

    def observe(self, name: str) -> AsyncObserver:
        """``async for change in coord.observe(name)``: leadership changes from now on."""
        return AsyncObserver(self, self._backend.watch, validate_resource(name))

    # -- lifecycle ------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop renewing held leases (they expire), give queued reports up to
        :data:`REPORT_DRAIN` seconds, close the backend. Idempotent; afterwards no task of
        this coordinator is left."""
        if self._closed:
            return
        self._closed = True
        await self._scheduler.aclose()
        if self._reports is not None and self._sender is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reports.join(), REPORT_DRAIN)
            self.diagnostics_dropped += self._reports.qsize()
            self._sender.cancel()
            await asyncio.wait({self._sender})
        await self._backend.aclose()

    def __repr__(self) -> str:
        return f"<AsyncCoordinator {self.url}>"


async def _take(backend: AsyncCoordinatorBackend, ticket: Ticket) -> Granted | None:
    """Leave the queue, taking a lease handed to ``ticket`` meanwhile. If the caller is
    cancelled during the step, the step still completes and a lease it took is released before
    the ``CancelledError`` propagates: a cancelled acquire keeps no lease."""
    task = asyncio.ensure_future(backend.leave(ticket, take=True))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            handed = await task
            if handed is not None:
                await backend.release(ticket.resource, handed.epoch, handed.owner)
        raise

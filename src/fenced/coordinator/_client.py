"""The user-facing :class:`Coordinator`: validation, waiting, deadlines and retries, once.

Backends (:mod:`fenced.coordinator.backend`) do single atomic steps; everything a user relies on
regardless of backend lives here: parameter checks before any I/O, the local deadline computed
from the moment each request was *sent*, first-come-first-served waiting on backend
notifications, and ``hold()``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import cast

from fenced.coordinator._requests import (
    HISTORY_PAGE,
    AcquirePlan,
    AcquireSteps,
    BackendIdentity,
    HistoryQuery,
    Report,
    Step,
    busy,
    check_lease,
    default_holder,
    lease_of,
    plan_acquire,
    renewable,
    renewed_lease,
    trouble_report,
    validate_fence,
)
from fenced.coordinator.backend import CoordinatorBackend, Granted, Ticket
from fenced.core._clock import Clock, SystemClock
from fenced.core._closing import Closing
from fenced.core._lease import Lease, LeaseInfo
from fenced.core._names import validate_resource
from fenced.core._records import Record
from fenced.core._token import validate_coordinator_id
from fenced.election._campaign import Campaign, validate_value
from fenced.election._observer import LeaderInfo, Observer
from fenced.runtime._diagnostics import DiagnosticSender
from fenced.runtime._hold import Fenceable, Hold
from fenced.runtime._keeper import OnLost
from fenced.runtime._scheduler import LeaseScheduler

__all__ = ["HISTORY_PAGE", "Coordinator", "default_holder"]

log = logging.getLogger("fenced.coordinator")

REPORT_QUEUE = 256
"""Holder reports (renewal failures, losses) a coordinator queues before it drops new ones."""
REPORT_DRAIN = 2.0
"""Seconds :meth:`Coordinator.close` gives the queued reports to be sent before it drops them."""


class Coordinator(BackendIdentity, Closing):
    """Grants leases with fencing tokens on named resources. Thread-safe.

    Create with :func:`fenced.connect`. Use as a context manager or call :meth:`close`.
    """

    _backend: CoordinatorBackend

    def __init__(self, backend: CoordinatorBackend, *, clock: Clock | None = None) -> None:
        validate_coordinator_id(backend.coordinator_id)  # once: tokens are built unchecked
        self._backend = backend
        self._clock: Clock = clock or SystemClock()
        self._reports: DiagnosticSender[Report] = DiagnosticSender(
            self._send_report, capacity=REPORT_QUEUE, name=f"fenced-diagnostics:{backend.url}"
        )
        self._scheduler = LeaseScheduler(self._clock, name=f"fenced-leases:{backend.url}")
        """Renews every lease held with :meth:`hold` and fires its loss: one thread for all of
        them, and up to RENEWAL_WORKERS for the renewal calls (runtime/_scheduler.py)."""

    # -- identity (url, coordinator_id, capabilities, require: BackendIdentity) ------------
    @property
    def backend(self) -> CoordinatorBackend:
        """The backend (for tools and tests; not needed for normal use)."""
        return self._backend

    # -- leases ---------------------------------------------------------------------------
    def acquire(
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
        """Grant a lease on ``resource`` with epoch = last epoch + 1.

        ``wait=0`` tries once; ``wait=None`` waits forever; otherwise waits up to ``wait``
        seconds, first come first served, woken by the backend's notifications, then raises
        :class:`Busy`. A waiter that gives up leaves the queue in one atomic step with the
        check that no release handed it the lease meanwhile; if one did, that lease is returned
        (a moment after ``wait``) instead of Busy, so a refused acquire consumes no epoch. The
        epoch is durable before this returns. With ``request_id``, a retry after a lost reply
        returns the same lease (never a second epoch) and raises :class:`LeaseLost` if that
        lease has ended meanwhile.

        An epoch is consumed without a lease returned only when the call fails after the
        coordinator granted it: the reply was lost (:class:`OutcomeUnknown`, a cut connection:
        retry with the same ``request_id``, or the lease expires after ``ttl``), or the wait
        was interrupted by another exception (the lease handed over meanwhile is released at
        once) or by the death of the process (it expires after ``ttl``).

        Parameters are validated before any I/O (:class:`ConfigurationError`,
        :class:`InvalidName`). The returned lease's local deadline is ``send time of the granting
        request + ttl - safety_margin`` (default margin: 10 % of ttl). ``value`` is an election
        candidate's advertised value (see :meth:`campaign`), shown by :meth:`current` while the
        lease lives.
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
                result = backend.try_grant(plan.request, ticket)
                if isinstance(result, Granted):
                    ticket = None  # the grant consumed it
                    return self._granted(plan, result, sent)
                step = steps.next_step(result, clock.now())
                if step is Step.WAIT:
                    assert ticket is not None
                    backend.wait(ticket, steps.timeout)
                elif step is Step.ENQUEUE:
                    ticket = backend.enqueue(plan.request)
                else:
                    if ticket is not None:
                        # A release may have handed the lease to this ticket since the last
                        # try_grant: leaving takes it (atomically), so no epoch is consumed
                        # by a waiter that gives up.
                        sent = clock.now()
                        handed, ticket = backend.leave(ticket, take=True), None
                        if handed is not None:
                            log.info("%s: epoch %d handed over as the wait ended",
                                     plan.request.resource, handed.epoch)  # fmt: skip
                            return lease_of(self.coordinator_id, plan, handed, sent)
                    raise busy(plan.request.resource, result)
        finally:
            if ticket is not None:
                backend.leave(ticket)

    def _granted(self, plan: AcquirePlan, granted: Granted, sent: float) -> Lease:
        log.info("%s: granted epoch %d to %s", plan.request.resource, granted.epoch, granted.holder)
        return lease_of(self.coordinator_id, plan, granted, sent)

    def renew(self, lease: Lease) -> Lease:
        """Extend ``lease`` by its ttl; returns the lease with its new local deadline.

        Only the owner, only while live: raises :class:`LeaseLost` if the coordinator no longer
        has this owner's lease at this epoch (expired, released or taken over), and without
        asking it if the local deadline already passed — the holder treats the lease as lost
        from then on, whatever the coordinator would say. After a loss, acquire again (a new
        epoch). :class:`Unavailable` / :class:`OutcomeUnknown` leave the lease as it was.
        """
        check_lease(lease, self.coordinator_id, self.url)
        sent = self._clock.now()
        renewable(lease, sent)
        remaining = self._backend.renew(lease.resource, lease.epoch, lease.owner, lease.ttl)
        return renewed_lease(lease, sent, remaining)

    def release(self, lease: Lease) -> bool:
        """Release ``lease`` if it is still this owner's at this epoch; idempotent.

        Returns True if it was released now; False if it had already ended or belongs to a newer
        owner — a delayed release never affects a newer lease.
        """
        check_lease(lease, self.coordinator_id, self.url)
        released = self._backend.release(lease.resource, lease.epoch, lease.owner)
        if released:
            log.info("%s: released epoch %d by %s", lease.resource, lease.epoch, lease.holder)
        return released

    def current(self, resource: str) -> LeaseInfo | None:
        """The live lease of ``resource`` (holder, epoch, remaining time), or None."""
        return self._backend.current(validate_resource(resource))

    def last_epoch(self, resource: str) -> int:
        """The largest epoch ever granted for ``resource`` (0 if none)."""
        return self._backend.last_epoch(validate_resource(resource))

    def resources(self) -> list[str]:
        """Every resource that was ever granted, sorted."""
        return self._backend.resources()

    def history(
        self, resource: str | None = None, *, after: int = 0, limit: int | None = None
    ) -> list[Record]:
        """The coordinator's retained records (of ``resource``, or all) with ``seq > after``,
        oldest first.

        Grants, releases, expiries (detected and recorded before answering), holder-reported
        renewal failures and losses, proclamations and restores. Never the owner secret.

        ``limit=None`` returns every retained record: the backend is read in pages of
        :data:`HISTORY_PAGE` until one comes back short (records appended meanwhile are
        included). ``limit=N`` returns at most the ``N`` oldest: a cursor — pass the last
        record's ``seq`` as ``after`` to read the next ones, as with a SQL keyset or etcd's
        ``min_create_revision``. Bad ``after``/``limit``: :class:`ConfigurationError`.
        """
        query = HistoryQuery(resource, after, limit)
        want = query.want()
        while query.take(self._backend.records(query.resource, query.after, want), want):
            want = query.want()
        return query.found

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        """Have it recorded that ``lease``'s holder saw a renewal fail or lost it; returns at once.

        Called by the runtime after it signalled what it reports; the record lets ``fenced
        timeline`` show renewal failures and losses. Best effort, never raises, never blocks:
        the report is queued for this coordinator's one background sender, which sends the
        reports of all its leases in order; when :data:`REPORT_QUEUE` reports are waiting (the
        coordinator is slow or unreachable), a new one is dropped and counted in
        :attr:`diagnostics_dropped`.
        """
        self._reports.submit(trouble_report(lease, error))

    @property
    def diagnostics_dropped(self) -> int:
        """Holder reports dropped so far: the queue was full, or :meth:`close` could not send
        them in time. A dropped report loses a record, never a renewal or a loss signal."""
        return self._reports.dropped

    def _send_report(self, report: Report) -> None:
        resource, epoch, holder, kind, detail = report
        try:
            self._backend.report(resource, epoch, holder, kind, detail)
        except Exception as failure:  # the coordinator may well be unreachable right now
            log.debug("could not record %s for %s: %s", kind.value, resource, failure)

    def hold(
        self,
        resource: str,
        ttl: float,
        *,
        wait: float | None,
        fence: Iterable[Fenceable] = (),
        on_lost: OnLost | None = None,
        holder: str | None = None,
        request_id: str | None = None,
        safety_margin: float | None = None,
        value: str | None = None,
    ) -> Hold:
        """Context manager: acquire, install at ``fence`` stores, renew, signal loss, release.

        Yields a :class:`~fenced.runtime._keeper.HeldLease` (``token``, ``epoch``, ``state``,
        ``check()``, ``lost``). See :mod:`fenced.runtime._hold` for the guarantees. Parameters are
        validated here, before any I/O.
        """
        plan = plan_acquire(
            resource, ttl, wait, holder, request_id, safety_margin, value,
            self._backend.capabilities, self.url,
        )  # fmt: skip
        name = plan.request.resource
        stores = cast("tuple[Fenceable, ...]", validate_fence(fence, on_lost))

        def acquire() -> Lease:
            return self.acquire(
                name, ttl, wait, holder, request_id, safety_margin=safety_margin, value=value
            )

        return Hold(
            acquire,
            self,
            clock=self._clock,
            fence=stores,
            on_lost=on_lost,
            scheduler=self._scheduler,
        )

    # -- election (implemented in fenced.election; see docs/election.md) ------------------
    def campaign(
        self,
        name: str,
        value: str,
        ttl: float,
        *,
        wait: float | None = None,
        fence: Iterable[Fenceable] = (),
        on_lost: OnLost | None = None,
        holder: str | None = None,
        safety_margin: float | None = None,
    ) -> Campaign:
        """Context manager: wait to become leader of election ``name``, yield the leadership.

        A term is a lease on ``name``: its number is the lease's epoch and its token fences
        stores like any lease's (install it with ``fence=[store]``). Candidates queue first come,
        first served; ``wait=None`` (the default: campaigning means waiting to be elected) waits
        forever, otherwise :class:`Busy` after ``wait`` seconds, and the candidate leaves the
        queue. Yields a :class:`~fenced.election.Leadership`. See
        :mod:`fenced.election._campaign` for the guarantees; parameters are validated here.
        """
        advertised = validate_value(value)

        def hold(signal_loss: OnLost) -> Hold:
            return self.hold(
                name,
                ttl,
                wait=wait,
                fence=fence,
                on_lost=signal_loss,
                holder=holder,
                safety_margin=safety_margin,
                value=advertised,
            )

        return Campaign(hold, self._backend, advertised, on_lost=on_lost)

    def leader(self, name: str) -> LeaderInfo | None:
        """The current leader of election ``name`` (holder, value, term, remaining), or None."""
        info = self.current(name)
        return None if info is None else LeaderInfo.from_lease(info)

    def observe(self, name: str) -> Observer:
        """An iterator of the leadership changes of election ``name``, from now on, in order.

        Delivers every term exactly once (even one that ended before it was read), woken by
        the backend's notifications, and retries through outages. See
        :mod:`fenced.election._observer`. Reads the history once now (raises if that fails).
        """
        return Observer(self, self._backend, validate_resource(name))

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Close the backend's connections; idempotent. Held leases simply expire.

        Queued holder reports get up to :data:`REPORT_DRAIN` seconds to be sent first; the rest
        are dropped (counted in :attr:`diagnostics_dropped`).
        """
        self._scheduler.close()
        self._reports.close(REPORT_DRAIN)
        self._backend.close()

    def __repr__(self) -> str:
        return f"<Coordinator {self.url}>"

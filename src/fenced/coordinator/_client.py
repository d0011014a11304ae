"""The user-facing :class:`Coordinator`: validation, waiting, deadlines and retries, once.

Backends (:mod:`fenced.coordinator.backend`) do single atomic steps; everything a user relies on
regardless of backend lives here: parameter checks before any I/O, the local deadline computed
from the moment each request was *sent*, first-come-first-served waiting on backend
notifications, and ``hold()``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import secrets
import socket
from collections.abc import Iterable

from fenced.coordinator.backend import (
    CAP_REQUEST_ID,
    Blocked,
    CoordinatorBackend,
    Granted,
    GrantRequest,
    Ticket,
)
from fenced.core._clock import Clock, SystemClock
from fenced.core._closing import Closing
from fenced.core._errors import Busy, ConfigurationError, LeaseLost, LossReason
from fenced.core._lease import Lease, LeaseInfo
from fenced.core._names import validate_resource
from fenced.core._policy import LeasePolicy, validate_holder, validate_wait
from fenced.core._records import Record, RecordKind
from fenced.core._token import FencingToken, validate_coordinator_id
from fenced.election._campaign import Campaign, validate_value
from fenced.election._observer import LeaderInfo, Observer
from fenced.runtime._diagnostics import DiagnosticSender
from fenced.runtime._hold import Fenceable, Hold
from fenced.runtime._keeper import OnLost
from fenced.runtime._scheduler import LeaseScheduler

__all__ = ["Coordinator", "default_holder"]

log = logging.getLogger("fenced.coordinator")

_MAX_REQUEST_ID = 200

REPORT_QUEUE = 256
"""Holder reports (renewal failures, losses) a coordinator queues before it drops new ones."""
HISTORY_PAGE = 1000
"""Records :meth:`Coordinator.history` asks its backend for in one request."""
REPORT_DRAIN = 2.0
"""Seconds :meth:`Coordinator.close` gives the queued reports to be sent before it drops them."""

_Report = tuple[str, int, str, RecordKind, dict[str, object]]


_holder: str | None = None  # the default label of this process, validated


def _forget_holder() -> None:
    global _holder  # noqa: PLW0603 - a per-process memo
    _holder = None


os.register_at_fork(after_in_child=_forget_holder)  # a forked child gets its own pid


def default_holder() -> str:
    """The default holder label: ``host:pid`` (the host name as it was at this process's first
    call; a forked child gets its own pid). Computed and validated once per process."""
    global _holder  # noqa: PLW0603 - a per-process memo
    if _holder is None:
        _holder = validate_holder(f"{socket.gethostname()}:{os.getpid()}")
    return _holder


def _lease_policy(ttl: object, safety_margin: object) -> LeasePolicy:
    """:meth:`LeasePolicy.create`, remembered for plain ``int``/``float``/None settings (a
    process uses a handful). The memo is keyed by type and value, so ``True`` never passes for
    ``1``; a setting that fails validation raises every time and is never remembered."""
    if type(ttl) in _PLAIN_SETTING and type(safety_margin) in _PLAIN_SETTING:
        return _remembered_policy(ttl, safety_margin)
    return LeasePolicy.create(ttl, safety_margin)


_PLAIN_SETTING = (int, float, type(None))


@functools.lru_cache(maxsize=256, typed=True)
def _remembered_policy(ttl: object, safety_margin: object) -> LeasePolicy:
    return LeasePolicy.create(ttl, safety_margin)


def _validate_request_id(request_id: object) -> str | None:
    if request_id is None:
        return None
    if (
        not isinstance(request_id, str)
        or not 1 <= len(request_id) <= _MAX_REQUEST_ID
        or not request_id.isprintable()
    ):
        raise ConfigurationError(
            f"request_id must be a printable string of 1-{_MAX_REQUEST_ID} characters"
        )
    return request_id


class Coordinator(Closing):
    """Grants leases with fencing tokens on named resources. Thread-safe.

    Create with :func:`fenced.connect`. Use as a context manager or call :meth:`close`.
    """

    def __init__(self, backend: CoordinatorBackend, *, clock: Clock | None = None) -> None:
        validate_coordinator_id(backend.coordinator_id)  # once: tokens are built unchecked
        self._backend = backend
        self._clock: Clock = clock or SystemClock()
        self._reports: DiagnosticSender[_Report] = DiagnosticSender(
            self._send_report, capacity=REPORT_QUEUE, name=f"fenced-diagnostics:{backend.url}"
        )
        self._scheduler = LeaseScheduler(self._clock, name=f"fenced-leases:{backend.url}")
        """Renews every lease held with :meth:`hold` and fires its loss: one thread for all of
        them, and up to RENEWAL_WORKERS for the renewal calls (runtime/_scheduler.py)."""

    # -- identity -------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._backend.url

    @property
    def coordinator_id(self) -> str:
        return self._backend.coordinator_id

    @property
    def capabilities(self) -> frozenset[str]:
        return self._backend.capabilities

    @property
    def backend(self) -> CoordinatorBackend:
        """The backend (for tools and tests; not needed for normal use)."""
        return self._backend

    def require(self, capability: str) -> None:
        """Raise :class:`ConfigurationError` unless the backend has ``capability``."""
        if capability not in self._backend.capabilities:
            raise ConfigurationError(f"{self.url} does not support {capability!r}")

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
        name = validate_resource(resource)
        policy = _lease_policy(ttl, safety_margin)
        patience = validate_wait(wait)
        label = default_holder() if holder is None else validate_holder(holder)
        rid = _validate_request_id(request_id)
        advertised = None if value is None else validate_value(value)
        if rid is not None:
            self.require(CAP_REQUEST_ID)
        request = GrantRequest(
            name, policy.ttl, secrets.token_hex(16), label, rid, advertised, patience != 0
        )
        give_up = None if patience is None else self._clock.now() + patience
        ticket: Ticket | None = None
        try:
            while True:
                sent = self._clock.now()
                result = self._backend.try_grant(request, ticket)
                if isinstance(result, Granted):
                    ticket = None  # the grant consumed it
                    log.info("%s: granted epoch %d to %s", name, result.epoch, result.holder)
                    return self._lease(request, policy, result, sent)
                now = self._clock.now()
                if give_up is not None and now >= give_up:
                    if ticket is not None:
                        # A release may have handed the lease to this ticket since the last
                        # try_grant: leaving takes it (atomically), so no epoch is consumed
                        # by a waiter that gives up.
                        sent = self._clock.now()
                        handed, ticket = self._backend.leave(ticket, take=True), None
                        if handed is not None:
                            log.info(
                                "%s: epoch %d handed over as the wait ended", name, handed.epoch
                            )
                            return self._lease(request, policy, handed, sent)
                    raise self._busy(name, result)
                if ticket is None:
                    ticket = self._backend.enqueue(request)
                    continue
                timeout = math.inf if give_up is None else give_up - now
                if result.retry_in is not None:
                    timeout = min(timeout, max(result.retry_in, 0.0))
                self._backend.wait(ticket, min(timeout, 3600.0))
        finally:
            if ticket is not None:
                self._backend.leave(ticket)

    def _lease(
        self, request: GrantRequest, policy: LeasePolicy, granted: Granted, sent: float
    ) -> Lease:
        lifetime = min(granted.ttl, granted.expires_in)
        return Lease(
            # the coordinator id was checked at connect and the name by acquire
            token=FencingToken._of_checked(self.coordinator_id, request.resource, granted.epoch),
            owner=granted.owner,
            holder=granted.holder,
            ttl=granted.ttl,
            safety_margin=policy.safety_margin,
            deadline=sent + lifetime - policy.safety_margin,
            expires_in=granted.expires_in,
            request_id=request.request_id,
        )

    @staticmethod
    def _busy(resource: str, blocked: Blocked) -> Busy:
        return Busy(resource, blocked.holder, blocked.epoch, blocked.remaining)

    def renew(self, lease: Lease) -> Lease:
        """Extend ``lease`` by its ttl; returns the lease with its new local deadline.

        Only the owner, only while live: raises :class:`LeaseLost` if the coordinator no longer
        has this owner's lease at this epoch (expired, released or taken over), and without
        asking it if the local deadline already passed — the holder treats the lease as lost
        from then on, whatever the coordinator would say. After a loss, acquire again (a new
        epoch). :class:`Unavailable` / :class:`OutcomeUnknown` leave the lease as it was.
        """
        self._check_lease(lease)
        sent = self._clock.now()
        if sent >= lease.deadline:
            raise LeaseLost(LossReason.EXPIRED, "the local deadline passed before renewal")
        remaining = self._backend.renew(lease.resource, lease.epoch, lease.owner, lease.ttl)
        return dataclasses.replace(
            lease,
            deadline=sent + min(remaining, lease.ttl) - lease.safety_margin,
            expires_in=remaining,
        )

    def release(self, lease: Lease) -> bool:
        """Release ``lease`` if it is still this owner's at this epoch; idempotent.

        Returns True if it was released now; False if it had already ended or belongs to a newer
        owner — a delayed release never affects a newer lease.
        """
        self._check_lease(lease)
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
        name = None if resource is None else validate_resource(resource)
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ConfigurationError(f"after must be an integer >= 0, got {after!r}")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ConfigurationError(f"limit must be None or an integer >= 1, got {limit!r}")
        found: list[Record] = []
        while limit is None or len(found) < limit:
            want = HISTORY_PAGE if limit is None else min(HISTORY_PAGE, limit - len(found))
            page = self._backend.records(name, after, want)
            found += page
            if len(page) < want:
                break
            after = page[-1].seq
        return found

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        """Have it recorded that ``lease``'s holder saw a renewal fail or lost it; returns at once.

        Called by the runtime after it signalled what it reports; the record lets ``fenced
        timeline`` show renewal failures and losses. Best effort, never raises, never blocks:
        the report is queued for this coordinator's one background sender, which sends the
        reports of all its leases in order; when :data:`REPORT_QUEUE` reports are waiting (the
        coordinator is slow or unreachable), a new one is dropped and counted in
        :attr:`diagnostics_dropped`.
        """
        kind = RecordKind.LOST if isinstance(error, LeaseLost) else RecordKind.RENEWAL_FAILED
        detail: dict[str, object] = {"error": f"{type(error).__name__}: {error}"}
        if isinstance(error, LeaseLost):
            detail["reason"] = error.reason.value
        self._reports.submit((lease.resource, lease.epoch, lease.holder, kind, detail))

    @property
    def diagnostics_dropped(self) -> int:
        """Holder reports dropped so far: the queue was full, or :meth:`close` could not send
        them in time. A dropped report loses a record, never a renewal or a loss signal."""
        return self._reports.dropped

    def _send_report(self, report: _Report) -> None:
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
        name = validate_resource(resource)
        _lease_policy(ttl, safety_margin)
        validate_wait(wait)
        if holder is not None:
            validate_holder(holder)
        _validate_request_id(request_id)
        if value is not None:
            validate_value(value)
        stores = tuple(fence)
        for store in stores:
            if not callable(getattr(store, "fence", None)):
                raise ConfigurationError(f"{store!r} in fence= has no fence(token) method")
        if on_lost is not None and not callable(on_lost):
            raise ConfigurationError("on_lost must be callable")

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

    def _check_lease(self, lease: object) -> None:
        if not isinstance(lease, Lease):
            raise ConfigurationError(f"expected a Lease, got {type(lease).__name__}")
        if lease.coordinator_id != self.coordinator_id:
            raise ConfigurationError(
                f"this lease comes from coordinator {lease.coordinator_id}, "
                f"not from {self.coordinator_id} ({self.url})"
            )

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

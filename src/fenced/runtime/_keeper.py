"""Background renewal of one held lease, and the signal that it is gone.

:class:`HeldLease` is what ``with coord.hold(...) as held`` yields. It is renewed every ``ttl/3``
(±10 % jitter), each new local deadline computed from the moment the renewal was *sent*, and the
loss is fired at the deadline even while a renewal call hangs. Both are the coordinator's
:class:`~fenced.runtime._scheduler.LeaseScheduler`'s work: one thread for the deadlines and
renewal times of all its held leases, and a few threads for the renewal calls.

Time is the injected :class:`~fenced.core._clock.Clock`'s: deadlines on ``clock.now()``, which
keeps counting while the host is suspended (CLOCK_BOOTTIME on Linux), and every wait through
``clock.wait``, which re-reads that clock, so a deadline that passed during a suspend is acted on
at the resume. Under a :class:`~fenced.core._clock.ManualClock` the keeper runs entirely on the
test's time.

Timeline of a pause::

    t0  acquire sent; deadline = t0 + ttl - margin
    t1  renewal fails (coordinator unreachable)  -> UNCERTAIN, retried every ttl/10,
                                                    sooner near the deadline
    t2  deadline passes                          -> LOST(EXPIRED): ``lost`` is set, on_lost runs
    t3  the coordinator grants epoch+1 to another worker; our stale writes are rejected by stores

Loss is a signal the holder receives (the ``lost`` event, the ``on_lost`` callback, and
:class:`~fenced.LeaseLost` from :meth:`HeldLease.check` and when the ``with`` block ends).
Cancelling the holder's work is best effort; the fence at the store is the guarantee.

Loss first, diagnostics after: the loss is signalled (state, ``lost``, ``on_lost``) before
anything is reported, and reports of failed renewals and losses are only handed to
``LeaseOps.report_trouble``, which must not block (the coordinator queues them for its
background sender, see :class:`~fenced.runtime._diagnostics.DiagnosticSender`): a report to an
unreachable coordinator can delay neither a renewal nor a loss signal.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Protocol

from fenced.core._clock import Clock
from fenced.core._errors import LeaseLost, LossReason
from fenced.core._lease import Lease, LeaseState, LeaseTracker
from fenced.core._token import FencingToken
from fenced.runtime._scheduler import LeaseScheduler

__all__ = ["HeldLease", "HeldView", "LeaseOps", "OnLost", "renewal_interval", "retry_interval"]

log = logging.getLogger("fenced.runtime")
loss_log = logging.getLogger("fenced.runtime.loss")
"""The one warning of a loss (a child of ``fenced.runtime``): a program that says the loss
itself, as ``fenced run`` does in its one line, raises this logger's level."""

OnLost = Callable[[LeaseLost], object]


def renewal_interval(ttl: float, rng: random.Random) -> float:
    """When a held lease is renewed next after a renewal: a third of the ttl, ±10 %. Both
    faces (this module and :mod:`fenced.aio`) renew by this schedule."""
    return ttl / 3 * rng.uniform(0.9, 1.1)


def retry_interval(ttl: float, left: float, rng: random.Random) -> float:
    """After a failed renewal, ``left`` seconds before the local deadline: a tenth of the ttl,
    or a quarter of the time left when that is sooner (at least 10 ms), ±10 %. A lease that
    began with less than its ttl (an etcd grant rides a pooled etcd lease kept alive a moment
    before) or whose renewals kept failing still gets several tries before it is lost."""
    return max(min(ttl / 10, left / 4), 0.01) * rng.uniform(0.9, 1.1)


class LeaseOps(Protocol):
    """What the runtime needs of a coordinator."""

    def renew(self, lease: Lease) -> Lease: ...

    def release(self, lease: Lease) -> bool: ...

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        """Have a renewal failure or a loss recorded, later (best effort). Must return at once
        and never raise: it is called from the renewer and at the loss."""
        ...


class HeldView:
    """What a holder reads of a held lease, on either face: token, epoch, state, deadline,
    ``loss()``, ``check()``, and ``superseded()``. Subclasses keep ``_lease`` (the lease as
    last renewed), ``_tracker``, ``_clock`` and signal a loss with ``_fire``."""

    _lease: Lease
    _tracker: LeaseTracker
    _clock: Clock

    def _fire(self, error: LeaseLost) -> None:
        raise NotImplementedError

    @property
    def lease(self) -> Lease:
        """The lease as last renewed."""
        return self._lease

    @property
    def token(self) -> FencingToken:
        return self._lease.token

    @property
    def epoch(self) -> int:
        return self._lease.epoch

    @property
    def resource(self) -> str:
        return self._lease.resource

    @property
    def state(self) -> LeaseState:
        """HELD, UNCERTAIN or LOST at this instant."""
        return self._tracker.state(self._clock.now())

    @property
    def deadline(self) -> float:
        """The local deadline, on the clock's :meth:`~fenced.core._clock.Clock.now`."""
        return self._tracker.deadline

    def loss(self) -> LeaseLost | None:
        """Why the lease is lost, or None while it is HELD or UNCERTAIN."""
        return self._tracker.loss(self._clock.now())

    def check(self) -> None:
        """Raise :class:`LeaseLost` unless the lease is HELD right now."""
        now = self._clock.now()
        error = self._tracker.loss(now)
        if error is not None:
            self._fire(error)
            raise LeaseLost(error.reason, error.detail)
        if self._tracker.state(now) is LeaseState.UNCERTAIN:
            raise LeaseLost(LossReason.UNCERTAIN, "a renewal failed; the lease may be lost")

    def superseded(self, detail: str = "a store reported a newer epoch") -> None:
        """Tell the runtime a store saw a newer epoch: the lease is LOST (SUPERSEDED)."""
        self._lose(LeaseLost(LossReason.SUPERSEDED, detail))

    def _lose(self, error: LeaseLost) -> None:
        self._tracker.mark_lost(error)
        self._fire(self._tracker.loss(self._clock.now()) or error)


class HeldLease(HeldView):
    """A lease kept alive in the background until :meth:`stop`.

    Guarantees: ``state`` is HELD only while the last renewal succeeded and the local deadline
    has not passed; ``lost`` is set and ``on_lost`` is called exactly once, with the
    :class:`LeaseLost` reason, as soon as the lease is lost (at the deadline at the latest);
    ``check()`` raises :class:`LeaseLost` unless HELD (UNCERTAIN included). Renewals and loss
    signals never wait for a report to the coordinator.
    """

    def __init__(
        self,
        ops: LeaseOps,
        lease: Lease,
        *,
        clock: Clock,
        on_lost: OnLost | None = None,
        rng: random.Random | None = None,
        scheduler: LeaseScheduler | None = None,
    ) -> None:
        """``scheduler``: the coordinator's, shared by its held leases; without one the lease
        gets a scheduler of its own (two threads), ended by :meth:`stop`."""
        self._ops = ops
        self._lease = lease
        self._clock = clock
        self._on_lost = on_lost
        self._rng = rng or random.Random()
        self._tracker = LeaseTracker(lease.deadline)
        self._cond = threading.Condition()
        self._stopping = False
        self._fired = False
        self.lost = threading.Event()
        """Set once the lease is lost (never cleared)."""
        self._own_scheduler = scheduler is None
        self._scheduler = scheduler or LeaseScheduler(
            clock, workers=1, name=f"fenced-lease:{lease.resource}"
        )
        self._started = False

    # -- what the holder reads ------------------------------------------------------------
    @property
    def lease(self) -> Lease:
        """The lease as last renewed."""
        with self._cond:
            return self._lease

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Have the scheduler renew the lease and watch its deadline."""
        self._started = True
        self._scheduler.add(self, self._clock.now() + self._interval())

    def stop(self, *, release: bool = True) -> bool:
        """Stop renewing and (by default) release the lease. Returns release()'s result.

        A renewal in flight is waited for (up to the ttl) before the release. A failure to
        release is logged and reported as False: the lease then simply expires.
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._started:
            self._scheduler.remove(self, timeout=self._lease.ttl)
        if self._own_scheduler:
            self._scheduler.close()
        if not release:
            return False
        try:
            released = self._ops.release(self.lease)
        except Exception as error:
            log.warning("release of %s epoch %s failed: %s", self.resource, self.epoch, error)
            return False
        self._tracker.mark_lost(LeaseLost(LossReason.RELEASED, "released by its holder"))
        return released

    def was_lost(self) -> bool:
        """True if the lease was lost before :meth:`stop` (released does not count)."""
        return self.lost.is_set()

    # -- internals ------------------------------------------------------------------------
    def _fire(self, error: LeaseLost) -> None:
        """Signal the loss once: ``lost``, then ``on_lost``; then log it and hand it to the
        diagnostics (which never blocks)."""
        with self._cond:
            if self._fired:
                return
            self._fired = True
            self._cond.notify_all()
        self.lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost(error)
            except Exception:
                log.exception("on_lost callback for %s raised", self.resource)
        loss_log.warning("lease on %s epoch %s lost: %s", self.resource, self.epoch, error)
        self._ops.report_trouble(self.lease, error)

    def _interval(self) -> float:
        return renewal_interval(self._lease.ttl, self._rng)

    def _retry_interval(self) -> float:
        return retry_interval(
            self._lease.ttl, self._tracker.deadline - self._clock.now(), self._rng
        )

    # -- what the scheduler calls ------------------------------------------------------------
    @property
    def active(self) -> bool:
        """False once stopping or lost: the scheduler keeps nothing more of it."""
        with self._cond:
            return not self._stopping and not self._fired

    def deadline_due(self) -> float | None:
        """At the local deadline (scheduler's thread): fire the loss, or return the deadline a
        renewal moved it to."""
        if not self.active:
            return None
        error = self._tracker.loss(self._clock.now())
        if error is None:
            return self._tracker.deadline
        self._fire(error)
        return None

    def renew(self, sent: float) -> float | None:
        """One renewal (a renewal thread), ``sent`` being when it was handed over; when to renew
        next, or None once lost or stopping."""
        if not self.active:
            return None
        try:
            renewed = self._ops.renew(self.lease)
        except LeaseLost as error:
            self._lose(error)
            return None
        except Exception as error:
            self._tracker.renewal_failed()
            log.warning("renewal of %s epoch %s failed: %s", self.resource, self.epoch, error)
            self._ops.report_trouble(self.lease, error)
            return self._clock.now() + self._retry_interval()
        self._tracker.renewed(self._clock.now(), renewed.deadline)
        if self._tracker.loss(self._clock.now()) is not None:
            self._lose(LeaseLost(LossReason.EXPIRED, "the renewal came back too late"))
            return None
        with self._cond:
            self._lease = renewed
        return sent + self._interval()

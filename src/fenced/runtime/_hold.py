"""``coord.hold(...)``: acquire, install at the stores, keep alive, signal loss, release.

Guarantees, in order:

1. ``__enter__`` acquires (or raises :class:`~fenced.Busy`), then installs the new epoch at every
   store in ``fence`` with ``store.fence(token)`` *before* the body runs (strict handoff: from
   then on those stores reject every older epoch, even before the body writes anything). If a
   store refuses (its floor is higher: a restored or foreign coordinator), the lease is released
   and the store's error is raised with a note saying what it means.
2. While the body runs, the lease is renewed in the background (see :mod:`._keeper`), by the
   coordinator's scheduler (:mod:`._scheduler`).
3. ``__exit__`` stops renewing and releases. If the lease was lost while the body ran and the
   body itself raised nothing, the block ends with :class:`~fenced.LeaseLost`: a body that
   outlives its lease never ends silently. An exception from the body is never masked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Protocol

from fenced.core._clock import Clock
from fenced.core._errors import FencedError, LeaseLost, LossReason
from fenced.core._lease import Lease
from fenced.core._token import FencingToken
from fenced.runtime._keeper import HeldLease, LeaseOps, OnLost
from fenced.runtime._scheduler import LeaseScheduler

__all__ = ["Fenceable", "Hold", "expired_while_fencing", "outlived", "refused"]


class Fenceable(Protocol):
    """Anything that can install a fencing token: a store, or the user's own adapter."""

    def fence(self, token: FencingToken) -> object: ...


def refused(error: FencedError, lease: Lease, store: object) -> None:
    """Say on ``error`` what a store's refusal of a new epoch means (both faces' ``hold``)."""
    error.add_note(
        f"hold({lease.resource!r}) could not install epoch {lease.epoch} at "
        f"{store!r}; the lease was released. A store whose floor is above the "
        "coordinator's epochs means the coordinator was restored or is another "
        "one: see docs/operations.md"
    )


def expired_while_fencing() -> LeaseLost:
    """What ``hold`` raises when the lease expired while its epoch was being installed."""
    return LeaseLost(
        LossReason.EXPIRED, "the lease expired while its epoch was installed at stores"
    )


def outlived(loss: LeaseLost) -> LeaseLost:
    """What ``hold`` raises when the body ended normally after the lease was lost."""
    return LeaseLost(loss.reason, f"the body outlived its lease: {loss.detail}")


class Hold:
    """The context manager returned by ``Coordinator.hold``; single use."""

    def __init__(
        self,
        acquire: Callable[[], Lease],
        ops: LeaseOps,
        *,
        clock: Clock,
        fence: Iterable[Fenceable] = (),
        on_lost: OnLost | None = None,
        scheduler: LeaseScheduler | None = None,
    ) -> None:
        self._acquire = acquire
        self._scheduler = scheduler
        self._ops = ops
        self._clock = clock
        self._fence = tuple(fence)
        self._on_lost = on_lost
        self._held: HeldLease | None = None

    def __enter__(self) -> HeldLease:
        if self._held is not None:
            raise RuntimeError("a hold() context manager can be entered only once")
        lease = self._acquire()
        held = HeldLease(
            self._ops, lease, clock=self._clock, on_lost=self._on_lost, scheduler=self._scheduler
        )
        try:
            for store in self._fence:
                try:
                    store.fence(lease.token)
                except FencedError as error:
                    refused(error, lease, store)
                    raise
            if held.loss() is not None:
                raise expired_while_fencing()
        except BaseException:
            with contextlib.suppress(FencedError):  # if release fails, it expires by itself
                self._ops.release(lease)
            raise
        held.start()
        self._held = held
        return held

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        held = self._held
        if held is None:
            return
        loss = held.loss() if held.lost.is_set() or held.loss() is not None else None
        held.stop(release=True)
        if exc_type is None and loss is not None:
            raise outlived(loss)

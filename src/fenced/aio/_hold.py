"""``async with coord.hold(...)``: acquire, install at the stores, keep alive, signal loss,
release — the sync :mod:`fenced.runtime._hold` guarantees, awaited, plus the body's
cancellation at a loss.

1. ``__aenter__`` acquires (or raises :class:`~fenced.Busy`), then installs the new epoch at every
   store in ``fence`` (``await store.fence(token)`` for an async store, a plain call for a sync
   one) before the body runs. If a store refuses, the lease is released and the error raised.
2. While the body runs, the coordinator's scheduler task renews the lease.
3. **At a loss the task running the body is cancelled** (``cancel_on_loss=True``, the default):
   it gets :class:`asyncio.CancelledError` at its next ``await``, and the block ends with
   :class:`~fenced.LeaseLost` (the ``CancelledError`` as its cause). A body that shields itself
   or catches the cancellation still sees ``held.lost``, and the block still ends with
   ``LeaseLost``. A cancellation from elsewhere (the task was cancelled by its owner too) is
   never swallowed: it propagates as ``CancelledError``.
4. ``__aexit__`` stops renewing and releases (shielded: a cancelled exit never half-releases —
   the release completes, or the lease expires by its ttl). A body that outlived its lease and
   raised nothing ends with ``LeaseLost``; an exception from the body is never masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from types import TracebackType

from fenced.aio._keeper import AsyncHeldLease, AsyncLeaseOps, AsyncLeaseScheduler, OnLost
from fenced.core._clock import Clock
from fenced.core._errors import FencedError, LeaseLost, LossReason
from fenced.core._lease import Lease
from fenced.runtime._hold import expired_while_fencing, outlived, refused

__all__ = ["AsyncHold"]


class AsyncHold:
    """The async context manager returned by ``AsyncCoordinator.hold``; single use."""

    def __init__(
        self,
        acquire: Callable[[], Awaitable[Lease]],
        ops: AsyncLeaseOps,
        *,
        clock: Clock,
        scheduler: AsyncLeaseScheduler,
        fence: tuple[object, ...] = (),
        on_lost: OnLost | None = None,
        cancel_on_loss: bool = True,
    ) -> None:
        self._acquire = acquire
        self._ops = ops
        self._clock = clock
        self._scheduler = scheduler
        self._fence = fence
        self._on_lost = on_lost
        self._cancel_on_loss = cancel_on_loss
        self._held: AsyncHeldLease | None = None
        self._entered = False

    async def __aenter__(self) -> AsyncHeldLease:
        if self._entered:
            raise RuntimeError("a hold() context manager can be entered only once")
        self._entered = True
        lease = await self._acquire()
        held = AsyncHeldLease(
            self._ops, lease, clock=self._clock, scheduler=self._scheduler, on_lost=self._on_lost
        )
        try:
            for store in self._fence:
                try:
                    installed = store.fence(lease.token)  # type: ignore[attr-defined]
                    if inspect.isawaitable(installed):
                        await installed
                except FencedError as error:
                    refused(error, lease, store)
                    raise
            if held.loss() is not None:
                raise expired_while_fencing()
        except BaseException:
            with contextlib.suppress(FencedError):  # if release fails, it expires by itself
                await asyncio.shield(self._ops.release(lease))
            raise
        held.start(asyncio.current_task() if self._cancel_on_loss else None)
        self._held = held
        return held

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        held = self._held
        if held is None:
            return
        held.keep_body()
        task = asyncio.current_task()
        ours = held.cancelled_body  # the loss cancelled this task (delivered or pending)
        loss = held.loss() if held.lost.is_set() or held.loss() is not None else None
        try:
            await held.stop(release=True)
        except asyncio.CancelledError:
            # Our pending cancellation arrived here, in the exit: the release goes on (shielded).
            if not ours or task is None or task.uncancel() > 0:
                raise
            ours = False
            await held.stop(release=True)
        if ours and isinstance(exc, asyncio.CancelledError) and task is not None:
            if task.uncancel() > 0:
                return  # cancelled from elsewhere as well: let that CancelledError go on
            lost = held.loss() or LeaseLost(LossReason.EXPIRED, "the lease was lost")
            raise LeaseLost(
                lost.reason, f"the body was cancelled: the lease was lost: {lost.detail}"
            ) from exc
        if exc_type is None and loss is not None:
            raise outlived(loss)

"""Elections on the asyncio face: ``async with coord.campaign(...)``, ``async for change in
coord.observe(name)``, ``await leadership.resign()`` / ``proclaim(value)``.

The semantics are those of :mod:`fenced.election` (a term is a lease on the election name; its
number is the epoch; candidates queue first come, first served; every term observed exactly once,
in order). What decides is shared with the sync face: values are checked by
:func:`~fenced.election._campaign.validate_value`, records are folded into changes by the same
:class:`~fenced.election._observer.TermTracker`. As with ``hold``, the loss of the term cancels
the body of ``campaign`` (``cancel_on_loss=False`` to opt out).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import random
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Protocol, TypeVar

from fenced.aio._hold import AsyncHold
from fenced.aio._keeper import AsyncHeldLease, OnLost
from fenced.core._errors import LeaseLost, LossReason, OutcomeUnknown, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record
from fenced.election._campaign import TermView
from fenced.election._observer import (
    _BACKOFF_FIRST,
    _BACKOFF_MAX,
    RECHECK,
    LeaderChange,
    TermTracker,
)

__all__ = ["AsyncCampaign", "AsyncLeadership", "AsyncObserver"]

log = logging.getLogger("fenced.election")

T = TypeVar("T")


class AsyncProclaimer(Protocol):
    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None: ...


class AsyncLeadership(TermView):
    """One term of leadership (the async :class:`~fenced.election.Leadership`): ``term``,
    ``token``, ``value``, ``state``, ``check()``, ``lost`` and ``ended`` (asyncio events),
    ``await proclaim(value)``, ``await resign()``."""

    _held: AsyncHeldLease

    def __init__(
        self, held: AsyncHeldLease, proclaimer: AsyncProclaimer, value: str, ended: asyncio.Event
    ) -> None:
        self._held = held
        self._proclaimer = proclaimer
        self._value = value
        self._lock = threading.Lock()
        self._resigned = None
        self.ended = ended
        """Set once the leadership is over for this process: lost, resigned or block exited."""

    @property
    def lost(self) -> asyncio.Event:
        """Set once the term is lost (a resignation does not set it)."""
        return self._held.lost

    async def proclaim(self, value: str) -> None:
        """Advertise ``value`` in the same term (see the sync ``Leadership.proclaim``)."""
        advertised, lease = self._advertised(value)
        await self._proclaimer.proclaim(lease.resource, lease.epoch, lease.owner, advertised)
        with self._lock:
            self._value = advertised

    async def resign(self) -> bool:
        """Step down now: stop renewing and release the term (shielded: a cancelled resign
        never half-releases). True if released now; idempotent."""
        with self._lock:
            if self._resigned is not None:
                return False
            self._resigned = LeaseLost(LossReason.RELEASED, "the leader resigned")
        self._held.keep_body()
        try:
            return await self._held.stop(release=True)
        finally:
            self.ended.set()


class AsyncCampaign:
    """The async context manager returned by ``AsyncCoordinator.campaign``; single use."""

    def __init__(
        self,
        hold: Callable[[OnLost], AsyncHold],
        proclaimer: AsyncProclaimer,
        value: str,
        *,
        on_lost: OnLost | None = None,
    ) -> None:
        self._on_lost = on_lost
        self._ended = asyncio.Event()
        self._hold = hold(self._signal_loss)
        self._proclaimer = proclaimer
        self._value = value
        self._leadership: AsyncLeadership | None = None

    def _signal_loss(self, error: LeaseLost) -> None:
        self._ended.set()
        if self._on_lost is not None:
            self._on_lost(error)

    async def __aenter__(self) -> AsyncLeadership:
        if self._leadership is not None:
            raise RuntimeError("a campaign() context manager can be entered only once")
        held = await self._hold.__aenter__()
        self._leadership = AsyncLeadership(held, self._proclaimer, self._value, self._ended)
        return self._leadership

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        leadership = self._leadership
        if leadership is None:
            return
        try:
            if not leadership.resigned or leadership.lost.is_set():
                await self._hold.__aexit__(exc_type, exc, tb)
        finally:
            self._ended.set()


class ObserveReads(Protocol):
    """What an async observer reads from an :class:`~fenced.aio.AsyncCoordinator`."""

    async def current(self, resource: str) -> LeaseInfo | None: ...

    async def last_epoch(self, resource: str) -> int: ...

    async def history(self, resource: str | None = None, *, after: int = 0) -> list[Record]: ...


class AsyncObserver:
    """``async for change in coord.observe(name)``: every leadership change of ``name`` from
    now on, in order, woken by the backend's notifications; retries through outages with
    backoff. The first read happens at the first ``__anext__`` (or ``async with``) and raises
    if it fails. Ends after :meth:`aclose`."""

    def __init__(
        self,
        reads: ObserveReads,
        watch: Callable[[str, int, float], Awaitable[None]],
        name: str,
        *,
        recheck: float = RECHECK,
    ) -> None:
        self._reads = reads
        self._watch = watch
        self._name = name
        self._recheck = recheck
        self._rng = random.Random()
        self._tracker = TermTracker(name)
        self._pending: collections.deque[LeaderChange] = collections.deque()
        self._seq = 0
        self._started = False
        self._closed = asyncio.Event()
        self._failing = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def position(self) -> int:
        """The seq of the last record read."""
        return self._seq

    def __aiter__(self) -> AsyncIterator[LeaderChange]:
        return self

    async def __aenter__(self) -> AsyncObserver:
        await self._start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop: iteration ends (a task waiting in ``__anext__`` returns within RECHECK)."""
        self._closed.set()

    async def __anext__(self) -> LeaderChange:
        change = await self.get(None)
        if change is None:
            raise StopAsyncIteration
        return change

    async def get(self, timeout: float | None = None) -> LeaderChange | None:
        """The next change, or None after ``timeout`` seconds or once closed."""
        await self._start()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(timeout, 0.0)
        next_recheck = loop.time() + self._recheck
        while True:
            if self._pending:
                return self._pending.popleft()
            if self._closed.is_set():
                return None
            records = await self._call(
                lambda: self._reads.history(self._name, after=self._seq), deadline
            )
            if records is None:
                return None
            if records:
                await self._absorb(records, deadline)
                continue
            now = loop.time()
            if now >= next_recheck:
                next_recheck = now + self._recheck
                if await self._rewound(deadline):
                    continue
            left = self._recheck if deadline is None else deadline - now
            if left <= 0:
                return None
            pause = min(left, max(next_recheck - now, 0.001))
            if await self._call(functools.partial(self._watched, pause), deadline) is None:
                return None

    async def _watched(self, pause: float) -> bool:
        await self._watch(self._name, self._seq, pause)
        return True

    async def _start(self) -> None:
        if self._started:
            return
        self._started = True
        while records := await self._reads.history(self._name, after=self._seq):
            self._tracker.feed_all(records)
            self._seq = records[-1].seq
        live = self._tracker.live
        if live is not None and not live.value_known:
            info = await self._reads.current(self._name)
            if info is not None and info.epoch == live.number:
                self._tracker.learn_value(live.number, info.value)
        current = self._tracker.current()
        if current is not None:
            self._pending.append(current)

    async def _absorb(
        self, records: list[Record], deadline: float | None, *, position: int | None = None
    ) -> None:
        changes = self._tracker.feed_all(records)
        self._seq = records[-1].seq if position is None else position
        term = self._tracker.unknown_value()
        if term is not None:  # ask the coordinator; if it cannot answer in time: unknown (None)
            answer = await self._call(self._current, deadline)
            if answer is not None:
                changes = self._tracker.valued(changes, term, answer[0])
        self._pending.extend(changes)

    async def _current(self) -> tuple[LeaseInfo | None]:
        return (await self._reads.current(self._name),)

    async def _rewound(self, deadline: float | None) -> bool:
        """Read the history again if a restore renumbered it (the sync Observer's rule)."""
        last = await self._call(lambda: self._reads.last_epoch(self._name), deadline)
        seen = self._tracker.highest
        if last is None or last <= seen:
            return False
        newer = await self._call(lambda: self._reads.history(self._name, after=self._seq), deadline)
        if newer is None:
            return False
        if newer:
            await self._absorb(newer, deadline)
            return True
        self._tracker.highest = last
        replay: list[Record] = []
        while True:
            start = replay[-1].seq if replay else 0
            page = await self._call(
                functools.partial(self._reads.history, self._name, after=start), deadline
            )
            if not page:
                break
            replay.extend(page)
        if not replay:
            return False
        log.warning("the records of %s were renumbered; read them again", self._name)
        await self._absorb(self._tracker.replayed(replay, seen), deadline, position=replay[-1].seq)
        return True

    async def _call(self, fn: Callable[[], Awaitable[T]], deadline: float | None) -> T | None:
        """``await fn()``, retried with backoff through outages; None if closed or past
        ``deadline`` (loop time)."""
        loop = asyncio.get_running_loop()
        delay = _BACKOFF_FIRST
        while True:
            try:
                result = await fn()
            except (Unavailable, OutcomeUnknown) as error:
                if not self._failing:
                    log.warning("observing %s: %s; retrying", self._name, error)
                    self._failing = True
                pause = delay * self._rng.uniform(0.8, 1.2)
                if deadline is not None:
                    pause = min(pause, deadline - loop.time())
                if pause <= 0:
                    return None
                try:
                    await asyncio.wait_for(self._closed.wait(), pause)
                    return None
                except TimeoutError:
                    pass
                delay = min(delay * 2, _BACKOFF_MAX)
                continue
            if self._failing:
                log.warning("observing %s: reconnected", self._name)
                self._failing = False
            return result

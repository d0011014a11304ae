"""Waiters' places in the queues, kept by the server between a client's polls.

An HTTP client cannot hold a connection open for as long as it is willing to wait, so
``:acquire`` waits at most the server's poll bound per request. A waiter that names itself with a
``request_id`` keeps its place (the backend's ticket: first come, first served) after the
request ends, and its next poll with the same ``request_id`` continues from there. A place that
no poll touched for ``keep`` seconds is left (the backend's ``leave``: a lease a release handed to
it meanwhile is released at once and passed on), so a client that went away holds nobody up for
longer than ``keep`` plus the sweep interval.

Polls of one place are served one at a time, in arrival order. Places live in one server
process: a client that moves to another server takes a new place there (at the end of the line).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.coordinator.backend import Granted, GrantRequest, Ticket

__all__ = ["Place", "Places"]

log = logging.getLogger("fenced.server")


@dataclass(eq=False)
class Place:
    """One waiter's ticket, the request it was taken for, and when a poll last ended."""

    request: GrantRequest
    ticket: Ticket
    idle_since: float | None = None
    """``time.monotonic()`` when the last poll ended; None while a poll runs."""
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)


class Places:
    """The kept places of one server, by ``(resource, request_id)``; one sweeper task."""

    def __init__(self, backend: AsyncCoordinatorBackend, keep: float) -> None:
        self._backend = backend
        self.keep = keep
        self._places: dict[tuple[str, str], Place] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._polls: set[asyncio.Task[object]] = set()
        self.stopping = False
        """Set at shutdown: polls end at once with a retryable answer."""

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep(), name="fenced-places")

    @property
    def waiting(self) -> int:
        """Requests waiting on the server now (long polls, watches, event streams)."""
        return len(self._polls)

    def __len__(self) -> int:
        return len(self._places)

    @contextlib.asynccontextmanager
    async def polling(self, key: tuple[str, str]) -> AsyncIterator[Place | None]:
        """The kept place of ``key`` (None if there is none), this poll's turn on it held."""
        task = asyncio.current_task()
        assert task is not None
        self._polls.add(task)
        try:
            place = self._places.get(key)
            if place is None:
                yield None
                return
            async with place.turn:
                if self._places.get(key) is not place:  # left while this poll queued
                    yield None
                    return
                place.idle_since = None
                try:
                    yield place
                finally:
                    place.idle_since = time.monotonic()
        finally:
            self._polls.discard(task)

    def poll_started(self) -> None:
        """Count the running task as a poll (interrupted at shutdown)."""
        task = asyncio.current_task()
        assert task is not None
        self._polls.add(task)

    def poll_ended(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._polls.discard(task)

    def keep_place(self, key: tuple[str, str], request: GrantRequest, ticket: Ticket) -> Place:
        """Keep ``ticket`` as the place of ``key`` (its poll holds the turn)."""
        place = Place(request, ticket)
        self._places[key] = place
        return place

    def forget(self, key: tuple[str, str], place: Place) -> None:
        """The place was consumed by a grant (the backend dropped its ticket)."""
        if self._places.get(key) is place:
            del self._places[key]

    async def leave(self, key: tuple[str, str], take: bool) -> Granted | None:
        """Leave the place of ``key`` (the backend's ``leave``); None if there is none."""
        place = self._places.pop(key, None)
        if place is None:
            return None
        async with place.turn:
            return await self._backend.leave(place.ticket, take)

    def interrupt(self) -> None:
        """Shutdown: every running poll is cancelled (it answers "retry")."""
        self.stopping = True
        for task in list(self._polls):
            task.cancel("fenced serve is shutting down")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(max(self.keep / 4, 0.05))
            now = time.monotonic()
            for key, place in list(self._places.items()):
                if place.idle_since is not None and now - place.idle_since > self.keep:
                    log.info("%s: left the place of request %s (no poll for %.1fs)",
                             key[0], key[1], now - place.idle_since)  # fmt: skip
                    with contextlib.suppress(Exception):
                        await self.leave(key, take=False)

    async def aclose(self) -> None:
        """Stop the sweeper and leave every place (best effort: a place left unanswered is
        dropped by the backend with its ticket's keep-alive)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for key in list(self._places):
            with contextlib.suppress(Exception):
                await self.leave(key, take=False)

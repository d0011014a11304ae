"""The ZooKeeper coordinator, asyncio face: ``await fenced.aio.connect("zk://…")``.

The same plans as the sync face (:mod:`._plans`); each request is sent with kazoo's
asynchronous API and its completion is handed to the event loop
(``loop.call_soon_threadsafe``), so no call holds a thread while it waits, and waiting for a
watch (:meth:`AsyncZooKeeperBackend.wait`, :meth:`~AsyncZooKeeperBackend.watch`) suspends the
task only. kazoo's own threads (its connection and its callback worker) run from
:func:`open_async_zookeeper` until :meth:`~AsyncZooKeeperBackend.aclose`, which stops them on a
short-lived thread of its own and returns once they have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kazoo.handlers.threading import KazooTimeoutError
from kazoo.interfaces import IAsyncResult
from kazoo.protocol.states import KazooState

from fenced.coordinator.backend import (
    CAP_RECORDS,
    CAP_REQUEST_ID,
    CAP_WAIT_NOTIFY,
    Blocked,
    Granted,
    GrantRequest,
    Ticket,
    owned_ticket,
)
from fenced.coordinator.backends.zookeeper import _plans as plans
from fenced.coordinator.backends.zookeeper._driver import (
    KICK_EVERY,
    answer,
    connected,
    kick,
    new_client,
    submit,
    translate,
)
from fenced.coordinator.backends.zookeeper._layout import Paths
from fenced.coordinator.backends.zookeeper._settings import parse_zk_url
from fenced.coordinator.backends.zookeeper._steps import Plan, Request, SharedState
from fenced.core._errors import FencedError, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._urls import redacted

__all__ = ["AsyncZooKeeperBackend", "open_async_zookeeper"]

T = TypeVar("T")


async def open_async_zookeeper(url: str, *, create: bool = True) -> AsyncZooKeeperBackend:
    """Open the asyncio backend: start kazoo's session (without blocking the loop) and read or
    create fenced's state. Unavailable when no session is established in ``connect_timeout``."""
    backend = AsyncZooKeeperBackend(url)
    try:
        await backend._start(create)
    except BaseException:
        await backend.aclose()
        raise
    return backend


class AsyncZooKeeperBackend:
    """The asyncio coordinator backend on a ZooKeeper ensemble (see the module docstring)."""

    capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})

    def __init__(self, url: str) -> None:
        self._settings = settings = parse_zk_url(url)
        self.url = settings.display()
        self.coordinator_id = ""
        self._loop = asyncio.get_running_loop()
        self._client = new_client(settings)
        self._state = SharedState(Paths(settings.chroot))
        self._changed = asyncio.Event()
        self._connected = asyncio.Event()
        self._client.add_listener(self._on_state)
        self._closed = False
        self._background: dict[str, asyncio.Task[None]] = {}

    def __repr__(self) -> str:
        return f"AsyncZooKeeperBackend({self.url!r})"

    async def _start(self, create: bool) -> None:
        self._client.start_async()
        try:
            await asyncio.wait_for(self._connected.wait(), self._settings.connect_timeout)
        except TimeoutError as error:
            raise Unavailable(
                f"ZooKeeper: no session with {redacted(self.url)} within "
                f"{self._settings.connect_timeout:g} s"
            ) from error
        await self._run(plans.open_state(self._state, create, self.url))
        self.coordinator_id = self._state.coordinator_id

    def _on_state(self, state: str) -> bool:
        """kazoo's connection listener (its thread): tell the loop."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._changed_to, state)
        return False

    def _changed_to(self, state: str) -> None:
        if state == KazooState.LOST:
            self._state.held.clear()
        if state == KazooState.CONNECTED:
            connected(self._client, self._state)
            self._connected.set()
            if self._state.lost_places:
                self._in_background("sweep", plans.sweep)
        else:
            self._connected.clear()
        self._wake()

    def _in_background(self, name: str, plan: Callable[[SharedState], Plan[None]]) -> None:
        """Run ``plan`` in a task of its own (at most one of each ``name``; cancelled by
        :meth:`aclose`); its failures are left for a later run."""
        if self._closed or name in self._background:
            return

        async def run() -> None:
            with contextlib.suppress(FencedError):
                await self._run(plan(self._state), sweep=False)

        task = self._loop.create_task(run())
        self._background[name] = task
        task.add_done_callback(lambda _: self._background.pop(name, None))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _future(self, result: IAsyncResult) -> asyncio.Future[None]:
        future: asyncio.Future[None] = self._loop.create_future()

        def done(_result: object) -> None:
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_settle, future)

        result.rawlink(done)
        return future

    async def _run(self, plan: Plan[T], sweep: bool = True) -> T:
        """Run ``plan`` to its end, each request waited for at most the URL's timeout (places
        left behind in queues are swept first)."""
        if sweep and self._state.lost_places:
            with contextlib.suppress(FencedError):
                await self._run(plans.sweep(self._state), sweep=False)
        try:
            request = next(plan)
            while True:
                try:
                    reply = await self._answer(request)
                except FencedError as error:
                    request = plan.throw(error)
                else:
                    request = plan.send(reply)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            plan.close()
            if self._state.prune_due:
                self._in_background("prune", plans.prune)

    async def _answer(self, request: Request) -> object:
        pending = submit(self._client, self._state, request)
        replies = asyncio.gather(*(self._future(r) for r in pending))
        deadline = self._loop.time() + self._settings.timeout
        try:
            while not replies.done():
                left = deadline - self._loop.time()
                if left <= 0:
                    raise translate(request, KazooTimeoutError())
                await asyncio.wait({replies}, timeout=min(left, KICK_EVERY))
                if not replies.done():
                    kick(self._client, self._state)
        finally:
            replies.cancel()  # no-op once answered; else (timeout, cancelled) stop waiting
        return answer(request, pending, self._state)

    async def _wait_for(self, path: str, timeout: float, children: bool = False) -> bool:
        """Until ``path`` changes (see the sync face), the connection changes, or timeout;
        True when the znode's watch fired (or it was gone already)."""
        fired = asyncio.Event()
        changed = self._changed

        def fire(_event: object) -> None:
            if not self._loop.is_closed():
                self._loop.call_soon_threadsafe(fired.set)

        try:
            if children:
                result = self._client.get_children_async(path, watch=fire)
            else:
                result = self._client.exists_async(path, watch=fire)
            await asyncio.wait_for(self._future(result), self._settings.timeout)
            if not children and result.get_nowait() is None:
                return True
        except Exception:  # not connected: wait for the connection to change
            fired.clear()
        waits = [asyncio.ensure_future(fired.wait()), asyncio.ensure_future(changed.wait())]
        try:
            await asyncio.wait(waits, timeout=max(0.0, timeout), return_when="FIRST_COMPLETED")
        finally:
            for waiting in waits:
                waiting.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return fired.is_set()

    # -- the contract ---------------------------------------------------------------------

    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        mine = owned_ticket(self, ticket, request.resource, plans.ZkTicket)
        return await self._run(plans.try_grant(self._state, request, mine, self))

    async def enqueue(self, request: GrantRequest) -> Ticket:
        return await self._run(plans.enqueue(self._state, request, self))

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        """As the sync face's ``wait``: only the head of the queue is woken by a release."""
        mine = owned_ticket(self, ticket, ticket.resource, plans.ZkTicket)
        assert mine is not None
        deadline = self._loop.time() + timeout
        while (left := deadline - self._loop.time()) > 0:
            try:
                wake = await self._run(plans.wake_path(self._state, mine))
            except Unavailable:
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, 0.25))
                return
            if wake is None:
                return
            path, due = wake
            fired = await self._wait_for(path, left if due is None else min(left, due))
            if path == self._state.paths.lease(mine.resource):
                mine.head_woken = fired  # deleted: the next try_grant tries the handoff
                return  # the lease is gone (or due): try at once
            if not fired:
                return

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Delete the waiter's znode. Nothing is handed to a waiter here: always None."""
        mine = owned_ticket(self, ticket, ticket.resource, plans.ZkTicket)
        assert mine is not None
        await self._run(plans.leave(self._state, mine))
        return None

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return await self._run(plans.renew(self._state, resource, epoch, owner, ttl))

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        return await self._run(plans.release(self._state, resource, epoch, owner))

    async def current(self, resource: str) -> LeaseInfo | None:
        return await self._run(plans.current(self._state, resource))

    async def last_epoch(self, resource: str) -> int:
        return await self._run(plans.last_epoch(self._state, resource))

    async def resources(self) -> list[str]:
        return await self._run(plans.resources(self._state))

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        await self._run(plans.proclaim(self._state, resource, epoch, owner, value))

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        return await self._run(plans.records(self._state, resource, after, limit))

    async def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        await self._run(plans.report(self._state, resource, epoch, holder, kind, detail))

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        deadline = self._loop.time() + timeout
        while True:
            newest, due = await self._run(plans.newest_seq(self._state, resource))
            left = deadline - self._loop.time()
            if newest > after or left <= 0:
                return
            await self._wait_for(
                self._state.paths.log, left if due is None else min(left, due + 0.01), True
            )

    async def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        return await self._run(plans.advance(self._state, minimum, floors, detail))

    async def aclose(self) -> None:
        """Stop kazoo (its threads end before this returns); idempotent."""
        if self._closed:
            return
        self._closed = True
        tasks = list(self._background.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        done = self._loop.create_future()

        def stop() -> None:
            try:
                self._client.stop()
                self._client.close()
            except Exception:  # noqa: S110 - closing is best effort
                pass
            finally:
                if not self._loop.is_closed():
                    self._loop.call_soon_threadsafe(_settle, done)

        stopper = threading.Thread(target=stop, name="fenced-zk-close", daemon=True)
        stopper.start()
        await asyncio.shield(done)
        stopper.join()


def _settle(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)

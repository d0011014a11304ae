"""The asyncio face's watches: every watch of one backend on ONE etcd ``Watch`` stream, read by
ONE task (:class:`AsyncWatcher`).

etcd multiplexes watches on a stream: each create request names its own watch id, and every
reply carries the id it is for. The watcher keeps the watches its backend asked for
(:meth:`AsyncWatcher.add`), writes their create requests on the stream, and its task reads the
replies and hands each batch of events, once and in order, to the callback of its watch (which
only wakes tasks: it never awaits). A callback is told of trouble too: ``"broken"`` (the stream
ended: every waiter re-checks), ``"compacted"`` (the watch's start revision was compacted
away: events were lost, the owner re-reads), ``"changed"`` (a watch confirmed only after its
owner gave up waiting for it: what happened meanwhile is not known), ``"down"`` (no endpoint
took the stream for a while; it keeps trying).

After a broken stream (a member killed, restarted, or cut off from the leader: etcd ends the
streams of a member without a leader, as every request carries "require leader") the task
opens a new one on any endpoint and creates every watch again from the revision after the last
event it delivered: no event is skipped, none delivered twice. A watch etcd cancels for another
reason than compaction (etcd 3.4 refuses a create on a stream whose token it no longer takes with
"invalid auth token" or "permission denied") gets a new token and a new stream.

A watch created without a start revision starts at etcd's current revision H (etcd's "synced"
group, no catch-up loop): every change after H is delivered, so an owner that waits for the
confirmation (:meth:`AsyncWatcher.start`) and then reads sees every later change.

The replies are read while the event loop runs: those that came while it did not wait in the
stream, and each costs a wake-up of the loop to read. :meth:`AsyncWatcher.caught_up` asks etcd
for a progress notification (etcd 3.4+: a reply with watch id -1, written after the events it
had sent) and says when it came, so an owner knows it has seen what happened until then.
Requests nobody waits for (cancels, progress requests) are written by a task of their own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._aio_transport import AsyncTransport, cancelling
from fenced.coordinator.backends.etcd._client import KV, RETRY_PAUSE, Event

__all__ = ["AsyncWatcher"]

log = logging.getLogger("fenced.coordinator.etcd")

_PUT, _DELETE = 0, 1  # etcd's Event.EventType
_REFUSED_PAUSE = 1.0  # between new streams while etcd keeps cancelling a watch
_PROGRESS = rpc.WatchRequest(progress_request=rpc.WatchProgressRequest())
_PROGRESS_ID = -1  # the watch id of etcd's reply to a progress request (no watch's)


def _cancel_request(watch_id: int) -> rpc.WatchRequest:
    return rpc.WatchRequest(cancel_request=rpc.WatchCancelRequest(watch_id=watch_id))


@dataclass(eq=False)
class _Watch:
    id: int
    key: bytes
    range_end: bytes
    on_events: Callable[[list[Event]], None]
    on_trouble: Callable[[str], None]
    next_rev: int = 0  # the next revision to deliver (0: from etcd's current revision on)
    confirmed: int = 0  # the revision etcd confirmed it at on the current stream (0: not yet)
    late: bool = False  # its owner stopped waiting for the confirmation
    sent_on: Any = None  # the stream its create request was written on
    created: asyncio.Event = field(default_factory=asyncio.Event)

    def request(self) -> rpc.WatchRequest:
        create = rpc.WatchCreateRequest(
            key=self.key, range_end=self.range_end, watch_id=self.id, start_revision=self.next_rev
        )
        return rpc.WatchRequest(create_request=create)


class _Broken(Exception):
    """The stream cannot go on (a reason from etcd, or its end)."""


class AsyncWatcher:
    """The watches of one asyncio etcd backend on one ``Watch`` stream (module docstring).

    Use from one event loop. :meth:`add` registers a watch, :meth:`start` gets it created,
    :meth:`remove` cancels it; the reading task starts with the first watch and ends with
    :meth:`aclose`."""

    def __init__(self, transport: AsyncTransport) -> None:
        self._transport = transport
        self._watches: dict[int, _Watch] = {}
        self._ids = itertools.count(1)
        self._call: Any = None  # the open stream
        self._token: str | None = None  # the token it was opened with
        self.endpoint: str | None = None
        """The endpoint that serves the open stream (None while there is none)."""
        self._write = asyncio.Lock()  # one write on the stream at a time
        self._wanted = asyncio.Event()  # a watch was added
        self._task: asyncio.Task[None] | None = None
        self._answered = False  # the open stream delivered a reply
        self._writes: set[asyncio.Task[None]] = set()  # writes nobody waits for
        self._progress: collections.deque[asyncio.Future[bool]] = collections.deque()
        # the callers of caught_up() whose progress request etcd has not answered yet
        self._closed = False

    # -- the backend's side ---------------------------------------------------------------
    def add(
        self,
        key: bytes,
        range_end: bytes,
        on_events: Callable[[list[Event]], None],
        on_trouble: Callable[[str], None],
    ) -> int:
        """Register a watch of ``[key, range_end)`` (``range_end`` empty: the key alone) from
        etcd's current revision; its id. :meth:`start` gets it created."""
        watch_id = next(self._ids)
        self._watches[watch_id] = _Watch(watch_id, key, range_end, on_events, on_trouble)
        self._wanted.set()
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="fenced-etcd-watch"
            )
        return watch_id

    async def start(self, watch_id: int, wait: float) -> bool:
        """Write the watch's create request if the stream is open (else the task does when it
        opens one), then wait up to ``wait`` seconds for etcd's confirmation; True if
        confirmed. A watch confirmed later tells its owner ``"changed"``."""
        watch = self._watches.get(watch_id)
        if watch is None:
            return False
        await self._create(watch)
        if watch.confirmed:
            return True
        if wait > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await watch.created.wait()
        if not watch.confirmed:
            watch.late = True
        return bool(watch.confirmed)

    def healthy(self, watch_id: int) -> bool:
        """Is the watch confirmed on the open stream (its events arrive as they happen)?"""
        watch = self._watches.get(watch_id)
        return watch is not None and bool(watch.confirmed) and watch.sent_on is self._call

    async def caught_up(self, wait: float, enough: asyncio.Future[None] | None = None) -> bool:
        """Have the events etcd sent on the open stream so far delivered: ask etcd for a
        progress notification (a round trip to the member, no consensus) and wait up to
        ``wait`` seconds for it, or until ``enough`` is done (the caller saw what it needed:
        the events before it were delivered, as the stream is in order); True if either came.
        False at once without an open stream.

        For a task of an event loop that may not have run for a while (``asyncio.run`` per
        call): the events that arrived meanwhile wait in the stream until the watch task reads
        them, one at a time."""
        call = self._call
        if call is None or self._closed:
            return False
        answer: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._progress.append(answer)  # etcd answers the requests in order
        self._write_soon(call, _PROGRESS)  # its answer may come before the write's
        awaited: set[asyncio.Future[Any]] = {answer} if enough is None else {answer, enough}
        try:
            done, _ = await asyncio.wait(awaited, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not answer.done():
                answer.cancel()  # its answer, when it comes, is still this request's
        if answer in done and not answer.cancelled():
            return answer.result()
        if not done:  # no answer: the next one may be another request's
            with contextlib.suppress(ValueError):
                self._progress.remove(answer)
        return bool(done)

    def remove(self, watch_id: int) -> None:
        """Cancel the watch (its callbacks are not called any more); the cancel request is
        written in the background (nobody waits for it)."""
        watch = self._watches.pop(watch_id, None)
        call = self._call
        if watch is not None and watch.sent_on is not None and watch.sent_on is call:
            self._write_soon(call, _cancel_request(watch_id))

    async def aclose(self) -> None:
        """End the stream and the task; idempotent. The watches are forgotten."""
        self._closed = True
        self._watches.clear()
        writes, self._writes = self._writes, set()
        for write in writes:
            write.cancel()
        task, self._task = self._task, None
        call, self._call = self._call, None
        if call is not None:
            call.cancel()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if writes:
            await asyncio.gather(*writes, return_exceptions=True)

    # -- writes ---------------------------------------------------------------------------
    async def _create(self, watch: _Watch) -> None:
        async with self._write:
            call = self._call
            if call is None or watch.sent_on is call or watch.id not in self._watches:
                return
            watch.sent_on = call
            watch.confirmed = 0
            watch.created.clear()
            with contextlib.suppress(Exception):  # a broken stream: the task opens a new one
                await call.write(watch.request())

    def _write_soon(self, call: Any, request: rpc.WatchRequest) -> None:
        """Write ``request`` on the stream ``call`` in a task of its own (after the writes
        already waiting: an ``asyncio.Lock`` serves in order), unless the stream was replaced
        meanwhile; nobody waits for it. :meth:`aclose` cancels such tasks."""

        async def write() -> None:
            async with self._write:
                if self._call is call:
                    with contextlib.suppress(Exception):  # a broken stream: the task resumes
                        await call.write(request)

        task = asyncio.get_running_loop().create_task(write(), name="fenced-etcd-watch-write")
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    # -- the task -------------------------------------------------------------------------
    async def _run(self) -> None:
        failures = 0
        while not self._closed:
            if not self._watches:
                self._wanted.clear()
                await self._wanted.wait()
                continue
            try:
                call, token, endpoint = await self._transport.open_stream(
                    "watch", self._transport.connect_timeout * 2
                )
            except Exception as error:  # EtcdError: no endpoint took it; anything else too
                failures += 1
                log.debug("cannot open the watch stream: %s", error)
                if failures == 3:
                    self._trouble("down")
                await asyncio.sleep(RETRY_PAUSE[min(failures, len(RETRY_PAUSE) - 1)])
                continue
            refused = False
            self._answered = False
            try:
                await self._serve(call, token, endpoint)
            except _Broken as broken:
                reason = str(broken)
                log.debug("watch stream broken at %s (%s); resuming", endpoint, reason)
                if "permission denied" in reason or self._transport._token_stale(reason):
                    refused = True  # etcd 3.4 may say "permission denied" for a stale token
                    await self._transport.renew_token(token)
            except Exception as error:  # never seen; the task must go on: a new stream
                log.warning("etcd watch stream at %s failed: %r; resuming", endpoint, error)
            finally:
                self._call = None
                self.endpoint = None
                self._progressed(answered=False)
                call.cancel()
            failures = 0 if self._answered and not refused else failures + 1
            self._trouble("broken")
            pause = RETRY_PAUSE[min(failures, len(RETRY_PAUSE) - 1)]
            if refused and failures > 1:  # refused again with a new token: really refused
                pause = _REFUSED_PAUSE
            await asyncio.sleep(pause)

    async def _serve(self, call: Any, token: str | None, endpoint: str) -> None:
        """Create every watch on the new stream ``call``, then deliver its replies until it
        breaks (:class:`_Broken`)."""
        async with self._write:
            self._call, self._token, self.endpoint = call, token, endpoint
            for watch in list(self._watches.values()):
                watch.sent_on = call
                watch.confirmed = 0
                watch.created.clear()
                try:
                    await call.write(watch.request())
                except Exception as error:
                    raise _Broken(f"writing a watch: {error}") from error
        try:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise _Broken("the stream ended")
                await self._handle(call, reply)
        except grpc.RpcError as error:
            raise _Broken(str(error.details() or error.code())) from error
        except asyncio.CancelledError:
            if cancelling():
                raise
            raise _Broken("the stream was cancelled (its channel closed)") from None

    async def _handle(self, call: Any, reply: rpc.WatchResponse) -> None:
        self._answered = True
        watch = self._watches.get(reply.watch_id)
        if watch is None and reply.watch_id == _PROGRESS_ID and not reply.canceled:
            self._progressed()
            return
        if reply.canceled and reply.cancel_reason and watch is None:
            # a create refused before it got an id (watch_id -1): "invalid auth token" in
            # etcd 3.4 (a stream opened with a token it no longer takes)
            raise _Broken(reply.cancel_reason)
        if watch is None or watch.sent_on is not call:
            if watch is None and (reply.created or reply.events) and not reply.canceled:
                self._write_soon(call, _cancel_request(reply.watch_id))  # removed meanwhile
            return
        if reply.canceled:
            if reply.compact_revision:  # events were lost: the owner re-reads
                watch.next_rev = 0
                watch.sent_on = None
                watch.confirmed = 0
                watch.on_trouble("compacted")
                await self._create(watch)  # from the current revision on
                return
            raise _Broken(reply.cancel_reason or "the watch was cancelled")
        if reply.created:
            watch.confirmed = max(reply.header.revision, 1)
            if not watch.next_rev:
                watch.next_rev = watch.confirmed + 1
            watch.created.set()
            if watch.late:
                watch.late = False
                watch.on_trouble("changed")
        if reply.events:
            events = [
                Event("DELETE" if event.type == _DELETE else "PUT", KV.from_message(event.kv))
                for event in reply.events
            ]
            watch.next_rev = max(watch.next_rev, events[-1].kv.mod_revision + 1)
            watch.on_events(events)

    def _progressed(self, answered: bool = True) -> None:
        """A progress notification answers the oldest :meth:`caught_up` request (``answered``
        False: the stream ended, every request is answered False)."""
        while self._progress:
            future = self._progress.popleft()
            if not future.done():
                future.set_result(answered)
            if answered:
                return

    def _trouble(self, reason: str) -> None:
        for watch in list(self._watches.values()):
            watch.on_trouble(reason)

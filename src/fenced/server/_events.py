"""``GET /v1/events``: lease changes as Server-Sent Events, for waiting clients and the page.

The stream sends every coordinator record (:class:`~fenced.core._records.Record`) of the
resources whose names start with ``prefix``, oldest first, then every new one as it is written::

    id: 17
    event: granted
    data: {"seq":17,"at":1718000000.5,"kind":"granted","resource":"jobs/a","epoch":3,...}

``event`` is the record's kind (``granted``, ``released``, ``expired``, ``renewal-failed``,
``lost``, ``proclaimed``, ``restored``), ``data`` its JSON (the shape of ``/v1/records``) and
``id`` its ``seq``. Guarantees:

- **No loss, no duplicate, in order**: the records of the prefix with ``seq > after`` are sent
  in ``seq`` order, each once. ``after`` is the ``Last-Event-ID`` header when present (what a
  reconnecting EventSource sends), else the ``after`` query parameter, else 0 (the whole history
  first). A client that reconnects with the last ``id`` it saw misses nothing.
- **Caught up**: once the history is sent, one ``event: ready`` (``data: {"seq": N}``,
  ``id: N``) says that everything up to ``N`` was sent; what follows is live.
- **Live**: a change shows within milliseconds for the resources the server watches (the first
  :data:`MAX_WATCHED` resources the streams' prefixes cover, by the backend's own watch), and
  within :data:`REFRESH` seconds otherwise (new resources, expiries nobody else noticed).
- **Stale writes**: the records the server's stores (``--store``) keep of *rejected* mutations of
  those resources are sent as ``event: rejected`` with ``"store": NAME``, **without** ``id``
  (they have their own sequence, per store). A stream sends each store's retained rejections
  again when it (re)connects: a client dedups them by ``(store, resource, seq)``.
- **Heartbeat**: a comment line (``: keep-alive``) every :data:`HEARTBEAT` seconds of silence.
- **Shutdown**: at SIGTERM every stream ends cleanly (the last chunk is sent, the response is
  complete); a client reconnects with its ``Last-Event-ID``, here after a restart or at another
  server. A stream asked for while the server stops answers ``503 unavailable``.

One reader per server, however many streams: a single task reads new records
(``records(None, …)``) into a buffer of the last :data:`BUFFER` records, woken by one
``watch`` task per watched resource and at least every :data:`REFRESH` seconds; the streams read
the buffer. Only a stream that starts (or falls) further back than the buffer reads the backend
itself, until it has caught up. The reader and its watches run while at least one stream is
open, and count as polls of :class:`~fenced.server._places.Places`: ``Places.interrupt`` (at
SIGTERM) cancels them, and the reader then ends every stream.

Authentication: role ``read`` on ``prefix`` (checked as the name; an empty prefix is "no one
name", as for ``/v1/records``), from the ``Authorization: Bearer KEY`` header, before the stream
starts. Browsers' ``EventSource`` cannot send that header: the page reads the stream with
``fetch()`` instead. Keys are never accepted in the URL (URLs are logged by proxies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections import deque
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import StreamingResponse

from fenced.aio._store import AsyncStore
from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.core._errors import ConfigurationError, FencedError, InvalidName, Unavailable
from fenced.core._records import Record, RecordKind
from fenced.server._places import Places
from fenced.server._state import ServerState, State

__all__ = ["BUFFER", "HEARTBEAT", "MAX_WATCHED", "REFRESH", "Hub", "router"]

log = logging.getLogger("fenced.server")

router = APIRouter(prefix="/v1", tags=["events"])

HEARTBEAT = 15.0
"""Seconds of silence after which a stream sends a comment (proxies keep it open)."""
REFRESH = 0.25
"""Seconds between the reader's reads when no watch wakes it."""
STORE_REFRESH = 1.0
"""Seconds between reads of the stores' rejections."""
BUFFER = 4096
"""Records kept in memory for the streams (the newest)."""
STORE_BUFFER = 1024
"""Store rejections kept in memory for the streams (the newest)."""
MAX_WATCHED = 64
"""Resources watched at most (one backend watch each); the others are read every REFRESH."""
PAGE = 1000
"""Records read per backend call."""
WATCH_SPAN = 10.0
"""Seconds one backend watch call lasts at most."""
RETRY_MS = 1000
"""The reconnection delay the stream suggests to EventSource clients (``retry:``)."""

_PREFIX = re.compile(r"[A-Za-z0-9._/-]{0,255}")
MEDIA_TYPE = "text/event-stream"


class Hub:
    """The reader of one server: the newest records, and who is waiting for the next ones.

    ``seq``: every record with ``seq ≤ seq`` has been read; the buffer holds all of those with
    ``floor < seq``. ``news`` is set (and replaced) whenever records arrive or the hub closes.
    """

    def __init__(
        self, backend: AsyncCoordinatorBackend, places: Places, stores: dict[str, AsyncStore]
    ) -> None:
        self.backend = backend
        self._places = places
        self._stores = dict(stores)
        self.seq = 0
        self.floor = 0
        self.started = False
        """True once the reader has read up to the backend's newest record."""
        self.closed = False
        self.news = asyncio.Event()
        self._buffer: deque[Record] = deque(maxlen=BUFFER)
        self._subscribers: dict[int, str] = {}
        self._next_subscriber = 0
        self._task: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        self._known: set[str] = set()
        self._store_seq: dict[tuple[str, str], int] = {}
        self.store_log: deque[tuple[int, str, Record]] = deque(maxlen=STORE_BUFFER)
        self.store_count = 0
        self._recording = set(self._stores)

    # -- streams -------------------------------------------------------------------------------

    def subscribe(self, prefix: str) -> int:
        """Register a stream of ``prefix``; start the reader if it is not running."""
        self._next_subscriber += 1
        self._subscribers[self._next_subscriber] = prefix
        if self.ensure_reader():
            self._kick.set()  # watch the new prefix's resources now
        return self._next_subscriber

    def ensure_reader(self) -> bool:
        """Start the reader unless it runs (it ends when no stream is left, or on a bug);
        True if it was running already (or the server stops), False if started now."""
        if self._task is not None or self.stopping:
            return True
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="fenced-events")
        return False

    def unsubscribe(self, subscriber: int) -> None:
        self._subscribers.pop(subscriber, None)

    def covers(self, after: int) -> bool:
        """Whether the buffer holds every record with ``seq > after`` that has been read."""
        return self.started and after >= self.floor

    def buffered(self, after: int) -> list[Record]:
        """The buffered records with ``seq > after`` (call only if :meth:`covers`)."""
        if after >= self.seq:
            return []
        return [record for record in self._buffer if record.seq > after]

    def rejections(self, after: int) -> list[tuple[int, str, Record]]:
        """The kept store rejections numbered above ``after``."""
        return [entry for entry in self.store_log if entry[0] > after]

    async def records(self, after: int) -> list[Record]:
        """Read the backend directly (a stream further back than the buffer)."""
        return await self.backend.records(None, after, PAGE)

    @property
    def stopping(self) -> bool:
        return self.closed or self._places.stopping

    # -- the reader ----------------------------------------------------------------------------

    def _announce(self) -> None:
        news, self.news = self.news, asyncio.Event()
        news.set()

    def _matches(self, resource: str) -> bool:
        return any(resource.startswith(prefix) for prefix in self._subscribers.values())

    async def _read(self) -> None:
        while True:
            found = await self.backend.records(None, self.seq, PAGE)
            for record in found:
                if len(self._buffer) == self._buffer.maxlen:
                    self.floor = self._buffer[0].seq
                self._buffer.append(record)
                self._known.add(record.resource)
            if found:
                self.seq = max(self.seq, found[-1].seq)
            if len(found) < PAGE:
                break
        if found or not self.started:
            self.started = True
            self._announce()

    async def _read_stores(self) -> None:
        added = False
        for name, store in self._stores.items():
            if name not in self._recording:
                continue
            for resource in sorted(r for r in self._known if self._matches(r))[:MAX_WATCHED]:
                after = self._store_seq.get((name, resource), 0)
                try:
                    found = await store.history(resource, after)
                except ConfigurationError:  # a store that keeps no records
                    self._recording.discard(name)
                    break
                for record in found:
                    self._store_seq[(name, resource)] = max(after, record.seq)
                    if record.kind is RecordKind.REJECTED:
                        self.store_count += 1
                        self.store_log.append((self.store_count, name, record))
                        added = True
        if added:
            self._announce()

    async def _run(self) -> None:
        self._places.poll_started()
        loop = asyncio.get_running_loop()
        watchers: dict[str, asyncio.Task[None]] = {}
        stores_read = 0.0
        try:
            try:
                self._known.update(await self.backend.resources())
            except FencedError as error:  # found again in the records as they come
                log.warning("events: listing resources failed: %s", error)
            while self._subscribers:
                self._kick.clear()  # before the read: a wake during it is not lost
                try:
                    await self._read()
                    if self._stores and loop.time() - stores_read >= STORE_REFRESH:
                        stores_read = loop.time()
                        await self._read_stores()
                except FencedError as error:
                    log.warning("events: reading records failed: %s", error)
                    await asyncio.sleep(REFRESH * 4)
                self._watch(watchers)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(REFRESH):
                        await self._kick.wait()
        except asyncio.CancelledError:
            if not self._places.stopping:
                raise
            self.closed = True
        except Exception:  # a bug: logged; the next stream's turn starts a new reader
            log.exception("events: the reader failed")
        finally:
            self._task = None  # a stream that subscribes from now on starts a new reader
            for task in watchers.values():
                task.cancel()
            if watchers:
                await asyncio.gather(*watchers.values(), return_exceptions=True)
            self._places.poll_ended()
            self._announce()

    def _watch(self, watchers: dict[str, asyncio.Task[None]]) -> None:
        """One watch task per resource a stream covers, at most :data:`MAX_WATCHED`."""
        wanted = sorted(r for r in self._known if self._matches(r))[:MAX_WATCHED]
        for resource in set(watchers) - set(wanted):
            watchers.pop(resource).cancel()
        loop = asyncio.get_running_loop()
        for resource in wanted:
            if resource not in watchers:
                watchers[resource] = loop.create_task(
                    self._watch_one(resource), name=f"fenced-events-watch:{resource}"
                )

    async def _watch_one(self, resource: str) -> None:
        self._places.poll_started()
        loop = asyncio.get_running_loop()
        try:
            while True:
                after = self.seq
                began = loop.time()
                try:
                    await self.backend.watch(resource, after, WATCH_SPAN)
                except FencedError:
                    await asyncio.sleep(REFRESH * 4)
                    continue
                if loop.time() - began >= WATCH_SPAN:
                    continue  # timed out: nothing new
                self._kick.set()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(REFRESH * 4):
                        while self.seq <= after and not self.stopping:
                            await self.news.wait()
        except asyncio.CancelledError:
            pass  # stopped by the reader, or by Places.interrupt at shutdown
        finally:
            self._places.poll_ended()


def hub_of(request: Request) -> Hub:
    """The hub of the app serving ``request`` (created at the first stream)."""
    state: ServerState = request.app.state.fenced
    hub: Hub | None = getattr(request.app.state, "fenced_events", None)
    if hub is None or hub.backend is not state.backend:  # none yet, or from an earlier start
        hub = Hub(state.backend, state.places, state.stores)
        request.app.state.fenced_events = hub
    return hub


def _event(record: Record, store: str | None = None) -> bytes:
    body = record.to_json()
    if store is not None:
        body["store"] = store
        head = ""
    else:
        head = f"id: {record.seq}\n"
    data = json.dumps(body, separators=(",", ":"), default=str)
    return f"{head}event: {record.kind.value}\ndata: {data}\n\n".encode()


async def _stream(hub: Hub, prefix: str, after: int) -> AsyncIterator[bytes]:
    """The events of ``prefix`` after ``after`` (module docstring), until shutdown or the
    client goes away (then the response is cancelled and the stream unsubscribes)."""
    subscriber = hub.subscribe(prefix)
    try:
        yield f"retry: {RETRY_MS}\n: fenced events\n\n".encode()
        cursor, ready, rejections = after, False, 0
        while not hub.stopping:
            hub.ensure_reader()
            news = hub.news  # before reading: records that arrive meanwhile set it
            more = False
            if hub.covers(cursor):
                batch = hub.buffered(cursor)
                reached = max(cursor, hub.seq)
            else:
                batch = await hub.records(cursor)
                more = len(batch) == PAGE
                reached = batch[-1].seq if batch else cursor
            for record in batch:
                if record.resource.startswith(prefix):
                    yield _event(record)
            cursor = max(cursor, reached)
            if more:
                continue
            if not ready:
                ready = True
                yield f'id: {cursor}\nevent: ready\ndata: {{"seq":{cursor}}}\n\n'.encode()
            for number, store, record in hub.rejections(rejections):
                rejections = number
                if record.resource.startswith(prefix):
                    yield _event(record, store)
            if hub.stopping:
                break
            try:
                async with asyncio.timeout(HEARTBEAT):
                    await news.wait()
            except TimeoutError:
                yield b": keep-alive\n\n"
    finally:
        hub.unsubscribe(subscriber)


async def _may_read(request: Request) -> None:
    """Role ``read`` on the stream's ``prefix`` (None for no prefix: every resource)."""
    state: ServerState = request.app.state.fenced
    if state.authority is not None:
        prefix = request.query_params.get("prefix") or None
        state.authority.check(request.headers.get("authorization"), "read", prefix)


@router.get(
    "/events",
    response_class=StreamingResponse,
    dependencies=[Depends(_may_read)],
    responses={200: {"content": {MEDIA_TYPE: {}}, "description": "The event stream."}},
    summary="Lease changes (Server-Sent Events)",
)
async def events(
    request: Request,
    state: State,
    prefix: Annotated[str, Query(max_length=255)] = "",
    after: Annotated[int, Query(ge=0)] = 0,
    last_event_id: Annotated[str | None, Header(max_length=32)] = None,
) -> StreamingResponse:
    """The records of the resources whose names start with ``prefix`` with ``seq`` above
    ``Last-Event-ID`` (else ``after``), then live (module docstring). ``400`` for a prefix
    with other characters than a name's or a ``Last-Event-ID`` that is not a number; ``401`` /
    ``403`` without role ``read`` on ``prefix``; ``503 unavailable`` while the server stops."""
    if not _PREFIX.fullmatch(prefix):
        raise InvalidName(f"prefix {prefix!r}: only A-Z a-z 0-9 . _ - / (at most 255)")
    if last_event_id is not None:
        if not last_event_id.isdigit():
            raise ConfigurationError(f"Last-Event-ID {last_event_id!r}: not a record seq")
        after = int(last_event_id)
    if state.places.stopping:
        raise Unavailable("fenced serve is shutting down: reconnect (another server)")
    return StreamingResponse(
        _stream(hub_of(request), prefix, after),
        media_type=MEDIA_TYPE,
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )

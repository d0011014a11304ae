"""The asyncio face of the etcd backend: :func:`open_async_etcd` and :class:`AsyncEtcdBackend`.

The same backend as the sync :class:`~._backend.EtcdBackend` — same URL, keys, values,
transactions, records, pooled etcd leases and handoff — with its I/O awaited over ``grpc.aio``.
**One source of truth:** every transaction sent here is built, and every reply read, by the
functions the sync face uses (:mod:`._plans`: grants, proclaims, queueing, leaving, a waiter's
place; :mod:`._records`: records, expiries, reports, listings; :mod:`._handoff`: the release
and its handoff to the head of the line; :mod:`._leasepool`: the bookkeeping of pooled etcd
leases; :mod:`._base`: the cached state), and the two faces hold each other to it in a
lockstep test. Only the sending and the waiting are this module's own:

- **Requests** through :class:`~._aio_transport.AsyncTransport` (unary ``grpc.aio`` calls with
  the sync transport's serializers, failover, "require leader", token renewal once on
  "invalid auth token", TLS diagnosed by :func:`~._security.diagnose`).
- **Keep-alives** of the pooled etcd leases, the queue lease and the waiters' reserved leases,
  revocation of idle ones, retried leaves and the loading of queue views: ONE keeper task per
  backend (the sync face's keeper thread, as a task).
- **Watches**: TWO ``Watch`` streams per backend, each read by ONE task
  (:class:`~._aio_watch.AsyncWatcher`): one for the lease keys and the records (what wakes a
  waiter that is handed the lease, and ``watch()`` callers), one for the lines
  ``P/queue/NAME:`` (what the queue views and the waiters behind others follow). A stream
  delivers one message at a time, each a wake-up of the loop: the lease key's event of a
  handoff never waits behind the line's event of the same transaction, nor a release's
  catching up behind lease events. A watch per resource and purpose is held while a waiter, a
  queue view or a ``watch()`` caller needs it (a view of a line this process waited in keeps the
  lease key's watch too: the next wait needs it at once). Each batch of events wakes only the
  tasks it concerns: a waiter when its predecessor is deleted or a release hands it the lease
  (:meth:`~._waitqueue.Place.saw`, as in the sync face), a ``watch()`` caller on a record or the
  lease key's change. A broken stream is resumed on any endpoint from the next revision, and
  every waiter re-checks. Watches are created before the read they cover, so no change falls
  between the two; nobody waits for a watch's cancellation.
- **Waiting** suspends the task on an ``asyncio.Event``; no thread per waiter.

Differences from the sync face: ``?api=gateway`` is refused with a ConfigurationError
(supporting etcd's JSON gateway here would double the transport work for a path the sync face
keeps); ``advance`` is not part of the asyncio contract. A view is current only while the loop
runs: events that came while it did not (``asyncio.run`` per call, a long blocking call) wait
in the stream. So a release first lets its view catch up (:meth:`AsyncEtcdBackend._current_head`:
the watch task reads what came, and etcd's progress notification says when that was all),
unless the loop ran its requests just before; a waiter that queued meanwhile is then handed
the lease in the release's transaction as in the sync face, rather than taking it itself two
round trips later. The handoff transaction is built when the release runs, not ahead of it in
a view's thread (the sync face's :meth:`~._handoff._Handoff._plan_ahead` saves a watch
thread's idle time, which a task does not have).

Failure behaviour: as the sync face (:mod:`._backend`): nothing applied →
:class:`~fenced.Unavailable`; a mutating request whose reply was lost →
:class:`~fenced.OutcomeUnknown` (a grant: retry with the same ``request_id``); a grant that has
ended → :class:`~fenced.LeaseLost`; a bad URL, TLS refused, a wrong password or missing
permission → :class:`~fenced.ConfigurationError`, never showing the password. A task cancelled
during a grant or while queueing leaves its pooled etcd lease to expire (the step may have
happened), as a lost reply does.

:meth:`AsyncEtcdBackend.aclose` cancels the keeper and watch tasks, revokes idle pooled leases
and closes the channels; idempotent. Afterwards no task of this backend remains, and grpc.aio
leaves no thread but its one daemon polling thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import secrets
import time
import weakref
from typing import TYPE_CHECKING

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
from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._base import (
    _MAX_ATTEMPTS,
    QUEUE_TTL,
    RECHECK,
    REQUEST_RETENTION,
    _mutating,
)
from fenced.coordinator.backends.etcd._client import KV, EtcdRejected, Event, Json
from fenced.coordinator.backends.etcd._handoff import (
    _VIEW_IDLE,
    _VIEWS_KEPT,
    handoff_head,
    needs_retention,
    release_plan,
    release_reread,
    settle_time,
    taken_again,
)
from fenced.coordinator.backends.etcd._keys import LeaseValue, prefix_end
from fenced.coordinator.backends.etcd._leasepool import (
    _RETENTION_ROTATE,
    _PooledLease,
    _PoolState,
    _ttl_left,
)
from fenced.coordinator.backends.etcd._ops import _first, _get, _kvs, _Op, _owner, _translated
from fenced.coordinator.backends.etcd._plans import (
    GrantPlan,
    Refusal,
    blocked_by,
    earlier_grant,
    epoch_reads,
    grant_plan,
    leave_txn,
    meta_found,
    meta_reads,
    meta_txn,
    owned_lease,
    proclaim_txn,
    queued,
    standing,
    ticket_reads,
    ticket_shortcut,
    ticket_txn,
)
from fenced.coordinator.backends.etcd._records import (
    RecordPages,
    report_txn,
    resources_page,
    resources_read,
    settle_reads,
    settle_txn,
)
from fenced.coordinator.backends.etcd._settings import EtcdSettings, parse_etcd_url
from fenced.coordinator.backends.etcd._waitqueue import Line, Place
from fenced.core._errors import (
    ConfigurationError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

if TYPE_CHECKING:
    from fenced.coordinator.backends.etcd._aio_transport import AsyncTransport
    from fenced.coordinator.backends.etcd._aio_watch import AsyncWatcher

__all__ = ["AsyncEtcdBackend", "AsyncEtcdTicket", "open_async_etcd"]

log = logging.getLogger("fenced.coordinator.etcd")

_TICK = 0.05  # the keeper's round (the sync keeper thread's too)
_RAN_LATELY = 0.002  # a loop that got a reply this recently has read what its streams brought
_CATCH_UP = 0.05  # how long a release waits for its view to catch up, at most
_FIRST_READS = 3  # rounds of the loop a release lets the watch task read before asking etcd
_RECENT = 64  # events of a resource's lease key and line kept for a waiter that follows late


async def open_async_etcd(url: str) -> AsyncEtcdBackend:
    """Open the asyncio etcd backend of ``url`` (the sync backend's URL forms and parameters:
    ``etcd://`` or ``etcds://`` with ``ca``/``cert``/``key``/``server_name``,
    ``user:password@`` or ``FENCED_ETCD_PASSWORD``, ``prefix``, ``timeout``,
    ``connect_timeout``, several endpoints with failover; see ``docs/etcd.md``).

    Reads (or stores) the coordinator id, then starts the keeper task. Raises
    :class:`~fenced.ConfigurationError` for a bad URL, ``api=gateway``, a missing grpcio, TLS
    refused, a wrong password or missing permission; :class:`~fenced.Unavailable` if no member
    answers within the timeout. On failure nothing is left running."""
    settings = parse_etcd_url(url)
    if settings.api != "grpc":
        raise ConfigurationError(
            "the asyncio etcd backend speaks etcd's gRPC API only: remove api=gateway"
        )
    try:
        from fenced.coordinator.backends.etcd._aio_transport import AsyncTransport  # noqa: PLC0415
        from fenced.coordinator.backends.etcd._aio_watch import AsyncWatcher  # noqa: PLC0415
    except ImportError as error:
        raise ConfigurationError(
            f"the asyncio etcd backend needs grpcio: pip install 'fenced[etcd]' ({error})"
        ) from error
    transport = AsyncTransport(
        settings.endpoints,
        timeout=settings.timeout,
        connect_timeout=settings.connect_timeout,
        tls=settings.tls,
        login=settings.login,
    )
    backend = AsyncEtcdBackend(
        settings, transport, AsyncWatcher(transport), AsyncWatcher(transport)
    )
    try:
        await backend._open()
    except BaseException:
        await backend.aclose()
        raise
    return backend


class AsyncEtcdTicket(Place):
    """A waiter's place (:class:`~._waitqueue.Place`, shared with the sync face); its task
    waits on :attr:`changed`, set by the backend's watch task."""

    def __init__(self, backend: object, request: GrantRequest, key: bytes, lease_id: int) -> None:
        super().__init__(backend, request, key, lease_id)
        self.changed = asyncio.Event()
        self.holds: list[tuple[str, str]] = []  # the backend's watches it holds


class _View:
    """A queue view (:class:`~._waitqueue.Line`): loaded by the keeper once its watch is
    confirmed, changed by the watch's events. It holds the watch of the line, and that of the
    lease key once this process waited in the line (its next wait needs it at once, and it is
    not cancelled and created again around each grant)."""

    def __init__(self) -> None:
        self.line = Line()
        self.holds: list[tuple[str, str]] = []
        self.loaded = False
        self.queued: asyncio.Future[None] | None = None  # a release catching up waits on it
        self.put_at = 0.0  # when another process's waiter last queued


class AsyncEtcdBackend(_PoolState):
    """:class:`~fenced.coordinator.aio_backend.AsyncCoordinatorBackend` on an etcd 3.4+
    cluster; open it with :func:`open_async_etcd` (module docstring). Use it from one event
    loop."""

    capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})

    def __init__(
        self,
        settings: EtcdSettings,
        transport: AsyncTransport,
        watcher: AsyncWatcher,
        lines: AsyncWatcher,
    ) -> None:
        self._init_state(settings)
        self._transport = transport
        self._transport.permission_hint = settings.permission_hint()
        self._watcher = watcher  # lease keys and records: what wakes waiters and watch()
        self._lines = lines  # the lines: what the views, and waiters behind others, follow
        self.coordinator_id = ""
        # one lock per resource while in use (see _LeasePool._grant_lock)
        self._grant_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._orphans: dict[bytes, AsyncEtcdTicket] = {}  # waiters whose leave() failed
        self._watch_ids: dict[tuple[str, str], list[int]] = {}  # (resource, kind): [id, users]
        self._tickets: dict[str, set[AsyncEtcdTicket]] = {}
        self._record_waiters: dict[str, set[asyncio.Event]] = {}
        self._recent: dict[str, collections.deque[Event]] = {}
        self._views: dict[str, _View] = {}
        self._keeper: asyncio.Task[None] | None = None
        self._ran_at = 0.0  # when a reply to this backend's transactions last came

    def __repr__(self) -> str:
        return f"<AsyncEtcdBackend {self.url}>"

    async def _open(self) -> None:
        keys = self._keys
        try:
            ok, responses, _ = await self._send(
                meta_txn(keys, secrets.token_hex(16)), "reading the coordinator id"
            )
        except OutcomeUnknown:  # the id may have been written: read it
            ok = False
            responses, _ = await self._read(meta_reads(keys), "reading the coordinator id")
        except EtcdRejected as error:
            raise ConfigurationError(f"etcd: reading the coordinator id: {error}") from error
        self.coordinator_id, self._minimum = meta_found(self.url, keys, ok, responses)
        self._keeper = asyncio.get_running_loop().create_task(
            self._keep(), name="fenced-etcd-keeper"
        )

    # -- requests -------------------------------------------------------------------------
    async def _call(self, path: str, body: Json, *, mutating: bool, what: str) -> Json:
        with _translated(what):
            return await self._transport.call(path, body, mutating=mutating)

    async def _send(
        self, request: rpc.TxnRequest, what: str
    ) -> tuple[bool, list[rpc.ResponseOp], int]:
        """One transaction built already; its outcome, replies and revision."""
        with _translated(what):
            reply = await self._transport.call_message(
                "kv/txn", request, mutating=_mutating(request)
            )
        self._ran_at = time.monotonic()
        assert isinstance(reply, rpc.TxnResponse)
        return self._seen(reply)

    async def _read(self, ops: list[_Op], what: str) -> tuple[list[rpc.ResponseOp], int]:
        _, responses, revision = await self._send(rpc.TxnRequest(success=ops), what)
        return responses, revision

    async def _lease_kv(self, resource: str) -> KV | None:
        responses, _ = await self._read([_get(self._keys.lease(resource))], f"reading {resource}")
        return _first(responses[0])

    # -- pooled etcd leases ---------------------------------------------------------------
    async def _grant_lease(self, want: int) -> _PooledLease:
        sent = self._clock.now()
        try:
            reply = await self._call(
                "lease/grant", {"TTL": str(want)}, mutating=True, what="lease grant"
            )
        except OutcomeUnknown as error:  # at worst an etcd lease nobody uses: it expires
            raise Unavailable(str(error)) from error
        except EtcdRejected as error:
            raise Unavailable(f"etcd: lease grant: {error}") from error
        return self._pooled_from(reply, want, sent)

    async def _keepalive(self, lease_id: int) -> tuple[int, float]:
        """Keep ``lease_id`` alive: ``(TTL etcd granted (0: gone), send time)``."""
        sent = self._clock.now()
        reply = await self._call(
            "lease/keepalive", {"ID": str(lease_id)}, mutating=False, what="lease keep-alive"
        )
        return int(reply.get("TTL", 0)), sent

    async def _take_lease(self, ttl: float) -> _PooledLease:
        want = max(1, math.ceil(ttl))
        best = self._idle_lease(want)
        if best is not None:
            return best
        return self._pool_in_use(await self._grant_lease(want))

    def _grant_lock(self, resource: str) -> asyncio.Lock:
        """The resource's lock for renew, release, proclaim and taking a handed grant (the
        sync face's ``_grant_lock``, as an ``asyncio.Lock``)."""
        lock = self._grant_locks.get(resource)
        if lock is None:
            lock = self._grant_locks[resource] = asyncio.Lock()
        return lock

    async def _queue_lease_id(self) -> int:
        current = self._queue_lease_current()
        if current is not None:
            return current
        fresh = await self._grant_lease(QUEUE_TTL)
        with self._lock:
            self._queue_lease = fresh
        return fresh.id

    async def _retention_lease_id(self) -> int:
        current = self._retention_current()
        if current is not None:
            return current
        fresh = await self._grant_lease(REQUEST_RETENTION + int(_RETENTION_ROTATE))
        with self._lock:
            self._retention = fresh
        return fresh.id

    async def _remaining(self, kv: KV, ttl: float) -> float:
        """A lease key's remaining time: exact for our own, etcd's whole seconds + 0.5 else."""
        own = self._own_remaining(kv, ttl)
        if own is not None:
            return own
        try:
            reply = await self._call(
                "lease/timetolive", {"ID": str(kv.lease)}, mutating=False, what="lease ttl"
            )
        except (Unavailable, EtcdRejected):
            return ttl
        return _ttl_left(reply, ttl)

    async def _refresh(self, pooled: _PooledLease) -> None:
        try:
            ttl, sent = await self._keepalive(pooled.id)
        except Exception as error:
            log.debug("keep-alive of etcd lease %x failed: %s", pooled.id, error)
            return
        self._refreshed(pooled, ttl, sent)

    # -- the keeper task ------------------------------------------------------------------
    async def _keep(self) -> None:
        """Keeps idle pooled leases, reserved leases and the queue lease alive, revokes idle
        ones, retries failed leaves, loads and drops queue views, closes retired channels."""
        if len(self._transport.endpoints) > 1:
            with contextlib.suppress(Exception):
                await self._transport.prefer_leader()
        while not self._closed:
            try:
                await self._keep_once()
            except Exception as error:  # the keeper must go on
                log.debug("etcd keeper: %s", error)
            await asyncio.sleep(_TICK)

    async def _keep_once(self) -> None:
        due, revoke = self._keep_plan(QUEUE_TTL / 4)
        for pooled in due:
            await self._refresh(pooled)
        for pooled in revoke:
            with contextlib.suppress(Exception):
                await self._call("lease/revoke", {"ID": str(pooled.id)}, mutating=True, what="")
        for ticket in list(self._orphans.values()):
            try:
                await self._leave_once(ticket)
            except Exception as error:
                log.debug("leaving the queue of %s failed again: %s", ticket.resource, error)
            else:
                self._orphans.pop(ticket.key, None)
        now = time.monotonic()
        for name, view in list(self._views.items()):
            if view.line.broken or now - view.line.used > _VIEW_IDLE:
                del self._views[name]
                self._release_holds(view.holds)
            elif not view.loaded and self._healthy(name, "line"):
                queue = self._keys.queue(name)
                try:
                    responses, revision = await self._read(
                        [_get(queue, prefix_end(queue))], f"reading the line of {name}"
                    )
                except Exception as error:  # the next round tries again
                    log.debug("loading the view of %s: %s", name, error)
                    continue
                view.line.load(_kvs(responses[0]), revision)
                view.loaded = True
        await self._transport.sweep()

    # -- watches --------------------------------------------------------------------------
    def _stream(self, kind: str) -> AsyncWatcher:
        """The watch stream of the watches of ``kind``: the lines on a stream of their own,
        so that the event a waiter or a release needs never waits behind the other's (one
        stream delivers one message at a time, each a wake-up of the loop)."""
        return self._lines if kind == "line" else self._watcher

    def _range(self, name: str, kind: str) -> tuple[bytes, bytes]:
        keys = self._keys
        if kind == "lease":
            return keys.lease(name), b""
        prefix = keys.queue(name) if kind == "line" else keys.log(name)
        return prefix, prefix_end(prefix)

    async def _hold(
        self, name: str, kind: str, holds: list[tuple[str, str]], wait: float | None
    ) -> bool:
        """Hold the watch of ``name``'s ``kind`` (``lease``, ``line`` or ``log``), created
        if nobody holds it; wait up to ``wait`` for etcd's confirmation (None: the watch
        task's open budget). True if it is confirmed."""
        entry = self._watch_ids.get((name, kind))
        if entry is None:
            key, end = self._range(name, kind)
            watch_id = self._stream(kind).add(
                key,
                end,
                functools.partial(self._saw, name, kind),
                functools.partial(self._trouble, name, kind),
            )
            entry = self._watch_ids[(name, kind)] = [watch_id, 0]
        entry[1] += 1
        holds.append((name, kind))
        budget = self._transport.connect_timeout * 2 if wait is None else wait
        return await self._stream(kind).start(entry[0], budget)

    def _release_holds(self, holds: list[tuple[str, str]]) -> None:
        """Let go of the watches in ``holds``; a watch nobody holds any more is cancelled."""
        unused: list[tuple[str, int]] = []
        while holds:
            name, kind = holds.pop()
            entry = self._watch_ids.get((name, kind))
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del self._watch_ids[(name, kind)]
                unused.append((kind, entry[0]))
                if not any(key[0] == name for key in self._watch_ids):
                    self._recent.pop(name, None)
        for kind, watch_id in unused:
            self._stream(kind).remove(watch_id)

    def _healthy(self, name: str, kind: str) -> bool:
        entry = self._watch_ids.get((name, kind))
        return entry is not None and self._stream(kind).healthy(entry[0])

    def _watching(self, ticket: AsyncEtcdTicket) -> bool:
        name = ticket.resource
        return self._healthy(name, "lease") and self._healthy(name, "line")

    def _saw(self, name: str, kind: str, events: list[Event]) -> None:
        """Events of ``name``'s ``kind`` watch (called by the watch task): wake whom they
        concern."""
        if kind == "line":
            view = self._views.get(name)
            if view is not None:
                view.line.apply(events)
                own = {ticket.key for ticket in self._tickets.get(name, ())}
                if any(event.kind == "PUT" and event.kv.key not in own for event in events):
                    view.put_at = time.monotonic()  # another waiter queued
                    if view.queued is not None and not view.queued.done():
                        view.queued.set_result(None)
        if kind in ("lease", "line"):
            recent = self._recent.get(name)
            if recent is None:
                recent = self._recent[name] = collections.deque(maxlen=_RECENT)
            recent.extend(events)
            for ticket in self._tickets.get(name, ()):
                self._deliver(ticket, events)
        if kind in ("lease", "log"):
            for woken in self._record_waiters.get(name, ()):
                woken.set()

    def _trouble(self, name: str, kind: str, reason: str) -> None:
        """The ``kind`` watch of ``name`` lost (or may have lost) events: everyone re-checks."""
        if kind == "line" and reason == "compacted":
            view = self._views.get(name)
            if view is not None:
                view.line.lost()
        for ticket in self._tickets.get(name, ()):
            ticket.changed.set()
        for woken in self._record_waiters.get(name, ()):
            woken.set()

    @staticmethod
    def _deliver(ticket: AsyncEtcdTicket, events: list[Event]) -> None:
        """The events of the ticket's predecessor after it was read (the sync face's watch on
        the predecessor alone delivers just these)."""
        mine = [e for e in events if e.kv.key == ticket.pred and e.kv.mod_revision > ticket.seen_at]
        if mine and ticket.saw(mine):
            ticket.changed.set()

    def _follow(self, ticket: AsyncEtcdTicket, pred: bytes | None, seen_at: int) -> None:
        """Wait behind ``pred`` as read at ``seen_at`` (None: nothing to wait for). Events of
        it that the watch task delivered since that read are replayed."""
        ticket.changed.clear()
        ticket._followed(pred, seen_at, pred == self._keys.lease(ticket.resource))
        if pred is None:
            ticket.changed.set()
            return
        self._deliver(ticket, list(self._recent.get(ticket.resource, ())))

    def _unfollow(self, ticket: AsyncEtcdTicket) -> None:
        tickets = self._tickets.get(ticket.resource)
        if tickets is not None:
            tickets.discard(ticket)
            if not tickets:
                del self._tickets[ticket.resource]
        self._release_holds(ticket.holds)

    async def _watch_queue(self, resource: str, waiting: bool = False) -> None:
        """Keep a view of ``resource``'s line (its releases hand over); loaded by the keeper.
        ``waiting``: this process waits in that line (the view keeps the lease key's watch
        too)."""
        view = self._views.get(resource)
        if view is None or view.line.broken:
            if self._closed:
                return
            if view is not None:
                del self._views[resource]
                self._release_holds(view.holds)
            if len(self._views) >= _VIEWS_KEPT:
                oldest = min(self._views, key=lambda name: self._views[name].line.used)
                self._release_holds(self._views.pop(oldest).holds)
            view = self._views[resource] = _View()
            await self._hold(resource, "line", view.holds, 0.0)
        else:
            view.line.used = time.monotonic()
        if waiting and (resource, "lease") not in view.holds:
            await self._hold(resource, "lease", view.holds, 0.0)

    async def _granted_again(self, resource: str) -> None:
        if taken_again(self, resource):
            await self._watch_queue(resource)

    def _queue_head(self, resource: str) -> KV | None:
        view = self._views.get(resource)
        return view.line.head() if view is not None else None

    async def _current_head(self, resource: str) -> KV | None:
        """The head of ``resource``'s line for a release (:meth:`_queue_head`), once the view
        has caught up with its watch stream.

        A loop that did not run for a while (``asyncio.run`` per call, a long blocking call)
        left the events of that time unread in the stream: a waiter that queued meanwhile
        would not be handed the lease (it takes it itself, two round trips later), and a head
        that left would fail the handoff's compare (a read and a retry). So, unless a reply
        came within :data:`_RAN_LATELY` (the loop is running) or another process's waiter
        queued since the last reply, the watch task first reads what came: for
        :data:`_FIRST_READS` rounds of the loop (what came is read at once), then until etcd's
        progress notification (:meth:`~._aio_watch.AsyncWatcher.caught_up`: a round trip to a
        member, no consensus). Either ends as soon as another waiter's key shows up: the events
        before it have been delivered (a stream is in order), so the view knows the head."""
        view = self._views.get(resource)
        if view is None or not view.loaded:
            return None
        if (
            time.monotonic() - self._ran_at > _RAN_LATELY
            and view.put_at <= self._ran_at
            and self._healthy(resource, "line")
        ):
            queued = view.queued = asyncio.get_running_loop().create_future()
            try:
                for _ in range(_FIRST_READS):
                    await asyncio.sleep(0)
                    if queued.done():
                        break
                else:
                    await self._lines.caught_up(_CATCH_UP, queued)
            finally:
                view.queued = None
        return view.line.head()

    # -- grants ---------------------------------------------------------------------------
    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant, or say what blocks it (the sync face's ``try_grant``: the same transaction,
        the same answers)."""
        own = owned_ticket(self, ticket, request.resource, AsyncEtcdTicket)
        if own is not None:
            found = await self._ticket_state(own)
            if found is not None:
                return found
        elif (
            request.queues
            and request.request_id is None
            and self._queue_head(request.resource) is not None
        ):
            return Blocked(None, self._last(request.resource), 0.0, None)
        for _ in range(_MAX_ATTEMPTS):
            result = await self._grant_once(request, own)
            if result is not None:
                return result
        raise Unavailable(f"etcd: {request.resource} changed too often to grant (contention)")

    async def _grant_once(
        self, request: GrantRequest, ticket: AsyncEtcdTicket | None
    ) -> Granted | Blocked | None:
        name = request.resource
        retention = None if request.request_id is None else await self._retention_lease_id()
        if ticket is not None:
            pooled = await self._ticket_lease(ticket)
        else:
            pooled = await self._take_lease(request.ttl)
        try:
            plan = grant_plan(self._keys, request, self._cached(name), pooled.id, ticket, retention)
            answer = await self._send(plan.request, f"grant of {name}")
        except BaseException as error:
            self._grant_failed(pooled, ticket, name, error)  # raises, or: try again
            return None
        found = self._grant_answered(pooled, request, ticket, plan, answer)
        if isinstance(found, Granted):
            await self._granted_again(name)
            return found
        return await self._not_granted(request, ticket, found, plan, answer[2])

    async def _not_granted(
        self,
        request: GrantRequest,
        ticket: AsyncEtcdTicket | None,
        found: Refusal,
        plan: GrantPlan,
        revision: int,
    ) -> Granted | Blocked | None:
        """What a failed grant's failure branch says (:func:`~._plans.refusal`)."""
        name = request.resource
        self._remember(res=(name, found.res))
        self._remember_meta(found.meta)
        if ticket is not None and found.handed:
            assert found.lease is not None
            granted = await self._take_handed(ticket, found.lease)  # a release handed it to us
            if granted is not None:
                return granted
        if found.earlier is not None:
            lease, kv = earlier_grant(found.earlier, name, found.lease)
            self._adopt(kv, lease, name)
            remaining = await self._remaining(kv, lease.ttl)
            return Granted(lease.epoch, lease.owner, lease.holder, lease.ttl, remaining)
        if ticket is not None:
            if not found.queued:  # our queue key is gone (handed, or it expired)
                await self._put_ticket(ticket)
                return None
            if found.pred is None:
                return None  # stale cache only: try again
            blocked = await self._blocked(found.lease, self._last(name), RECHECK, precise=False)
            ticket.blocked = blocked
            self._follow(ticket, found.pred, revision)
            return blocked
        if found.lease is not None:  # the remaining time costs a request: only for a Busy
            return await self._blocked(
                found.lease, self._last(name), None, precise=not request.queues
            )
        res_rev, _, min_rev, _ = self._cached(name)
        if (res_rev, min_rev) == plan.compared:  # every other compare held: queue not empty
            return Blocked(None, self._last(name), 0.0, None)
        return None  # a stale cache: try again

    async def _blocked(
        self, lease_kv: KV | None, last: int, retry_in: float | None, *, precise: bool = True
    ) -> Blocked:
        remaining = 0.0
        if lease_kv is not None:
            ttl = LeaseValue.decode(lease_kv.value).ttl
            remaining = await self._remaining(lease_kv, ttl) if precise else ttl
        return blocked_by(lease_kv, last, retry_in, remaining)

    # -- a live lease ---------------------------------------------------------------------
    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        """Keep alive exactly the etcd lease the grant rides, after checking that its key is
        still this owner's epoch; LeaseLost otherwise (nothing is extended)."""
        async with self._grant_lock(resource):
            pooled = self._carrying_lease(resource, epoch, owner)
            kv = await self._lease_kv(resource)
            if owned_lease(kv, epoch, owner) is None or kv is None:
                if pooled is not None:
                    self._give_back(pooled)
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            granted, sent = await self._keepalive(kv.lease)
            return self._renewed(pooled, kv, granted, sent, resource, epoch)

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        async with self._grant_lock(resource):
            pooled = self._carrying_lease(resource, epoch, owner)
            for _ in range(_MAX_ATTEMPTS):
                kv = await self._lease_kv(resource)
                lease = owned_lease(kv, epoch, owner)
                if kv is None or lease is None:
                    raise LeaseLost(
                        LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                    )
                request, new_state = proclaim_txn(
                    self._keys, resource, kv, lease, value, self._cached(resource)
                )
                ok, responses, revision = await self._send(request, f"proclaim on {resource}")
                if ok:
                    self._proclaimed(pooled, kv, resource, revision, new_state)
                    return
                self._remember(res=(resource, _first(responses[0])))
        raise Unavailable(f"etcd: {resource} changed too often to proclaim (contention)")

    async def current(self, resource: str) -> LeaseInfo | None:
        kv = await self._lease_kv(resource)
        if kv is None:
            return None
        lease = LeaseValue.decode(kv.value)
        return self._info(resource, lease, await self._remaining(kv, lease.ttl))

    async def last_epoch(self, resource: str) -> int:
        responses, _ = await self._read(epoch_reads(self._keys, resource), f"reading {resource}")
        return self._last_epoch(resource, responses)

    # -- release and handoff --------------------------------------------------------------
    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        """Delete the lease if owner and epoch match, in one transaction that hands it to the
        head of the line when this backend keeps a view of it (the sync face's release)."""
        async with self._grant_lock(resource):
            pooled = self._carrying_lease(resource, epoch, owner)
            released = await self._release_locked(resource, epoch, owner, pooled)
            if pooled is not None and released is not None:
                self._give_back(pooled)
        return bool(released)

    async def _release_locked(
        self, resource: str, epoch: int, owner: str, pooled: _PooledLease | None
    ) -> bool | None:
        """True: released now; False: not this owner's lease (None: and ``pooled`` is free)."""
        lease_rev = pooled.lease_rev if pooled is not None else 0
        holder = ""
        if not lease_rev:
            kv = await self._lease_kv(resource)
            lease = owned_lease(kv, epoch, owner)
            if kv is None or lease is None:
                return None if pooled is not None else False
            lease_rev, holder = kv.mod_revision, lease.holder
        elif pooled is not None:
            holder = pooled.holder
        head = await self._current_head(resource)
        passed: set[bytes] = set()  # waiters that cannot be handed the lease
        for _ in range(_MAX_ATTEMPTS):
            head = handoff_head(head, passed)
            retention = await self._retention_lease_id() if needs_retention(head) else 0
            plan = release_plan(
                self._keys,
                resource,
                epoch,
                holder,
                lease_rev,
                head,
                self._cached(resource),
                functools.partial(int, retention),
            )
            unknown: OutcomeUnknown | None = None
            try:
                ok, _, revision = await self._send(plan.request, f"release of {resource}")
            except EtcdRejected as error:
                if error.code != 5 or head is None:
                    raise Unavailable(f"etcd: release of {resource}: {error}") from error
                passed.add(head.key)  # the waiter's etcd lease expired: it takes the lease itself
                continue
            except OutcomeUnknown as lost:  # a release is safe to repeat: did it happen?
                ok, unknown = False, lost
            if ok:
                with self._lock:
                    self._res[resource] = (revision, plan.state)
                return True
            settle = 0.0 if unknown is None else settle_time(pooled, self._transport.timeout)
            responses = await self._read_settling(
                [*plan.reads(), _get(plan.record)], f"reading {resource} to release it", settle
            )
            if responses is None:  # only after a lost reply (settle > 0): still unknown
                assert unknown is not None
                raise unknown
            kv = self._remember_release(resource, responses)
            seen = release_reread(plan, responses, kv, resource, epoch, owner, unknown is not None)
            if seen.released:
                return True
            if seen.passed is not None:
                passed.add(seen.passed)
            if seen.lease is None:
                return None if pooled is not None else False
            (lease_rev, holder), head = seen.lease, seen.head
        raise Unavailable(f"etcd: {resource} changed too often to release (contention)")

    async def _read_settling(
        self, ops: list[_Op], what: str, settle: float
    ) -> list[rpc.ResponseOp] | None:
        """:meth:`_read`, tried again on ``Unavailable`` for up to ``settle`` seconds; None if
        it never answered."""
        deadline = time.monotonic() + settle
        while True:
            try:
                responses, _ = await self._read(ops, what)
                return responses
            except Unavailable as error:
                if time.monotonic() >= deadline:
                    if settle == 0.0:
                        raise
                    log.debug("%s: %s", what, error)
                    return None
            await asyncio.sleep(0.05)

    # -- waiting in line ------------------------------------------------------------------
    async def enqueue(self, request: GrantRequest) -> Ticket:
        """Queue with the etcd lease a release will attach the lease key to, after the
        watches that cover the line (so no change falls between them and the queueing read)."""
        name = request.resource
        pooled = await self._take_lease(request.ttl)
        with self._lock:
            pooled.reserved = True
        key = self._keys.ticket(name, secrets.token_hex(8))
        ticket = AsyncEtcdTicket(self, request, key, pooled.id)
        self._tickets.setdefault(name, set()).add(ticket)
        try:
            await self._hold(name, "lease", ticket.holds, None)
            await self._hold(name, "line", ticket.holds, None)
            await self._put_ticket(ticket)
        except BaseException:
            self._unfollow(ticket)
            if ticket.key not in self._orphans:  # else the keeper leaves in our place
                self._give_back(pooled)
            raise
        await self._watch_queue(name, waiting=True)
        return ticket

    async def _ticket_lease(self, ticket: AsyncEtcdTicket) -> _PooledLease:
        """The etcd lease a waiter's own grant is attached to (a fresh one if that expired)."""
        with self._lock:
            pooled = self._leases.get(ticket.lease_id)
            if pooled is not None and not pooled.tainted:
                return pooled
        pooled = await self._take_lease(ticket.request.ttl)
        with self._lock:
            pooled.reserved = True
        ticket.lease_id = pooled.id
        return pooled

    async def _put_ticket(self, ticket: AsyncEtcdTicket) -> None:
        keys = self._keys
        name = ticket.resource
        for _ in range(3):
            lease_id = await self._queue_lease_id()
            try:
                ok, responses, revision = await self._send(
                    ticket_txn(keys, ticket, lease_id), f"queueing for {name}"
                )
            except (OutcomeUnknown, asyncio.CancelledError):
                ticket.rev = 0  # unknown: the keeper deletes the key if it exists
                self._orphans[ticket.key] = ticket
                raise
            except EtcdRejected as error:
                if error.code == 5:  # the queue lease expired: take a new one
                    with self._lock:
                        self._queue_lease = None
                    continue
                raise Unavailable(f"etcd: queueing: {error}") from error
            if not ok:  # cannot happen (fresh random id); take another id
                ticket.key = keys.ticket(name, secrets.token_hex(8))
                continue
            ticket.rev = revision
            pred, ticket.blocked = queued(responses, self._last(name))
            self._follow(ticket, pred, revision)
            return
        raise Unavailable(f"etcd: could not queue for {name}")

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        """Suspend until the watch task wakes this waiter, or ``timeout`` passed."""
        own = owned_ticket(self, ticket, ticket.resource, AsyncEtcdTicket)
        assert own is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(timeout, 0.0)):
                await own.changed.wait()

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue; a lease a release handed to this waiter meanwhile is returned with
        ``take``, else released (handed on). On failure the keeper retries, and the waiter's
        etcd lease is no longer kept alive: a grant that reached it expires within its TTL."""
        own = owned_ticket(self, ticket, ticket.resource, AsyncEtcdTicket)
        assert own is not None
        self._unfollow(own)
        if own.done:
            return None
        own.done = True
        if not own.rev:  # never queued
            with self._lock:
                pooled = self._leases.get(own.lease_id)
            if pooled is not None and own.key not in self._orphans:
                self._give_back(pooled)
            return None
        try:
            return await self._leave_once(own, take)
        except BaseException as error:
            log.debug("leaving the queue of %s failed: %s", own.resource, error)
            self._orphans[own.key] = own
            if not isinstance(error, Exception):
                raise
            return None

    async def _leave_once(self, ticket: AsyncEtcdTicket, take: bool = False) -> Granted | None:
        """Delete the waiter's key, or take (``take``) or release the lease a release handed
        to it instead (the sync face's ``_leave_once``)."""
        name = ticket.resource
        pooled = self._unreserve(ticket.lease_id)  # no more keep-alives: a grant to it expires
        ok, responses, _ = await self._send(leave_txn(self._keys, ticket), "leaving the queue")
        lease_kv = None if ok else _first(responses[0])
        if lease_kv is None or _owner(lease_kv) != ticket.request.owner:
            if pooled is not None:
                self._give_back(pooled)  # it carries nothing, and no release can hand it more
            return None
        if take:
            granted = await self._take_handed(ticket, lease_kv)
            if granted is not None:
                return granted
        lease = LeaseValue.decode(lease_kv.value)
        if pooled is not None and pooled.id == lease_kv.lease:
            self._carry(pooled, (name, lease.epoch, lease.owner), lease_kv, lease.holder)
        await self.release(name, lease.epoch, lease.owner)
        return None

    async def _ticket_state(self, ticket: AsyncEtcdTicket) -> Granted | Blocked | None:
        """Where a waiter stands, without a write if possible; None: try to take the lease
        (the sync face's ``_ticket_state``)."""
        handed = ticket.handed
        if handed is not None:
            granted = await self._take_handed(ticket, handed)
            if granted is not None:
                return granted
            ticket.handed = None
        name = ticket.resource
        woken = ticket.changed.is_set()
        watching = self._watching(ticket)
        shortcut = ticket_shortcut(self._keys, ticket, woken, watching)
        if shortcut != "read":
            return ticket.blocked if shortcut == "blocked" else None
        responses, revision = await self._read(
            ticket_reads(self._keys, ticket), "checking the queue"
        )
        found = standing(ticket, responses)
        self._remember(res=(name, found.res))
        self._remember_meta(found.meta)
        if found.handed:
            assert found.lease is not None
            return await self._take_handed(ticket, found.lease)  # None: that grant ended
        if not found.queued or found.pred is None:
            return None  # our key is gone (the grant attempt queues us again), or no pred
        if woken or found.pred != ticket.pred or not watching:
            ticket.blocked = await self._blocked(
                found.lease, self._last(name), RECHECK, precise=False
            )
            self._follow(ticket, found.pred, revision)
        ticket.checked_at = time.monotonic()
        return ticket.blocked

    async def _take_handed(self, ticket: AsyncEtcdTicket, kv: KV) -> Granted | None:
        """Take the lease a release handed to this waiter (``kv``: the lease key it put); it
        rides the waiter's own etcd lease, kept alive once more first if less than half its
        TTL is left. None if that grant has ended already."""
        pooled = self._handed_lease(kv)
        if pooled is None:
            return None
        name = ticket.resource
        async with self._grant_lock(name):
            if pooled.expires - self._clock.now() < pooled.ttl * 0.5:
                granted, sent = await self._keepalive(pooled.id)
                if granted <= 0:
                    self._drop(pooled)
                    return None
                self._refreshed(pooled, granted, sent)
            expires_in = self._take_over(pooled, kv, name)
        self._retire(ticket)
        lease = LeaseValue.decode(kv.value)
        return Granted(lease.epoch, lease.owner, lease.holder, lease.ttl, expires_in)

    def _retire(self, ticket: AsyncEtcdTicket) -> None:
        """The waiter was granted: it stops watching."""
        ticket.done = True
        self._unfollow(ticket)

    # -- records --------------------------------------------------------------------------
    async def _settle(self, resource: str | None) -> None:
        """Record the expiries of leases whose end was not recorded yet (and cache states)."""
        reads = settle_reads(self._keys, resource)
        for _ in range(_MAX_ATTEMPTS):
            responses, _ = await self._read(reads, "reading records")
            settle = settle_txn(self._keys, responses)
            if settle is None:
                return
            ok, _, revision = await self._send(settle.request, "recording expiries")
            if ok:
                with self._lock:
                    for name, state in settle.expired.items():
                        self._res[name] = (revision, state)
                if not settle.more:
                    return

    async def _read_records(
        self, resource: str | None, after: int, limit: int
    ) -> tuple[list[Record], int]:
        pages = RecordPages(self._keys, resource, after, limit)
        while (ops := pages.next_read()) is not None:
            responses, revision = await self._read(ops, "reading records")
            pages.feed(responses, revision)
        return pages.found, pages.revision

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        await self._settle(resource)
        return (await self._read_records(resource, after, limit))[0]

    async def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        for _ in range(_MAX_ATTEMPTS):
            res_rev, state, _, _ = self._cached(resource)
            request, new_state = report_txn(
                self._keys, resource, res_rev, state, (kind, resource, epoch, holder, detail)
            )
            if self._reported(resource, new_state, await self._send(request, "report")):
                return
        raise Unavailable(f"etcd: {resource} changed too often to report (contention)")

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        """Suspend until ``resource`` has a record with ``seq > after`` or ``timeout`` passed;
        woken by the watches of its records and of its lease key (an expiry is recorded when
        noticed). While those watches are not confirmed, it re-reads every :data:`RECHECK`."""
        deadline = time.monotonic() + timeout
        woken = asyncio.Event()
        self._record_waiters.setdefault(resource, set()).add(woken)
        holds: list[tuple[str, str]] = []
        try:
            await self._hold(resource, "log", holds, None)
            await self._hold(resource, "lease", holds, None)
            while True:
                woken.clear()  # before the read: a change during it wakes the next wait
                await self._settle(resource)
                found, _ = await self._read_records(resource, after, 1)
                left = deadline - time.monotonic()
                if found or left <= 0:
                    return
                if not (self._healthy(resource, "log") and self._healthy(resource, "lease")):
                    left = min(left, RECHECK)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await woken.wait()
        finally:
            waiters = self._record_waiters.get(resource)
            if waiters is not None:
                waiters.discard(woken)
                if not waiters:
                    del self._record_waiters[resource]
            self._release_holds(holds)

    async def resources(self) -> list[str]:
        names: list[str] = []
        start: bytes | None = None
        while True:
            responses, _ = await self._read(resources_read(self._keys, start), "listing resources")
            found, start = resources_page(self._keys, responses)
            names += found
            if start is None:
                return sorted(names)

    # -- close ----------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop the keeper and watch tasks, revoke idle pooled leases and the queue lease,
        close the channels; idempotent. Leases still held are not revoked: they expire (the
        Coordinator's contract). Waiting tasks are woken (their next call raises
        :class:`~fenced.Unavailable`)."""
        if self._closed:
            return
        self._closed = True
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await self._watcher.aclose()
        await self._lines.aclose()
        for tickets in self._tickets.values():
            for ticket in tickets:
                ticket.changed.set()
        for waiters in self._record_waiters.values():
            for woken in waiters:
                woken.set()
        self._views.clear()
        self._watch_ids.clear()
        for lease_id in self._closing_leases():
            with contextlib.suppress(Exception):
                await self._transport.call(
                    "lease/revoke", {"ID": str(lease_id)}, mutating=True, timeout=0.5
                )
        await self._transport.aclose()

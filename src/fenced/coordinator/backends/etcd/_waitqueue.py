"""Waiting on etcd: a waiter's place in line and a holder's view of the line. No decisions.

:class:`Place` (a waiter's place and what the watch on its predecessor saw) and :class:`Line`
(the waiters of one resource as a watch shows them) are shared by both faces, without I/O; the
sync face watches each in a thread of its own (:class:`EtcdTicket`, :class:`QueueView`), the
asyncio face (:mod:`._aio`) on its one watch stream.

:class:`EtcdTicket` is a waiter's ``P/queue/NAME:ID`` and the watch on its *predecessor* — the
waiter just ahead of it, or the lease key for the head of the line. The watch records what it
saw (``deleted``: the predecessor is gone; ``handed``: a release put the lease key with this
waiter's owner secret, i.e. handed it the lease) and wakes the waiter; the backend decides.

:class:`QueueView` is the line of one resource as a holder's process sees it through a watch on
``P/queue/NAME:``: the release of that process hands the lease to its head in the release's own
transaction; ``changed`` is called (by the watch's thread) after each change of the line, so
that the holder can build that transaction before it releases. A view is a hint only — the
handoff compares everything it assumed — so a stale view costs a retry, never a wrong grant.

Both watches start at the *current* revision (etcd's "synced" group: no 100 ms catch-up loop)
and cover the gap since the state they start from with one read at the revision etcd confirmed
the watch at (see :class:`~._watch.WatchStream`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fenced.coordinator.backend import Blocked, GrantRequest
from fenced.coordinator.backends.etcd._client import KV, Event, Transport, b64
from fenced.coordinator.backends.etcd._keys import LeaseValue, prefix_end
from fenced.coordinator.backends.etcd._watch import WatchStream
from fenced.core._errors import ConfigurationError

__all__ = ["EtcdTicket", "Line", "Place", "QueueView"]


def _owned_by(kv: KV, owner: str) -> bool:
    """Does the lease key ``kv`` hold the grant of ``owner``?"""
    try:
        return LeaseValue.decode(kv.value).owner == owner
    except (ConfigurationError, KeyError, TypeError, ValueError):
        return False


class Place:
    """A waiter's place in line, whichever face waits (the sync :class:`EtcdTicket`, the
    asyncio ``AsyncEtcdTicket``): ``P/queue/NAME:ID``, its create revision (its place in
    line), the etcd lease a grant to it is attached to (``lease_id``, reserved while it waits),
    its predecessor as last read (``pred``, read at revision ``seen_at``; ``head``: that is the
    lease key) and what the watch on it saw (:meth:`saw`, :meth:`caught_up`)."""

    def __init__(self, backend: object, request: GrantRequest, key: bytes, lease_id: int) -> None:
        self._backend = backend  # for owned_ticket()
        self.request = request
        self.key = key
        self.lease_id = lease_id
        self.rev = 0
        self.pred: bytes | None = None
        self.seen_at = 0
        self.head = False
        self.checked_at = 0.0
        self.deleted = False
        """The predecessor was seen deleted since it was followed."""
        self.handed: KV | None = None
        """The lease key as a release put it for this waiter (its owner secret): granted."""
        self.blocked: Blocked | None = None
        self.done = False

    @property
    def resource(self) -> str:
        return self.request.resource

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.key.decode(errors='replace')} rev {self.rev}>"

    def _followed(self, pred: bytes | None, seen_at: int, head: bool) -> None:
        """Follow ``pred`` as read at ``seen_at`` (forget what was seen of the one before)."""
        self.deleted = False
        self.pred = pred
        self.seen_at = seen_at
        self.head = head
        self.checked_at = time.monotonic()

    def saw(self, events: list[Event]) -> bool:
        """The watch on the predecessor delivered ``events`` (of its key only, after
        ``seen_at``); True: wake the waiter.

        Wakes on its DELETE; the head (``pred`` is the lease key) also on a PUT of the lease key
        with this waiter's owner secret — a release handed it the lease — and on a later change
        of a lease key it was handed (that grant ended before it was taken); not on a proclaim
        (the holder changed its advertised value)."""
        woken = False
        for event in events:
            if event.kind == "DELETE":
                self.handed = None
                self.deleted = True
            elif self.head and _owned_by(event.kv, self.request.owner):
                self.handed = event.kv
            elif self.head and self.handed is not None:
                self.handed = None
            else:
                continue  # a proclaim: the holder changed its advertised value
            woken = True
        return woken

    def caught_up(self, found: list[KV]) -> bool:
        """Was the predecessor unchanged since ``seen_at`` (``found``: its key as a read at a
        later revision found it; the watch covers what comes after that read)?"""
        if not found:
            self.deleted = True
            return False
        if self.head and _owned_by(found[0], self.request.owner):
            self.handed = found[0]
            return False
        return found[0].mod_revision <= self.seen_at


class EtcdTicket(Place):
    """A waiter's place (:class:`Place`) and the watch on its predecessor, in a thread."""

    def __init__(self, backend: object, request: GrantRequest, key: bytes, lease_id: int) -> None:
        super().__init__(backend, request, key, lease_id)
        self.changed = threading.Event()
        self.watches: list[WatchStream] = []

    def follow(self, transport: Transport, pred: bytes | None, seen_at: int, head: bool) -> None:
        """Watch ``pred`` from ``seen_at + 1`` (None: nothing to wait for, wake at once).

        Wakes on its DELETE; the head (``pred`` is the lease key) also on a PUT of the lease key
        with this waiter's owner secret — a release handed it the lease — and on a later change
        of a lease key it was handed (that grant ended before it was taken).
        """
        self.stop()
        self.changed.clear()
        self._followed(pred, seen_at, head)
        if pred is None:
            self.changed.set()
            return
        changed = self.changed

        def on_events(events: list[Event], revision: int) -> None:
            if self.saw(events):
                changed.set()

        def on_trouble(reason: str) -> None:
            changed.set()

        def catch_up(confirmed: int) -> bool:
            """Was ``pred`` unchanged up to revision ``confirmed`` (the watch covers the rest)?"""
            body: dict[str, object] = {"key": b64(pred), "revision": str(confirmed)}
            if not head:
                body["keys_only"] = True
            reply = transport.call("kv/range", body, mutating=False)
            return self.caught_up([KV.from_json(kv) for kv in reply.get("kvs", [])])

        self.watches = [
            WatchStream(
                transport,
                pred,
                None,
                seen_at + 1,
                on_events,
                on_trouble,
                name="waiter",
                catch_up=catch_up,
            )
        ]

    @property
    def watching(self) -> bool:
        return bool(self.watches) and all(watch.alive for watch in self.watches)

    def stop(self) -> None:
        watches, self.watches = self.watches, []
        for watch in watches:
            watch.stop()


class Line:
    """The waiters of one resource as a watch on ``P/queue/NAME:`` shows them (no I/O; both
    faces' views keep one): loaded by a read at some revision (:meth:`load`), then changed by
    the watch's later events (:meth:`apply`; events that arrive before the load are kept and
    applied after it). :meth:`head` is None until loaded, and once :attr:`broken` (the watch
    lost events: a compacted revision)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[bytes, KV] = {}
        self._early: list[Event] = []
        self._ready = False
        self.broken = False
        self.used = time.monotonic()

    def load(self, kvs: list[KV], revision: int) -> None:
        """The line as a read at ``revision`` found it."""
        with self._lock:
            self._waiters = {kv.key: kv for kv in kvs}
            early, self._early = self._early, []
            self._ready = True
        self.apply([event for event in early if event.kv.mod_revision > revision])

    def apply(self, events: list[Event]) -> None:
        """Events of the watch on the line."""
        with self._lock:
            if not self._ready and not self.broken:
                self._early += events
                return
            for event in events:
                if event.kind == "DELETE":
                    self._waiters.pop(event.kv.key, None)
                else:
                    self._waiters[event.kv.key] = event.kv

    def lost(self) -> None:
        """The watch lost events (compacted): the view is useless from now on."""
        with self._lock:
            self._ready = False
            self.broken = True

    def head(self) -> KV | None:
        """The oldest waiter's key as last seen (None: nobody, or not known)."""
        self.used = time.monotonic()
        with self._lock:
            if not self._ready or not self._waiters:
                return None
            return min(self._waiters.values(), key=lambda kv: kv.create_revision)


class QueueView(Line):
    """The waiters of one resource (:class:`Line`), kept by a watch on ``P/queue/NAME:`` in
    a thread (see the module docstring). After its watch ended (a compacted revision), the
    owner opens a new one."""

    def __init__(
        self, transport: Transport, prefix: bytes, changed: Callable[[], None] | None = None
    ) -> None:
        super().__init__()
        self._transport = transport
        self._prefix = prefix
        self._changed = changed
        self._watch = WatchStream(
            transport,
            prefix,
            prefix_end(prefix),
            0,
            self._on_events,
            self._on_trouble,
            name="queue",
            catch_up=self._load,
        )

    def _load(self, revision: int) -> bool:
        reply = self._transport.call(
            "kv/range",
            {
                "key": b64(self._prefix),
                "range_end": b64(prefix_end(self._prefix)),
                "revision": str(revision),
            },
            mutating=False,
        )
        self.load(list(map(KV.from_json, reply.get("kvs", []))), revision)
        return True

    def _on_events(self, events: list[Event], revision: int) -> None:
        self.apply(events)
        if self._changed is not None:
            self._changed()

    def _on_trouble(self, reason: str) -> None:
        if reason in ("compacted", "changed"):  # changed: the first read failed
            self.lost()
            self._watch.stop()

    def stop(self) -> None:
        self._watch.stop()

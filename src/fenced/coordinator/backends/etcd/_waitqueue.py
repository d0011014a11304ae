"""Waiting on etcd: a waiter's place in line and a holder's view of the line. No decisions.

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

__all__ = ["EtcdTicket", "QueueView"]


def _owned_by(kv: KV, owner: str) -> bool:
    """Does the lease key ``kv`` hold the grant of ``owner``?"""
    try:
        return LeaseValue.decode(kv.value).owner == owner
    except (ConfigurationError, KeyError, TypeError, ValueError):
        return False


class EtcdTicket:
    """A waiter's place: ``P/queue/NAME:ID``, its create revision (its place in line), the etcd
    lease a grant to it is attached to (``lease_id``, reserved while it waits), and the watch on
    its predecessor."""

    def __init__(self, backend: object, request: GrantRequest, key: bytes, lease_id: int) -> None:
        self._backend = backend  # for owned_ticket()
        self.request = request
        self.key = key
        self.lease_id = lease_id
        self.rev = 0
        self.pred: bytes | None = None
        self.checked_at = 0.0
        self.changed = threading.Event()
        self.deleted = False
        """The predecessor was seen deleted since :meth:`follow`."""
        self.handed: KV | None = None
        """The lease key as a release put it for this waiter (its owner secret): granted."""
        self.watches: list[WatchStream] = []
        self.blocked: Blocked | None = None
        self.done = False

    @property
    def resource(self) -> str:
        return self.request.resource

    def __repr__(self) -> str:
        return f"<EtcdTicket {self.key.decode(errors='replace')} rev {self.rev}>"

    def follow(self, transport: Transport, pred: bytes | None, seen_at: int, head: bool) -> None:
        """Watch ``pred`` from ``seen_at + 1`` (None: nothing to wait for, wake at once).

        Wakes on its DELETE; the head (``pred`` is the lease key) also on a PUT of the lease key
        with this waiter's owner secret — a release handed it the lease — and on a later change
        of a lease key it was handed (that grant ended before it was taken).
        """
        self.stop()
        self.changed.clear()
        self.deleted = False
        self.pred = pred
        self.checked_at = time.monotonic()
        if pred is None:
            self.changed.set()
            return
        owner = self.request.owner
        changed = self.changed

        def on_events(events: list[Event], revision: int) -> None:
            for event in events:
                if event.kind == "DELETE":
                    self.handed = None
                    self.deleted = True
                elif head and _owned_by(event.kv, owner):
                    self.handed = event.kv
                elif head and self.handed is not None:
                    self.handed = None
                else:
                    continue  # a proclaim: the holder changed its advertised value
                changed.set()

        def on_trouble(reason: str) -> None:
            changed.set()

        def catch_up(confirmed: int) -> bool:
            """Was ``pred`` unchanged up to revision ``confirmed`` (the watch covers the rest)?"""
            body: dict[str, object] = {"key": b64(pred), "revision": str(confirmed)}
            if not head:
                body["keys_only"] = True
            reply = transport.call("kv/range", body, mutating=False)
            found = [KV.from_json(kv) for kv in reply.get("kvs", [])]
            if not found:
                self.deleted = True
                return False
            if head and _owned_by(found[0], owner):
                self.handed = found[0]
                return False
            return found[0].mod_revision <= seen_at

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


class QueueView:
    """The waiters of one resource, kept by a watch on ``P/queue/NAME:`` (see the module
    docstring). :meth:`head` is None until the view is loaded, and after its watch ended (a
    compacted revision): the owner then opens a new one."""

    def __init__(
        self, transport: Transport, prefix: bytes, changed: Callable[[], None] | None = None
    ) -> None:
        self._transport = transport
        self._prefix = prefix
        self._changed = changed
        self._lock = threading.Lock()
        self._waiters: dict[bytes, KV] = {}
        self._ready = False
        self.broken = False
        self.used = time.monotonic()
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
        with self._lock:
            self._waiters = {kv.key: kv for kv in map(KV.from_json, reply.get("kvs", []))}
            self._ready = True
        return True

    def _on_events(self, events: list[Event], revision: int) -> None:
        with self._lock:
            for event in events:
                if event.kind == "DELETE":
                    self._waiters.pop(event.kv.key, None)
                else:
                    self._waiters[event.kv.key] = event.kv
        if self._changed is not None:
            self._changed()

    def _on_trouble(self, reason: str) -> None:
        if reason in ("compacted", "changed"):  # changed: the first read failed
            with self._lock:
                self._ready = False
                self.broken = True
            self._watch.stop()

    def head(self) -> KV | None:
        """The oldest waiter's key as last seen (None: nobody, or not known)."""
        self.used = time.monotonic()
        with self._lock:
            if not self._ready or not self._waiters:
                return None
            return min(self._waiters.values(), key=lambda kv: kv.create_revision)

    def stop(self) -> None:
        self._watch.stop()

"""The state an etcd backend keeps, and the sync backend's requests to etcd.

:class:`_EtcdState` is what both faces (the sync :class:`~._backend.EtcdBackend`, the asyncio
:class:`~._aio.AsyncEtcdBackend`) know, without I/O; :class:`_EtcdBase` adds the sync face's
attributes and sends its requests and transactions through its transport (every error
translated, see :func:`._ops._translated`). The state caches each
resource's state key (``P/res/NAME``: its mod revision and value) and the minimum epoch from
every reply that shows them; a cache is only a guess for the next compare, never trusted: a
transaction compares the revision it was built from, and a stale cache makes it fail and retry.
A change of the cluster id (a snapshot restore) drops the whole cache.

Also the constants shared by the backend's modules: :data:`QUEUE_TTL`, :data:`RECHECK`,
:data:`REQUEST_RETENTION`, and the bound on attempts of one operation under contention.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any

from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._client import KV, Transport
from fenced.coordinator.backends.etcd._keys import Keys, LeaseValue, ResourceState, prefix_end
from fenced.coordinator.backends.etcd._ops import _first, _get, _int_value, _kvs, _Op, _translated
from fenced.coordinator.backends.etcd._waitqueue import EtcdTicket, QueueView
from fenced.core._clock import Clock, SystemClock
from fenced.core._lease import LeaseInfo

if TYPE_CHECKING:
    from fenced.coordinator.backends.etcd._handoff import _Release
    from fenced.coordinator.backends.etcd._leasepool import _PooledLease
    from fenced.coordinator.backends.etcd._settings import EtcdSettings

log = logging.getLogger("fenced.coordinator.etcd")

QUEUE_TTL = 2
"""TTL (s) of the etcd lease of a process's waiter keys: a dead waiter is skipped after that."""
RECHECK = 1.0
"""Seconds after which a waiter re-reads its predecessor even without a notification."""
REQUEST_RETENTION = 24 * 3600
"""Seconds a ``request_id`` is remembered at least (its key's retention lease lives 25 h)."""
_MAX_ATTEMPTS = 16  # attempts of one operation under contention before Unavailable

Json = dict[str, Any]


class _EtcdState:
    """What an etcd backend knows, whichever face does its I/O (the sync :class:`_EtcdBase`
    and the asyncio :class:`~._aio.AsyncEtcdBackend` share it): its keys, the cached view of
    each resource's state and of the minimum epoch, the cluster id, the pooled etcd leases.
    No I/O here; ``_lock`` guards the cache and the pool (uncontended on an event loop)."""

    url: str
    coordinator_id: str
    _keys: Keys
    _clock: Clock  # of the pooled leases' times: counts a suspended host
    _lock: threading.Lock
    _res: dict[str, tuple[int, ResourceState]]  # name: (mod revision, state) as last seen
    _minimum: tuple[int, int]  # (mod revision, value) of the minimum epoch as last seen
    _leases: dict[int, _PooledLease]
    _queue_lease: _PooledLease | None
    _retention: _PooledLease | None
    _granted: dict[str, float]  # resource: when this process was last granted it
    _cluster_id: str
    _closed: bool

    def _init_state(self, settings: EtcdSettings) -> None:
        """The state of a backend of ``settings`` before its first request."""
        self.url = settings.display()
        self._keys = Keys(settings.prefix)
        self._clock = SystemClock()  # of the pooled leases' times: counts a suspended host
        self._lock = threading.Lock()
        self._res = {}
        self._minimum = (0, 0)
        self._leases = {}
        self._queue_lease = None
        self._retention = None
        self._granted = {}
        self._cluster_id = ""
        self._closed = False

    def _seen(self, reply: rpc.TxnResponse) -> tuple[bool, list[rpc.ResponseOp], int]:
        """A transaction's outcome, replies and revision; a reply from another cluster than
        the last one (a snapshot restore) drops every cached view first."""
        header = reply.header
        cluster = str(header.cluster_id) if header.cluster_id else ""
        if cluster and cluster != self._cluster_id:
            if self._cluster_id:  # another cluster (a snapshot restore): drop every cached view
                log.warning(
                    "etcd cluster id changed (%s -> %s): a restore?", self._cluster_id, cluster
                )
                with self._lock:
                    self._res.clear()
                    self._minimum = (-1, 0)
            self._cluster_id = cluster
        return reply.succeeded, list(reply.responses), header.revision

    def _remember(
        self,
        *,
        res: tuple[str, KV | None] | None = None,
        minimum: KV | bool | None = False,
    ) -> None:
        with self._lock:
            if res is not None:
                name, kv = res
                self._res[name] = (
                    (0, ResourceState())
                    if kv is None
                    else (kv.mod_revision, ResourceState.decode(kv.value))
                )
            if minimum is not False:
                self._minimum = _int_value(minimum if isinstance(minimum, KV) else None)

    def _reported(
        self,
        resource: str,
        new_state: ResourceState,
        answer: tuple[bool, list[rpc.ResponseOp], int],
    ) -> bool:
        """A report transaction's answer (both faces): True if the record was appended (the
        resource's state is now ``new_state``); else the state it compared is remembered as
        read, for the next attempt."""
        ok, responses, revision = answer
        if ok:
            with self._lock:
                self._res[resource] = (revision, new_state)
            return True
        self._remember(res=(resource, _first(responses[0])))
        return False

    def _meta(self) -> _Op:
        """One read of ``P/meta/``: the minimum epoch (and the id)."""
        return _get(self._keys.meta_prefix, prefix_end(self._keys.meta_prefix))

    def _remember_meta(self, response: rpc.ResponseOp) -> None:
        found = {kv.key: kv for kv in _kvs(response)}
        self._remember(minimum=found.get(self._keys.minimum))

    def _remember_release(self, resource: str, responses: list[rpc.ResponseOp]) -> KV | None:
        """Cache what a failed release read (``_Release.reads`` in :mod:`._handoff`); the
        lease key."""
        self._remember(res=(resource, _first(responses[1])))
        self._remember_meta(responses[2])
        return _first(responses[0])

    def _last(self, name: str) -> int:
        """The last epoch of ``name`` as cached (or the minimum epoch, if higher)."""
        with self._lock:
            return max(self._res.get(name, (0, ResourceState()))[1].epoch, self._minimum[1])

    def _last_epoch(self, resource: str, responses: list[rpc.ResponseOp]) -> int:
        """The last epoch of ``resource`` that ``epoch_reads`` found (cached too)."""
        res_kv, min_kv = _first(responses[0]), _first(responses[1])
        self._remember(res=(resource, res_kv), minimum=min_kv)
        epoch = ResourceState.decode(res_kv.value).epoch if res_kv is not None else 0
        return max(epoch, _int_value(min_kv)[1])

    def _info(self, resource: str, lease: LeaseValue, remaining: float) -> LeaseInfo:
        """The live lease ``lease`` of ``resource`` as ``current()`` shows it."""
        return LeaseInfo(
            resource,
            lease.epoch,
            lease.holder,
            remaining,
            lease.ttl,
            self.coordinator_id,
            lease.value,
        )

    def _cached(self, name: str) -> tuple[int, ResourceState, int, int]:
        """``(mod revision, state)`` of ``name`` and ``(mod revision, value)`` of the minimum
        epoch, as cached (what the next transaction on ``name`` compares)."""
        with self._lock:
            res_rev, state = self._res.get(name, (0, ResourceState()))
            min_rev, minimum = self._minimum
        return res_rev, state, min_rev, minimum


def _mutating(request: rpc.TxnRequest) -> bool:
    """Does the transaction write (a lost reply then leaves its outcome unknown)?"""
    ops = [*request.success, *request.failure]
    return any(op.WhichOneof("request") != "request_range" for op in ops)


class _EtcdBase(_EtcdState):
    """The state of the sync etcd backend, its requests (through its transport, every error
    translated) and its threads' attributes."""

    _transport: Transport
    _wake: threading.Condition  # on ``_lock``: wakes the keeper
    _grant_locks: weakref.WeakValueDictionary[str, threading.Lock]
    _orphans: dict[bytes, EtcdTicket]  # waiters whose leave() failed: the keeper retries
    _views: dict[str, QueueView]
    _planned: dict[str, _Release]  # handoffs built ahead, one per view at most
    _retiring: list[EtcdTicket]  # granted waiters whose watch the keeper stops

    def _call(self, path: str, body: Json, *, mutating: bool, what: str) -> Json:
        with _translated(what):
            return self._transport.call(path, body, mutating=mutating)

    def _txn(
        self, compare: list[rpc.Compare], success: list[_Op], failure: list[_Op], *, what: str
    ) -> tuple[bool, list[rpc.ResponseOp], int]:
        """One transaction; its outcome, replies and revision."""
        request = rpc.TxnRequest(compare=compare, success=success, failure=failure)
        return self._send(request, what)

    def _send(self, request: rpc.TxnRequest, what: str) -> tuple[bool, list[rpc.ResponseOp], int]:
        """:meth:`_txn` of a transaction built already."""
        with _translated(what):
            reply = self._transport.call_message("kv/txn", request, mutating=_mutating(request))
        assert isinstance(reply, rpc.TxnResponse)
        return self._seen(reply)

    def _read(self, ops: list[_Op], what: str) -> tuple[list[rpc.ResponseOp], int]:
        _, responses, revision = self._txn([], ops, [], what=what)
        return responses, revision

    def _lease_kv(self, resource: str) -> KV | None:
        responses, _ = self._read([_get(self._keys.lease(resource))], f"reading {resource}")
        return _first(responses[0])

"""Release, and the handoff to the head of the line in the release's own transaction.

A process that queues for a resource, or takes it repeatedly, keeps a :class:`QueueView` (a
watch on its line) so that its releases know the head (:meth:`_queue_head`). A release compares
the lease key and the state it was built from, and the head's key unchanged; it puts the lease
key in the head's name on the head's own etcd lease, deletes the head's key and writes both
records. With no head known it deletes the lease key and the head takes the lease itself. When
the line changes while this process holds the resource, the view's watch thread builds that
release ahead (:meth:`_plan_ahead`); a release uses it only if it was built from exactly the
inputs it would be built from now (:func:`_release_inputs`), so a plan built ahead sends the same
transaction the release would build. A release whose reply was lost reads until it learns
whether it happened (at most the lease's TTL), else raises :class:`~fenced.OutcomeUnknown`.

The decisions are functions that both faces use (the sync :class:`_Handoff` here, the asyncio
backend in :mod:`._aio`): :func:`release_plan` builds an attempt's transaction,
:func:`handoff_head` picks the waiter it hands to, :func:`release_reread` says what the reads
after a failed attempt mean, :func:`settle_time` how long a lost reply is resolved,
:func:`taken_again` when a process starts keeping a view of a line.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._base import _MAX_ATTEMPTS, _EtcdState
from fenced.coordinator.backends.etcd._client import KV, EtcdRejected
from fenced.coordinator.backends.etcd._keys import (
    STAMP_LATER,
    Keys,
    LeaseValue,
    QueueValue,
    ResourceState,
    dumps,
    prefix_end,
    records_from,
    stamped,
)
from fenced.coordinator.backends.etcd._leasepool import _PooledLease
from fenced.coordinator.backends.etcd._ops import _cmp, _delete, _first, _get, _handoff, _Op, _put
from fenced.coordinator.backends.etcd._records import _Item, _Records, resource_records
from fenced.coordinator.backends.etcd._waitqueue import QueueView
from fenced.core._errors import ConfigurationError, OutcomeUnknown, Unavailable
from fenced.core._records import RecordKind
from fenced.core._token import MAX_EPOCH

log = logging.getLogger("fenced.coordinator.etcd")

_VIEW_IDLE = 60.0  # stop watching a resource's queue after this long without a release
_VIEWS_KEPT = 32  # queue views per process at most (each one a watch: a connection, a thread)
_GRANTS_KEPT = 1024  # resources whose last grant time is kept (see _granted_again)


@dataclass(frozen=True)
class _Release:
    """One attempt of a release: its transaction, and the state it writes."""

    request: rpc.TxnRequest  # its records' ops last in ``success`` (see stamp)
    reads: Callable[[], list[_Op]]  # after a failure: lease, res, meta, queue head (, the
    # head's request_id); built only then
    state: ResourceState
    record: bytes  # the key of its RELEASED record
    inputs: tuple[object, ...]  # everything it was built from (_release_inputs)
    records: int  # how many of the last ``success`` ops are its records'
    handed: QueueValue | None = None  # the waiter it hands the lease to
    head: bytes = b""  # that waiter's queue key

    def stamp(self, at: float) -> None:
        """Give the records of this plan, built at :data:`STAMP_LATER`, the time ``at``."""
        ops = self.request.success
        for index in range(len(ops) - self.records, len(ops)):
            if ops[index].HasField("request_put"):
                put = ops[index].request_put
                put.value = stamped(put.value, at)


def _release_inputs(
    epoch: int,
    holder: str,
    lease_rev: int,
    head: KV | None,
    res_rev: int,
    state: ResourceState,
    minimum: int,
) -> tuple[object, ...]:
    """What a release's transaction is built from: the same inputs, the same transaction (but
    for its records' time)."""
    seen = None if head is None else (head.key, head.mod_revision)
    return (epoch, holder, lease_rev, seen, res_rev, state, minimum)


def release_plan(
    keys: Keys,
    resource: str,
    epoch: int,
    holder: str,
    lease_rev: int,
    head: KV | None,
    cached: tuple[int, ResourceState, int, int],
    retention: Callable[[], int],
    at: float | None = None,
) -> _Release:
    """The transaction that releases ``epoch`` (and hands the lease to ``head``, if given),
    built from the cached state of ``resource`` (``cached``: see ``_EtcdState._cached``), with
    its records at ``at`` (default: now). ``retention`` gives the id of the retention lease
    (called only for a head that queued with a request_id)."""
    lease_key, res_key, queue = keys.lease(resource), keys.res(resource), keys.queue(resource)
    res_rev, state, _, minimum = cached
    compare = [_cmp(lease_key, "MOD", lease_rev), _cmp(res_key, "MOD", res_rev)]
    request_key: bytes | None = None

    def reads() -> list[_Op]:
        found = [
            _get(lease_key),
            _get(res_key),
            _get(keys.meta_prefix, prefix_end(keys.meta_prefix)),
            _get(queue, prefix_end(queue), sort_order="ASCEND", sort_target="CREATE", limit=1),
        ]
        return found if request_key is None else [*found, _get(request_key)]

    items: list[_Item] = [(RecordKind.RELEASED, resource, epoch, holder, {})]
    record = keys.record(resource, state.last_record + 1)
    inputs = _release_inputs(epoch, holder, lease_rev, head, res_rev, state, minimum)
    if head is None:
        record_ops, number = resource_records(keys, resource, state.last_record, items, at)
        new_state = ResourceState(max(state.epoch, epoch), "released", holder, number)
        success = [_delete(lease_key), _put(res_key, new_state.encode()), *record_ops]
        request = rpc.TxnRequest(compare=compare, success=success)
        return _Release(request, reads, new_state, record, inputs, len(record_ops))
    waiter = QueueValue.decode(head.value)
    granted = max(state.epoch, epoch, minimum) + 1
    if granted > MAX_EPOCH:
        raise ConfigurationError(f"{resource}: epochs exhausted")
    detail: dict[str, object] = {"after": "released"}
    if waiter.value is not None:
        detail["value"] = waiter.value
    items.append((RecordKind.GRANTED, resource, granted, waiter.holder, detail))
    record_ops, number = resource_records(keys, resource, state.last_record, items, at)
    new_state = ResourceState(granted, "held", waiter.holder, number)
    value = LeaseValue(granted, waiter.owner, waiter.holder, waiter.ttl, waiter.value, number)
    # The head's key, unchanged. Nothing else is needed: create revisions only grow, so a
    # key that was the oldest at some revision (the view's, or a read's) stays the oldest
    # while it exists; and the minimum cannot have moved while our lease key is unchanged
    # (advance deletes every lease key in the transaction that raises it).
    compare.append(_cmp(head.key, "MOD", head.mod_revision))
    success = [
        _put(lease_key, value.encode(), waiter.lease),
        _delete(head.key),
        _put(res_key, new_state.encode()),
    ]
    if waiter.request_id is not None:
        request_key = keys.request(waiter.request_id)
        compare.append(_cmp(request_key, "CREATE", 0))
        success.append(
            _put(
                request_key,
                dumps({"resource": resource, "epoch": granted, "owner": waiter.owner}),
                retention(),
            )
        )
    request = rpc.TxnRequest(compare=compare, success=[*success, *record_ops])
    return _Release(request, reads, new_state, record, inputs, len(record_ops), waiter, head.key)


def handoff_head(head: KV | None, passed: set[bytes]) -> KV | None:
    """The waiter a release attempt hands the lease to: ``head``, unless it cannot be handed
    the lease (``passed``, or its value does not say how)."""
    if head is not None and (head.key in passed or not _handoff(head)):
        return None
    return head


def needs_retention(head: KV | None) -> bool:
    """Does a release that hands the lease to ``head`` (a :func:`handoff_head`) write its
    request_id's key (on the retention lease)?"""
    return head is not None and QueueValue.decode(head.value).request_id is not None


@dataclass(frozen=True, slots=True)
class _Reread:
    """What the reads after a failed release attempt say (:func:`release_reread`)."""

    released: bool  # the attempt whose reply was lost did release
    lease: tuple[int, str] | None  # (mod revision, holder) of the owner's live lease key
    head: KV | None  # the head of the line, for the next attempt
    passed: bytes | None  # a waiter not to hand the lease to (its request_id had a grant)


def release_reread(
    plan: _Release,
    responses: list[rpc.ResponseOp],
    lease_kv: KV | None,
    resource: str,
    epoch: int,
    owner: str,
    unknown: bool,
) -> _Reread:
    """The meaning of ``plan.reads()`` plus the read of its RELEASED record's key, after the
    attempt ``plan`` failed (``unknown``: its reply was lost)."""
    record = _first(responses[-1])
    if unknown and record is not None:
        found = records_from(record.value, record.create_revision)[0]
        if (found.kind, found.resource, found.epoch) == (RecordKind.RELEASED, resource, epoch):
            return _Reread(True, None, None, None)  # our lost release did it
    passed = None
    handed = plan.handed
    if handed is not None and handed.request_id and _first(responses[4]) is not None:
        passed = plan.head  # that request_id was granted before: it finds that grant
    lease = LeaseValue.decode(lease_kv.value) if lease_kv is not None else None
    if lease_kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
        return _Reread(False, None, None, passed)
    return _Reread(False, (lease_kv.mod_revision, lease.holder), _first(responses[3]), passed)


def settle_time(pooled: _PooledLease | None, timeout: float) -> float:
    """How long a release whose outcome is unknown keeps trying to learn it: a lost reply
    usually means a member died, and the cluster answers again once it has a new leader.
    Not longer than the lease would live anyway (its etcd TTL), nor 3 request timeouts."""
    lease_ttl = float(pooled.ttl) if pooled is not None else 1.0
    return min(lease_ttl, 3 * timeout)


def taken_again(state: _EtcdState, resource: str) -> bool:
    """Note that this process was granted ``resource`` now; True if it was granted it within
    :data:`_VIEW_IDLE` before: then it keeps a view of the line, so that its releases can
    hand over (a resource taken once costs nothing)."""
    now = time.monotonic()
    with state._lock:
        last = state._granted.get(resource)
        if len(state._granted) >= _GRANTS_KEPT:
            state._granted.clear()
        state._granted[resource] = now
    return last is not None and now - last < _VIEW_IDLE


class _Handoff(_Records):
    """Release and handoff of an etcd backend, and the views of lines they use."""

    def _watch_queue(self, resource: str) -> None:
        """Keep a :class:`QueueView` of ``resource``'s waiters (its releases hand over)."""
        with self._lock:
            view = self._views.get(resource)
            if view is not None and not view.broken:
                view.used = time.monotonic()
                return
            if self._closed:
                return
            evicted = None
            if len(self._views) >= _VIEWS_KEPT:
                oldest = min(self._views, key=lambda name: self._views[name].used)
                evicted = self._views.pop(oldest)
                self._planned.pop(oldest, None)
            self._views[resource] = QueueView(
                self._transport,
                self._keys.queue(resource),
                functools.partial(self._plan_ahead, resource),
            )
        for stale in (view, evicted):
            if stale is not None:
                stale.stop()

    def _granted_again(self, resource: str) -> None:
        """A process that takes a resource again within :data:`_VIEW_IDLE` watches its line (one
        watch, no cost per grant), so that its releases can hand over: a resource taken once
        costs nothing. (Waiters watch the line of the resource they queue for.)"""
        if taken_again(self, resource):
            self._watch_queue(resource)

    def _queue_head(self, resource: str) -> KV | None:
        with self._lock:
            view = self._views.get(resource)
        return view.head() if view is not None else None

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        with self._grant_lock(resource):
            pooled = self._carrying_lease(resource, epoch, owner)
            released = self._release_locked(resource, epoch, owner, pooled)
            if pooled is not None and released is not None:
                self._give_back(pooled)
        return bool(released)

    def _release_locked(
        self, resource: str, epoch: int, owner: str, pooled: _PooledLease | None
    ) -> bool | None:
        """True: released now; False: not this owner's lease (None: and ``pooled`` is free).

        Hands the lease to the head of the line in the same transaction when this process
        knows the head (its :class:`QueueView`, or the failure branch of an attempt that found
        a waiter); otherwise deletes the lease key and the head takes the lease itself.
        """
        lease_rev = pooled.lease_rev if pooled is not None else 0
        holder = ""
        if not lease_rev:
            kv = self._lease_kv(resource)
            lease = LeaseValue.decode(kv.value) if kv is not None else None
            if kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
                return None if pooled is not None else False
            lease_rev, holder = kv.mod_revision, lease.holder
        elif pooled is not None:
            holder = pooled.holder
        head = self._queue_head(resource)
        ahead = self._planned_ahead(resource, epoch, holder, lease_rev, head)
        passed: set[bytes] = set()  # waiters that cannot be handed the lease
        for _ in range(_MAX_ATTEMPTS):
            if ahead is not None:
                plan, ahead = ahead, None
            else:
                head = handoff_head(head, passed)
                plan = self._release_plan(resource, epoch, holder, lease_rev, head)
            unknown: OutcomeUnknown | None = None
            try:
                ok, _, revision = self._send(plan.request, f"release of {resource}")
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
            # (the transaction has no failure branch: a release that fails reads the state here)
            settle = 0.0 if unknown is None else settle_time(pooled, self._transport.timeout)
            responses = self._read_settling(
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

    def _read_settling(
        self, ops: list[_Op], what: str, settle: float
    ) -> list[rpc.ResponseOp] | None:
        """:meth:`_read`, tried again on ``Unavailable`` for up to ``settle`` seconds; None if
        it never answered (the last error is logged)."""
        deadline = time.monotonic() + settle
        while True:
            try:
                responses, _ = self._read(ops, what)
                return responses
            except Unavailable as error:
                if time.monotonic() >= deadline:
                    if settle == 0.0:
                        raise
                    log.debug("%s: %s", what, error)
                    return None
            time.sleep(0.05)

    def _release_plan(
        self,
        resource: str,
        epoch: int,
        holder: str,
        lease_rev: int,
        head: KV | None,
        at: float | None = None,
    ) -> _Release:
        """:func:`release_plan` from this backend's cache."""
        return release_plan(
            self._keys,
            resource,
            epoch,
            holder,
            lease_rev,
            head,
            self._cached(resource),
            self._retention_lease_id,
            at,
        )

    def _plan_ahead(self, resource: str) -> None:
        """The line of ``resource`` changed (called by its view's watch thread): if this
        process holds ``resource``, build the release that hands it to the new head now, so
        that :meth:`release` finds it ready (:meth:`_planned_ahead`) and sends the handoff
        without building it.

        Only a hint: any failure leaves the release to build its plan itself. Heads with a
        request_id are left to the release too (their plan may have to grant a retention
        lease: a request, not for a watch thread).
        """
        with self._lock:
            self._planned.pop(resource, None)
            grants = [
                (pooled.grant, pooled.holder, pooled.lease_rev)
                for pooled in self._leases.values()
                if pooled.grant is not None and pooled.grant[0] == resource
            ]
        head = self._queue_head(resource)
        if len(grants) != 1 or head is None or not grants[0][2]:
            return
        (_, epoch, _), holder, lease_rev = grants[0]
        try:
            waiter = QueueValue.decode(head.value)
            if not waiter.handoff or waiter.request_id is not None:
                return
            plan = self._release_plan(resource, epoch, holder, lease_rev, head, STAMP_LATER)
        except Exception as error:
            log.debug("planning the handoff of %s: %s", resource, error)
            return
        with self._lock:
            if resource in self._views:  # not dropped meanwhile (it would never be replaced)
                self._planned[resource] = plan

    def _planned_ahead(
        self, resource: str, epoch: int, holder: str, lease_rev: int, head: KV | None
    ) -> _Release | None:
        """The release :meth:`_plan_ahead` built, if it was built from exactly what this
        release would build it from (the lease, the head's key and revision, the cached state
        and minimum), with its records' time set to now; else None. Used once."""
        with self._lock:
            plan = self._planned.pop(resource, None)
        res_rev, state, _, minimum = self._cached(resource)
        if plan is None or plan.inputs != _release_inputs(
            epoch, holder, lease_rev, head, res_rev, state, minimum
        ):
            return None
        plan.stamp(time.time())
        return plan

"""Every decision of the ZooKeeper coordinator, as plans both faces run (see :mod:`._steps`).

The rules are the memory model's (:mod:`fenced.coordinator.backends.memory._backend`); here is
how each holds on ZooKeeper:

* **Grant** — one transaction: the meta znode's version (the minimum epoch a restore set), the
  resource's counter set to ``max(epoch, minimum) + 1`` *at the version read* (so two grants
  never write the same epoch: the second fails and re-reads), the lease created as a
  persistent znode (it exists at most once), the ``granted`` record, the request id's znode, and
  either the caller's waiter znode deleted or, for a caller without a place in the queue, the
  queue znode's version checked (a waiter queued since the queue was seen empty fails it).
* **Expiry** — a lease ends at ``base + ttl`` by the leader's clock, and only then (or at its
  release): the lease znode is persistent, so the end of its holder's session, which can come
  milliseconds after a grant to a client that was silent for a session timeout, does not end
  it before the holder's deadline. The leader's clock is read by writing the clock znode (a
  :class:`~._steps.Tick`) whenever the estimate says a lease is within :data:`SLACK_MS` of its
  expiry; an expired lease is deleted (at its version) in the transaction that records its
  expiry, or the one that grants the next lease.
* **Renew, proclaim, release** — one transaction that checks the counter's version (no grant
  since) and writes or deletes the lease znode at its version. A renewal committed after the
  lease's expiry (its own mtime says so) is undone: the lease is deleted and the expiry
  recorded, never revived.
* **Reads** — ``current``, ``last_epoch``, ``resources`` and ``records`` begin with a
  :class:`~._steps.Sync`: they see every transaction committed before they began, whichever
  client committed it (a plain ZooKeeper read is only as fresh as the member the session is
  on). The deciding steps need none: a stale read costs one failed transaction.
* **Waiting** — ephemeral sequential znodes under the queue znode; a waiter may be granted
  when its znode is the first and no lease is live. Waking is the driver's (a watch on the
  predecessor, or on the lease when first).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import NodeExistsError, NoNodeError, RolledBackError
from kazoo.protocol.states import ZnodeStat

from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator.backends.zookeeper._layout import (
    Counter,
    LeaseDoc,
    Paths,
    decode_meta,
    decode_record,
    decode_request,
    encode_meta,
    encode_record,
    encode_request,
)
from fenced.coordinator.backends.zookeeper._steps import (
    Batch,
    Children,
    Get,
    Held,
    Multi,
    Op,
    Plan,
    SharedState,
    Sync,
    Tick,
)
from fenced.core._errors import (
    ConfigurationError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

__all__ = [
    "RECORDS_KEPT",
    "REQUESTS_KEPT_S",
    "SLACK_MS",
    "ZkTicket",
    "advance",
    "current",
    "enqueue",
    "last_epoch",
    "leave",
    "newest_seq",
    "open_state",
    "proclaim",
    "prune",
    "records",
    "release",
    "renew",
    "report",
    "resources",
    "sweep",
    "try_grant",
    "wake_path",
]

SLACK_MS = 250.0
"""A lease whose estimated expiry is this close is checked against the leader's clock."""
RECORDS_KEPT = 10_000
"""Records kept (all resources); the oldest are pruned every :data:`_PRUNE_EVERY`."""
_PRUNE_EVERY = 1000
REQUESTS_KEPT_S = 24 * 3600.0
"""Seconds a ``request_id``'s grant is remembered (a retry after that is a new request)."""
_CHUNK = 100  # operations per pruning or restoring transaction
_ATTEMPTS = 32  # transactions a step may try under contention before it is Unavailable


@dataclass(eq=False)
class ZkTicket:
    """A place in a resource's queue: the path of its ephemeral sequential znode ("" while it
    is being made) and the token written into it (how a znode whose creation reply was lost is
    found again)."""

    resource: str
    path: str
    _backend: object
    token: bytes = field(default_factory=lambda: secrets.token_hex(12).encode())
    head_woken: bool = False
    """Set by the faces' ``wait`` when the lease this head waiter watched was deleted: its next
    ``try_grant`` tries the one-round-trip handoff first."""

    def __repr__(self) -> str:
        return f"ZkTicket({self.resource!r}, {self.path.rpartition('/')[2]!r})"


def _ok(results: list[Any]) -> bool:
    return not any(isinstance(r, Exception) for r in results)


def _failed(results: list[Any], ops: tuple[Op, ...]) -> list[tuple[Op, Exception]]:
    """The operations that failed (not merely rolled back), with their errors."""
    return [
        (op, r)
        for op, r in zip(ops, results, strict=False)
        if isinstance(r, Exception) and not isinstance(r, RolledBackError)
    ]


def _record(
    state: SharedState,
    kind: RecordKind,
    resource: str,
    epoch: int,
    holder: str | None,
    detail: dict[str, object] | None = None,
    at_ms: float | None = None,
) -> Op:
    at = (state.server_now_ms() if at_ms is None else at_ms) / 1000.0
    data = encode_record(kind, epoch, holder, detail or {}, at)
    return ("create", state.paths.record_prefix(resource), data, False, True)


def _meta(state: SharedState) -> Plan[tuple[int, int]]:
    """(minimum, version) of the meta znode, remembered or read."""
    if state.meta is None:
        answer = yield Get(state.paths.meta)
        if isinstance(answer, NoNodeError):
            raise ConfigurationError(f"the fenced state under {state.paths.root} was deleted")
        data, stat = answer
        state.meta = (decode_meta(data, state.paths.meta)[1], stat.version)
    return state.meta


@dataclass(frozen=True)
class _View:
    """A resource as read: counter (None: never granted), lease, queue."""

    counter: Counter | None
    counter_version: int
    lease: tuple[LeaseDoc, ZnodeStat] | None
    waiters: list[str] | None
    """Sorted waiter znode names (None: the queue znode does not exist)."""
    queue_version: int


def _read(state: SharedState, resource: str, queue: bool = True) -> Plan[_View]:
    """The resource's counter, lease and (with ``queue``) waiters, read together.

    The reads are pipelined, not atomic: a grant or release committed between them shows a
    lease znode beside a counter that does not describe it. Such a view is read again (a
    counter that says "live" beside no lease znode is consistent: the holder's session ended).
    """
    paths = state.paths
    reads: list[Get | Children] = [Get(paths.counter(resource)), Get(paths.lease(resource))]
    if queue:
        reads.append(Children(paths.queue(resource)))
    for _ in range(_ATTEMPTS):
        answers = yield Batch(tuple(reads))
        counter: Counter | None = None
        counter_version = -1
        if not isinstance(answers[0], NoNodeError):
            data, stat = answers[0]
            counter, counter_version = Counter.decode(data, paths.counter(resource)), stat.version
        lease = None
        if not isinstance(answers[1], NoNodeError):
            data, stat = answers[1]
            lease = (LeaseDoc.decode(data, paths.lease(resource)), stat)
            if counter is None or counter.state != "live" or counter.epoch != lease[0].epoch:
                continue  # torn between a grant or release and our reads
        if counter is None:
            state.counters.pop(resource, None)
        else:
            state.counters[resource] = (counter, counter_version)
        waiters: list[str] | None = None
        queue_version = -1
        if queue and not isinstance(answers[2], NoNodeError):
            children, stat = answers[2]
            waiters, queue_version = sorted(children), stat.version
            if not waiters:
                state.queues[resource] = queue_version
        return _View(counter, counter_version, lease, waiters, queue_version)
    raise Unavailable(f"ZooKeeper: {resource} changed during every one of {_ATTEMPTS} reads")


def _expired(state: SharedState, lease: LeaseDoc, stat: ZnodeStat) -> Plan[tuple[bool, float]]:
    """Whether the lease has expired by the leader's clock, and its remaining time (s).

    Reads the leader's clock (a Tick) only when the estimate is within :data:`SLACK_MS`."""
    expires = lease.expires_ms(stat.mtime)
    remaining = expires - state.server_now_ms()
    if remaining > SLACK_MS:
        return False, remaining / 1000.0
    now = yield Tick()
    return now >= expires, max(0.0, (expires - now) / 1000.0)


def _expiry_ops(
    state: SharedState,
    resource: str,
    counter: Counter,
    counter_version: int,
    lease: tuple[LeaseDoc, ZnodeStat] | None,
) -> list[Op]:
    """End a lease that expired (or whose session ended): delete it, record the expiry, and
    mark the counter (the counter's ``set`` is the caller's when it grants)."""
    ops: list[Op] = []
    at_ms = None
    if lease is not None:
        doc, stat = lease
        ops.append(("delete", state.paths.lease(resource), stat.version))
        at_ms = doc.expires_ms(stat.mtime)
    ops.append(
        _record(state, RecordKind.EXPIRED, resource, counter.epoch, counter.holder, None, at_ms)
    )
    return ops


def try_grant(
    state: SharedState, request: GrantRequest, ticket: ZkTicket | None, backend: object
) -> Plan[Granted | Blocked]:
    """``CoordinatorBackend.try_grant`` (see the module docstring)."""
    paths, resource = state.paths, request.resource
    ttl = request.ttl
    if ticket is not None and ticket.head_woken:
        ticket.head_woken = False
        handed = yield from _handoff(state, request, ticket, ttl)
        if handed is not None:
            return handed
    for _ in range(_ATTEMPTS):
        minimum, meta_version = yield from _meta(state)
        remembered = state.counters.get(resource)
        queue_version = state.queues.get(resource)
        if (
            remembered is None
            or remembered[0].state == "live"
            or (ticket is None and queue_version is None)
            or ticket is not None
        ):
            view = yield from _read(state, resource)
            counter, counter_version = view.counter, view.counter_version
            lease, waiters, queue_version = view.lease, view.waiters, view.queue_version
        else:
            (counter, counter_version), lease, waiters = remembered, None, []
        last = max(0 if counter is None else counter.epoch, minimum)
        ops: list[Op] = [("check", paths.meta, meta_version)]
        after = "none" if counter is None else counter.state
        if counter is not None and counter.state == "live":
            if lease is not None:
                expired, remaining = yield from _expired(state, *lease)
                if not expired:
                    blocked = Blocked(lease[0].holder, lease[0].epoch, remaining, remaining)
                    return (yield from _unless_earlier(state, request, blocked))
            ops += _expiry_ops(state, resource, counter, counter_version, lease)
            after = "expired"
        if ticket is not None:
            name = ticket.path.rpartition("/")[2]
            if waiters is None or name not in waiters:
                # our place ended with our session: queue again, at the end
                ticket.path = ""
                ticket.path = yield from _enqueue_path(state, resource, ticket.token)
                return (yield from _unless_earlier(state, request, Blocked(None, last, 0, None)))
            if waiters[0] != name:
                return (yield from _unless_earlier(state, request, Blocked(None, last, 0, None)))
            ops.append(("delete", ticket.path, -1))
        elif waiters:
            return (yield from _unless_earlier(state, request, Blocked(None, last, 0, None)))
        elif waiters is None:
            ops.append(("create", paths.queue(resource), b"", False, False))
        else:
            ops.append(("check", paths.queue(resource), queue_version))
        epoch = last + 1
        grant = _Grant(state, request, ttl, epoch, counter_version if counter else None, after)
        sent = (*ops, *grant.ops)
        results = yield Multi(sent)
        if _ok(results):
            if ticket is None and waiters is None:
                state.queues[resource] = 0  # the queue znode this grant created
            elif ticket is None and waiters == [] and queue_version is not None:
                state.queues[resource] = queue_version
            return grant.done(results[len(ops) :])
        if any(op[1] == paths.meta for op, _ in _failed(results, sent)):
            state.meta = None
        state.forget(resource)
        if request.request_id is not None:
            earlier = yield from _earlier_grant(state, request)
            if earlier is not None:
                return earlier
    raise Unavailable(f"ZooKeeper: {resource} changed on every one of {_ATTEMPTS} attempts")


class _Grant:
    """The operations of one grant (counter, lease, record, request id) and what its success
    leaves remembered."""

    def __init__(
        self,
        state: SharedState,
        request: GrantRequest,
        ttl: float,
        epoch: int,
        counter_version: int | None,
        after: str,
    ) -> None:
        paths, resource = state.paths, request.resource
        self.state, self.request, self.ttl, self.epoch = state, request, ttl, epoch
        self.counter = Counter(epoch, request.holder, "live")
        self.doc = LeaseDoc(epoch, request.owner, request.holder, ttl, request.value)
        self.version = 0 if counter_version is None else counter_version + 1
        ops: list[Op] = [
            ("create", paths.counter(resource), self.counter.encode(), False, False)
            if counter_version is None
            else ("set", paths.counter(resource), self.counter.encode(), counter_version),
            ("create", paths.lease(resource), self.doc.encode(), False, False),
        ]
        ops.append(self.record(after))
        if request.request_id is not None:
            request_doc = encode_request(resource, epoch, request.owner)
            ops.append(("create", paths.request(request.request_id), request_doc, False, False))
        self.ops = tuple(ops)

    def done(self, results: list[Any]) -> Granted:
        """Remember the committed grant (``results``: those of :attr:`ops`)."""
        state, request = self.state, self.request
        state.counters[request.resource] = (self.counter, self.version)
        observed = _mtime(results[0])
        if observed is None:
            mtime = int(state.server_now_ms())
        else:
            mtime = observed
            state.observe(mtime)
        held = Held(request.owner, self.doc, 0, self.version, mtime)
        state.held[(request.resource, self.epoch)] = held
        _note_records(state, results)
        return Granted(self.epoch, request.owner, request.holder, self.ttl, self.ttl)

    def record(self, after: str) -> Op:
        """The ``granted`` record, ``after`` saying how the previous lease ended."""
        detail: dict[str, object] = {"after": after}
        if self.request.value is not None:
            detail["value"] = self.request.value
        resource, holder = self.request.resource, self.request.holder
        return _record(self.state, RecordKind.GRANTED, resource, self.epoch, holder, detail)

    def record_path(self, results: list[Any]) -> str:
        return str(results[2])


def _handoff(
    state: SharedState, request: GrantRequest, ticket: ZkTicket, ttl: float
) -> Plan[Granted | None]:
    """The head waiter, woken by the deletion of the lease, grants itself in one round trip:
    the grant transaction as the lease it waited behind left things (the counter one version
    on, "released"), sent right after a read of the counter. None when the guess was wrong
    (the normal path reads again). The read, answered before the transaction, tells how the
    lease ended; if not by a release, the ``granted`` record's ``after`` is corrected."""
    remembered, meta = state.counters.get(request.resource), state.meta
    if remembered is None or meta is None or remembered[0].state != "live":
        return None
    (counter, version), (minimum, meta_version) = remembered, meta
    grant = _Grant(state, request, ttl, max(counter.epoch, minimum) + 1, version + 1, "released")
    ops: tuple[Op, ...] = (
        ("check", state.paths.meta, meta_version),
        ("delete", ticket.path, -1),
        *grant.ops,
    )
    counter_path = state.paths.counter(request.resource)
    answers = yield Batch((Get(counter_path),), then=Multi(ops))
    results = answers[-1]
    if not _ok(results):
        state.forget(request.resource)
        return None
    granted = grant.done(results[2:])
    if not isinstance(answers[0], NoNodeError):
        ended = Counter.decode(answers[0][0], counter_path).state
        if ended != "released":
            corrected = grant.record(ended)[2]
            yield Multi((("set", grant.record_path(results[2:]), corrected, -1),))
    return granted


def _mtime(result: Any) -> int | None:
    return result.mtime if isinstance(result, ZnodeStat) else None


def _unless_earlier(
    state: SharedState, request: GrantRequest, blocked: Blocked
) -> Plan[Granted | Blocked]:
    """``blocked``, unless the request's id was granted before (then that answer)."""
    if request.request_id is not None:
        earlier = yield from _earlier_grant(state, request)
        if earlier is not None:
            return earlier
    return blocked


def _earlier_grant(state: SharedState, request: GrantRequest) -> Plan[Granted | None]:
    """The answer for a request id seen before (None: never seen)."""
    assert request.request_id is not None
    path = state.paths.request(request.request_id)
    answer = yield Get(path)
    if isinstance(answer, NoNodeError):
        return None
    resource, epoch, owner = decode_request(answer[0], path)
    if resource != request.resource:
        raise ConfigurationError(
            f"this request_id was already used to acquire {resource}, not {request.resource}"
        )
    view = yield from _read(state, resource, queue=False)
    if view.lease is not None and view.lease[0].epoch == epoch and view.lease[0].owner == owner:
        expired, remaining = yield from _expired(state, *view.lease)
        if not expired:
            doc = view.lease[0]
            return Granted(epoch, owner, doc.holder, doc.ttl, remaining)
    raise LeaseLost(LossReason.REJECTED, "the lease granted for this request_id has ended")


def _enqueue_path(state: SharedState, resource: str, token: bytes) -> Plan[str]:
    """Create a waiter znode holding ``token`` at the end of the queue (creating the queue
    znode if needed); the queue znode's version is raised in the same transaction. A lost
    reply leaves the place to be swept (:func:`sweep`)."""
    queue = state.paths.queue(resource)
    for _ in range(_ATTEMPTS):
        ops: tuple[Op, ...] = (
            ("set", queue, b"", -1),
            ("create", state.paths.waiter_prefix(resource), token, True, True),
        )
        try:
            results = yield Multi(ops)
        except OutcomeUnknown:
            state.lost_places.add((resource, token))
            raise
        if _ok(results):
            state.queues.pop(resource, None)
            return str(results[1])
        created = yield Multi((("create", queue, b"", False, False),))
        if not _ok(created) and not isinstance(created[0], NodeExistsError):
            raise Unavailable(f"ZooKeeper refused to create {queue}: {created[0]!r}")
    raise Unavailable(f"ZooKeeper: could not queue for {resource}")


def enqueue(state: SharedState, request: GrantRequest, backend: object) -> Plan[ZkTicket]:
    ticket = ZkTicket(request.resource, "", backend)
    ticket.path = yield from _enqueue_path(state, request.resource, ticket.token)
    return ticket


def leave(state: SharedState, ticket: ZkTicket) -> Plan[None]:
    """Delete the waiter's znode (gone already: nothing to do). When that fails, or the place
    is being made again, it is left to :func:`sweep`: a place this session leaves behind would
    hold up the queue for as long as the session lives."""
    if not ticket.path:
        state.lost_places.add((ticket.resource, ticket.token))
        return
    try:
        yield Multi((("delete", ticket.path, -1),))
    except (Unavailable, OutcomeUnknown):
        state.lost_places.add((ticket.resource, ticket.token))
        raise


def sweep(state: SharedState) -> Plan[None]:
    """Delete the places this backend may have left in queues (see :func:`leave`)."""
    for resource, token in list(state.lost_places):
        queue = state.paths.queue(resource)
        answer = yield Children(queue)
        if not isinstance(answer, NoNodeError) and answer[0]:
            paths = [f"{queue}/{child}" for child in answer[0]]
            found = yield Batch(tuple(Get(path) for path in paths))
            doomed = [
                path
                for path, got in zip(paths, found, strict=True)
                if not isinstance(got, NoNodeError) and got[0] == token
            ]
            if doomed:
                yield Multi(tuple(("delete", path, -1) for path in doomed))
        state.lost_places.discard((resource, token))


def wake_path(state: SharedState, ticket: ZkTicket) -> Plan[tuple[str, float | None] | None]:
    """What should wake ``ticket``: the deletion of its predecessor in the queue, or — when it
    is first — of the lease, or that lease's expiry (seconds from now, estimated); None when it
    may try to be granted now."""
    paths, resource = state.paths, ticket.resource
    answers = yield Batch((Children(paths.queue(resource)), Get(paths.lease(resource))))
    name = ticket.path.rpartition("/")[2]
    if isinstance(answers[0], NoNodeError):
        return None
    waiters = sorted(answers[0][0])
    if name not in waiters:
        return None
    index = waiters.index(name)
    if index > 0:
        return f"{paths.queue(resource)}/{waiters[index - 1]}", None
    if isinstance(answers[1], NoNodeError):
        return None
    doc = LeaseDoc.decode(answers[1][0], paths.lease(resource))
    due = (doc.expires_ms(answers[1][1].mtime) - state.server_now_ms()) / 1000.0
    return (paths.lease(resource), max(0.0, due)) if due > 0 else None


def _held(
    state: SharedState, resource: str, epoch: int, owner: str, fresh: bool
) -> Plan[Held | None]:
    """The lease of this epoch and owner as remembered, or read (None: not live, not theirs)."""
    held = None if fresh else state.held.get((resource, epoch))
    if held is not None and held.owner == owner:
        return held
    view = yield from _read(state, resource, queue=False)
    if (
        view.counter is None
        or view.counter.epoch != epoch
        or view.counter.state != "live"
        or view.lease is None
        or view.lease[0].epoch != epoch
        or view.lease[0].owner != owner
    ):
        if view.counter is not None and view.counter.state == "live":
            yield from _settle(state, resource, view)
        return None
    doc, stat = view.lease
    held = Held(owner, doc, stat.version, view.counter_version, stat.mtime)
    state.held[(resource, epoch)] = held
    return held


def _settle(state: SharedState, resource: str, view: _View) -> Plan[bool]:
    """Record the expiry of the resource's lease if it is due (True: the lease is not live)."""
    counter = view.counter
    if counter is None or counter.state != "live":
        return True
    if view.lease is not None and view.lease[0].epoch == counter.epoch:
        expired, _ = yield from _expired(state, *view.lease)
        if not expired:
            return False
    ops = _expiry_ops(state, resource, counter, view.counter_version, view.lease)
    ended = Counter(counter.epoch, counter.holder, "expired")
    ops.append(("set", state.paths.counter(resource), ended.encode(), view.counter_version))
    results = yield Multi(tuple(ops))
    state.held.pop((resource, counter.epoch), None)
    if _ok(results):
        state.counters[resource] = (ended, view.counter_version + 1)
        _note_records(state, results)
    else:
        state.forget(resource)
    return True


def _live(
    state: SharedState, resource: str, epoch: int, owner: str, fresh: bool
) -> Plan[Held | None]:
    """The live lease of this epoch and owner (:func:`_held`), None when it is not theirs or
    has expired by the leader's clock (its expiry is recorded then)."""
    held = yield from _held(state, resource, epoch, owner, fresh)
    if held is None or held.expires_ms - state.server_now_ms() > SLACK_MS:
        return held
    now = yield Tick()
    if now < held.expires_ms:
        return held
    yield from _resettle(state, resource)
    return None


def _resettle(state: SharedState, resource: str) -> Plan[None]:
    """Read the resource again and record its lease's expiry if that is due."""
    view = yield from _read(state, resource, queue=False)
    yield from _settle(state, resource, view)


def renew(state: SharedState, resource: str, epoch: int, owner: str, ttl: float) -> Plan[float]:
    """``CoordinatorBackend.renew``: see the module docstring."""
    lost = LeaseLost(LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's")
    for fresh in (False, True):
        held = yield from _live(state, resource, epoch, owner, fresh)
        if held is None:
            raise lost
        doc = LeaseDoc(epoch, owner, held.doc.holder, ttl, held.doc.value)
        ops: tuple[Op, ...] = (
            ("check", state.paths.counter(resource), held.counter_version),
            ("set", state.paths.lease(resource), doc.encode(), held.lease_version),
        )
        results = yield Multi(ops)
        if not _ok(results):
            state.held.pop((resource, epoch), None)
            continue
        stat = results[1]
        state.observe(stat.mtime)
        if stat.mtime >= held.expires_ms:  # committed after the expiry: never revived
            yield from _resettle(state, resource)
            raise lost
        state.held[(resource, epoch)] = Held(
            owner, doc, stat.version, held.counter_version, stat.mtime
        )
        return ttl
    raise lost


def proclaim(state: SharedState, resource: str, epoch: int, owner: str, value: str) -> Plan[None]:
    """``CoordinatorBackend.proclaim``: the value changes, the expiry does not."""
    lost = LeaseLost(LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's")
    for fresh in (False, True):
        held = yield from _live(state, resource, epoch, owner, fresh)
        if held is None:
            raise lost
        base = held.doc.base if held.doc.base is not None else held.mtime
        doc = LeaseDoc(epoch, owner, held.doc.holder, held.doc.ttl, value, base)
        ops: tuple[Op, ...] = (
            ("check", state.paths.counter(resource), held.counter_version),
            ("set", state.paths.lease(resource), doc.encode(), held.lease_version),
            _record(state, RecordKind.PROCLAIMED, resource, epoch, doc.holder, {"value": value}),
        )
        results = yield Multi(ops)
        if not _ok(results):
            state.held.pop((resource, epoch), None)
            continue
        stat = results[1]
        state.held[(resource, epoch)] = Held(
            owner, doc, stat.version, held.counter_version, stat.mtime
        )
        _note_records(state, results)
        return
    raise lost


def release(state: SharedState, resource: str, epoch: int, owner: str) -> Plan[bool]:
    """``CoordinatorBackend.release``: delete the lease at its version, mark the counter."""
    for fresh in (False, True):
        held = yield from _live(state, resource, epoch, owner, fresh)
        if held is None:
            return False
        ended = Counter(epoch, held.doc.holder, "released")
        ops: tuple[Op, ...] = (
            ("delete", state.paths.lease(resource), held.lease_version),
            ("set", state.paths.counter(resource), ended.encode(), held.counter_version),
            _record(state, RecordKind.RELEASED, resource, epoch, held.doc.holder),
        )
        results = yield Multi(ops)
        state.held.pop((resource, epoch), None)
        if _ok(results):
            state.counters[resource] = (ended, held.counter_version + 1)
            state.observe(results[1].mtime)
            _note_records(state, results)
            return True
    return False


def current(state: SharedState, resource: str) -> Plan[LeaseInfo | None]:
    yield Sync(state.paths.root)
    view = yield from _read(state, resource, queue=False)
    if view.counter is None or view.counter.state != "live" or view.lease is None:
        yield from _settle(state, resource, view)
        return None
    doc, stat = view.lease
    expired, remaining = yield from _expired(state, doc, stat)
    if expired or doc.epoch != view.counter.epoch:
        yield from _settle(state, resource, view)
        return None
    return LeaseInfo(
        resource, doc.epoch, doc.holder, remaining, doc.ttl, state.coordinator_id, doc.value
    )


def last_epoch(state: SharedState, resource: str) -> Plan[int]:
    state.meta = None
    path = state.paths.counter(resource)
    _, meta, answer = yield Batch((Sync(state.paths.root), Get(state.paths.meta), Get(path)))
    if isinstance(meta, NoNodeError):
        raise ConfigurationError(f"the fenced state under {state.paths.root} was deleted")
    minimum = decode_meta(meta[0], state.paths.meta)[1]
    state.meta = (minimum, meta[1].version)
    if isinstance(answer, NoNodeError):
        return minimum
    return max(Counter.decode(answer[0], path).epoch, minimum)


def resources(state: SharedState) -> Plan[list[str]]:
    yield Sync(state.paths.root)
    return (yield from _resource_names(state))


def _resource_names(state: SharedState) -> Plan[list[str]]:
    answer = yield Children(state.paths.resources)
    if isinstance(answer, NoNodeError):
        return []
    return sorted(Paths.resource_of(child) for child in answer[0])


def _settle_all(state: SharedState, names: Iterable[str]) -> Plan[None]:
    """Record every expiry that is due among ``names``."""
    for resource in names:
        view = yield from _read(state, resource, queue=False)
        if view.counter is not None and view.counter.state == "live":
            yield from _settle(state, resource, view)


def records(state: SharedState, resource: str | None, after: int, limit: int) -> Plan[list[Record]]:
    """Records with ``seq > after``, oldest first, due expiries recorded first."""
    yield Sync(state.paths.root)
    names = [resource] if resource is not None else (yield from _resource_names(state))
    yield from _settle_all(state, names)
    answer = yield Children(state.paths.log)
    if isinstance(answer, NoNodeError):
        return []
    chosen: list[tuple[int, str, str]] = []
    for child in answer[0]:
        parsed = Paths.record_name(child)
        if parsed is None:
            continue
        name, seq = parsed
        if seq > after and (resource is None or name == resource):
            chosen.append((seq, name, child))
    chosen.sort()
    chosen = chosen[: max(limit, 0)]
    if not chosen:
        return []
    paths = [f"{state.paths.log}/{child}" for _, _, child in chosen]
    answers = yield Batch(tuple(Get(p) for p in paths))
    found: list[Record] = []
    for (seq, name, _), path, got in zip(chosen, paths, answers, strict=True):
        if not isinstance(got, NoNodeError):  # pruned meanwhile
            found.append(decode_record(name, seq, got[0], path))
    return found


def newest_seq(state: SharedState, resource: str) -> Plan[tuple[int, float | None]]:
    """The resource's newest record seq (0: none) and, when its lease is live, the estimated
    seconds until its expiry is due (what a watch waits for besides new records)."""
    view = yield from _read(state, resource, queue=False)
    due: float | None = None
    if view.counter is not None and view.counter.state == "live":
        if view.lease is None or (yield from _settle(state, resource, view)):
            due = 0.0 if view.lease is None else None
        else:
            doc, stat = view.lease
            due = max(0.0, (doc.expires_ms(stat.mtime) - state.server_now_ms()) / 1000.0)
    answer = yield Children(state.paths.log)
    seqs = [
        parsed[1]
        for child in ([] if isinstance(answer, NoNodeError) else answer[0])
        if (parsed := Paths.record_name(child)) is not None and parsed[0] == resource
    ]
    return max(seqs, default=0), due


def report(
    state: SharedState,
    resource: str,
    epoch: int,
    holder: str,
    kind: RecordKind,
    detail: dict[str, object],
) -> Plan[None]:
    results = yield Multi((_record(state, kind, resource, epoch, holder, detail),))
    _note_records(state, results)


def _note_records(state: SharedState, results: list[Any]) -> None:
    """After a committed transaction: every :data:`_PRUNE_EVERY` records, a prune is due (the
    faces run :func:`prune` in the background: it never delays, nor fails, the step)."""
    created = [
        parsed[1]
        for r in results
        if isinstance(r, str) and (parsed := Paths.record_name(r.rpartition("/")[2]))
    ]
    if any(seq % _PRUNE_EVERY < len(created) for seq in created):
        state.prune_due = True


def prune(state: SharedState) -> Plan[None]:
    """Delete the oldest records beyond :data:`RECORDS_KEPT`, and request ids older than
    :data:`REQUESTS_KEPT_S` (up to :data:`_CHUNK` × 10 per pass)."""
    state.prune_due = False
    answer = yield Children(state.paths.log)
    if isinstance(answer, NoNodeError):
        return
    numbered = sorted(
        (parsed[1], child)
        for child in answer[0]
        if (parsed := Paths.record_name(child)) is not None
    )
    doomed = [
        f"{state.paths.log}/{child}"
        for _, child in numbered[: max(0, len(numbered) - RECORDS_KEPT)]
    ]
    answer = yield Children(state.paths.requests)
    if not isinstance(answer, NoNodeError) and answer[0]:
        paths = [f"{state.paths.requests}/{child}" for child in answer[0][: _CHUNK * 10]]
        found = yield Batch(tuple(Get(path) for path in paths))
        oldest = state.server_now_ms() - REQUESTS_KEPT_S * 1000.0
        doomed += [
            path
            for path, got in zip(paths, found, strict=True)
            if not isinstance(got, NoNodeError) and got[1].ctime < oldest
        ]
    for start in range(0, len(doomed), _CHUNK):
        yield Multi(tuple(("delete", path, -1) for path in doomed[start : start + _CHUNK]))


def advance(
    state: SharedState, minimum: int, floors: dict[str, int], detail: dict[str, object]
) -> Plan[int]:
    """Restore safety: floors first (each counter raised at its version), then the minimum and
    the end of every lease with its ``restored`` record, :data:`_CHUNK` resources per
    transaction (the meta znode in the first: from then on no grant gets an epoch ≤ minimum).
    """
    names = sorted(set((yield from _resource_names(state))) | set(floors))
    yield from _settle_all(state, names)
    for _ in range(_ATTEMPTS):
        views: dict[str, _View] = {}
        for name in names:
            views[name] = yield from _read(state, name, queue=False)
        answer = yield Get(state.paths.meta)
        if isinstance(answer, NoNodeError):
            raise ConfigurationError(f"the fenced state under {state.paths.root} was deleted")
        coordinator_id, old_minimum = decode_meta(answer[0], state.paths.meta)
        new_minimum = max(old_minimum, minimum)
        ops: list[Op] = [
            (
                "set",
                state.paths.meta,
                encode_meta(coordinator_id, new_minimum),
                answer[1].version,
            )
        ]
        for name in names:
            view = views[name]
            last = max(0 if view.counter is None else view.counter.epoch, floors.get(name, 0))
            restored = Counter(last, None, "restored")
            if view.counter is None:
                ops.append(("create", state.paths.counter(name), restored.encode(), False, False))
            else:
                ops.append(
                    ("set", state.paths.counter(name), restored.encode(), view.counter_version)
                )
            if view.lease is not None:
                ops.append(("delete", state.paths.lease(name), view.lease[1].version))
            ops.append(
                _record(
                    state,
                    RecordKind.RESTORED,
                    name,
                    max(last, new_minimum),
                    None,
                    {**detail, "minimum": new_minimum},
                )
            )
        applied = True
        for start in range(0, len(ops), _CHUNK * 3):
            results = yield Multi(tuple(ops[start : start + _CHUNK * 3]))
            if not _ok(results):
                applied = False
                break
        state.meta = None
        state.held.clear()
        for name in names:
            state.forget(name)
        if applied:
            return new_minimum
    raise Unavailable("ZooKeeper: the state changed on every attempt to restore")


def open_state(state: SharedState, create: bool, display: str) -> Plan[None]:
    """Read fenced's meta znode under the chroot (with ``create``, make the chroot and the
    state first if missing); sets ``state.coordinator_id``."""
    paths = state.paths
    answer = yield Get(paths.meta)
    if isinstance(answer, NoNodeError):
        if not create:
            raise ConfigurationError(
                f"no fenced coordinator state under {paths.root} on {display} "
                "(opened with create=False)"
            )
        segments = paths.root.strip("/").split("/")
        for depth in range(1, len(segments) + 1):
            path = "/" + "/".join(segments[:depth])
            yield Multi((("create", path, b"", False, False),))  # exists already: fine
        ops: list[Op] = [("create", path, b"", False, False) for path in paths.dirs()]
        ops.append(("create", paths.clock, b"", False, False))
        ops.append(("create", paths.meta, encode_meta(secrets.token_hex(16), 0), False, False))
        yield Multi(tuple(ops))  # fails as a whole when another client made it first
        answer = yield Get(paths.meta)
        if isinstance(answer, NoNodeError):
            raise Unavailable(f"ZooKeeper: {paths.meta} vanished while it was created")
    state.coordinator_id, minimum = decode_meta(answer[0], paths.meta)
    state.meta = (minimum, answer[1].version)

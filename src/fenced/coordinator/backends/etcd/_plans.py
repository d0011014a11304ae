"""The etcd backend's decisions that both faces share: which transaction to send, and what its
reply means. No I/O.

The sync :class:`~._backend.EtcdBackend` and the asyncio :class:`~._aio.AsyncEtcdBackend` build
every grant, proclaim, queueing, leave and check of a waiter's place here, and read the replies
here; they differ only in how they send them (a thread that blocks, a task that awaits). The
builders of records, expiries, reports and releases are in :mod:`._records` and
:mod:`._handoff`, the bookkeeping of pooled etcd leases in :mod:`._leasepool`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

from fenced.coordinator.backend import Blocked, GrantRequest
from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._base import RECHECK
from fenced.coordinator.backends.etcd._client import KV
from fenced.coordinator.backends.etcd._keys import (
    Keys,
    LeaseValue,
    QueueValue,
    ResourceState,
    dumps,
    prefix_end,
)
from fenced.coordinator.backends.etcd._ops import (
    _cmp,
    _delete,
    _first,
    _get,
    _int_value,
    _kvs,
    _Op,
    _owner,
    _put,
    _waiter_ahead,
)
from fenced.coordinator.backends.etcd._records import _Item, resource_records
from fenced.coordinator.backends.etcd._waitqueue import Place
from fenced.core._errors import ConfigurationError, LeaseLost, LossReason, Unavailable
from fenced.core._records import RecordKind
from fenced.core._token import MAX_EPOCH, validate_coordinator_id

__all__ = [
    "GrantPlan",
    "Refusal",
    "Standing",
    "blocked_by",
    "earlier_grant",
    "epoch_reads",
    "grant_plan",
    "leave_txn",
    "meta_found",
    "meta_reads",
    "meta_txn",
    "owned_lease",
    "proclaim_txn",
    "queued",
    "refusal",
    "standing",
    "ticket_reads",
    "ticket_shortcut",
    "ticket_txn",
]


# -- the coordinator id --------------------------------------------------------------------------


def meta_reads(keys: Keys) -> list[_Op]:
    """The reads of the coordinator id and of the minimum epoch."""
    return [_get(keys.coordinator_id), _get(keys.minimum)]


def meta_txn(keys: Keys, candidate: str) -> rpc.TxnRequest:
    """Write ``candidate`` as the coordinator id unless there is one; read both meta keys."""
    reads = meta_reads(keys)
    return rpc.TxnRequest(
        compare=[_cmp(keys.coordinator_id, "CREATE", 0)],
        success=[_put(keys.coordinator_id, candidate.encode()), *reads],
        failure=reads,
    )


def meta_found(
    url: str, keys: Keys, ok: bool, responses: list[rpc.ResponseOp]
) -> tuple[str, tuple[int, int]]:
    """The coordinator id and ``(mod revision, value)`` of the minimum epoch that
    :func:`meta_txn` (``ok``: its outcome) or :func:`meta_reads` (``ok`` False) found.

    Raises :class:`~fenced.Unavailable` if no id is stored, :class:`~fenced.ConfigurationError`
    if the key holds something else than a coordinator id."""
    offset = 1 if ok else 0
    id_kv = _first(responses[offset])
    if id_kv is None:
        raise Unavailable("etcd: the coordinator id could not be stored")
    minimum = _int_value(_first(responses[offset + 1]))
    try:
        return validate_coordinator_id(id_kv.value.decode(errors="replace")), minimum
    except ConfigurationError as error:
        raise ConfigurationError(
            f"{url}: the key {keys.coordinator_id.decode()} does not hold a fenced "
            f"coordinator id ({error}); is the prefix used by something else?"
        ) from error


# -- grants --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GrantPlan:
    """One grant attempt: its transaction, the epoch and state it writes."""

    request: rpc.TxnRequest
    epoch: int
    state: ResourceState
    compared: tuple[int, int]  # the revisions of the state and of the minimum it compares


def grant_plan(
    keys: Keys,
    request: GrantRequest,
    cached: tuple[int, ResourceState, int, int],
    lease_id: int,
    ticket: Place | None,
    retention: int | None,
) -> GrantPlan:
    """The transaction that grants ``request`` with epoch = max(last, minimum) + 1 on the etcd
    lease ``lease_id``, from the cached state (``cached``: see ``_EtcdState._cached``).

    It compares: no lease key, the state and the minimum as cached, and either an empty line
    (no ``ticket``) or the ticket's key in place with no key ahead of it; it writes the lease
    key, the state, the records (an unrecorded expiry of the last lease first), deletes the
    ticket's key, and with a request_id its ``P/req/ID`` key on the retention lease
    ``retention``. Its failure branch reads what :func:`refusal` needs.
    """
    name = request.resource
    lease_key, res_key, queue = keys.lease(name), keys.res(name), keys.queue(name)
    res_rev, state, min_rev, minimum = cached
    epoch = max(state.epoch, minimum) + 1
    if epoch > MAX_EPOCH:
        raise ConfigurationError(f"{name}: epochs exhausted")
    items: list[_Item] = []
    after = state.state
    if state.state == "held":
        items.append((RecordKind.EXPIRED, name, state.epoch, state.holder, {}))
        after = "expired"
    detail: dict[str, object] = {"after": after}
    if request.value is not None:
        detail["value"] = request.value
    items.append((RecordKind.GRANTED, name, epoch, request.holder, detail))
    record_ops, number = resource_records(keys, name, state.last_record, items)
    value = LeaseValue(
        epoch, request.owner, request.holder, request.ttl, request.value, number
    ).encode()
    new_state = ResourceState(epoch, "held", request.holder, number)
    compare = [
        _cmp(lease_key, "CREATE", 0),
        _cmp(res_key, "MOD", res_rev),
        _cmp(keys.minimum, "MOD", min_rev),
    ]
    success = [_put(lease_key, value, lease_id), _put(res_key, new_state.encode()), *record_ops]
    failure = [_get(lease_key), _get(res_key), _get(keys.meta_prefix, prefix_end(keys.meta_prefix))]
    if ticket is not None:
        compare += [
            _cmp(ticket.key, "CREATE", ticket.rev),
            _cmp(queue, "CREATE", ticket.rev - 1, "GREATER", prefix_end(queue)),
        ]
        success.append(_delete(ticket.key))
        failure += [_get(ticket.key), _waiter_ahead(queue, ticket.rev)]
    else:
        compare.append(_cmp(queue, "CREATE", 0, "EQUAL", prefix_end(queue)))
    if request.request_id is not None:
        assert retention is not None
        compare.append(_cmp(keys.request(request.request_id), "CREATE", 0))
        success.append(
            _put(
                keys.request(request.request_id),
                dumps({"resource": name, "epoch": epoch, "owner": request.owner}),
                retention,
            )
        )
        failure.append(_get(keys.request(request.request_id)))
    txn = rpc.TxnRequest(compare=compare, success=success, failure=failure)
    return GrantPlan(txn, epoch, new_state, (res_rev, min_rev))


@dataclass(frozen=True, slots=True)
class Refusal:
    """What the failure branch of a :func:`grant_plan` transaction read (:func:`refusal`)."""

    lease: KV | None  # the lease key
    res: KV | None  # the resource's state key
    meta: rpc.ResponseOp  # the read of P/meta/
    handed: bool  # the lease key holds the ticket's owner secret: a release handed it over
    earlier: KV | None  # the request_id's earlier grant
    queued: bool  # the ticket's key is still there (always False without a ticket)
    pred: bytes | None  # the key the ticket waits behind (a waiter's, or the lease key)


def refusal(
    request: GrantRequest, ticket: Place | None, responses: list[rpc.ResponseOp]
) -> Refusal:
    """Read the failure branch of a grant attempt. What follows, in this order (both faces):
    a lease ``handed`` to the ticket is taken; an ``earlier`` grant of the request_id is
    returned (:func:`earlier_grant`); a ticket whose key is gone queues again, one with a
    ``pred`` waits behind it (none: try again); without a ticket, a live ``lease`` blocks
    (:func:`blocked_by`), and so do waiters ahead if every other compare held."""
    lease_kv, res_kv = _first(responses[0]), _first(responses[1])
    handed = ticket is not None and lease_kv is not None and _owner(lease_kv) == request.owner
    earlier = _first(responses[-1]) if request.request_id is not None else None
    queued = False
    pred = None
    if ticket is not None:
        queued = _first(responses[3]) is not None
        pred_kv = _first(responses[4])
        pred = pred_kv.key if pred_kv is not None else (lease_kv.key if lease_kv else None)
    return Refusal(lease_kv, res_kv, responses[2], handed, earlier, queued, pred)


def earlier_grant(earlier: KV, name: str, lease_kv: KV | None) -> tuple[LeaseValue, KV]:
    """The live lease (value, key) that a request_id's ``P/req/ID`` key ``earlier`` names.

    Raises :class:`~fenced.ConfigurationError` if that grant was of another resource than
    ``name``, :class:`~fenced.LeaseLost` if it has ended (never a second epoch)."""
    found = json.loads(earlier.value)
    resource, epoch, owner = str(found["resource"]), int(found["epoch"]), str(found["owner"])
    if resource != name:  # its grant is of another resource: never a token for this one
        raise ConfigurationError(
            f"this request_id was already used to acquire {resource}, not {name}"
        )
    lease = LeaseValue.decode(lease_kv.value) if lease_kv is not None else None
    if lease_kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
        raise LeaseLost(LossReason.REJECTED, "the lease granted for this request_id has ended")
    return lease, lease_kv


def blocked_by(lease_kv: KV | None, last: int, retry_in: float | None, remaining: float) -> Blocked:
    """Blocked by the live lease ``lease_kv`` with ``remaining`` seconds left (or, without
    one, by waiters ahead: ``last`` is the last epoch)."""
    if lease_kv is None:
        return Blocked(None, last, 0.0, retry_in)
    lease = LeaseValue.decode(lease_kv.value)
    return Blocked(
        lease.holder, lease.epoch, remaining, remaining if retry_in is None else retry_in
    )


# -- a live lease --------------------------------------------------------------------------------


def owned_lease(kv: KV | None, epoch: int, owner: str) -> LeaseValue | None:
    """The lease key ``kv``'s value if it is the grant of ``epoch`` to ``owner``, else None."""
    lease = LeaseValue.decode(kv.value) if kv is not None else None
    if lease is None or (lease.epoch, lease.owner) != (epoch, owner):
        return None
    return lease


def epoch_reads(keys: Keys, resource: str) -> list[_Op]:
    """The reads of ``resource``'s last epoch: its state and the minimum epoch."""
    return [_get(keys.res(resource)), _get(keys.minimum)]


def proclaim_txn(
    keys: Keys,
    resource: str,
    kv: KV,
    lease: LeaseValue,
    value: str,
    cached: tuple[int, ResourceState, int, int],
) -> tuple[rpc.TxnRequest, ResourceState]:
    """The transaction that advertises ``value`` for the live lease ``kv`` (same epoch, same
    etcd lease) and records it; the state it writes."""
    lease_key, res_key = keys.lease(resource), keys.res(resource)
    res_rev, state, _, _ = cached
    record_ops, number = resource_records(
        keys,
        resource,
        state.last_record,
        [(RecordKind.PROCLAIMED, resource, lease.epoch, lease.holder, {"value": value})],
    )
    new_value = LeaseValue(
        lease.epoch, lease.owner, lease.holder, lease.ttl, value, number
    ).encode()
    new_state = replace(state, last_record=number)
    request = rpc.TxnRequest(
        compare=[_cmp(lease_key, "MOD", kv.mod_revision), _cmp(res_key, "MOD", res_rev)],
        success=[
            _put(lease_key, new_value, kv.lease),
            _put(res_key, new_state.encode()),
            *record_ops,
        ],
        failure=[_get(res_key)],
    )
    return request, new_state


# -- waiting in line -----------------------------------------------------------------------------


def ticket_txn(keys: Keys, ticket: Place, queue_lease: int) -> rpc.TxnRequest:
    """The transaction that puts the waiter's key on the queue lease, naming the etcd lease of
    its grant, and reads the two last waiters and the lease key (:func:`queued`)."""
    name = ticket.resource
    queue = keys.queue(name)
    request = ticket.request
    value = QueueValue(
        request.holder,
        request.owner,
        request.ttl,
        ticket.lease_id,
        request.value,
        request.request_id,
    ).encode()
    return rpc.TxnRequest(
        compare=[_cmp(ticket.key, "CREATE", 0)],
        success=[
            _put(ticket.key, value, queue_lease),
            _get(
                queue,
                prefix_end(queue),
                sort_order="DESCEND",
                sort_target="CREATE",
                limit=2,
                keys_only=True,
            ),
            _get(keys.lease(name)),
        ],
        failure=[_get(ticket.key)],
    )


def queued(responses: list[rpc.ResponseOp], last: int) -> tuple[bytes | None, Blocked]:
    """What a :func:`ticket_txn` that succeeded read: the key to wait behind (the waiter just
    ahead, the lease key for the head, or None: nobody) and what blocks the waiter."""
    in_line = _kvs(responses[1])
    lease_kv = _first(responses[2])
    pred = in_line[1].key if len(in_line) > 1 else (lease_kv.key if lease_kv else None)
    if lease_kv is not None:
        lease = LeaseValue.decode(lease_kv.value)
        return pred, Blocked(lease.holder, lease.epoch, lease.ttl, RECHECK)
    return pred, Blocked(None, last, 0.0, RECHECK)


def leave_txn(keys: Keys, ticket: Place) -> rpc.TxnRequest:
    """Delete the waiter's key if it is still there, else read the lease key (a release may
    have handed it the lease: ``_owner(lease) == owner``)."""
    mine = (
        _cmp(ticket.key, "CREATE", ticket.rev)
        if ticket.rev
        else _cmp(ticket.key, "CREATE", 0, "GREATER")
    )
    return rpc.TxnRequest(
        compare=[mine],
        success=[_delete(ticket.key)],
        failure=[_get(keys.lease(ticket.resource))],
    )


def ticket_shortcut(keys: Keys, ticket: Place, woken: bool, watching: bool) -> str:
    """Where a waiter stands without a read: ``"take"`` (try to take the lease: nothing known
    to wait behind, or the head woken by the lease key's DELETE), ``"blocked"`` (not woken,
    its watch alive, and checked within :data:`RECHECK`: as before), or ``"read"``
    (:func:`ticket_reads`)."""
    if ticket.pred is None or ticket.blocked is None:
        return "take"
    if woken and ticket.deleted and ticket.pred == keys.lease(ticket.resource):
        return "take"
    if not woken and watching and time.monotonic() - ticket.checked_at < RECHECK:
        return "blocked"
    return "read"


def ticket_reads(keys: Keys, ticket: Place) -> list[_Op]:
    """The read of where a waiter stands (:func:`standing`)."""
    name = ticket.resource
    return [
        _get(keys.lease(name)),
        _waiter_ahead(keys.queue(name), ticket.rev),
        _get(ticket.key, keys_only=True),
        _get(keys.res(name)),
        _get(keys.meta_prefix, prefix_end(keys.meta_prefix)),
    ]


@dataclass(frozen=True, slots=True)
class Standing:
    """Where :func:`ticket_reads` found a waiter (:func:`standing`)."""

    lease: KV | None
    res: KV | None
    meta: rpc.ResponseOp
    handed: bool  # the lease key holds its owner secret: take it
    queued: bool  # its key is still there (else the grant attempt queues it again)
    pred: bytes | None  # the key it waits behind (None: try to take the lease)


def standing(ticket: Place, responses: list[rpc.ResponseOp]) -> Standing:
    """Read :func:`ticket_reads`'s reply. A waiter whose ``pred`` changed, or that was woken,
    or whose watch is gone, follows the new ``pred`` from the read's revision."""
    lease_kv, pred_kv, mine, res_kv = (_first(r) for r in responses[:4])
    handed = lease_kv is not None and _owner(lease_kv) == ticket.request.owner
    pred = pred_kv.key if pred_kv is not None else (lease_kv.key if lease_kv else None)
    return Standing(lease_kv, res_kv, responses[4], handed, mine is not None, pred)

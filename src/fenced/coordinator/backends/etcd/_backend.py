"""The etcd coordinator backend: ``etcd://host:port[,host:port…][?prefix=/fenced&timeout=5]``.

fenced on a Raft-replicated etcd 3.4+ cluster: requests through etcd's gRPC API
(:mod:`.grpc_transport`; ``?api=gateway``: its JSON gateway, :mod:`.client`), watches through
the gateway (see ``docs/etcd.md`` for the client choice, and :mod:`.keys` for the key
layout).

Guarantees
----------
- **Epochs never repeat, across restores too.** A resource's last epoch is kept in our own key
  ``P/res/NAME`` and raised in the same etcd transaction that writes the lease, guarded by a
  compare on that key's mod revision (optimistic concurrency: a stale view makes the transaction
  fail and retry, never grant twice). A grant is committed by a Raft majority (fsynced) before
  :meth:`EtcdBackend.try_grant` returns. Etcd revisions are never used as epochs: they move back
  after ``etcdctl snapshot restore``. :meth:`EtcdBackend.advance` raises a coordinator-wide
  minimum epoch (``P/meta/minimum``) that every grant compares too.
- **Expiry by etcd leases**, i.e. by the etcd leader's clock: etcd deletes ``P/lease/NAME`` when
  the etcd lease it is attached to expires — between TTL and TTL + 0.5 s after the last
  keep-alive, TTL being the ttl rounded *up* to whole seconds (at least etcd's minimum, 1-2 s).
  A new etcd leader restarts every lease's countdown (etcd's documented behaviour): a failover
  can only lengthen a lease at the coordinator, never shorten it. Holders stay safe either way:
  their local deadline counts from the send time of their last successful request and is never
  later than the coordinator's expiry.
- **One etcd lease carries at most one grant at a time** (see "Etcd leases" below), so renewing
  one resource never extends another, releasing never revokes anything shared, and no grant
  outlives its own etcd lease.
- **First come, first served, herd-free.** A waiter puts ``P/queue/NAME:ID`` (its create revision
  is its place) and watches *only its predecessor* — the waiter just ahead, or the lease key for
  the head — as etcd's and ZooKeeper's lock recipes do. The watch starts at the current revision
  (etcd's "synced" group, no 100 ms catch-up loop) and one read at the revision etcd confirmed it
  at covers the gap since the predecessor was seen. A grant compares "no queued key older than
  mine", so nobody jumps the queue; a caller without a ticket needs an empty queue. A waiter that
  gives up deletes its key; a dead waiter's key dies with its process's queue lease
  (:data:`QUEUE_TTL`).
- **A release hands the lease to the head of the line** in its own transaction, so a handoff
  costs one quorum write: epoch + 1 in the head's name (its owner secret, holder, ttl and value,
  which its queue key carries), attached to the etcd lease the waiter created when it queued and
  that its process keeps alive while it waits; the head's queue key is deleted and both records
  (released, granted) are written in that transaction. The head learns of its grant from the
  PUT of the lease key that its watch delivers — with its own owner secret — and returns from
  ``try_grant`` without a request. The releaser knows the head from a :class:`QueueView` (a
  watch on the line, kept by processes that queue for a resource or take it repeatedly) and
  compares only that the head's key is unchanged; with no head known it deletes the lease key
  and the head takes the lease itself (the DELETE wakes it). The new epoch is durable (Raft)
  before the head can see it. A head that left its grant untaken (``leave``) releases it, which
  hands it on; a head that died or was stopped keeps it until its etcd lease expires, at most
  TTL (+0.5 s) after its process last kept it alive, like a holder that dies.
- **Records in the same transaction** as the change they describe (grant, release, proclaim,
  restore, a detected expiry), under ``P/log/NAME:N`` numbered by the resource's own counter in
  ``P/res/NAME`` (see :mod:`.keys`): no key is shared by the changes of different
  resources, so they never conflict. A record's ``seq`` is derived from the etcd revision that
  wrote it (commit order across all resources). An expiry is noticed by the next grant,
  :meth:`records` or :meth:`watch` of the resource and dated when it was noticed (etcd does not
  say when a lease expired). A record's ``at`` is the writing client's wall clock
  (``time.time()``: etcd has no server time to stamp with, and this backend takes no injected
  clock), so records written by different hosts are ordered by ``seq``, not by ``at``. Each
  resource's oldest records are pruned beyond :data:`RECORDS_KEPT`.
- **request_id**: ``P/req/ID`` is written in the grant's transaction and compared absent by
  every grant with that id, so a retry after a lost reply finds the earlier grant (also from
  another client), for :data:`REQUEST_RETENTION` seconds.

Etcd leases (why one etcd lease per live grant, reused)
-------------------------------------------------------
etcd's own ``concurrency.Session`` attaches every key of a process to one session lease. For fenced
that breaks the lease rules (docs/concepts.md): a lease on resource A renewed by a healthy holder
would keep alive resource B of the same process whose holder stopped renewing (B outlives its ttl),
and releasing by revoking would end every other lease. fenced therefore keeps a per-process *pool*
of etcd leases per TTL, and each pooled lease carries **at most one** ``P/lease/NAME`` key at a
time:

- acquire attaches the key to an idle pooled lease (no LeaseGrant on the hot path: the
  uncontended acquire is one round trip, the release another);
- renew keeps alive exactly that lease, after checking that the key is still this owner's and
  this epoch;
- release deletes the key (compare owner and epoch) and returns the etcd lease to the pool;
  nothing is revoked;
- renew, release and proclaim of one resource never overlap in one backend: each holds the
  resource's lock (:meth:`EtcdBackend._grant_lock`) from finding the pooled lease that carries
  the grant until it is done with it, and release returns that lease to the pool before letting
  go. So a late renew cannot act on a pooled lease that a release returned meanwhile and a grant
  reused: it finds that its grant has no carrier any more, and its key is gone;
- idle pooled leases are kept alive in the background (they carry no key, so this extends
  nothing); a grant's coordinator expiry is the pooled lease's expiry, which is never more than
  its TTL after the grant, and the holder's ``expires_in`` is computed from the send time of that
  lease's last keep-alive;
- a grant whose reply was lost leaves its etcd lease out of the pool and unrenewed (it expires
  within its TTL) unless a retry with the same request_id finds the grant and adopts it;
- a waiter takes a pooled lease when it queues and names it in its queue key (reserved: the
  keeper keeps it alive while the waiter waits, nothing else may use it); a release that hands
  over attaches the lease key to it, and the waiter's ``expires_in`` counts from the send time
  of its last keep-alive. A waiter that leaves without a grant gives it back to the pool; one
  whose leave could not be completed stops keeping it alive (a grant that reached it expires).

Race timelines (more in ``docs/etcd.md``)::

    holder A                          waiter B (head: watches P/lease/R)    waiter C (behind B)
    txn: lease MOD = mine, res MOD,
         B's key MOD
      → put P/lease/R = (epoch+1, B's
        owner…) on B's etcd lease,
        delete B's key, res = held by B,
        records released + granted
    committed (Raft majority) ──────▶ PUT P/lease/R, owner = B's secret
                                      → try_grant returns Granted, no I/O
                                                                          DELETE of B's key:
                                                                          reads, watches P/lease/R

    B's wait ran out just as A's release committed:
                                      leave(take): txn "my key exists" fails;
                                      P/lease/R holds B's secret → acquire
                                      returns it (a leave for another reason
                                      releases it, which hands it to C)

    B's process was SIGKILLed/SIGSTOPped before A's release: its key (queue lease, 2 s) and
    its etcd lease (TTL) are still there → A hands over to B; nobody keeps B's etcd lease alive
    → etcd deletes P/lease/R within TTL + 0.5 s → C (now head, watching it) takes the lease;
    the grant records B's epoch as expired. B, continued, sees its grant ended and queues again.

Failure behaviour: no endpoint reachable, no leader, or too many requests (nothing was applied)
→ :class:`~fenced.Unavailable`; a mutating request sent whose reply was lost or timed out →
:class:`~fenced.OutcomeUnknown` (a grant: retry with the same ``request_id``); a malformed URL,
a foreign value under the prefix, permission errors → :class:`~fenced.ConfigurationError`.
Watches survive a broken connection (resumed from the next revision on any endpoint); a
compacted start revision makes the waiter re-read the state. Nothing here logs or raises with
an owner secret.

URL query parameters (optional): ``prefix`` (default ``/fenced``), ``timeout`` (seconds for one
request including failover between endpoints, default 5), ``connect_timeout`` (seconds per
connection attempt, default 1).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
import time
import weakref
from dataclasses import replace

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
)
from fenced.coordinator.backends.etcd._client import KV, EtcdRejected, Transport
from fenced.coordinator.backends.etcd._handoff import _VIEW_IDLE
from fenced.coordinator.backends.etcd._keys import (
    Keys,
    LeaseValue,
    ResourceState,
    dumps,
    prefix_end,
)
from fenced.coordinator.backends.etcd._leasepool import _IDLE_DROP, _IDLE_REFRESH, _PooledLease
from fenced.coordinator.backends.etcd._ops import (
    _cmp,
    _delete,
    _first,
    _get,
    _int_value,
    _owner,
    _put,
    _waiter_ahead,
)
from fenced.coordinator.backends.etcd._records import RECORDS_KEPT, _Item
from fenced.coordinator.backends.etcd._settings import parse_etcd_url
from fenced.coordinator.backends.etcd._waiters import _Waiters
from fenced.coordinator.backends.etcd._waitqueue import EtcdTicket, QueueView
from fenced.core._clock import Clock, SystemClock
from fenced.core._errors import (
    ConfigurationError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo
from fenced.core._records import RecordKind
from fenced.core._token import MAX_EPOCH, validate_coordinator_id

__all__ = [
    "QUEUE_TTL",
    "RECHECK",
    "RECORDS_KEPT",
    "REQUEST_RETENTION",
    "EtcdBackend",
    "EtcdTicket",
    "parse_etcd_url",
]

log = logging.getLogger("fenced.coordinator.etcd")


class EtcdBackend(_Waiters):
    """Coordinator backend on an etcd 3.4+ cluster; see the module docstring. Thread-safe.

    Its parts, by responsibility: :mod:`.base` (requests, cached state), :mod:`.leasepool`
    (pooled etcd leases), :mod:`.records` (records, resources, restore), :mod:`.handoff`
    (release and handoff), :mod:`.waiters` (waiting in line); here: construction, the keeper
    thread, grants, renew, proclaim, reads of one lease, close."""

    capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})

    def __init__(self, url: str) -> None:
        settings = parse_etcd_url(url)
        self.url = settings.display()
        self._keys = Keys(settings.prefix)
        transport: type[Transport] = Transport
        if settings.api == "grpc":
            try:
                from fenced.coordinator.backends.etcd._grpc_transport import GrpcTransport  # noqa: PLC0415
            except ImportError as error:
                raise ConfigurationError(
                    "etcd:// over gRPC needs grpcio: pip install 'fenced[etcd]', "
                    f"or add ?api=gateway to the URL ({error})"
                ) from error
            transport = GrpcTransport
        self._transport = transport(
            settings.endpoints,
            timeout=settings.timeout,
            connect_timeout=settings.connect_timeout,
            tls=settings.tls,
            login=settings.login,
        )
        who = "the client certificate's user" if settings.login is None else "etcd user"
        user = "" if settings.login is None else f" {settings.login.user!r}"
        self._transport.permission_hint = (
            f"{who}{user} needs readwrite permission on the key prefix {settings.prefix}/ "
            "(docs/etcd.md, 'Least privilege')"
        )
        self._clock: Clock = SystemClock()  # of the pooled leases' times: counts a suspended host
        self._lock = threading.Lock()
        # one lock per resource while in use (see _grant_lock); dropped with its last user
        self._grant_locks: weakref.WeakValueDictionary[str, threading.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._res: dict[str, tuple[int, ResourceState]] = {}
        self._minimum = (0, 0)
        self._leases: dict[int, _PooledLease] = {}
        self._queue_lease: _PooledLease | None = None
        self._retention: _PooledLease | None = None
        self._orphans: dict[bytes, EtcdTicket] = {}  # waiters whose leave() failed: retried
        self._views: dict[str, QueueView] = {}
        self._planned = {}
        self._granted: dict[str, float] = {}
        self._retiring: list[EtcdTicket] = []  # granted waiters whose watch the keeper stops
        self._cluster_id = ""
        self._closed = False
        self._wake = threading.Condition(self._lock)
        try:
            self.coordinator_id = self._init_meta()
        except BaseException:
            self._transport.close()
            raise
        self._keeper = threading.Thread(target=self._keep, name="fenced-etcd-keeper", daemon=True)
        self._keeper.start()

    def __repr__(self) -> str:
        return f"<EtcdBackend {self.url}>"

    def _init_meta(self) -> str:
        keys = self._keys
        candidate = secrets.token_hex(16)
        reads = [_get(keys.coordinator_id), _get(keys.minimum)]
        try:
            ok, responses, _ = self._txn(
                [_cmp(keys.coordinator_id, "CREATE", 0)],
                [_put(keys.coordinator_id, candidate.encode()), *reads],
                reads,
                what="reading the coordinator id",
            )
        except OutcomeUnknown:  # the id may have been written: read it
            ok = False
            responses, _ = self._read(reads, "reading the coordinator id")
        except EtcdRejected as error:
            raise ConfigurationError(f"etcd: reading the coordinator id: {error}") from error
        offset = 1 if ok else 0
        id_kv = _first(responses[offset])
        if id_kv is None:
            raise Unavailable("etcd: the coordinator id could not be stored")
        self._minimum = _int_value(_first(responses[offset + 1]))
        try:
            return validate_coordinator_id(id_kv.value.decode(errors="replace"))
        except ConfigurationError as error:
            raise ConfigurationError(
                f"{self.url}: the key {keys.coordinator_id.decode()} does not hold a fenced "
                f"coordinator id ({error}); is the prefix used by something else?"
            ) from error

    def _keep(self) -> None:
        """Keeper thread: keeps idle pooled leases, waiters' leases and the queue lease alive,
        drops dead ones, retries failed leaves, stops idle queue views."""
        if len(self._transport.endpoints) > 1:
            with contextlib.suppress(Exception):
                self._transport.prefer_leader()
        while True:
            with self._lock:
                if self._closed:
                    return
                now = self._clock.now()  # the pooled leases' clock
                due: list[_PooledLease] = []
                revoke: list[_PooledLease] = []
                for pooled in list(self._leases.values()):
                    refresh = now - pooled.refreshed >= pooled.ttl * _IDLE_REFRESH
                    if pooled.in_use:
                        if pooled.reserved and not pooled.tainted:
                            if refresh:
                                due.append(pooled)
                        elif pooled.tainted or pooled.grant is None:
                            if pooled.expires < now - 1.0 and pooled.tainted:
                                del self._leases[pooled.id]
                        elif pooled.expires < now - 1.0:
                            del self._leases[pooled.id]  # abandoned grant: expired in etcd
                        continue
                    if now - pooled.idle_since > _IDLE_DROP:
                        del self._leases[pooled.id]
                        revoke.append(pooled)
                    elif refresh:
                        due.append(pooled)
                queue = self._queue_lease
                if queue is not None and now - queue.refreshed >= QUEUE_TTL / 4:
                    due.append(queue)
                orphans = list(self._orphans.values())
                idle = [
                    name
                    for name, view in self._views.items()
                    if view.broken or time.monotonic() - view.used > _VIEW_IDLE
                ]
                stopped = [self._views.pop(name) for name in idle]
                for name in idle:
                    self._planned.pop(name, None)  # only views keep their handoffs current
                retiring, self._retiring = self._retiring, []
            for ticket in retiring:
                ticket.stop()
            for view in stopped:
                view.stop()
            for pooled in due:
                self._refresh(pooled)
            for pooled in revoke:
                with contextlib.suppress(Exception):
                    self._call("lease/revoke", {"ID": str(pooled.id)}, mutating=True, what="")
            for ticket in orphans:
                try:
                    self._leave_once(ticket)
                except Exception as error:
                    log.debug("leaving the queue of %s failed again: %s", ticket.resource, error)
                else:
                    with self._lock:
                        self._orphans.pop(ticket.key, None)
            with self._lock:
                if self._closed:
                    return
                self._wake.wait(0.05)

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant, or say what blocks it. A caller that will queue anyway (``request.queues``)
        and that this process's view of the line sees behind a waiter is told so without a
        request: the attempt could not succeed (a caller without a ticket is behind every
        waiter), and in etcd a failed transaction that would have written is still a quorum
        write: this one is not sent."""
        own = owned_ticket(self, ticket, request.resource, EtcdTicket)
        if own is not None:
            found = self._ticket_state(own)
            if found is not None:
                return found
        elif (
            request.queues
            and request.request_id is None
            and self._queue_head(request.resource) is not None
        ):
            return Blocked(None, self._last(request.resource), 0.0, None)
        for _ in range(_MAX_ATTEMPTS):
            result = self._grant_once(request, own)
            if result is not None:
                return result
        raise Unavailable(f"etcd: {request.resource} changed too often to grant (contention)")

    def _grant_once(
        self, request: GrantRequest, ticket: EtcdTicket | None
    ) -> Granted | Blocked | None:
        keys = self._keys
        name = request.resource
        lease_key, res_key, queue = keys.lease(name), keys.res(name), keys.queue(name)
        with self._lock:
            res_rev, state = self._res.get(name, (0, ResourceState()))
            min_rev, minimum = self._minimum
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
        record_ops, number = self._resource_records(name, state.last_record, items)
        pooled = self._ticket_lease(ticket) if ticket is not None else self._take_lease(request.ttl)
        value = LeaseValue(
            epoch, request.owner, request.holder, request.ttl, request.value, number
        ).encode()
        new_state = ResourceState(epoch, "held", request.holder, number)
        compare = [
            _cmp(lease_key, "CREATE", 0),
            _cmp(res_key, "MOD", res_rev),
            _cmp(keys.minimum, "MOD", min_rev),
        ]
        success = [
            _put(lease_key, value, pooled.id),
            _put(res_key, new_state.encode()),
            *record_ops,
        ]
        failure = [_get(lease_key), _get(res_key), self._meta()]
        if ticket is not None:
            compare += [
                _cmp(ticket.key, "CREATE", ticket.rev),
                _cmp(queue, "CREATE", ticket.rev - 1, "GREATER", prefix_end(queue)),
            ]
            success.append(_delete(ticket.key))
            failure += [
                _get(ticket.key),
                _waiter_ahead(queue, ticket.rev),
            ]
        else:
            compare.append(_cmp(queue, "CREATE", 0, "EQUAL", prefix_end(queue)))
        if request.request_id is not None:
            compare.append(_cmp(keys.request(request.request_id), "CREATE", 0))
            success.append(
                _put(
                    keys.request(request.request_id),
                    dumps({"resource": name, "epoch": epoch, "owner": request.owner}),
                    self._retention_lease_id(),
                )
            )
            failure.append(_get(keys.request(request.request_id)))
        try:
            ok, responses, revision = self._txn(compare, success, failure, what=f"grant of {name}")
        except OutcomeUnknown:
            with self._lock:
                pooled.tainted = True  # it may carry the grant: neither reuse nor keep it alive
            raise
        except EtcdRejected as error:
            if error.code == 5:  # the pooled etcd lease expired meanwhile (e.g. SIGSTOP)
                self._drop(pooled)
                return None
            if ticket is None:
                self._give_back(pooled)
            raise Unavailable(f"etcd: grant of {name}: {error}") from error
        except BaseException:
            if ticket is None:
                self._give_back(pooled)
            raise
        if ok:
            with self._lock:
                self._res[name] = (revision, new_state)
                pooled.grant = (name, epoch, request.owner)
                pooled.lease_rev = revision
                pooled.holder = request.holder
                pooled.reserved = False
                expires_in = min(request.ttl, pooled.expires - self._clock.now())
            if ticket is not None:
                self._retire(ticket)
            self._granted_again(name)
            return Granted(epoch, request.owner, request.holder, request.ttl, expires_in)
        if ticket is None:
            self._give_back(pooled)
        return self._not_granted(request, ticket, responses, revision, (res_rev, min_rev))

    def _not_granted(
        self,
        request: GrantRequest,
        ticket: EtcdTicket | None,
        responses: list[rpc.ResponseOp],
        revision: int,
        compared: tuple[int, int],
    ) -> Granted | Blocked | None:
        """What a failed grant's failure branch says (``compared``: the revisions of the state
        and of the minimum that the attempt compared)."""
        name = request.resource
        lease_kv, res_kv = _first(responses[0]), _first(responses[1])
        self._remember(res=(name, res_kv))
        self._remember_meta(responses[2])
        if ticket is not None and lease_kv is not None and _owner(lease_kv) == request.owner:
            granted = self._take_handed(ticket, lease_kv)  # a release handed it to us
            if granted is not None:
                return granted
        if request.request_id is not None:
            earlier = _first(responses[-1])
            if earlier is not None:
                return self._earlier_grant(earlier, name, lease_kv)
        if ticket is not None:
            if _first(responses[3]) is None:  # our queue key is gone (handed, or it expired)
                self._requeue(ticket)
                return None
            pred_kv = _first(responses[4])
            pred = pred_kv.key if pred_kv is not None else (lease_kv.key if lease_kv else None)
            if pred is None:
                return None  # stale cache only: try again
            blocked = self._blocked(lease_kv, self._last(name), RECHECK, precise=False)
            ticket.blocked = blocked
            self._follow(ticket, pred, revision)
            return blocked
        if lease_kv is not None:  # the remaining time costs a request: only for a Busy
            return self._blocked(lease_kv, self._last(name), None, precise=not request.queues)
        with self._lock:
            fresh = (self._res[name][0], self._minimum[0])
        if fresh == compared:  # every other compare held: the queue is not empty
            return Blocked(None, self._last(name), 0.0, None)
        return None  # a stale cache: try again

    def _earlier_grant(self, earlier: KV, name: str, lease_kv: KV | None) -> Granted:
        found = json.loads(earlier.value)
        resource, epoch, owner = str(found["resource"]), int(found["epoch"]), str(found["owner"])
        if resource != name:  # its grant is of another resource: never a token for this one
            raise ConfigurationError(
                f"this request_id was already used to acquire {resource}, not {name}"
            )
        lease = LeaseValue.decode(lease_kv.value) if lease_kv is not None else None
        if lease_kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
            raise LeaseLost(LossReason.REJECTED, "the lease granted for this request_id has ended")
        with self._lock:
            pooled = self._leases.get(lease_kv.lease)
            if pooled is not None and (pooled.tainted or pooled.reserved):  # ours: adopt it
                pooled.tainted = pooled.reserved = False
                pooled.in_use = True
                pooled.grant = (resource, epoch, owner)
                pooled.lease_rev = lease_kv.mod_revision
                pooled.holder = lease.holder
        remaining = self._remaining(lease_kv, lease.ttl)
        return Granted(epoch, owner, lease.holder, lease.ttl, remaining)

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        with self._grant_lock(resource):
            pooled = self._carrying_lease(resource, epoch, owner)
            kv = self._lease_kv(resource)
            lease = LeaseValue.decode(kv.value) if kv is not None else None
            if kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
                if pooled is not None:
                    self._give_back(pooled)
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            granted, sent = self._keepalive(kv.lease)
            if granted <= 0:
                if pooled is not None:
                    self._drop(pooled)
                raise LeaseLost(LossReason.REJECTED, f"{resource} epoch {epoch} has expired")
            if pooled is not None and pooled.id == kv.lease:
                with self._lock:
                    pooled.ttl = granted
                    pooled.expires = sent + granted
                    pooled.refreshed = sent
            return float(granted)

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        with self._grant_lock(resource):
            self._proclaim_locked(resource, epoch, owner, value)

    def _proclaim_locked(self, resource: str, epoch: int, owner: str, value: str) -> None:
        keys = self._keys
        lease_key = keys.lease(resource)
        pooled = self._carrying_lease(resource, epoch, owner)
        for _ in range(_MAX_ATTEMPTS):
            kv = self._lease_kv(resource)
            lease = LeaseValue.decode(kv.value) if kv is not None else None
            if kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            with self._lock:
                res_rev, state = self._res.get(resource, (0, ResourceState()))
            record_ops, number = self._resource_records(
                resource,
                state.last_record,
                [(RecordKind.PROCLAIMED, resource, epoch, lease.holder, {"value": value})],
            )
            new_value = LeaseValue(epoch, owner, lease.holder, lease.ttl, value, number).encode()
            new_state = replace(state, last_record=number)
            ok, responses, revision = self._txn(
                [_cmp(lease_key, "MOD", kv.mod_revision), _cmp(keys.res(resource), "MOD", res_rev)],
                [
                    _put(lease_key, new_value, kv.lease),
                    _put(keys.res(resource), new_state.encode()),
                    *record_ops,
                ],
                [_get(keys.res(resource))],
                what=f"proclaim on {resource}",
            )
            if ok:
                with self._lock:
                    self._res[resource] = (revision, new_state)
                    if pooled is not None and pooled.id == kv.lease:
                        pooled.lease_rev = revision
                return
            self._remember(res=(resource, _first(responses[0])))
        raise Unavailable(f"etcd: {resource} changed too often to proclaim (contention)")

    def current(self, resource: str) -> LeaseInfo | None:
        kv = self._lease_kv(resource)
        if kv is None:
            return None
        lease = LeaseValue.decode(kv.value)
        return LeaseInfo(
            resource,
            lease.epoch,
            lease.holder,
            self._remaining(kv, lease.ttl),
            lease.ttl,
            self.coordinator_id,
            lease.value,
        )

    def last_epoch(self, resource: str) -> int:
        responses, _ = self._read(
            [_get(self._keys.res(resource)), _get(self._keys.minimum)], f"reading {resource}"
        )
        res_kv, min_kv = _first(responses[0]), _first(responses[1])
        self._remember(res=(resource, res_kv), minimum=min_kv)
        epoch = ResourceState.decode(res_kv.value).epoch if res_kv is not None else 0
        return max(epoch, _int_value(min_kv)[1])

    def close(self) -> None:
        """Stop the keeper, revoke idle pooled leases and the queue lease, close connections.

        Leases still held are not revoked: they expire (the Coordinator's contract).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
            revoke = [p.id for p in self._leases.values() if not p.in_use]
            if self._queue_lease is not None:
                revoke.append(self._queue_lease.id)
            self._leases.clear()
            views = list(self._views.values())
            self._views.clear()
            retiring, self._retiring = self._retiring, []
        for view in views:
            view.stop()
        for ticket in retiring:
            ticket.stop()
        for lease_id in revoke:
            with contextlib.suppress(Exception):
                self._transport.call(
                    "lease/revoke", {"ID": str(lease_id)}, mutating=True, timeout=0.5
                )
        self._transport.close()

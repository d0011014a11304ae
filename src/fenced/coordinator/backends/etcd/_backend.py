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
import logging
import secrets
import threading
import time
import weakref

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
from fenced.coordinator.backends.etcd._base import (
    _MAX_ATTEMPTS,
    QUEUE_TTL,
    RECHECK,
    REQUEST_RETENTION,
)
from fenced.coordinator.backends.etcd._client import KV, EtcdRejected, Transport
from fenced.coordinator.backends.etcd._handoff import _VIEW_IDLE
from fenced.coordinator.backends.etcd._keys import (
    LeaseValue,
)
from fenced.coordinator.backends.etcd._ops import (
    _first,
)
from fenced.coordinator.backends.etcd._plans import (
    GrantPlan,
    Refusal,
    earlier_grant,
    epoch_reads,
    grant_plan,
    meta_found,
    meta_reads,
    meta_txn,
    owned_lease,
    proclaim_txn,
)
from fenced.coordinator.backends.etcd._records import RECORDS_KEPT
from fenced.coordinator.backends.etcd._settings import parse_etcd_url
from fenced.coordinator.backends.etcd._waiters import _Waiters
from fenced.coordinator.backends.etcd._waitqueue import EtcdTicket, QueueView
from fenced.core._errors import (
    ConfigurationError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo

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
        self._init_state(settings)
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
        self._transport.permission_hint = settings.permission_hint()
        # one lock per resource while in use (see _grant_lock); dropped with its last user
        self._grant_locks: weakref.WeakValueDictionary[str, threading.Lock] = (
            weakref.WeakValueDictionary()
        )
        self._orphans: dict[bytes, EtcdTicket] = {}  # waiters whose leave() failed: retried
        self._views: dict[str, QueueView] = {}
        self._planned = {}
        self._retiring: list[EtcdTicket] = []  # granted waiters whose watch the keeper stops
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
        try:
            ok, responses, _ = self._send(
                meta_txn(keys, secrets.token_hex(16)), "reading the coordinator id"
            )
        except OutcomeUnknown:  # the id may have been written: read it
            ok = False
            responses, _ = self._read(meta_reads(keys), "reading the coordinator id")
        except EtcdRejected as error:
            raise ConfigurationError(f"etcd: reading the coordinator id: {error}") from error
        coordinator_id, self._minimum = meta_found(self.url, keys, ok, responses)
        return coordinator_id

    def _keep(self) -> None:
        """Keeper thread: keeps idle pooled leases, waiters' leases and the queue lease alive,
        drops dead ones, retries failed leaves, stops idle queue views."""
        if len(self._transport.endpoints) > 1:
            with contextlib.suppress(Exception):
                self._transport.prefer_leader()
        while True:
            due, revoke = self._keep_plan(QUEUE_TTL / 4)
            with self._lock:
                if self._closed:
                    return
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
        name = request.resource
        retention = None if request.request_id is None else self._retention_lease_id()
        pooled = self._ticket_lease(ticket) if ticket is not None else self._take_lease(request.ttl)
        try:
            plan = self._grant_plan(request, ticket, pooled.id, retention)
            answer = self._send(plan.request, f"grant of {name}")
        except BaseException as error:
            self._grant_failed(pooled, ticket, name, error)  # raises, or: try again
            return None
        found = self._grant_answered(pooled, request, ticket, plan, answer)
        if isinstance(found, Granted):
            self._granted_again(name)
            return found
        return self._not_granted(request, ticket, found, plan, answer[2])

    def _grant_plan(
        self, request: GrantRequest, ticket: EtcdTicket | None, lease_id: int, retention: int | None
    ) -> GrantPlan:
        """The transaction of one grant attempt (:func:`~._plans.grant_plan`, from the cached
        state): a method so that a subclass can send a variant, as fenced verify's seeded
        defects do."""
        cached = self._cached(request.resource)
        return grant_plan(self._keys, request, cached, lease_id, ticket, retention)

    def _not_granted(
        self,
        request: GrantRequest,
        ticket: EtcdTicket | None,
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
            granted = self._take_handed(ticket, found.lease)  # a release handed it to us
            if granted is not None:
                return granted
        if found.earlier is not None:
            return self._earlier_grant(found.earlier, name, found.lease)
        if ticket is not None:
            if not found.queued:  # our queue key is gone (handed, or it expired)
                self._requeue(ticket)
                return None
            if found.pred is None:
                return None  # stale cache only: try again
            blocked = self._blocked(found.lease, self._last(name), RECHECK, precise=False)
            ticket.blocked = blocked
            self._follow(ticket, found.pred, revision)
            return blocked
        if found.lease is not None:  # the remaining time costs a request: only for a Busy
            return self._blocked(found.lease, self._last(name), None, precise=not request.queues)
        res_rev, _, min_rev, _ = self._cached(name)
        if (res_rev, min_rev) == plan.compared:  # every other compare held: queue not empty
            return Blocked(None, self._last(name), 0.0, None)
        return None  # a stale cache: try again

    def _earlier_grant(self, earlier: KV, name: str, lease_kv: KV | None) -> Granted:
        lease, kv = earlier_grant(earlier, name, lease_kv)
        self._adopt(kv, lease, name)
        remaining = self._remaining(kv, lease.ttl)
        return Granted(lease.epoch, lease.owner, lease.holder, lease.ttl, remaining)

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        with self._grant_lock(resource):
            pooled = self._carrying_lease(resource, epoch, owner)
            kv = self._lease_kv(resource)
            if owned_lease(kv, epoch, owner) is None or kv is None:
                if pooled is not None:
                    self._give_back(pooled)
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            granted, sent = self._keepalive(kv.lease)
            return self._renewed(pooled, kv, granted, sent, resource, epoch)

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        with self._grant_lock(resource):
            self._proclaim_locked(resource, epoch, owner, value)

    def _proclaim_locked(self, resource: str, epoch: int, owner: str, value: str) -> None:
        pooled = self._carrying_lease(resource, epoch, owner)
        for _ in range(_MAX_ATTEMPTS):
            kv = self._lease_kv(resource)
            lease = owned_lease(kv, epoch, owner)
            if kv is None or lease is None:
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            request, new_state = proclaim_txn(
                self._keys, resource, kv, lease, value, self._cached(resource)
            )
            ok, responses, revision = self._send(request, f"proclaim on {resource}")
            if ok:
                self._proclaimed(pooled, kv, resource, revision, new_state)
                return
            self._remember(res=(resource, _first(responses[0])))
        raise Unavailable(f"etcd: {resource} changed too often to proclaim (contention)")

    def current(self, resource: str) -> LeaseInfo | None:
        kv = self._lease_kv(resource)
        if kv is None:
            return None
        lease = LeaseValue.decode(kv.value)
        return self._info(resource, lease, self._remaining(kv, lease.ttl))

    def last_epoch(self, resource: str) -> int:
        responses, _ = self._read(epoch_reads(self._keys, resource), f"reading {resource}")
        return self._last_epoch(resource, responses)

    def close(self) -> None:
        """Stop the keeper, revoke idle pooled leases and the queue lease, close connections.

        Leases still held are not revoked: they expire (the Coordinator's contract).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify_all()
        revoke = self._closing_leases()
        with self._lock:
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

"""The backend's side of waiting in line (the waiter's own side is :mod:`.waitqueue`).

:meth:`enqueue` puts the waiter's key ``P/queue/NAME:ID`` (its create revision is its place) on
this process's queue lease, naming the pooled etcd lease reserved for its grant, and watches its
predecessor. :meth:`_ticket_state` says where a waiter stands, with a read only when its watch
woke it, its predecessor changed or :data:`RECHECK` passed; :meth:`_take_handed` takes a grant a
release handed to it (no request unless its etcd lease needs keeping alive). :meth:`leave`
deletes its key, and takes (a waiter that gives up) or releases (hands on) a grant that reached
it meanwhile; a leave that fails is
retried by the keeper, and its reserved lease is no longer kept alive, so such a grant expires.
"""

from __future__ import annotations

import logging
import secrets
import time

from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket, owned_ticket
from fenced.coordinator.backends.etcd._base import RECHECK
from fenced.coordinator.backends.etcd._client import KV, EtcdRejected
from fenced.coordinator.backends.etcd._handoff import _Handoff
from fenced.coordinator.backends.etcd._keys import LeaseValue, QueueValue, ResourceState, prefix_end
from fenced.coordinator.backends.etcd._leasepool import _PooledLease
from fenced.coordinator.backends.etcd._ops import (
    _cmp,
    _delete,
    _first,
    _get,
    _kvs,
    _owner,
    _put,
    _waiter_ahead,
)
from fenced.coordinator.backends.etcd._waitqueue import EtcdTicket
from fenced.core._errors import OutcomeUnknown, Unavailable

log = logging.getLogger("fenced.coordinator.etcd")


class _Waiters(_Handoff):
    """Waiters of an etcd backend."""

    def enqueue(self, request: GrantRequest) -> Ticket:
        """Queue with the etcd lease a release will attach the lease key to (see
        :mod:`.backend`), and watch this resource's line so that this process can hand over too."""
        name = request.resource
        pooled = self._take_lease(request.ttl)
        with self._lock:
            pooled.reserved = True
        ticket = EtcdTicket(self, request, self._keys.ticket(name, secrets.token_hex(8)), pooled.id)
        try:
            self._put_ticket(ticket)
        except OutcomeUnknown:
            raise  # the keeper leaves in our place (see _put_ticket)
        except BaseException:
            self._give_back(pooled)
            raise
        self._watch_queue(name)
        return ticket

    def _ticket_lease(self, ticket: EtcdTicket) -> _PooledLease:
        """The etcd lease a waiter's own grant is attached to: the one its queue key names, or
        a fresh one if that expired (this process was stopped for longer than its TTL: a
        release that tries to hand over to the stale one fails, nothing else can carry it)."""
        with self._lock:
            pooled = self._leases.get(ticket.lease_id)
            if pooled is not None and not pooled.tainted:
                return pooled
        pooled = self._take_lease(ticket.request.ttl)
        with self._lock:
            pooled.reserved = True
        ticket.lease_id = pooled.id
        return pooled

    def _requeue(self, ticket: EtcdTicket) -> None:
        ticket.stop()
        self._put_ticket(ticket)

    def _put_ticket(self, ticket: EtcdTicket) -> None:
        keys = self._keys
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
        for _ in range(3):
            lease_id = self._queue_lease_id()
            try:
                ok, responses, revision = self._txn(
                    [_cmp(ticket.key, "CREATE", 0)],
                    [
                        _put(ticket.key, value, lease_id),
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
                    [_get(ticket.key)],
                    what=f"queueing for {name}",
                )
            except OutcomeUnknown:
                ticket.rev = 0  # unknown: the keeper deletes the key if it exists
                with self._lock:
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
            queued = _kvs(responses[1])
            lease_kv = _first(responses[2])
            pred = queued[1].key if len(queued) > 1 else (lease_kv.key if lease_kv else None)
            if lease_kv is not None:
                lease = LeaseValue.decode(lease_kv.value)
                ticket.blocked = Blocked(lease.holder, lease.epoch, lease.ttl, RECHECK)
            else:
                ticket.blocked = Blocked(None, self._last(name), 0.0, RECHECK)
            self._follow(ticket, pred, revision)
            return
        raise Unavailable(f"etcd: could not queue for {name}")

    def _follow(self, ticket: EtcdTicket, pred: bytes | None, seen_at: int) -> None:
        head = pred == self._keys.lease(ticket.resource)
        ticket.follow(self._transport, pred, seen_at, head)

    def wait(self, ticket: Ticket, timeout: float) -> None:
        own = owned_ticket(self, ticket, ticket.resource, EtcdTicket)
        assert own is not None
        own.changed.wait(max(timeout, 0.0))

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        """Leave the queue; a lease that a release handed to this waiter meanwhile is returned
        with ``take``, else released (handed on to the next waiter). On failure the keeper
        retries, and the waiter's etcd lease is no longer kept alive: a grant that reached it
        expires within its TTL."""
        own = owned_ticket(self, ticket, ticket.resource, EtcdTicket)
        assert own is not None
        own.stop()
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
            return self._leave_once(own, take)
        except Exception as error:
            log.debug("leaving the queue of %s failed: %s", own.resource, error)
            with self._lock:
                self._orphans[own.key] = own
            return None

    def _leave_once(self, ticket: EtcdTicket, take: bool = False) -> Granted | None:
        """Delete the waiter's key (a transaction that fails if a release took it first, and
        then reads the lease key), or take (``take``) or release the lease a release handed to
        it instead."""
        name = ticket.resource
        with self._lock:
            pooled = self._leases.get(ticket.lease_id)
            if pooled is not None:
                pooled.reserved = False  # no more keep-alives: a grant to it will expire
        queued = (
            _cmp(ticket.key, "CREATE", ticket.rev)
            if ticket.rev
            else _cmp(ticket.key, "CREATE", 0, "GREATER")
        )
        ok, responses, _ = self._txn(
            [queued],
            [_delete(ticket.key)],
            [_get(self._keys.lease(name))],
            what="leaving the queue",
        )
        lease_kv = None if ok else _first(responses[0])
        if lease_kv is None or _owner(lease_kv) != ticket.request.owner:
            if pooled is not None:
                self._give_back(pooled)  # it carries nothing, and no release can hand it more
            return None
        if take:
            granted = self._take_handed(ticket, lease_kv)
            if granted is not None:
                return granted
        lease = LeaseValue.decode(lease_kv.value)
        if pooled is not None and pooled.id == lease_kv.lease:
            with self._lock:
                pooled.in_use = True
                pooled.grant = (name, lease.epoch, lease.owner)
                pooled.lease_rev = lease_kv.mod_revision
                pooled.holder = lease.holder
        self.release(name, lease.epoch, lease.owner)
        return None

    def _ticket_state(self, ticket: EtcdTicket) -> Granted | Blocked | None:
        """Where a waiter stands, without a write if possible; None: try to take the lease.

        A waiter that a release handed the lease to takes it from the watch event (no request).
        The head woken by the lease key's DELETE tries to take it at once. A waiter behind
        others, woken because the one ahead was served or left, re-reads (a read, not a write)
        and watches its new predecessor; so does any waiter every :data:`RECHECK` seconds or
        after its watch broke, and the read finds a lease handed to it that the watch missed.
        """
        handed = ticket.handed
        if handed is not None:
            granted = self._take_handed(ticket, handed)
            if granted is not None:
                return granted
            ticket.handed = None
        if ticket.pred is None or ticket.blocked is None:
            return None
        keys = self._keys
        name = ticket.resource
        woken = ticket.changed.is_set()
        if woken and ticket.deleted and ticket.pred == keys.lease(name):
            return None
        if not woken and ticket.watching and time.monotonic() - ticket.checked_at < RECHECK:
            return ticket.blocked
        queue = keys.queue(name)
        responses, revision = self._read(
            [
                _get(keys.lease(name)),
                _waiter_ahead(queue, ticket.rev),
                _get(ticket.key, keys_only=True),
                _get(keys.res(name)),
                self._meta(),
            ],
            "checking the queue",
        )
        lease_kv, pred_kv, mine, res_kv = (_first(r) for r in responses[:4])
        self._remember(res=(name, res_kv))
        self._remember_meta(responses[4])
        if lease_kv is not None and _owner(lease_kv) == ticket.request.owner:
            return self._take_handed(ticket, lease_kv)  # None: that grant ended; try again
        if mine is None:
            return None  # our key is gone: the grant attempt queues us again
        pred = pred_kv.key if pred_kv is not None else (lease_kv.key if lease_kv else None)
        if pred is None:
            return None
        if woken or pred != ticket.pred or not ticket.watching:
            ticket.blocked = self._blocked(lease_kv, self._last(name), RECHECK, precise=False)
            self._follow(ticket, pred, revision)
        ticket.checked_at = time.monotonic()
        return ticket.blocked

    def _take_handed(self, ticket: EtcdTicket, kv: KV) -> Granted | None:
        """Take the lease a release handed to this waiter (``kv``: the lease key it put).

        The grant is attached to the waiter's own etcd lease, kept alive by this process while
        it waited; with less than half its TTL left (this process was stopped) it is kept alive
        once more first. None if that grant has ended already.
        """
        lease = LeaseValue.decode(kv.value)
        name = ticket.resource
        with self._lock:
            pooled = self._leases.get(kv.lease)
        if pooled is None or pooled.tainted:
            return None
        with self._grant_lock(name):
            if pooled.expires - self._clock.now() < pooled.ttl * 0.5:
                granted, sent = self._keepalive(pooled.id)
                if granted <= 0:
                    self._drop(pooled)
                    return None
                with self._lock:
                    pooled.ttl, pooled.expires, pooled.refreshed = granted, sent + granted, sent
            with self._lock:
                pooled.reserved = False
                pooled.in_use = True
                pooled.grant = (name, lease.epoch, lease.owner)
                pooled.lease_rev = kv.mod_revision
                pooled.holder = lease.holder
                if (
                    lease.last_record
                    and kv.mod_revision > self._res.get(name, (0, ResourceState()))[0]
                ):
                    # the grant's transaction wrote the state too, at the same revision
                    state = ResourceState(lease.epoch, "held", lease.holder, lease.last_record)
                    self._res[name] = (kv.mod_revision, state)
                expires_in = min(lease.ttl, pooled.expires - self._clock.now())
        self._retire(ticket)
        return Granted(lease.epoch, lease.owner, lease.holder, lease.ttl, expires_in)

    def _retire(self, ticket: EtcdTicket) -> None:
        """The waiter was granted: the keeper stops its watch (closing its connection is
        never on the caller's path)."""
        ticket.done = True
        with self._lock:
            self._retiring.append(ticket)
            self._wake.notify_all()

    def _blocked(
        self, lease_kv: KV | None, last: int, retry_in: float | None, *, precise: bool = True
    ) -> Blocked:
        """Blocked by ``lease_kv`` (or by waiters ahead); ``precise``: ask etcd the remaining
        time of another client's lease (a queued waiter does not need it: a watch wakes it)."""
        if lease_kv is None:
            return Blocked(None, last, 0.0, retry_in)
        lease = LeaseValue.decode(lease_kv.value)
        remaining = self._remaining(lease_kv, lease.ttl) if precise else lease.ttl
        return Blocked(
            lease.holder, lease.epoch, remaining, remaining if retry_in is None else retry_in
        )

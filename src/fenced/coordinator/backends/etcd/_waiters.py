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
from fenced.coordinator.backends.etcd._keys import LeaseValue
from fenced.coordinator.backends.etcd._leasepool import _PooledLease
from fenced.coordinator.backends.etcd._ops import (
    _first,
    _owner,
)
from fenced.coordinator.backends.etcd._plans import (
    blocked_by,
    leave_txn,
    queued,
    standing,
    ticket_reads,
    ticket_shortcut,
    ticket_txn,
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
        for _ in range(3):
            lease_id = self._queue_lease_id()
            try:
                ok, responses, revision = self._send(
                    ticket_txn(keys, ticket, lease_id), f"queueing for {name}"
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
            pred, ticket.blocked = queued(responses, self._last(name))
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
        pooled = self._unreserve(ticket.lease_id)  # no more keep-alives: a grant to it expires
        ok, responses, _ = self._send(leave_txn(self._keys, ticket), "leaving the queue")
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
            self._carry(pooled, (name, lease.epoch, lease.owner), lease_kv, lease.holder)
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
        name = ticket.resource
        woken = ticket.changed.is_set()
        shortcut = ticket_shortcut(self._keys, ticket, woken, ticket.watching)
        if shortcut != "read":
            return ticket.blocked if shortcut == "blocked" else None
        responses, revision = self._read(ticket_reads(self._keys, ticket), "checking the queue")
        found = standing(ticket, responses)
        self._remember(res=(name, found.res))
        self._remember_meta(found.meta)
        if found.handed:
            assert found.lease is not None
            return self._take_handed(ticket, found.lease)  # None: that grant ended; try again
        if not found.queued:
            return None  # our key is gone: the grant attempt queues us again
        if found.pred is None:
            return None
        if woken or found.pred != ticket.pred or not ticket.watching:
            ticket.blocked = self._blocked(found.lease, self._last(name), RECHECK, precise=False)
            self._follow(ticket, found.pred, revision)
        ticket.checked_at = time.monotonic()
        return ticket.blocked

    def _take_handed(self, ticket: EtcdTicket, kv: KV) -> Granted | None:
        """Take the lease a release handed to this waiter (``kv``: the lease key it put).

        The grant is attached to the waiter's own etcd lease, kept alive by this process while
        it waited; with less than half its TTL left (this process was stopped) it is kept alive
        once more first. None if that grant has ended already.
        """
        pooled = self._handed_lease(kv)
        if pooled is None:
            return None
        name = ticket.resource
        with self._grant_lock(name):
            if pooled.expires - self._clock.now() < pooled.ttl * 0.5:
                granted, sent = self._keepalive(pooled.id)
                if granted <= 0:
                    self._drop(pooled)
                    return None
                self._refreshed(pooled, granted, sent)
            expires_in = self._take_over(pooled, kv, name)
        self._retire(ticket)
        lease = LeaseValue.decode(kv.value)
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
        remaining = 0.0
        if lease_kv is not None:
            ttl = LeaseValue.decode(lease_kv.value).ttl
            remaining = self._remaining(lease_kv, ttl) if precise else ttl
        return blocked_by(lease_kv, last, retry_in, remaining)

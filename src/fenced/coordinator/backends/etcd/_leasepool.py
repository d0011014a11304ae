"""The pooled etcd leases of one process (see "Etcd leases" in :mod:`.backend`).

A :class:`_PooledLease` carries at most one ``P/lease/NAME`` key at a time. :class:`_LeasePool`
takes an idle one for a grant (granting a new etcd lease only when none of that TTL is idle),
gives it back when its grant ends, keeps alive idle and reserved ones (:meth:`_refresh`, called
by the keeper), finds the one that carries a grant (:meth:`_carrying_lease`, under the
resource's :meth:`_grant_lock`), and holds the queue lease (waiters' keys) and the retention
lease (``request_id`` keys). A lease whose grant may have happened unseen (a lost reply) is
*tainted*: never reused nor kept alive, so that grant expires within its TTL. A failed lease
grant raises :class:`~fenced.Unavailable` (an etcd lease nobody uses expires by itself).

:class:`_PoolState` is the bookkeeping (which lease to take, what a grant, keep-alive, renewal
or handed grant changes, what the keeper does next), shared by both faces; :class:`_LeasePool`
is the sync face's requests (the asyncio face's are in :mod:`._aio`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fenced.coordinator.backend import Granted
from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._base import (
    QUEUE_TTL,
    REQUEST_RETENTION,
    Json,
    _EtcdBase,
    _EtcdState,
)
from fenced.coordinator.backends.etcd._client import KV, EtcdRejected
from fenced.coordinator.backends.etcd._keys import LeaseValue, ResourceState
from fenced.core._errors import LeaseLost, LossReason, OutcomeUnknown, Unavailable

if TYPE_CHECKING:
    from fenced.coordinator.backend import GrantRequest
    from fenced.coordinator.backends.etcd._plans import GrantPlan, Refusal
    from fenced.coordinator.backends.etcd._waitqueue import Place

log = logging.getLogger("fenced.coordinator.etcd")


_IDLE_REFRESH = 0.2  # keep idle pooled leases alive every 0.2 x their TTL
_IDLE_DROP = 60.0  # revoke a pooled lease idle for this long
_RETENTION_ROTATE = 3600.0  # a new retention lease this often (each lives REQUEST_RETENTION + this)
_LESSOR_TICK = 0.5
"""etcd's lessor looks for expired leases every 500 ms: a lease ends up to that late."""


@dataclass(eq=False)
class _PooledLease:
    """One etcd lease of this process; carries at most one ``P/lease/NAME`` key at a time."""

    id: int
    want: int  # the TTL asked for (ceil of the fenced ttl)
    ttl: int  # the TTL etcd granted
    expires: float  # deadline clock: send time of the last successful grant/keep-alive + ttl
    grant: tuple[str, int, str] | None = None  # (resource, epoch, owner) while it carries one
    lease_rev: int = 0  # mod revision of the lease key it carries
    holder: str = ""  # the holder label of that grant
    in_use: bool = False  # taken for a grant attempt, or carrying a grant
    tainted: bool = False  # a grant with it may have happened unseen: never reuse, never renew
    reserved: bool = False  # a waiter's: its queue key names it, the keeper keeps it alive
    refreshed: float = 0.0
    idle_since: float = 0.0


def _ttl_left(reply: Json, ttl: float) -> float:
    """A ``TimeToLive`` answer as a lease's remaining time: etcd's whole seconds + 0.5 (its
    countdown truncates), at most ``ttl``; 0 for a lease that is gone."""
    left = int(reply.get("TTL", -1))
    return 0.0 if left < 0 else min(ttl, left + 0.5)


class _PoolState(_EtcdState):
    """The bookkeeping of the pooled etcd leases (no I/O): shared by both faces, whose own
    classes send the grants and keep-alives."""

    def _pooled_from(self, reply: Json, want: int, sent: float) -> _PooledLease:
        """The pooled lease a ``LeaseGrant`` of ``want`` seconds sent at ``sent`` answered."""
        granted = int(reply.get("TTL", 0))
        lease_id = int(reply.get("ID", 0))
        if granted <= 0 or not lease_id:
            raise Unavailable(f"etcd: lease grant returned {reply!r}")
        return _PooledLease(lease_id, want, granted, sent + granted, refreshed=sent)

    def _idle_lease(self, want: int) -> _PooledLease | None:
        """An idle pooled lease of TTL ``want`` with at least half its TTL left, now in use
        (the longest-lived one); None: grant one. Drops idle ones with less left."""
        now = self._clock.now()
        stale: list[_PooledLease] = []
        with self._lock:
            best: _PooledLease | None = None
            for pooled in self._leases.values():
                if pooled.want != want or pooled.in_use or pooled.tainted:
                    continue
                if pooled.expires - now < pooled.ttl * 0.5:
                    stale.append(pooled)
                elif best is None or pooled.expires > best.expires:
                    best = pooled
            for pooled in stale:
                del self._leases[pooled.id]
            if best is not None:
                best.in_use = True
            return best

    def _pool_in_use(self, pooled: _PooledLease) -> _PooledLease:
        """A newly granted ``pooled``, in the pool and in use."""
        pooled.in_use = True
        with self._lock:
            self._leases[pooled.id] = pooled
        return pooled

    def _give_back(self, pooled: _PooledLease) -> None:
        """``pooled`` carries no grant (any more): idle again."""
        with self._lock:
            pooled.grant = None
            pooled.lease_rev = 0
            pooled.holder = ""
            pooled.in_use = False
            pooled.idle_since = self._clock.now()

    def _drop(self, pooled: _PooledLease) -> None:
        with self._lock:
            self._leases.pop(pooled.id, None)

    def _carrying_lease(self, resource: str, epoch: int, owner: str) -> _PooledLease | None:
        """The pooled lease that carries this grant (call under the resource's grant lock)."""
        with self._lock:
            for pooled in self._leases.values():
                if pooled.grant == (resource, epoch, owner):
                    return pooled
        return None

    def _carry(
        self, pooled: _PooledLease, grant: tuple[str, int, str], kv: KV, holder: str
    ) -> None:
        """``pooled`` carries ``grant`` (resource, epoch, owner), whose lease key is ``kv``."""
        with self._lock:
            pooled.reserved = False
            pooled.in_use = True
            pooled.grant = grant
            pooled.lease_rev = kv.mod_revision
            pooled.holder = holder

    def _granted_on(
        self, pooled: _PooledLease, request: GrantRequest, plan: GrantPlan, revision: int
    ) -> float:
        """The grant ``plan`` of ``request`` on ``pooled`` was committed at ``revision``: the
        time it has left (counted from the send time of ``pooled``'s last keep-alive)."""
        with self._lock:
            self._res[request.resource] = (revision, plan.state)
            pooled.grant = (request.resource, plan.epoch, request.owner)
            pooled.lease_rev = revision
            pooled.holder = request.holder
            pooled.reserved = False
            return min(request.ttl, pooled.expires - self._clock.now())

    def _retire(self, ticket: Any) -> None:
        """The ticket was granted: forget it (each face's own)."""
        raise NotImplementedError

    def _grant_failed(
        self, pooled: _PooledLease, ticket: object | None, name: str, error: BaseException
    ) -> None:
        """A grant attempt on ``pooled`` raised ``error`` (both faces): return when the attempt
        is to be made again (the pooled etcd lease expired meanwhile, e.g. SIGSTOP), else raise
        what the caller gets. A grant that may have happened unseen (a lost reply, a cancelled
        task) taints ``pooled``: neither reused nor kept alive."""
        if isinstance(error, OutcomeUnknown | asyncio.CancelledError):
            with self._lock:
                pooled.tainted = True
            raise error
        if isinstance(error, EtcdRejected) and error.code == 5:
            self._drop(pooled)
            return
        if ticket is None:
            self._give_back(pooled)
        if isinstance(error, EtcdRejected):
            raise Unavailable(f"etcd: grant of {name}: {error}") from error
        raise error

    def _grant_answered(
        self,
        pooled: _PooledLease,
        request: GrantRequest,
        ticket: Place | None,
        plan: GrantPlan,
        answer: tuple[bool, list[rpc.ResponseOp], int],
    ) -> Granted | Refusal:
        """A grant attempt's answer (both faces): the lease if it succeeded (``pooled`` carries
        it, a ticket is retired), else what its failure branch read (``pooled`` is idle again
        unless it is a ticket's)."""
        # _plans imports the records, which extend this pool: imported here, not at the top
        from fenced.coordinator.backends.etcd._plans import refusal  # noqa: PLC0415

        ok, responses, revision = answer
        if ok:
            expires_in = self._granted_on(pooled, request, plan, revision)
            if ticket is not None:
                self._retire(ticket)
            return Granted(plan.epoch, request.owner, request.holder, request.ttl, expires_in)
        if ticket is None:
            self._give_back(pooled)
        return refusal(request, ticket, responses)

    def _adopt(self, kv: KV, lease: LeaseValue, resource: str) -> None:
        """A request_id's earlier grant was found: if one of our pooled leases carries it (its
        reply was lost, or it was handed to a waiter of ours), it carries that grant again."""
        with self._lock:
            pooled = self._leases.get(kv.lease)
            if pooled is not None and (pooled.tainted or pooled.reserved):  # ours: adopt it
                pooled.tainted = pooled.reserved = False
                pooled.in_use = True
                pooled.grant = (resource, lease.epoch, lease.owner)
                pooled.lease_rev = kv.mod_revision
                pooled.holder = lease.holder

    def _renewed(
        self,
        pooled: _PooledLease | None,
        kv: KV,
        granted: int,
        sent: float,
        resource: str,
        epoch: int,
    ) -> float:
        """The keep-alive of the etcd lease of the lease key ``kv`` (carried by ``pooled``, if
        ours), sent at ``sent``, answered ``granted`` seconds: returned; 0 (the etcd lease is
        gone) raises :class:`~fenced.LeaseLost`."""
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

    def _proclaimed(
        self,
        pooled: _PooledLease | None,
        kv: KV,
        resource: str,
        revision: int,
        state: ResourceState,
    ) -> None:
        """A proclaim that rewrote the lease key ``kv`` was committed at ``revision``."""
        with self._lock:
            self._res[resource] = (revision, state)
            if pooled is not None and pooled.id == kv.lease:
                pooled.lease_rev = revision

    def _handed_lease(self, kv: KV) -> _PooledLease | None:
        """The pooled lease that a release handed a grant on (the lease key ``kv``) to one of
        our waiters; None if it is not ours or no longer usable (that grant has ended)."""
        with self._lock:
            pooled = self._leases.get(kv.lease)
        if pooled is None or pooled.tainted:
            return None
        return pooled

    def _take_over(self, pooled: _PooledLease, kv: KV, resource: str) -> float:
        """Our waiter takes the grant a release handed to it on ``pooled`` (the lease key
        ``kv``); the time it has left. The grant's transaction wrote the resource's state at
        the same revision: cached too."""
        lease = LeaseValue.decode(kv.value)
        with self._lock:
            pooled.reserved = False
            pooled.in_use = True
            pooled.grant = (resource, lease.epoch, lease.owner)
            pooled.lease_rev = kv.mod_revision
            pooled.holder = lease.holder
            if (
                lease.last_record
                and kv.mod_revision > self._res.get(resource, (0, ResourceState()))[0]
            ):
                state = ResourceState(lease.epoch, "held", lease.holder, lease.last_record)
                self._res[resource] = (kv.mod_revision, state)
            return min(lease.ttl, pooled.expires - self._clock.now())

    def _unreserve(self, lease_id: int) -> _PooledLease | None:
        """A waiter leaves: its reserved etcd lease is no longer kept alive (a grant that
        reaches it expires)."""
        with self._lock:
            pooled = self._leases.get(lease_id)
            if pooled is not None:
                pooled.reserved = False
        return pooled

    def _queue_lease_current(self) -> int | None:
        """The queue lease's id if it lives more than 0.2 s yet (else: grant a new one)."""
        with self._lock:
            current = self._queue_lease
        if current is not None and current.expires - self._clock.now() > 0.2:
            return current.id
        return None

    def _retention_current(self) -> int | None:
        """The retention lease's id unless it is due for rotation (else: grant a new one)."""
        with self._lock:
            current = self._retention
        if current is not None and self._clock.now() - current.refreshed < _RETENTION_ROTATE:
            return current.id
        return None

    def _own_remaining(self, kv: KV, ttl: float) -> float | None:
        """A lease key's remaining time if one of our pooled leases carries it (exact), else
        None (ask etcd: :func:`_ttl_left`)."""
        with self._lock:
            pooled = self._leases.get(kv.lease)
            if pooled is not None and not pooled.tainted:
                return max(min(ttl, pooled.expires - self._clock.now()), 0.0)
        return None

    def _refreshed(self, pooled: _PooledLease, ttl: int, sent: float) -> None:
        """A keep-alive of ``pooled`` sent at ``sent`` answered ``ttl`` (0: the lease is gone)."""
        with self._lock:
            if ttl <= 0:
                self._leases.pop(pooled.id, None)
                if self._queue_lease is pooled:
                    self._queue_lease = None
                return
            pooled.ttl = ttl
            pooled.expires = sent + ttl
            pooled.refreshed = sent

    def _keep_plan(self, queue_every: float) -> tuple[list[_PooledLease], list[_PooledLease]]:
        """The keeper's round: the pooled leases to keep alive now (idle ones every
        :data:`_IDLE_REFRESH` of their TTL, reserved ones, the queue lease every
        ``queue_every`` seconds) and the idle ones to revoke (idle for :data:`_IDLE_DROP`);
        forgets abandoned and tainted ones once etcd has expired them."""
        with self._lock:
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
            if queue is not None and now - queue.refreshed >= queue_every:
                due.append(queue)
        return due, revoke

    def _closing_leases(self) -> list[int]:
        """At close: the etcd leases to revoke (idle pooled ones and the queue lease); the
        pool is emptied (leases that carry grants expire by themselves)."""
        with self._lock:
            revoke = [p.id for p in self._leases.values() if not p.in_use]
            if self._queue_lease is not None:
                revoke.append(self._queue_lease.id)
            self._leases.clear()
        return revoke


class _LeasePool(_PoolState, _EtcdBase):
    """The pooled etcd leases of the sync etcd backend: their requests."""

    def _grant_lease(self, want: int) -> _PooledLease:
        sent = self._clock.now()
        try:
            reply = self._call("lease/grant", {"TTL": str(want)}, mutating=True, what="lease grant")
        except OutcomeUnknown as error:  # at worst an etcd lease nobody uses: it expires
            raise Unavailable(str(error)) from error
        except EtcdRejected as error:
            raise Unavailable(f"etcd: lease grant: {error}") from error
        return self._pooled_from(reply, want, sent)

    def _keepalive(self, lease_id: int) -> tuple[int, float]:
        """Keep ``lease_id`` alive: ``(TTL etcd granted (0: gone), send time)``."""
        sent = self._clock.now()
        reply = self._call(
            "lease/keepalive", {"ID": str(lease_id)}, mutating=False, what="lease keep-alive"
        )
        return int(reply.get("TTL", 0)), sent

    def _take_lease(self, ttl: float) -> _PooledLease:
        want = max(1, math.ceil(ttl))
        best = self._idle_lease(want)
        if best is not None:
            return best
        return self._pool_in_use(self._grant_lease(want))

    def _grant_lock(self, resource: str) -> threading.Lock:
        """The lock that renew, release, proclaim and the taking of a handed grant of
        ``resource`` hold in this backend from looking up the pooled lease that carries the
        grant (:meth:`_carrying_lease`) until they are done with it; release returns that lease
        to the pool before it lets go. What it prevents::

            renew A                      release A                   acquire B
            finds P carrying A
                                         deletes A's key, P idle
                                                                     attaches B's key to P
            A's key is gone: P idle  ← while it carries B: the next grant shares P, and
                                       renewing that grant keeps B alive

        One lock per resource, whether or not a pooled lease of this process carries the grant
        (one adopted from another client does not): grants of different resources never wait
        for each other. Taken neither under ``self._lock`` nor under another resource's lock."""
        with self._lock:
            lock = self._grant_locks.get(resource)
            if lock is None:
                lock = threading.Lock()
                self._grant_locks[resource] = lock
            return lock

    def _queue_lease_id(self) -> int:
        current = self._queue_lease_current()
        if current is not None:
            return current
        fresh = self._grant_lease(QUEUE_TTL)
        with self._lock:
            self._queue_lease = fresh
            self._wake.notify_all()
        return fresh.id

    def _retention_lease_id(self) -> int:
        current = self._retention_current()
        if current is not None:
            return current
        fresh = self._grant_lease(REQUEST_RETENTION + int(_RETENTION_ROTATE))
        with self._lock:
            self._retention = fresh
        return fresh.id

    def lease_overrun(self, ttl: float) -> float:
        """How much longer than ``ttl`` this cluster may keep a lease live after the send time
        of its grant or last renewal (for ``fenced verify``'s checker): etcd grants
        ``max(ceil(ttl), its minimum)`` whole seconds and expires leases on a 500 ms tick.

        Takes an etcd lease of that TTL from the pool (granting one if none is idle) to learn
        what etcd grants, and gives it back. Raises :class:`~fenced.Unavailable` like a grant.
        """
        pooled = self._take_lease(ttl)
        self._give_back(pooled)
        return max(0.0, pooled.ttl - ttl) + _LESSOR_TICK

    def _remaining(self, kv: KV, ttl: float) -> float:
        """A lease key's remaining time: exact for our own, etcd's whole seconds + 0.5 else."""
        own = self._own_remaining(kv, ttl)
        if own is not None:
            return own
        try:
            reply = self._call(
                "lease/timetolive", {"ID": str(kv.lease)}, mutating=False, what="lease ttl"
            )
        except (Unavailable, EtcdRejected):
            return ttl
        return _ttl_left(reply, ttl)

    def _refresh(self, pooled: _PooledLease) -> None:
        try:
            ttl, sent = self._keepalive(pooled.id)
        except Exception as error:
            log.debug("keep-alive of etcd lease %x failed: %s", pooled.id, error)
            return
        self._refreshed(pooled, ttl, sent)

"""The pooled etcd leases of one process (see "Etcd leases" in :mod:`.backend`).

A :class:`_PooledLease` carries at most one ``P/lease/NAME`` key at a time. :class:`_LeasePool`
takes an idle one for a grant (granting a new etcd lease only when none of that TTL is idle),
gives it back when its grant ends, keeps alive idle and reserved ones (:meth:`_refresh`, called
by the keeper), finds the one that carries a grant (:meth:`_carrying_lease`, under the
resource's :meth:`_grant_lock`), and holds the queue lease (waiters' keys) and the retention
lease (``request_id`` keys). A lease whose grant may have happened unseen (a lost reply) is
*tainted*: never reused nor kept alive, so that grant expires within its TTL. A failed lease
grant raises :class:`~fenced.Unavailable` (an etcd lease nobody uses expires by itself).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass

from fenced.coordinator.backends.etcd._base import QUEUE_TTL, REQUEST_RETENTION, _EtcdBase
from fenced.coordinator.backends.etcd._client import KV, EtcdRejected
from fenced.core._errors import OutcomeUnknown, Unavailable

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


class _LeasePool(_EtcdBase):
    """The pooled etcd leases of an etcd backend."""

    def _grant_lease(self, want: int) -> _PooledLease:
        sent = self._clock.now()
        try:
            reply = self._call("lease/grant", {"TTL": str(want)}, mutating=True, what="lease grant")
        except OutcomeUnknown as error:  # at worst an etcd lease nobody uses: it expires
            raise Unavailable(str(error)) from error
        except EtcdRejected as error:
            raise Unavailable(f"etcd: lease grant: {error}") from error
        granted = int(reply.get("TTL", 0))
        lease_id = int(reply.get("ID", 0))
        if granted <= 0 or not lease_id:
            raise Unavailable(f"etcd: lease grant returned {reply!r}")
        return _PooledLease(lease_id, want, granted, sent + granted, refreshed=sent)

    def _keepalive(self, lease_id: int) -> tuple[int, float]:
        """Keep ``lease_id`` alive: ``(TTL etcd granted (0: gone), send time)``."""
        sent = self._clock.now()
        reply = self._call(
            "lease/keepalive", {"ID": str(lease_id)}, mutating=False, what="lease keep-alive"
        )
        return int(reply.get("TTL", 0)), sent

    def _take_lease(self, ttl: float) -> _PooledLease:
        want = max(1, math.ceil(ttl))
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
        pooled = self._grant_lease(want)
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

    def _carrying_lease(self, resource: str, epoch: int, owner: str) -> _PooledLease | None:
        """The pooled lease that carries this grant (call under :meth:`_grant_lock`)."""
        with self._lock:
            for pooled in self._leases.values():
                if pooled.grant == (resource, epoch, owner):
                    return pooled
        return None

    def _queue_lease_id(self) -> int:
        with self._lock:
            current = self._queue_lease
        if current is not None and current.expires - self._clock.now() > 0.2:
            return current.id
        fresh = self._grant_lease(QUEUE_TTL)
        with self._lock:
            self._queue_lease = fresh
            self._wake.notify_all()
        return fresh.id

    def _retention_lease_id(self) -> int:
        with self._lock:
            current = self._retention
        if current is not None and self._clock.now() - current.refreshed < _RETENTION_ROTATE:
            return current.id
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
        with self._lock:
            pooled = self._leases.get(kv.lease)
            if pooled is not None and not pooled.tainted:
                return max(min(ttl, pooled.expires - self._clock.now()), 0.0)
        try:
            reply = self._call(
                "lease/timetolive", {"ID": str(kv.lease)}, mutating=False, what="lease ttl"
            )
        except (Unavailable, EtcdRejected):
            return ttl
        left = int(reply.get("TTL", -1))
        return 0.0 if left < 0 else min(ttl, left + 0.5)

    def _refresh(self, pooled: _PooledLease) -> None:
        try:
            ttl, sent = self._keepalive(pooled.id)
        except Exception as error:
            log.debug("keep-alive of etcd lease %x failed: %s", pooled.id, error)
            return
        with self._lock:
            if ttl <= 0:
                self._leases.pop(pooled.id, None)
                if self._queue_lease is pooled:
                    self._queue_lease = None
                return
            pooled.ttl = ttl
            pooled.expires = sent + ttl
            pooled.refreshed = sent

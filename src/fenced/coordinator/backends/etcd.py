"""The etcd coordinator backend: ``etcd://host:port[,host:port…][?prefix=/fenced&timeout=5]``.

fenced on a Raft-replicated etcd 3.4+ cluster, through etcd's JSON gateway (see
:mod:`.etcd_client` and ``docs/etcd.md`` for the client choice and the key layout in
:mod:`.etcd_keys`).

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
  the head — as etcd's and ZooKeeper's lock recipes do. Only a DELETE wakes it. The watch starts
  at the current revision (etcd's "synced" group, no 100 ms catch-up loop) and one read at the
  revision etcd confirmed it at covers the gap since the predecessor was seen. A grant compares
  "no queued key older than mine", so nobody jumps the queue; a caller without a ticket needs an
  empty queue. A waiter that gives up deletes its key; a dead waiter's key dies with its
  process's queue lease (:data:`QUEUE_TTL`).
- **Records in the same transaction** as the change they describe (grant, release, proclaim,
  restore, a detected expiry), under ``P/rec/SEQ`` with the counter ``P/meta/seq`` compared and
  raised in that transaction. An expiry is noticed by the next grant, :meth:`records` or
  :meth:`watch` of the resource and dated when it was noticed (etcd does not say when a lease
  expired). The oldest records are pruned beyond :data:`RECORDS_KEPT`.
- **request_id**: ``P/req/ID`` is written in the grant's transaction and compared absent by
  every grant with that id, so a retry after a lost reply finds the earlier grant (also from
  another client), for :data:`REQUEST_RETENTION` seconds.

Etcd leases (why one etcd lease per live grant, reused)
-------------------------------------------------------
etcd's own ``concurrency.Session`` attaches every key of a process to one session lease. For
fenced that breaks DESIGN §2: a lease on resource A renewed by a healthy holder would keep alive
resource B of the same process whose holder stopped renewing (B outlives its ttl), and releasing
by revoking would end every other lease. fenced therefore keeps a per-process *pool* of etcd
leases per TTL, and each pooled lease carries **at most one** ``P/lease/NAME`` key at a time:

- acquire attaches the key to an idle pooled lease (no LeaseGrant on the hot path: the
  uncontended acquire is one round trip, the release another);
- renew keeps alive exactly that lease, after checking that the key is still this owner's and
  this epoch — under the pooled lease's lock, so that a late renew cannot overlap the lease's
  reuse for the next grant;
- release deletes the key (compare owner and epoch) and returns the etcd lease to the pool;
  nothing is revoked;
- idle pooled leases are kept alive in the background (they carry no key, so this extends
  nothing); a grant's coordinator expiry is the pooled lease's expiry, which is never more than
  its TTL after the grant, and the holder's ``expires_in`` is computed from the send time of that
  lease's last keep-alive;
- a grant whose reply was lost leaves its etcd lease out of the pool and unrenewed (it expires
  within its TTL) unless a retry with the same request_id finds the grant and adopts it.

Race timeline (release → handoff)::

    holder A                          waiter B (head: watches P/lease/R and P/res/R)
    txn: lease MOD = mine, seq, res
      → delete P/lease/R, res=released,
        record 'released', seq+1
    committed (Raft majority) ────────▶ watch: DELETE P/lease/R
                                      txn: lease absent, no queue key older than B's, res/seq
                                        MOD as cached → put P/lease/R (epoch+1), delete B's key,
                                        record 'granted' → Granted
                                                                   (C, watching B's queue key,
                                                                    is woken by that delete)

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
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

from fenced.coordinator.backend import (
    CAP_RECORDS,
    CAP_REQUEST_ID,
    CAP_WAIT_NOTIFY,
    Blocked,
    Granted,
    GrantRequest,
    Ticket,
)
from fenced.coordinator.backends.etcd_client import (
    KV,
    EtcdRejected,
    Event,
    MaybeApplied,
    NotApplied,
    Transport,
    WatchStream,
    b64,
)
from fenced.coordinator.backends.etcd_keys import (
    DEFAULT_PREFIX,
    Keys,
    LeaseValue,
    ResourceState,
    dumps,
    prefix_end,
    record_from,
    record_value,
)
from fenced.core.errors import (
    ConfigurationError,
    LeaseLost,
    LossReason,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core.lease import LeaseInfo
from fenced.core.names import validate_resource
from fenced.core.records import Record, RecordKind
from fenced.core.token import MAX_EPOCH, validate_coordinator_id

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

QUEUE_TTL = 2
"""TTL (s) of the etcd lease of a process's waiter keys: a dead waiter is skipped after that."""
RECHECK = 1.0
"""Seconds after which a waiter re-reads its predecessor even without a notification."""
REQUEST_RETENTION = 24 * 3600
"""Seconds a ``request_id`` is remembered at least (its key's retention lease lives 25 h)."""
RECORDS_KEPT = 100_000
"""Records kept; older ones are deleted by the grant that crosses a multiple of 1000."""

_PRUNE_EVERY = 1000
_MAX_ATTEMPTS = 16
_IDLE_REFRESH = 0.2  # keep idle pooled leases alive every 0.2 x their TTL
_IDLE_DROP = 60.0  # revoke a pooled lease idle for this long
_RETENTION_ROTATE = 3600.0
_RESTORE_CHUNK = 50  # resources per advance transaction (etcd's --max-txn-ops is 128)
_SETTLE_CHUNK = 40
_PAGE = 500
_STATE_GRACE = 0.02  # seconds the head waits for the state key's event of a release
Json = dict[str, Any]


# -- URL --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: list[tuple[str, int]]
    prefix: str
    timeout: float
    connect_timeout: float


def _positive(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"etcd URL: {name} must be a positive number of seconds")
    return value


def parse_etcd_url(url: str) -> EtcdSettings:
    """Parse ``etcd://host:port[,host:port…][/][?prefix=/p&timeout=S&connect_timeout=S]``."""
    # Split by hand: urllib's urlsplit rejects a multi-host netloc with an IPv6 literal.
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() != "etcd":
        raise ConfigurationError(f"expected an etcd:// URL, got {url!r}")
    rest, _, fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    if path or fragment:
        raise ConfigurationError(f"{url!r}: an etcd URL has no path (use ?prefix=/name)")
    del slash
    endpoints: list[tuple[str, int]] = []
    for item in netloc.split(","):
        text = item.strip()
        if not text or "@" in text:
            raise ConfigurationError(f"{url!r}: expected host:port[,host:port...]")
        host, port = text, 2379
        if text.startswith("["):
            host, bracket, rest = text[1:].partition("]")
            if not bracket:
                raise ConfigurationError(f"{url!r}: unclosed '[' in {text!r}")
            if rest:
                port = _port(url, rest.lstrip(":"))
        elif ":" in text:
            host, _, port_text = text.rpartition(":")
            port = _port(url, port_text)
        if not host:
            raise ConfigurationError(f"{url!r}: empty host")
        endpoints.append((host, port))
    if not endpoints:
        raise ConfigurationError(f"{url!r}: no etcd endpoint")
    options = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=False))
    unknown = set(options) - {"prefix", "timeout", "connect_timeout"}
    if unknown:
        raise ConfigurationError(f"{url!r}: unknown etcd URL parameter(s) {sorted(unknown)}")
    prefix = options.get("prefix", DEFAULT_PREFIX)
    Keys(prefix)  # validates
    timeout = _positive("timeout", options["timeout"]) if "timeout" in options else 5.0
    connect = (
        _positive("connect_timeout", options["connect_timeout"])
        if "connect_timeout" in options
        else min(1.0, timeout)
    )
    return EtcdSettings(endpoints, prefix, timeout, connect)


def _port(url: str, text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigurationError(f"{url!r}: bad port {text!r}")
    return int(text)


# -- transaction building -----------------------------------------------------------------------

_TARGET_FIELD = {
    "CREATE": "create_revision",
    "MOD": "mod_revision",
    "VERSION": "version",
    "LEASE": "lease",
}


def _cmp(
    key: bytes, target: str, value: int, result: str = "EQUAL", range_end: bytes | None = None
) -> Json:
    compare: Json = {"key": b64(key), "target": target, "result": result}
    compare[_TARGET_FIELD[target]] = str(value)
    if range_end is not None:
        compare["range_end"] = b64(range_end)
    return compare


def _put(key: bytes, value: bytes, lease: int = 0) -> Json:
    request: Json = {"key": b64(key), "value": b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def _get(key: bytes, range_end: bytes | None = None, **options: Any) -> Json:
    request: Json = {"key": b64(key)}
    if range_end is not None:
        request["range_end"] = b64(range_end)
    for name, value in options.items():
        request[name] = (
            str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        )
    return {"request_range": request}


def _delete(key: bytes, range_end: bytes | None = None) -> Json:
    request: Json = {"key": b64(key)}
    if range_end is not None:
        request["range_end"] = b64(range_end)
    return {"request_delete_range": request}


def _kvs(response: Json) -> list[KV]:
    return [KV.from_json(kv) for kv in response.get("response_range", {}).get("kvs", [])]


def _first(response: Json) -> KV | None:
    found = _kvs(response)
    return found[0] if found else None


def _int_value(kv: KV | None) -> tuple[int, int]:
    """``(mod_revision, value)`` of a counter key (``(0, 0)`` when absent)."""
    if kv is None:
        return 0, 0
    try:
        return kv.mod_revision, int(kv.value)
    except ValueError as error:
        raise ConfigurationError(f"unreadable counter in etcd: {kv.value[:50]!r}") from error


# -- pooled etcd leases ----------------------------------------------------------------------


@dataclass(eq=False)
class _PooledLease:
    """One etcd lease of this process; carries at most one ``P/lease/NAME`` key at a time."""

    id: int
    want: int  # the TTL asked for (ceil of the fenced ttl)
    ttl: int  # the TTL etcd granted
    expires: float  # monotonic: send time of the last successful grant/keep-alive + ttl
    lock: threading.Lock = field(default_factory=threading.Lock)
    grant: tuple[str, int, str] | None = None  # (resource, epoch, owner) while it carries one
    lease_rev: int = 0  # mod revision of the lease key it carries
    value: bytes = b""
    in_use: bool = False  # taken for a grant attempt, or carrying a grant
    tainted: bool = False  # a grant with it may have happened unseen: never reuse, never renew
    refreshed: float = 0.0
    idle_since: float = 0.0


# -- tickets ------------------------------------------------------------------------------------


class EtcdTicket:
    """A waiter's place: ``P/queue/NAME:ID``, its create revision, and its predecessor watch."""

    def __init__(self, resource: str, ticket_id: str, key: bytes) -> None:
        self._resource = resource
        self.id = ticket_id
        self.key = key
        self.rev = 0
        self.pred: bytes | None = None
        self.checked_at = 0.0
        self.changed = threading.Event()
        self.watches: list[WatchStream] = []
        self.blocked: Blocked | None = None
        self.done = False

    @property
    def resource(self) -> str:
        return self._resource

    def follow(
        self,
        transport: Transport,
        pred: bytes | None,
        seen_at: int,
        state: tuple[bytes, Callable[[KV], None]] | None = None,
    ) -> None:
        """Watch ``pred`` for its DELETE from ``seen_at + 1`` (None: nothing to wait for).

        ``state``: for the head of the queue (``pred`` is the lease key), also watch the
        resource's state key and hand every new value to the callback: the release that wakes
        the head wrote it, so the head's grant transaction then compares current revisions.
        """
        self.stop()
        self.changed.clear()
        self.pred = pred
        self.checked_at = time.monotonic()
        if pred is None:
            self.changed.set()
            return
        changed = self.changed

        def state_caught_up(revision: int) -> None:
            """The head: give the state watch a moment to deliver ``revision`` too."""
            if state is None:
                return
            give_up = time.monotonic() + _STATE_GRACE
            while time.monotonic() < give_up:
                watches = self.watches
                if len(watches) > 1 and watches[1].revision > revision:
                    return
                time.sleep(0.0005)

        def on_events(events: list[Event], revision: int) -> None:
            if any(event.kind == "DELETE" for event in events):
                state_caught_up(revision)
                changed.set()

        def on_trouble(reason: str) -> None:
            changed.set()

        def catch_up(confirmed: int) -> bool:
            """Did ``pred`` survive up to revision ``confirmed`` (the watch covers the rest)?"""
            reply = transport.call(
                "kv/range",
                {"key": b64(pred), "revision": str(confirmed), "count_only": True},
                mutating=False,
            )
            if int(reply.get("count", 0)) > 0:
                return True
            state_caught_up(confirmed)
            return False

        self.watches = [
            WatchStream(
                transport,
                pred,
                None,
                seen_at + 1,
                on_events,
                on_trouble,
                name="waiter",
                catch_up=catch_up,
            )
        ]
        if state is not None:
            state_key, learn = state

            def on_state(events: list[Event], revision: int) -> None:
                for event in events:  # learn only: the lease key's DELETE is what wakes
                    if event.kind == "PUT":
                        learn(event.kv)

            def learn_at(confirmed: int) -> bool:
                reply = transport.call(
                    "kv/range", {"key": b64(state_key), "revision": str(confirmed)}, mutating=False
                )
                for kv in reply.get("kvs", []):
                    learn(KV.from_json(kv))
                return True

            self.watches.append(
                WatchStream(
                    transport,
                    state_key,
                    None,
                    seen_at + 1,
                    on_state,
                    on_trouble,
                    name="waiter",
                    catch_up=learn_at,
                )
            )

    @property
    def watching(self) -> bool:
        return bool(self.watches) and all(watch.alive for watch in self.watches)

    def stop(self) -> None:
        watches, self.watches = self.watches, []
        for watch in watches:
            watch.stop()


# -- the backend ------------------------------------------------------------------------------


class EtcdBackend:
    """Coordinator backend on an etcd 3.4+ cluster; see the module docstring. Thread-safe."""

    capabilities = frozenset({CAP_WAIT_NOTIFY, CAP_REQUEST_ID, CAP_RECORDS})

    def __init__(self, url: str) -> None:
        settings = parse_etcd_url(url)
        hosts = ",".join(
            f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            for host, port in settings.endpoints
        )
        query = "" if settings.prefix == DEFAULT_PREFIX else f"?prefix={settings.prefix}"
        self.url = f"etcd://{hosts}{query}"
        self._keys = Keys(settings.prefix)
        self._transport = Transport(
            settings.endpoints, timeout=settings.timeout, connect_timeout=settings.connect_timeout
        )
        self._lock = threading.Lock()
        self._res: dict[str, tuple[int, ResourceState]] = {}
        self._minimum = (0, 0)
        self._seq = (0, 0)
        self._leases: dict[int, _PooledLease] = {}
        self._queue_lease: _PooledLease | None = None
        self._retention: _PooledLease | None = None
        self._orphans: set[bytes] = set()
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

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, path: str, body: Json, *, mutating: bool, what: str) -> Json:
        try:
            return self._transport.call(path, body, mutating=mutating)
        except NotApplied as error:
            raise Unavailable(f"etcd: {what}: {error}") from error
        except MaybeApplied as error:
            raise OutcomeUnknown(f"etcd: {what}: {error}") from error
        except EtcdRejected as error:
            if error.code in (7, 16):
                raise ConfigurationError(f"etcd refused {what}: {error}") from error
            raise

    def _txn(
        self, compare: list[Json], success: list[Json], failure: list[Json], *, what: str
    ) -> tuple[bool, list[Json], int]:
        mutating = any("request_range" not in op for op in success + failure)
        reply = self._call(
            "kv/txn",
            {"compare": compare, "success": success, "failure": failure},
            mutating=mutating,
            what=what,
        )
        header = reply.get("header", {})
        cluster = str(header.get("cluster_id", ""))
        if cluster and cluster != self._cluster_id:
            if self._cluster_id:  # another cluster (a snapshot restore): drop every cached view
                log.warning(
                    "etcd cluster id changed (%s -> %s): a restore?", self._cluster_id, cluster
                )
                with self._lock:
                    self._res.clear()
                    self._minimum = (-1, 0)
                    self._seq = (-1, 0)
            self._cluster_id = cluster
        revision = int(header.get("revision", 0))
        return bool(reply.get("succeeded", False)), list(reply.get("responses", [])), revision

    def _read(self, ops: list[Json], what: str) -> tuple[list[Json], int]:
        _, responses, revision = self._txn([], ops, [], what=what)
        return responses, revision

    def _init_meta(self) -> str:
        keys = self._keys
        candidate = secrets.token_hex(16)
        reads = [_get(keys.coordinator_id), _get(keys.minimum), _get(keys.seq)]
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
        self._seq = _int_value(_first(responses[offset + 2]))
        try:
            return validate_coordinator_id(id_kv.value.decode(errors="replace"))
        except ConfigurationError as error:
            raise ConfigurationError(
                f"{self.url}: the key {keys.coordinator_id.decode()} does not hold a fenced "
                f"coordinator id ({error}); is the prefix used by something else?"
            ) from error

    # -- etcd leases --------------------------------------------------------------------------
    def _grant_lease(self, want: int) -> _PooledLease:
        sent = time.monotonic()
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
        sent = time.monotonic()
        reply = self._call(
            "lease/keepalive", {"ID": str(lease_id)}, mutating=False, what="lease keep-alive"
        )
        return int(reply.get("TTL", 0)), sent

    def _take_lease(self, ttl: float) -> _PooledLease:
        want = max(1, math.ceil(ttl))
        now = time.monotonic()
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
            pooled.value = b""
            pooled.in_use = False
            pooled.idle_since = time.monotonic()

    def _drop(self, pooled: _PooledLease) -> None:
        with self._lock:
            self._leases.pop(pooled.id, None)

    def _carrier(self, resource: str, epoch: int, owner: str) -> _PooledLease | None:
        with self._lock:
            for pooled in self._leases.values():
                if pooled.grant == (resource, epoch, owner):
                    return pooled
        return None

    def _queue_lease_id(self) -> int:
        with self._lock:
            current = self._queue_lease
        if current is not None and current.expires - time.monotonic() > 0.2:
            return current.id
        fresh = self._grant_lease(QUEUE_TTL)
        with self._lock:
            self._queue_lease = fresh
            self._wake.notify_all()
        return fresh.id

    def _retention_lease_id(self) -> int:
        with self._lock:
            current = self._retention
        if current is not None and time.monotonic() - current.refreshed < _RETENTION_ROTATE:
            return current.id
        fresh = self._grant_lease(REQUEST_RETENTION + int(_RETENTION_ROTATE))
        with self._lock:
            self._retention = fresh
        return fresh.id

    def _remaining(self, kv: KV, ttl: float) -> float:
        """A lease key's remaining time: exact for our own, etcd's whole seconds + 0.5 else."""
        with self._lock:
            pooled = self._leases.get(kv.lease)
            if pooled is not None and not pooled.tainted:
                return max(min(ttl, pooled.expires - time.monotonic()), 0.0)
        try:
            reply = self._call(
                "lease/timetolive", {"ID": str(kv.lease)}, mutating=False, what="lease ttl"
            )
        except (Unavailable, EtcdRejected):
            return ttl
        left = int(reply.get("TTL", -1))
        return 0.0 if left < 0 else min(ttl, left + 0.5)

    def _keep(self) -> None:
        """Keeper thread: keeps idle pooled leases and the queue lease alive, drops dead ones."""
        if len(self._transport.endpoints) > 1:
            with contextlib.suppress(Exception):
                self._transport.prefer_leader()
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due: list[_PooledLease] = []
                revoke: list[_PooledLease] = []
                for pooled in list(self._leases.values()):
                    if pooled.in_use:
                        if pooled.tainted or pooled.grant is None:
                            if pooled.expires < now - 1.0 and pooled.tainted:
                                del self._leases[pooled.id]
                        elif pooled.expires < now - 1.0:
                            del self._leases[pooled.id]  # abandoned grant: expired in etcd
                        continue
                    if now - pooled.idle_since > _IDLE_DROP:
                        del self._leases[pooled.id]
                        revoke.append(pooled)
                    elif now - pooled.refreshed >= pooled.ttl * _IDLE_REFRESH:
                        due.append(pooled)
                queue = self._queue_lease
                if queue is not None and now - queue.refreshed >= QUEUE_TTL / 4:
                    due.append(queue)
                orphans = set(self._orphans)
            for pooled in due:
                self._refresh(pooled)
            for pooled in revoke:
                with contextlib.suppress(Exception):
                    self._call("lease/revoke", {"ID": str(pooled.id)}, mutating=True, what="")
            for key in orphans:
                with contextlib.suppress(Exception):
                    self._call("kv/deleterange", {"key": b64(key)}, mutating=True, what="")
                    with self._lock:
                        self._orphans.discard(key)
            with self._lock:
                if self._closed:
                    return
                self._wake.wait(0.05)

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

    # -- cached state -------------------------------------------------------------------------
    def _remember(
        self,
        *,
        res: tuple[str, KV | None] | None = None,
        minimum: KV | bool | None = False,
        seq: KV | bool | None = False,
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
            if seq is not False:
                self._seq = _int_value(seq if isinstance(seq, KV) else None)

    def _records_ops(
        self, seq: int, items: list[tuple[RecordKind, str, int, str | None, dict[str, object]]]
    ) -> tuple[list[Json], int]:
        """Puts of the records ``items`` after ``seq`` and of the counter; the new counter."""
        at = time.time()
        ops = [
            _put(
                self._keys.record(seq + i),
                record_value(Record(seq + i, at, kind, resource, epoch, holder, detail)),
            )
            for i, (kind, resource, epoch, holder, detail) in enumerate(items, 1)
        ]
        new = seq + len(items)
        ops.append(_put(self._keys.seq, str(new).encode()))
        if new // _PRUNE_EVERY > seq // _PRUNE_EVERY and new > RECORDS_KEPT:
            ops.append(_delete(self._keys.record(0), self._keys.record(new - RECORDS_KEPT + 1)))
        return ops, new

    # -- grants ---------------------------------------------------------------------------
    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        if ticket is not None and not isinstance(ticket, EtcdTicket):
            raise ConfigurationError(f"not a ticket of this backend: {ticket!r}")
        if ticket is not None:
            cached = self._still_blocked(ticket)
            if cached is not None:
                return cached
        for _ in range(_MAX_ATTEMPTS):
            result = self._grant_once(request, ticket)
            if result is not None:
                return result
        raise Unavailable(f"etcd: {request.resource} changed too often to grant (contention)")

    def _still_blocked(self, ticket: EtcdTicket) -> Blocked | None:
        """Blocked without a write while someone is provably ahead; None: try to take it.

        The head (watching the lease key) tries at once when woken. A waiter behind others,
        woken because the one ahead was served or left, re-reads (a read, not a write) and
        watches its new predecessor; so does any waiter every :data:`RECHECK` seconds or after
        its watch broke.
        """
        if ticket.pred is None or ticket.blocked is None:
            return None
        keys = self._keys
        name = ticket.resource
        woken = ticket.changed.is_set()
        if woken and ticket.pred == keys.lease(name):
            return None
        if not woken and ticket.watching and time.monotonic() - ticket.checked_at < RECHECK:
            return ticket.blocked
        queue = keys.queue(name)
        responses, revision = self._read(
            [
                _get(keys.lease(name)),
                _get(
                    queue,
                    prefix_end(queue),
                    max_create_revision=ticket.rev - 1,
                    sort_order="DESCEND",
                    sort_target="CREATE",
                    limit=1,
                    keys_only=True,
                ),
                _get(ticket.key, keys_only=True),
                _get(keys.res(name)),
                _get(keys.minimum),
                _get(keys.seq),
            ],
            "checking the queue",
        )
        lease_kv, pred_kv, mine, res_kv, min_kv, seq_kv = (_first(r) for r in responses)
        self._remember(res=(name, res_kv), minimum=min_kv, seq=seq_kv)
        if mine is None:
            return None  # our key is gone: the grant attempt queues us again
        pred = pred_kv.key if pred_kv is not None else (lease_kv.key if lease_kv else None)
        if pred is None:
            return None
        if woken or pred != ticket.pred or not ticket.watching:
            with self._lock:
                last = max(self._res.get(name, (0, ResourceState()))[1].epoch, self._minimum[1])
            ticket.blocked = self._blocked(lease_kv, last, RECHECK, precise=False)
            self._follow(ticket, pred, revision)
        ticket.checked_at = time.monotonic()
        return ticket.blocked

    def _grant_once(
        self, request: GrantRequest, ticket: EtcdTicket | None
    ) -> Granted | Blocked | None:
        keys = self._keys
        name = request.resource
        lease_key, res_key, queue = keys.lease(name), keys.res(name), keys.queue(name)
        with self._lock:
            res_rev, state = self._res.get(name, (0, ResourceState()))
            min_rev, minimum = self._minimum
            seq_rev, seq = self._seq
        epoch = max(state.epoch, minimum) + 1
        if epoch > MAX_EPOCH:
            raise ConfigurationError(f"{name}: epochs exhausted")
        items: list[tuple[RecordKind, str, int, str | None, dict[str, object]]] = []
        after = state.state
        if state.state == "held":
            items.append((RecordKind.EXPIRED, name, state.epoch, state.holder, {}))
            after = "expired"
        detail: dict[str, object] = {"after": after}
        if request.value is not None:
            detail["value"] = request.value
        items.append((RecordKind.GRANTED, name, epoch, request.holder, detail))
        record_ops, new_seq = self._records_ops(seq, items)
        pooled = self._take_lease(request.ttl)
        value = LeaseValue(
            epoch, request.owner, request.holder, request.ttl, request.value
        ).encode()
        compare = [
            _cmp(lease_key, "CREATE", 0),
            _cmp(res_key, "MOD", res_rev),
            _cmp(keys.minimum, "MOD", min_rev),
            _cmp(keys.seq, "MOD", seq_rev),
        ]
        success = [
            _put(lease_key, value, pooled.id),
            _put(res_key, ResourceState(epoch, "held", request.holder, new_seq).encode()),
            *record_ops,
        ]
        failure = [_get(lease_key), _get(res_key), _get(keys.minimum), _get(keys.seq)]
        if ticket is not None:
            compare += [
                _cmp(ticket.key, "CREATE", ticket.rev),
                _cmp(queue, "CREATE", ticket.rev - 1, "GREATER", prefix_end(queue)),
            ]
            success.append(_delete(ticket.key))
            failure += [
                _get(ticket.key),
                _get(
                    queue,
                    prefix_end(queue),
                    max_create_revision=ticket.rev - 1,
                    sort_order="DESCEND",
                    sort_target="CREATE",
                    limit=1,
                    keys_only=True,
                ),
            ]
        else:
            compare.append(_cmp(queue, "CREATE", 0, "EQUAL", prefix_end(queue)))
            failure.append(
                _get(queue, prefix_end(queue), sort_order="ASCEND", sort_target="CREATE", limit=1)
            )
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
            self._give_back(pooled)
            raise Unavailable(f"etcd: grant of {name}: {error}") from error
        except BaseException:
            self._give_back(pooled)
            raise
        if ok:
            with self._lock:
                self._res[name] = (revision, ResourceState(epoch, "held", request.holder, new_seq))
                self._seq = (revision, new_seq)
                pooled.grant = (name, epoch, request.owner)
                pooled.lease_rev = revision
                pooled.value = value
                expires_in = min(request.ttl, pooled.expires - time.monotonic())
            if ticket is not None:
                ticket.done = True
                ticket.stop()
            return Granted(epoch, request.owner, request.holder, request.ttl, expires_in)
        self._give_back(pooled)
        return self._not_granted(request, ticket, responses, revision)

    def _not_granted(
        self, request: GrantRequest, ticket: EtcdTicket | None, responses: list[Json], revision: int
    ) -> Granted | Blocked | None:
        name = request.resource
        lease_kv, res_kv = _first(responses[0]), _first(responses[1])
        self._remember(res=(name, res_kv), minimum=_first(responses[2]), seq=_first(responses[3]))
        if request.request_id is not None:
            earlier = _first(responses[-1])
            if earlier is not None:
                return self._earlier_grant(earlier, name, lease_kv)
        with self._lock:
            last = max(self._res[name][1].epoch, self._minimum[1])
        if ticket is not None:
            if _first(responses[4]) is None:  # our queue key is gone (its lease expired)
                self._requeue(ticket, request)
                return None
            pred_kv = _first(responses[5])
            pred = pred_kv.key if pred_kv is not None else (lease_kv.key if lease_kv else None)
            if pred is None:
                return None  # stale cache only: try again
            blocked = self._blocked(lease_kv, last, RECHECK, precise=False)
            ticket.blocked = blocked
            self._follow(ticket, pred, revision)
            return blocked
        if lease_kv is not None:
            return self._blocked(lease_kv, last, None)
        if _first(responses[4]) is not None:
            return Blocked(None, last, 0.0, None)
        return None

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

    def _earlier_grant(self, earlier: KV, name: str, lease_kv: KV | None) -> Granted:
        found = json.loads(earlier.value)
        resource, epoch, owner = str(found["resource"]), int(found["epoch"]), str(found["owner"])
        if resource != name:
            responses, _ = self._read([_get(self._keys.lease(resource))], "reading a lease")
            lease_kv = _first(responses[0])
        lease = LeaseValue.decode(lease_kv.value) if lease_kv is not None else None
        if lease_kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
            raise LeaseLost(LossReason.REJECTED, "the lease granted for this request_id has ended")
        with self._lock:
            pooled = self._leases.get(lease_kv.lease)
            if pooled is not None and pooled.tainted:  # our own lost grant: adopt it
                pooled.tainted = False
                pooled.in_use = True
                pooled.grant = (resource, epoch, owner)
                pooled.lease_rev = lease_kv.mod_revision
                pooled.value = lease_kv.value
        remaining = self._remaining(lease_kv, lease.ttl)
        return Granted(epoch, owner, lease.holder, lease.ttl, remaining)

    # -- the queue ------------------------------------------------------------------------
    def enqueue(self, request: GrantRequest) -> Ticket:
        name = request.resource
        ticket_id = secrets.token_hex(8)
        ticket = EtcdTicket(name, ticket_id, self._keys.ticket(name, ticket_id))
        self._put_ticket(ticket, request)
        return ticket

    def _requeue(self, ticket: EtcdTicket, request: GrantRequest) -> None:
        ticket.stop()
        self._put_ticket(ticket, request)

    def _put_ticket(self, ticket: EtcdTicket, request: GrantRequest) -> None:
        keys = self._keys
        queue = keys.queue(ticket.resource)
        holder = dumps({"holder": request.holder})
        for _ in range(3):
            lease_id = self._queue_lease_id()
            try:
                ok, responses, revision = self._txn(
                    [_cmp(ticket.key, "CREATE", 0)],
                    [
                        _put(ticket.key, holder, lease_id),
                        _get(
                            queue,
                            prefix_end(queue),
                            sort_order="DESCEND",
                            sort_target="CREATE",
                            limit=2,
                            keys_only=True,
                        ),
                        _get(keys.lease(ticket.resource)),
                    ],
                    [_get(ticket.key)],
                    what=f"queueing for {ticket.resource}",
                )
            except OutcomeUnknown:
                with self._lock:
                    self._orphans.add(ticket.key)  # the keeper deletes it
                raise
            except EtcdRejected as error:
                if error.code == 5:  # the queue lease expired: take a new one
                    with self._lock:
                        self._queue_lease = None
                    continue
                raise Unavailable(f"etcd: queueing: {error}") from error
            if not ok:  # cannot happen (fresh random id); take another id
                ticket.id = secrets.token_hex(8)
                ticket.key = keys.ticket(ticket.resource, ticket.id)
                continue
            ticket.rev = revision
            queued = _kvs(responses[1])
            lease_kv = _first(responses[2])
            pred = queued[1].key if len(queued) > 1 else (lease_kv.key if lease_kv else None)
            with self._lock:
                last = max(
                    self._res.get(ticket.resource, (0, ResourceState()))[1].epoch, self._minimum[1]
                )
            if lease_kv is not None:
                lease = LeaseValue.decode(lease_kv.value)
                ticket.blocked = Blocked(lease.holder, lease.epoch, lease.ttl, RECHECK)
            else:
                ticket.blocked = Blocked(None, last, 0.0, RECHECK)
            self._follow(ticket, pred, revision)
            return
        raise Unavailable(f"etcd: could not queue for {ticket.resource}")

    def _follow(self, ticket: EtcdTicket, pred: bytes | None, seen_at: int) -> None:
        name = ticket.resource
        lease_key = self._keys.lease(name)

        def learn(kv: KV) -> None:
            state = ResourceState.decode(kv.value)
            with self._lock:
                if kv.mod_revision > self._res.get(name, (0, state))[0]:
                    self._res[name] = (kv.mod_revision, state)
                if state.seq and kv.mod_revision > self._seq[0]:
                    self._seq = (kv.mod_revision, state.seq)

        head = pred == lease_key
        ticket.follow(
            self._transport, pred, seen_at, (self._keys.res(name), learn) if head else None
        )

    def wait(self, ticket: Ticket, timeout: float) -> None:
        if not isinstance(ticket, EtcdTicket):
            raise ConfigurationError(f"not a ticket of this backend: {ticket!r}")
        ticket.changed.wait(max(timeout, 0.0))

    def leave(self, ticket: Ticket) -> None:
        if not isinstance(ticket, EtcdTicket):
            raise ConfigurationError(f"not a ticket of this backend: {ticket!r}")
        ticket.stop()
        if ticket.done or not ticket.rev:
            return
        ticket.done = True
        try:
            self._txn(
                [_cmp(ticket.key, "CREATE", ticket.rev)],
                [_delete(ticket.key)],
                [],
                what="leaving the queue",
            )
        except Exception as error:  # the keeper retries; the key dies with the queue lease
            log.debug("leaving the queue of %s failed: %s", ticket.resource, error)
            with self._lock:
                self._orphans.add(ticket.key)

    # -- lease operations -----------------------------------------------------------------
    def _lease_kv(self, resource: str) -> KV | None:
        responses, _ = self._read([_get(self._keys.lease(resource))], f"reading {resource}")
        return _first(responses[0])

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        pooled = self._carrier(resource, epoch, owner)
        lock = pooled.lock if pooled is not None else threading.Lock()
        with lock:
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

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        pooled = self._carrier(resource, epoch, owner)
        lock = pooled.lock if pooled is not None else threading.Lock()
        with lock:
            released = self._release_locked(resource, epoch, owner, pooled)
        if pooled is not None and released is not None:
            self._give_back(pooled)
        return bool(released)

    def _release_locked(
        self, resource: str, epoch: int, owner: str, pooled: _PooledLease | None
    ) -> bool | None:
        """True: released now; False: not this owner's lease (None: and ``pooled`` is free)."""
        keys = self._keys
        lease_key, res_key = keys.lease(resource), keys.res(resource)
        lease_rev = pooled.lease_rev if pooled is not None else 0
        holder = ""
        if not lease_rev:
            kv = self._lease_kv(resource)
            lease = LeaseValue.decode(kv.value) if kv is not None else None
            if kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
                return None if pooled is not None else False
            lease_rev, holder = kv.mod_revision, lease.holder
        elif pooled is not None:
            holder = LeaseValue.decode(pooled.value).holder
        for _ in range(_MAX_ATTEMPTS):
            with self._lock:
                res_rev, state = self._res.get(resource, (0, ResourceState()))
                seq_rev, seq = self._seq
            record_ops, new_seq = self._records_ops(
                seq, [(RecordKind.RELEASED, resource, epoch, holder, {})]
            )
            new_state = ResourceState(max(state.epoch, epoch), "released", holder, new_seq)
            reads = [_get(lease_key), _get(res_key), _get(keys.seq)]
            try:
                ok, responses, revision = self._txn(
                    [
                        _cmp(lease_key, "MOD", lease_rev),
                        _cmp(res_key, "MOD", res_rev),
                        _cmp(keys.seq, "MOD", seq_rev),
                    ],
                    [_delete(lease_key), _put(res_key, new_state.encode()), *record_ops],
                    reads,
                    what=f"release of {resource}",
                )
            except OutcomeUnknown as lost:
                # The release is safe to repeat: find out whether it happened, else retry.
                try:
                    responses, revision = self._read(reads, f"checking a release of {resource}")
                except Unavailable:
                    raise lost from None
                ok, unknown = False, True
            else:
                unknown = False
            if ok:
                with self._lock:
                    self._res[resource] = (revision, new_state)
                    self._seq = (revision, new_seq)
                return True
            kv, res_kv = _first(responses[0]), _first(responses[1])
            self._remember(res=(resource, res_kv), seq=_first(responses[2]))
            lease = LeaseValue.decode(kv.value) if kv is not None else None
            if kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
                if unknown and res_kv is not None:
                    after = ResourceState.decode(res_kv.value)
                    if (after.epoch, after.state) == (epoch, "released"):
                        return True  # our lost release did it
                return None if pooled is not None else False
            lease_rev, holder = kv.mod_revision, lease.holder
        raise Unavailable(f"etcd: {resource} changed too often to release (contention)")

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        keys = self._keys
        lease_key = keys.lease(resource)
        pooled = self._carrier(resource, epoch, owner)
        for _ in range(_MAX_ATTEMPTS):
            kv = self._lease_kv(resource)
            lease = LeaseValue.decode(kv.value) if kv is not None else None
            if kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
                raise LeaseLost(
                    LossReason.REJECTED, f"{resource} epoch {epoch} is no longer this owner's"
                )
            with self._lock:
                seq_rev, seq = self._seq
            record_ops, new_seq = self._records_ops(
                seq, [(RecordKind.PROCLAIMED, resource, epoch, lease.holder, {"value": value})]
            )
            new_value = LeaseValue(epoch, owner, lease.holder, lease.ttl, value).encode()
            ok, responses, revision = self._txn(
                [_cmp(lease_key, "MOD", kv.mod_revision), _cmp(keys.seq, "MOD", seq_rev)],
                [_put(lease_key, new_value, kv.lease), *record_ops],
                [_get(keys.seq)],
                what=f"proclaim on {resource}",
            )
            if ok:
                with self._lock:
                    self._seq = (revision, new_seq)
                    if pooled is not None and pooled.id == kv.lease:
                        pooled.lease_rev = revision
                        pooled.value = new_value
                return
            self._remember(seq=_first(responses[0]))
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

    def resources(self) -> list[str]:
        prefix = self._keys.res_prefix
        names: list[str] = []
        start = prefix
        while True:
            responses, _ = self._read(
                [_get(start, prefix_end(prefix), keys_only=True, limit=_PAGE)], "listing resources"
            )
            found = _kvs(responses[0])
            names += [self._keys.name_of(kv.key, prefix) for kv in found]
            if len(found) < _PAGE:
                return sorted(names)
            start = found[-1].key + b"\x00"

    # -- records --------------------------------------------------------------------------
    def _settle(self, resource: str | None) -> None:
        """Record the expiries of leases whose end was not recorded yet (and cache states)."""
        keys = self._keys
        if resource is None:
            res_op = _get(keys.res_prefix, prefix_end(keys.res_prefix))
            lease_op = _get(keys.lease_prefix, prefix_end(keys.lease_prefix), keys_only=True)
        else:
            res_op, lease_op = _get(keys.res(resource)), _get(keys.lease(resource), keys_only=True)
        for _ in range(_MAX_ATTEMPTS):
            responses, _ = self._read([res_op, lease_op, _get(keys.seq)], "reading records")
            live = {kv.key for kv in _kvs(responses[1])}
            ended: list[tuple[str, KV, ResourceState]] = []
            for kv in _kvs(responses[0]):
                name = keys.name_of(kv.key, keys.res_prefix)
                state = ResourceState.decode(kv.value)
                if state.state == "held" and keys.lease(name) not in live:
                    ended.append((name, kv, state))
            seq_kv = _first(responses[2])
            self._remember(seq=seq_kv)
            if not ended:
                return
            seq_rev, seq = _int_value(seq_kv)
            chunk = ended[:_SETTLE_CHUNK]
            record_ops, new_seq = self._records_ops(
                seq,
                [
                    (RecordKind.EXPIRED, name, state.epoch, state.holder, {})
                    for name, _, state in chunk
                ],
            )
            compare = [_cmp(keys.seq, "MOD", seq_rev)]
            success = list(record_ops)
            for name, kv, state in chunk:
                compare += [
                    _cmp(kv.key, "MOD", kv.mod_revision),
                    _cmp(keys.lease(name), "CREATE", 0),
                ]
                success.append(
                    _put(
                        kv.key,
                        ResourceState(state.epoch, "expired", state.holder, new_seq).encode(),
                    )
                )
            ok, _, revision = self._txn(compare, success, [], what="recording expiries")
            if ok:
                with self._lock:
                    self._seq = (revision, new_seq)
                    for name, _, state in chunk:
                        self._res[name] = (
                            revision,
                            ResourceState(state.epoch, "expired", state.holder, new_seq),
                        )
                if len(ended) <= _SETTLE_CHUNK:
                    return

    def _read_records(
        self, resource: str | None, after: int, limit: int
    ) -> tuple[list[Record], int]:
        keys = self._keys
        start = keys.record(max(after, 0) + 1)
        end = prefix_end(keys.rec_prefix)
        found: list[Record] = []
        revision = 0
        while len(found) < limit:
            responses, read_rev = self._read([_get(start, end, limit=_PAGE)], "reading records")
            revision = revision or read_rev
            page = _kvs(responses[0])
            for kv in page:
                record = record_from(kv.value)
                if resource is None or record.resource == resource:
                    found.append(record)
            if len(page) < _PAGE:
                break
            start = page[-1].key + b"\x00"
        return found[:limit], revision

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        self._settle(resource)
        return self._read_records(resource, after, limit)[0]

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        keys = self._keys
        for _ in range(_MAX_ATTEMPTS):
            with self._lock:
                seq_rev, seq = self._seq
            record_ops, new_seq = self._records_ops(seq, [(kind, resource, epoch, holder, detail)])
            ok, responses, revision = self._txn(
                [_cmp(keys.seq, "MOD", seq_rev)], record_ops, [_get(keys.seq)], what="report"
            )
            if ok:
                with self._lock:
                    self._seq = (revision, new_seq)
                return
            self._remember(seq=_first(responses[0]))
        raise Unavailable("etcd: the record counter changed too often (contention)")

    def watch(self, resource: str, after: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        keys = self._keys
        woken = threading.Event()

        def on_events(events: list[Event], revision: int) -> None:
            woken.set()

        def on_trouble(reason: str) -> None:
            woken.set()

        while True:
            self._settle(resource)
            found, revision = self._read_records(resource, after, 1)
            if found or time.monotonic() >= deadline:
                return
            woken.clear()
            streams = [
                WatchStream(
                    self._transport,
                    keys.rec_prefix,
                    prefix_end(keys.rec_prefix),
                    revision + 1,
                    on_events,
                    on_trouble,
                    name="records",
                ),
                WatchStream(
                    self._transport,
                    keys.lease(resource),
                    None,
                    revision + 1,
                    on_events,
                    on_trouble,
                    name="records",
                ),
            ]
            try:
                woken.wait(max(deadline - time.monotonic(), 0.0))
            finally:
                for stream in streams:
                    stream.stop()

    # -- restore --------------------------------------------------------------------------
    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        """Restore safety (see the backend contract); for an etcd snapshot restore.

        Steps: (1) raise each resource's last epoch to its floor, in transactions of at most
        :data:`_RESTORE_CHUNK` resources (raising early is always safe); (2) in one transaction,
        compared against every resource state read before: raise ``P/meta/minimum``, delete every
        live lease key, mark and record the first resources as restored; (3) record the
        remaining resources in further transactions (records only: the epochs are safe after
        step 2). Returns the new minimum.
        """
        keys = self._keys
        for name in floors:
            validate_resource(name)
        pending = sorted(floors.items())
        while pending:
            chunk, pending = pending[:_RESTORE_CHUNK], pending[_RESTORE_CHUNK:]
            self._raise_floors(dict(chunk))
        new_minimum = 0
        for _ in range(_MAX_ATTEMPTS):
            responses, read_rev = self._read(
                [
                    _get(keys.res_prefix, prefix_end(keys.res_prefix)),
                    _get(keys.minimum),
                    _get(keys.seq),
                ],
                "reading state to advance",
            )
            states = [
                (keys.name_of(kv.key, keys.res_prefix), ResourceState.decode(kv.value))
                for kv in _kvs(responses[0])
            ]
            min_rev, old_minimum = _int_value(_first(responses[1]))
            seq_rev, seq = _int_value(_first(responses[2]))
            new_minimum = max(old_minimum, minimum)
            recorded = {**detail, "minimum": new_minimum}
            first, rest = states[:_RESTORE_CHUNK], states[_RESTORE_CHUNK:]
            record_ops, new_seq = self._records_ops(
                seq,
                [
                    (RecordKind.RESTORED, name, max(state.epoch, new_minimum), None, recorded)
                    for name, state in first
                ],
            )
            ok, _, revision = self._txn(
                [
                    _cmp(keys.res_prefix, "MOD", read_rev + 1, "LESS", prefix_end(keys.res_prefix)),
                    _cmp(keys.minimum, "MOD", min_rev),
                    _cmp(keys.seq, "MOD", seq_rev),
                ],
                [
                    _put(keys.minimum, str(new_minimum).encode()),
                    _delete(keys.lease_prefix, prefix_end(keys.lease_prefix)),
                    *[
                        _put(
                            keys.res(name),
                            ResourceState(state.epoch, "restored", None, new_seq).encode(),
                        )
                        for name, state in first
                    ],
                    *record_ops,
                ],
                [],
                what="advancing epochs",
            )
            if ok:
                with self._lock:
                    self._minimum = (revision, new_minimum)
                    self._seq = (revision, new_seq)
                    self._res.clear()
                self._record_restored(rest, recorded)
                return new_minimum
        raise Unavailable("etcd: the state changed too often to advance (contention)")

    def _raise_floors(self, floors: dict[str, int]) -> None:
        keys = self._keys
        for _ in range(_MAX_ATTEMPTS):
            responses, _ = self._read([_get(keys.res(name)) for name in floors], "reading epochs")
            compare: list[Json] = []
            success: list[Json] = []
            for (name, floor), response in zip(floors.items(), responses, strict=True):
                kv = _first(response)
                state = ResourceState.decode(kv.value) if kv is not None else ResourceState()
                compare.append(_cmp(keys.res(name), "MOD", kv.mod_revision if kv else 0))
                if floor > state.epoch:
                    raised = ResourceState(floor, state.state, state.holder)
                    success.append(_put(keys.res(name), raised.encode()))
            if not success:
                return
            ok, _, _ = self._txn(compare, success, [], what="raising epochs")
            if ok:
                return
        raise Unavailable("etcd: the state changed too often to advance (contention)")

    def _record_restored(
        self, states: list[tuple[str, ResourceState]], recorded: dict[str, object]
    ) -> None:
        keys = self._keys
        with self._lock:
            new_minimum = self._minimum[1]
        while states:
            chunk = states[:_RESTORE_CHUNK]
            with self._lock:
                seq_rev, seq = self._seq
            record_ops, new_seq = self._records_ops(
                seq,
                [
                    (RecordKind.RESTORED, name, max(state.epoch, new_minimum), None, recorded)
                    for name, state in chunk
                ],
            )
            updates: list[Json] = []
            compare = [_cmp(keys.seq, "MOD", seq_rev)]
            for name, state in chunk:
                updates.append(
                    _put(
                        keys.res(name),
                        ResourceState(state.epoch, "restored", None, new_seq).encode(),
                    )
                )
            ok, responses, revision = self._txn(
                compare, [*updates, *record_ops], [_get(keys.seq)], what="recording a restore"
            )
            if ok:
                with self._lock:
                    self._seq = (revision, new_seq)
                states = states[_RESTORE_CHUNK:]
            else:
                self._remember(seq=_first(responses[0]))

    # -- lifecycle ------------------------------------------------------------------------
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
        for lease_id in revoke:
            with contextlib.suppress(Exception):
                self._transport.call(
                    "lease/revoke", {"ID": str(lease_id)}, mutating=True, timeout=0.5
                )
        self._transport.close()

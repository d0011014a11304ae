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
etcd's own ``concurrency.Session`` attaches every key of a process to one session lease. For
fenced that breaks DESIGN §2: a lease on resource A renewed by a healthy holder would keep alive
resource B of the same process whose holder stopped renewing (B outlives its ttl), and releasing
by revoking would end every other lease. fenced therefore keeps a per-process *pool* of etcd
leases per TTL, and each pooled lease carries **at most one** ``P/lease/NAME`` key at a time:

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

    B's acquire gave up (Busy) just as A's release committed:
                                      leave(): txn "my key exists" fails;
                                      P/lease/R holds B's secret → release it
                                      (which hands it to C)

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
import functools
import json
import logging
import math
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
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
    owned_ticket,
)
from fenced.coordinator.backends.etcd import rpc
from fenced.coordinator.backends.etcd.client import (
    KV,
    EtcdRejected,
    Event,
    MaybeApplied,
    NotApplied,
    Transport,
    WatchStream,
)
from fenced.coordinator.backends.etcd.keys import (
    DEFAULT_PREFIX,
    SEQ_PER_REVISION,
    STAMP_LATER,
    Keys,
    LeaseValue,
    QueueValue,
    ResourceState,
    dumps,
    prefix_end,
    records_from,
    records_value,
    stamped,
)
from fenced.coordinator.backends.etcd.waitqueue import EtcdTicket, QueueView
from fenced.core.clock import Clock, SystemClock
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

_Item = tuple[RecordKind, str, int, str | None, dict[str, object]]
"""A record to write: kind, resource, epoch, holder, detail."""


def _restored(
    states: list[tuple[str, ResourceState]], minimum: int, detail: dict[str, object]
) -> list[_Item]:
    """The ``restored`` records of these resources after ``advance`` raised the minimum."""
    return [
        (RecordKind.RESTORED, name, max(state.epoch, minimum), None, detail)
        for name, state in states
    ]


QUEUE_TTL = 2
"""TTL (s) of the etcd lease of a process's waiter keys: a dead waiter is skipped after that."""
RECHECK = 1.0
"""Seconds after which a waiter re-reads its predecessor even without a notification."""
REQUEST_RETENTION = 24 * 3600
"""Seconds a ``request_id`` is remembered at least (its key's retention lease lives 25 h)."""
RECORDS_KEPT = 10_000
"""Record keys (recorded changes) kept per resource; the oldest are pruned every
:data:`_PRUNE_EVERY` of them."""
"""Records kept; older ones are deleted by the grant that crosses a multiple of 1000."""

_PRUNE_EVERY = 1000
_MAX_ATTEMPTS = 16
_IDLE_REFRESH = 0.2  # keep idle pooled leases alive every 0.2 x their TTL
_IDLE_DROP = 60.0  # revoke a pooled lease idle for this long
_RETENTION_ROTATE = 3600.0
_RESTORE_CHUNK = 50  # resources per advance transaction (etcd's --max-txn-ops is 128)
_SETTLE_CHUNK = 40
_PAGE = 500
_VIEW_IDLE = 60.0  # stop watching a resource's queue after this long without a release
_VIEWS_KEPT = 32  # queue views per process at most (each one a watch: a connection, a thread)
_GRANTS_KEPT = 1024  # resources whose last grant time is kept (see _granted_again)
Json = dict[str, Any]


# -- URL --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: list[tuple[str, int]]
    prefix: str
    timeout: float
    connect_timeout: float
    api: str = "grpc"


def _positive(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(f"etcd URL: {name} must be a positive number of seconds")
    return value


def parse_etcd_url(url: str) -> EtcdSettings:
    """Parse ``etcd://host:port[,host:port…][/][?prefix=/p&timeout=S&connect_timeout=S&api=A]``.

    ``api``: ``grpc`` (the default) or ``gateway`` (etcd's JSON gateway, for a network that
    passes only HTTP/1.1); watches use the gateway either way (``docs/etcd.md``, "Client")."""
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
    unknown = set(options) - {"prefix", "timeout", "connect_timeout", "api"}
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
    api = options.get("api", "grpc")
    if api not in ("grpc", "gateway"):
        raise ConfigurationError(f"{url!r}: api must be grpc or gateway, not {api!r}")
    return EtcdSettings(endpoints, prefix, timeout, connect, api)


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
_Op = rpc.RequestOp  # a transaction's operation, built as etcd's message (no JSON on the way)


def _cmp(
    key: bytes, target: str, value: int, result: str = "EQUAL", range_end: bytes | None = None
) -> rpc.Compare:
    compare = rpc.Compare(key=key, target=target, result=result, range_end=range_end or b"")
    setattr(compare, _TARGET_FIELD[target], value)
    return compare


def _put(key: bytes, value: bytes, lease: int = 0) -> _Op:
    return _Op(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def _get(key: bytes, range_end: bytes | None = None, **options: Any) -> _Op:
    return _Op(request_range=rpc.RangeRequest(key=key, range_end=range_end or b"", **options))


def _delete(key: bytes, range_end: bytes | None = None) -> _Op:
    return _Op(request_delete_range=rpc.DeleteRangeRequest(key=key, range_end=range_end or b""))


def _kvs(response: rpc.ResponseOp) -> list[KV]:
    return [KV.from_message(kv) for kv in response.response_range.kvs]


def _first(response: rpc.ResponseOp) -> KV | None:
    found = _kvs(response)
    return found[0] if found else None


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """Raise the fenced error for a transport's error inside (``what``: the operation, for the
    message); an :class:`EtcdRejected` other than a permission error passes unchanged."""
    try:
        yield
    except NotApplied as error:
        raise Unavailable(f"etcd: {what}: {error}") from error
    except MaybeApplied as error:
        raise OutcomeUnknown(f"etcd: {what}: {error}") from error
    except EtcdRejected as error:
        if error.code in (7, 16):
            raise ConfigurationError(f"etcd refused {what}: {error}") from error
        raise


def _int_value(kv: KV | None) -> tuple[int, int]:
    """``(mod_revision, value)`` of a decimal key such as the minimum (``(0, 0)`` when absent)."""
    if kv is None:
        return 0, 0
    try:
        return kv.mod_revision, int(kv.value)
    except ValueError as error:
        raise ConfigurationError(f"unreadable number in etcd: {kv.value[:50]!r}") from error


def _owner(lease_kv: KV) -> str:
    """The owner secret of a lease key's grant."""
    return LeaseValue.decode(lease_kv.value).owner


def _handoff(queued: KV) -> bool:
    """Can a release hand the lease to the waiter of this queue key?"""
    try:
        return QueueValue.decode(queued.value).handoff
    except (ConfigurationError, TypeError, ValueError):
        return False  # not a value of ours: that waiter takes the lease itself


@dataclass(frozen=True)
class _Release:
    """One attempt of a release: its transaction, and the state it writes."""

    request: rpc.TxnRequest  # its records' ops last in ``success`` (see stamp)
    reads: Callable[[], list[_Op]]  # after a failure: lease, res, meta, queue head (, the
    # head's request_id); built only then
    state: ResourceState
    record: bytes  # the key of its RELEASED record
    basis: tuple[object, ...]  # everything it was built from (_basis)
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


def _basis(
    epoch: int,
    holder: str,
    lease_rev: int,
    head: KV | None,
    res_rev: int,
    state: ResourceState,
    minimum: int,
) -> tuple[object, ...]:
    """What a release's transaction is built from: the same basis, the same transaction (but
    for its records' time)."""
    seen = None if head is None else (head.key, head.mod_revision)
    return (epoch, holder, lease_rev, seen, res_rev, state, minimum)


# -- pooled etcd leases ----------------------------------------------------------------------


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
        query = [] if settings.prefix == DEFAULT_PREFIX else [f"prefix={settings.prefix}"]
        if settings.api != "grpc":
            query.append(f"api={settings.api}")
        self.url = f"etcd://{hosts}" + ("?" + "&".join(query) if query else "")
        self._keys = Keys(settings.prefix)
        transport: type[Transport] = Transport
        if settings.api == "grpc":
            try:
                from fenced.coordinator.backends.etcd.grpc_transport import GrpcTransport  # noqa: PLC0415
            except ImportError as error:
                raise ConfigurationError(
                    "etcd:// over gRPC needs grpcio: pip install 'fenced[etcd]', "
                    f"or add ?api=gateway to the URL ({error})"
                ) from error
            transport = GrpcTransport
        self._transport = transport(
            settings.endpoints, timeout=settings.timeout, connect_timeout=settings.connect_timeout
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
        self._planned: dict[str, _Release] = {}  # handoffs built ahead, one per view at most
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

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, path: str, body: Json, *, mutating: bool, what: str) -> Json:
        with _translated(what):
            return self._transport.call(path, body, mutating=mutating)

    def _txn(
        self, compare: list[rpc.Compare], success: list[_Op], failure: list[_Op], *, what: str
    ) -> tuple[bool, list[rpc.ResponseOp], int]:
        """One transaction; its outcome, replies and revision."""
        request = rpc.TxnRequest(compare=compare, success=success, failure=failure)
        return self._send(request, what)

    def _send(self, request: rpc.TxnRequest, what: str) -> tuple[bool, list[rpc.ResponseOp], int]:
        """:meth:`_txn` of a transaction built already."""
        ops = [*request.success, *request.failure]
        mutating = any(op.WhichOneof("request") != "request_range" for op in ops)
        with _translated(what):
            reply = self._transport.call_message("kv/txn", request, mutating=mutating)
        assert isinstance(reply, rpc.TxnResponse)
        header = reply.header
        cluster = str(header.cluster_id) if header.cluster_id else ""
        if cluster and cluster != self._cluster_id:
            if self._cluster_id:  # another cluster (a snapshot restore): drop every cached view
                log.warning(
                    "etcd cluster id changed (%s -> %s): a restore?", self._cluster_id, cluster
                )
                with self._lock:
                    self._res.clear()
                    self._minimum = (-1, 0)
            self._cluster_id = cluster
        return reply.succeeded, list(reply.responses), header.revision

    def _read(self, ops: list[_Op], what: str) -> tuple[list[rpc.ResponseOp], int]:
        _, responses, revision = self._txn([], ops, [], what=what)
        return responses, revision

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

    # -- etcd leases --------------------------------------------------------------------------
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
        grant (:meth:`_carrier`) until they are done with it; release returns that lease to the
        pool before it lets go. What it prevents::

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

    def _carrier(self, resource: str, epoch: int, owner: str) -> _PooledLease | None:
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

    def _meta(self) -> _Op:
        """One read of ``P/meta/``: the minimum epoch (and the id)."""
        return _get(self._keys.meta_prefix, prefix_end(self._keys.meta_prefix))

    def _remember_meta(self, response: rpc.ResponseOp) -> None:
        found = {kv.key: kv for kv in _kvs(response)}
        self._remember(minimum=found.get(self._keys.minimum))

    def _records_ops(
        self, items: list[_Item], numbers: dict[str, int], at: float | None = None
    ) -> tuple[list[_Op], dict[str, int]]:
        """Puts of the records ``items`` of one transaction: one key per resource, numbered
        after the resource's last record key in ``numbers``; the raised numbers (to be written
        in the same transaction, with each resource's ``P/res/NAME`` compared). A resource
        whose number crosses a multiple of :data:`_PRUNE_EVERY` also loses its record keys
        older than the newest :data:`RECORDS_KEPT`. The records' time is ``at`` (default: now;
        :data:`STAMP_LATER`: see :func:`stamped`)."""
        if len(items) > SEQ_PER_REVISION:
            raise ValueError(f"{len(items)} records in one transaction")
        keys = self._keys
        at = time.time() if at is None else at
        grouped: dict[str, list[tuple[int, Record]]] = {}
        for index, (kind, resource, epoch, holder, detail) in enumerate(items):
            record = Record(0, at, kind, resource, epoch, holder, detail)
            grouped.setdefault(resource, []).append((index, record))
        raised = dict(numbers)
        ops: list[_Op] = []
        for resource, records in grouped.items():
            raised[resource] += 1
            ops.append(_put(keys.record(resource, raised[resource]), records_value(records)))
        for resource, new in raised.items():
            if new // _PRUNE_EVERY > numbers[resource] // _PRUNE_EVERY and new > RECORDS_KEPT:
                ops.append(
                    _delete(keys.record(resource, 0), keys.record(resource, new - RECORDS_KEPT + 1))
                )
        return ops, raised

    def _resource_records(
        self, resource: str, number: int, items: list[_Item], at: float | None = None
    ) -> tuple[list[_Op], int]:
        """:meth:`_records_ops` for records of one resource whose last number is ``number``."""
        ops, raised = self._records_ops(items, {resource: number}, at)
        return ops, raised[resource]

    # -- grants ---------------------------------------------------------------------------
    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        """Grant, or say what blocks it. A caller that will queue anyway (``request.queues``)
        and that this process's view of the line sees behind a waiter is told so without a
        request: the attempt could not succeed (a caller without a ticket is behind every
        waiter), and in etcd a failed transaction that would have written is still a quorum
        write. Under contention that is one write in three per acquisition."""
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
                if lease.n and kv.mod_revision > self._res.get(name, (0, ResourceState()))[0]:
                    # the grant's transaction wrote the state too, at the same revision
                    state = ResourceState(lease.epoch, "held", lease.holder, lease.n)
                    self._res[name] = (kv.mod_revision, state)
                expires_in = min(lease.ttl, pooled.expires - self._clock.now())
        self._retire(ticket)
        return Granted(lease.epoch, lease.owner, lease.holder, lease.ttl, expires_in)

    def _retire(self, ticket: EtcdTicket) -> None:
        """The waiter was granted: the keeper stops its watch (off the caller's path: closing a
        connection costs up to half a millisecond)."""
        ticket.done = True
        with self._lock:
            self._retiring.append(ticket)
            self._wake.notify_all()

    def _last(self, name: str) -> int:
        """The last epoch of ``name`` as cached (or the minimum epoch, if higher)."""
        with self._lock:
            return max(self._res.get(name, (0, ResourceState()))[1].epoch, self._minimum[1])

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
        record_ops, number = self._resource_records(name, state.n, items)
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

    # -- the queue ------------------------------------------------------------------------
    def enqueue(self, request: GrantRequest) -> Ticket:
        """Queue with the etcd lease a release will attach the lease key to (see the module
        docstring), and watch this resource's line so that this process can hand over too."""
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
        now = time.monotonic()
        with self._lock:
            last = self._granted.get(resource)
            if len(self._granted) >= _GRANTS_KEPT:
                self._granted.clear()
            self._granted[resource] = now
        if last is not None and now - last < _VIEW_IDLE:
            self._watch_queue(resource)

    def _queue_head(self, resource: str) -> KV | None:
        with self._lock:
            view = self._views.get(resource)
        return view.head() if view is not None else None

    def wait(self, ticket: Ticket, timeout: float) -> None:
        own = owned_ticket(self, ticket, ticket.resource, EtcdTicket)
        assert own is not None
        own.changed.wait(max(timeout, 0.0))

    def leave(self, ticket: Ticket) -> None:
        """Leave the queue; a lease that a release handed to this waiter meanwhile is released
        (handed on to the next waiter). On failure the keeper retries, and the waiter's etcd
        lease is no longer kept alive: a grant that reached it expires within its TTL."""
        own = owned_ticket(self, ticket, ticket.resource, EtcdTicket)
        assert own is not None
        own.stop()
        if own.done:
            return
        own.done = True
        if not own.rev:  # never queued
            with self._lock:
                pooled = self._leases.get(own.lease_id)
            if pooled is not None and own.key not in self._orphans:
                self._give_back(pooled)
            return
        try:
            self._leave_once(own)
        except Exception as error:
            log.debug("leaving the queue of %s failed: %s", own.resource, error)
            with self._lock:
                self._orphans[own.key] = own

    def _leave_once(self, ticket: EtcdTicket) -> None:
        """Delete the waiter's key, or release the lease a release handed to it instead."""
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
            return
        lease = LeaseValue.decode(lease_kv.value)
        if pooled is not None and pooled.id == lease_kv.lease:
            with self._lock:
                pooled.in_use = True
                pooled.grant = (name, lease.epoch, lease.owner)
                pooled.lease_rev = lease_kv.mod_revision
                pooled.holder = lease.holder
        self.release(name, lease.epoch, lease.owner)

    # -- lease operations -----------------------------------------------------------------
    def _lease_kv(self, resource: str) -> KV | None:
        responses, _ = self._read([_get(self._keys.lease(resource))], f"reading {resource}")
        return _first(responses[0])

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        with self._grant_lock(resource):
            pooled = self._carrier(resource, epoch, owner)
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
        with self._grant_lock(resource):
            pooled = self._carrier(resource, epoch, owner)
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
                if head is not None and (head.key in passed or not _handoff(head)):
                    head = None
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
            # (no failure branch: a release that fails is rare, reads are cheaper)
            settle = 0.0 if unknown is None else self._settle_for(pooled)
            responses = self._read_settling(
                [*plan.reads(), _get(plan.record)], f"reading {resource} to release it", settle
            )
            if responses is None:  # only after a lost reply (settle > 0): still unknown
                assert unknown is not None
                raise unknown
            kv = self._remember_release(resource, responses)
            record = _first(responses[-1])
            if unknown is not None and record is not None:
                found = records_from(record.value, record.create_revision)[0]
                if (found.kind, found.resource, found.epoch) == (
                    RecordKind.RELEASED,
                    resource,
                    epoch,
                ):
                    return True  # our lost release did it
            handed = plan.handed
            if handed is not None and handed.request_id and _first(responses[4]) is not None:
                passed.add(plan.head)  # that request_id was granted before: it finds that grant
            lease = LeaseValue.decode(kv.value) if kv is not None else None
            if kv is None or lease is None or (lease.epoch, lease.owner) != (epoch, owner):
                return None if pooled is not None else False
            lease_rev, holder = kv.mod_revision, lease.holder
            head = _first(responses[3])
        raise Unavailable(f"etcd: {resource} changed too often to release (contention)")

    def _settle_for(self, pooled: _PooledLease | None) -> float:
        """How long a release whose outcome is unknown keeps trying to learn it: a lost reply
        usually means a member died, and the cluster answers again once it has a new leader.
        Not longer than the lease would live anyway (its etcd TTL), nor 3 request timeouts."""
        lease_ttl = float(pooled.ttl) if pooled is not None else 1.0
        return min(lease_ttl, 3 * self._transport.timeout)

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

    def _remember_release(self, resource: str, responses: list[rpc.ResponseOp]) -> KV | None:
        """Cache what a failed release read (see :class:`_Release`); the lease key."""
        self._remember(res=(resource, _first(responses[1])))
        self._remember_meta(responses[2])
        return _first(responses[0])

    def _release_plan(
        self,
        resource: str,
        epoch: int,
        holder: str,
        lease_rev: int,
        head: KV | None,
        at: float | None = None,
    ) -> _Release:
        """The transaction that releases ``epoch`` (and hands the lease to ``head``, if given),
        with its records at ``at`` (default: now)."""
        keys = self._keys
        lease_key, res_key, queue = keys.lease(resource), keys.res(resource), keys.queue(resource)
        with self._lock:
            res_rev, state = self._res.get(resource, (0, ResourceState()))
            minimum = self._minimum[1]
        compare = [_cmp(lease_key, "MOD", lease_rev), _cmp(res_key, "MOD", res_rev)]
        request_key: bytes | None = None

        def reads() -> list[_Op]:
            found = [
                _get(lease_key),
                _get(res_key),
                self._meta(),
                _get(queue, prefix_end(queue), sort_order="ASCEND", sort_target="CREATE", limit=1),
            ]
            return found if request_key is None else [*found, _get(request_key)]

        items: list[_Item] = [(RecordKind.RELEASED, resource, epoch, holder, {})]
        record = keys.record(resource, state.n + 1)
        basis = _basis(epoch, holder, lease_rev, head, res_rev, state, minimum)
        if head is None:
            record_ops, number = self._resource_records(resource, state.n, items, at)
            new_state = ResourceState(max(state.epoch, epoch), "released", holder, number)
            success = [_delete(lease_key), _put(res_key, new_state.encode()), *record_ops]
            request = rpc.TxnRequest(compare=compare, success=success)
            return _Release(request, reads, new_state, record, basis, len(record_ops))
        waiter = QueueValue.decode(head.value)
        granted = max(state.epoch, epoch, minimum) + 1
        if granted > MAX_EPOCH:
            raise ConfigurationError(f"{resource}: epochs exhausted")
        detail: dict[str, object] = {"after": "released"}
        if waiter.value is not None:
            detail["value"] = waiter.value
        items.append((RecordKind.GRANTED, resource, granted, waiter.holder, detail))
        record_ops, number = self._resource_records(resource, state.n, items, at)
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
                    self._retention_lease_id(),
                )
            )
        request = rpc.TxnRequest(compare=compare, success=[*success, *record_ops])
        return _Release(request, reads, new_state, record, basis, len(record_ops), waiter, head.key)

    def _plan_ahead(self, resource: str) -> None:
        """The line of ``resource`` changed (called by its view's watch thread): if this
        process holds ``resource``, build the release that hands it to the new head now, so
        that :meth:`release` finds it ready (:meth:`_planned_ahead`) instead of spending a
        few hundred microseconds of a cold interpreter on it before it sends the handoff.

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
            res_rev, state = self._res.get(resource, (0, ResourceState()))
            minimum = self._minimum[1]
        if plan is None or plan.basis != _basis(
            epoch, holder, lease_rev, head, res_rev, state, minimum
        ):
            return None
        plan.stamp(time.time())
        return plan

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        with self._grant_lock(resource):
            self._proclaim_locked(resource, epoch, owner, value)

    def _proclaim_locked(self, resource: str, epoch: int, owner: str, value: str) -> None:
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
                res_rev, state = self._res.get(resource, (0, ResourceState()))
            record_ops, number = self._resource_records(
                resource,
                state.n,
                [(RecordKind.PROCLAIMED, resource, epoch, lease.holder, {"value": value})],
            )
            new_value = LeaseValue(epoch, owner, lease.holder, lease.ttl, value, number).encode()
            new_state = replace(state, n=number)
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
            responses, _ = self._read([res_op, lease_op], "reading records")
            live = {kv.key for kv in _kvs(responses[1])}
            ended: list[tuple[str, KV, ResourceState]] = []
            for kv in _kvs(responses[0]):
                name = keys.name_of(kv.key, keys.res_prefix)
                state = ResourceState.decode(kv.value)
                if state.state == "held" and keys.lease(name) not in live:
                    ended.append((name, kv, state))
            if not ended:
                return
            chunk = ended[:_SETTLE_CHUNK]
            record_ops, numbers = self._records_ops(
                [
                    (RecordKind.EXPIRED, name, state.epoch, state.holder, {})
                    for name, _, state in chunk
                ],
                {name: state.n for name, _, state in chunk},
            )
            compare: list[rpc.Compare] = []
            success = list(record_ops)
            expired: dict[str, ResourceState] = {}
            for name, kv, state in chunk:
                expired[name] = ResourceState(state.epoch, "expired", state.holder, numbers[name])
                compare += [
                    _cmp(kv.key, "MOD", kv.mod_revision),
                    _cmp(keys.lease(name), "CREATE", 0),
                ]
                success.append(_put(kv.key, expired[name].encode()))
            ok, _, revision = self._txn(compare, success, [], what="recording expiries")
            if ok:
                with self._lock:
                    for name, state in expired.items():
                        self._res[name] = (revision, state)
                if len(ended) <= _SETTLE_CHUNK:
                    return

    def _read_records(
        self, resource: str | None, after: int, limit: int
    ) -> tuple[list[Record], int]:
        """Records with ``seq > after`` (of ``resource``, or all), oldest first; and the revision
        of the first read.

        Read in pages sorted by create revision from ``after``'s revision on (etcd filters and
        sorts). A full page may end inside one transaction's records: its last revision is
        left for the next page, which starts at that revision (and a page filled by one
        transaction's records is followed by a read of all of them).
        """
        keys = self._keys
        start = keys.log_prefix if resource is None else keys.log(resource)
        end = prefix_end(start)
        after = max(after, 0)
        first = after // SEQ_PER_REVISION
        found: list[Record] = []
        revision = 0
        while len(found) < limit:
            responses, read_rev = self._read(
                [
                    _get(
                        start,
                        end,
                        min_create_revision=first,
                        sort_order="ASCEND",
                        sort_target="CREATE",
                        limit=_PAGE,
                    )
                ],
                "reading records",
            )
            revision = revision or read_rev
            page = _kvs(responses[0])
            full = len(page) >= _PAGE
            if full:
                last = page[-1].create_revision
                page = [kv for kv in page if kv.create_revision < last]
                if not page:  # one transaction's records fill the page: read them all
                    responses, _ = self._read(
                        [_get(start, end, min_create_revision=last, max_create_revision=last)],
                        "reading records",
                    )
                    page = _kvs(responses[0])
                    last += 1
                first = last
            records = sorted(
                (r for kv in page for r in records_from(kv.value, kv.create_revision)),
                key=lambda r: r.seq,
            )
            found += [record for record in records if record.seq > after]
            if not full:
                break
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
        res_key = self._keys.res(resource)
        for _ in range(_MAX_ATTEMPTS):
            with self._lock:
                res_rev, state = self._res.get(resource, (0, ResourceState()))
            record_ops, number = self._resource_records(
                resource, state.n, [(kind, resource, epoch, holder, detail)]
            )
            new_state = replace(state, n=number)
            ok, responses, revision = self._txn(
                [_cmp(res_key, "MOD", res_rev)],
                [_put(res_key, new_state.encode()), *record_ops],
                [_get(res_key)],
                what="report",
            )
            if ok:
                with self._lock:
                    self._res[resource] = (revision, new_state)
                return
            self._remember(res=(resource, _first(responses[0])))
        raise Unavailable(f"etcd: {resource} changed too often to report (contention)")

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
                    keys.log(resource),
                    prefix_end(keys.log(resource)),
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

        Steps: (0) record the expiries that are due, as a reader does (:meth:`_settle`: with the
        lease's own epoch, before a floor raises it), so that a lease that expired before the
        restore ends ``expired`` then ``restored`` whether or not anyone looked; (1) raise each
        resource's last epoch to its floor, in transactions of at most
        :data:`_RESTORE_CHUNK` resources (raising early is always safe); (2) in one transaction,
        compared against every resource state read before: raise ``P/meta/minimum``, delete every
        live lease key, mark and record the first resources as restored; (3) record the
        remaining resources in further transactions (records only: the epochs are safe after
        step 2). Returns the new minimum.
        """
        keys = self._keys
        for name in floors:
            validate_resource(name)
        self._settle(None)
        pending = sorted(floors.items())
        while pending:
            chunk, pending = pending[:_RESTORE_CHUNK], pending[_RESTORE_CHUNK:]
            self._raise_floors(dict(chunk))
        new_minimum = 0
        for _ in range(_MAX_ATTEMPTS):
            responses, read_rev = self._read(
                [_get(keys.res_prefix, prefix_end(keys.res_prefix)), _get(keys.minimum)],
                "reading state to advance",
            )
            states = [
                (keys.name_of(kv.key, keys.res_prefix), ResourceState.decode(kv.value))
                for kv in _kvs(responses[0])
            ]
            min_rev, old_minimum = _int_value(_first(responses[1]))
            new_minimum = max(old_minimum, minimum)
            recorded = {**detail, "minimum": new_minimum}
            first, rest = states[:_RESTORE_CHUNK], states[_RESTORE_CHUNK:]
            record_ops, numbers = self._records_ops(
                _restored(first, new_minimum, recorded), {name: state.n for name, state in first}
            )
            ok, _, revision = self._txn(
                [
                    _cmp(keys.res_prefix, "MOD", read_rev + 1, "LESS", prefix_end(keys.res_prefix)),
                    _cmp(keys.minimum, "MOD", min_rev),
                ],
                [
                    _put(keys.minimum, str(new_minimum).encode()),
                    _delete(keys.lease_prefix, prefix_end(keys.lease_prefix)),
                    *[
                        _put(
                            keys.res(name),
                            ResourceState(state.epoch, "restored", None, numbers[name]).encode(),
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
                    self._res.clear()
                self._record_restored([name for name, _ in rest], recorded, revision)
                return new_minimum
        raise Unavailable("etcd: the state changed too often to advance (contention)")

    def _read_states(self, names: list[str]) -> list[tuple[str, int, ResourceState]]:
        """``(name, mod revision, state)`` of each resource, in one read (a resource never
        granted: revision 0 and a blank state)."""
        responses, _ = self._read([_get(self._keys.res(name)) for name in names], "reading epochs")
        found = []
        for name, response in zip(names, responses, strict=True):
            kv = _first(response)
            if kv is None:
                found.append((name, 0, ResourceState()))
            else:
                found.append((name, kv.mod_revision, ResourceState.decode(kv.value)))
        return found

    def _raise_floors(self, floors: dict[str, int]) -> None:
        keys = self._keys
        for _ in range(_MAX_ATTEMPTS):
            compare: list[rpc.Compare] = []
            success: list[_Op] = []
            for name, revision, state in self._read_states(list(floors)):
                compare.append(_cmp(keys.res(name), "MOD", revision))
                if floors[name] > state.epoch:
                    raised = replace(state, epoch=floors[name])
                    success.append(_put(keys.res(name), raised.encode()))
            if not success:
                return
            ok, _, _ = self._txn(compare, success, [], what="raising epochs")
            if ok:
                return
        raise Unavailable("etcd: the state changed too often to advance (contention)")

    def _record_restored(self, names: list[str], recorded: dict[str, object], since: int) -> None:
        """Record the restore for the resources that the advance transaction (at revision
        ``since``) left out, :data:`_RESTORE_CHUNK` per transaction, each compared by mod
        revision. One granted since then keeps its state (its grant came after the restore);
        the others are marked restored."""
        keys = self._keys
        with self._lock:
            new_minimum = self._minimum[1]
        attempts = 0
        while names:
            attempts += 1
            if attempts > _MAX_ATTEMPTS:
                raise Unavailable("etcd: the state changed too often to record a restore")
            chunk = names[:_RESTORE_CHUNK]
            found = [item for item in self._read_states(chunk) if item[1]]
            states = [(name, state) for name, _, state in found]
            record_ops, numbers = self._records_ops(
                _restored(states, new_minimum, recorded), {name: state.n for name, state in states}
            )
            compare: list[rpc.Compare] = []
            success: list[_Op] = []
            for name, revision, state in found:
                marked = (
                    ResourceState(state.epoch, "restored", None, numbers[name])
                    if revision <= since
                    else replace(state, n=numbers[name])
                )
                compare.append(_cmp(keys.res(name), "MOD", revision))
                success.append(_put(keys.res(name), marked.encode()))
            ok, _, _ = self._txn(compare, [*success, *record_ops], [], what="recording a restore")
            if ok:
                names, attempts = names[_RESTORE_CHUNK:], 0

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

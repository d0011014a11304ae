"""In-process wire faults and the recording of every call a worker makes.

A verify worker talks to its coordinator backend through :class:`RecordingBackend` and to its
stores through :class:`RecordingStore`. Both record every mutating call as two events (``c.send``
/ ``c.reply`` for the coordinator, ``s.send`` / ``s.reply`` for a store) and inject the fault a
:class:`FaultPlan` chooses for the call:

``unavailable``
    the request is not forwarded; the caller gets :class:`~fenced.Unavailable` (nothing happened);
``lose_reply``
    the request is forwarded and takes effect; its reply is lost: the caller gets
    :class:`~fenced.OutcomeUnknown` (the storage timeout after a successful write, the lost
    renewal response);
``delay_request``
    the request reaches the backend ``delay`` seconds late (a delayed release);
``delay_reply``
    the request takes effect at once; its reply reaches the caller ``delay`` seconds late.

Because the wrapper sits between the library and the backend, it knows the truth that the caller
may not: each reply event says whether the call took effect (``applied``: true, false, or null
when not even the wrapper can know, e.g. a real network error). The ``c.send`` / ``s.send`` event
is written when the request is *forwarded* (after an injected request delay, whose start it
records as ``issued``), which is no earlier than the moment the library itself took as the
request's send time.

For networked backends the same faults can also be injected on the wire by
:class:`fenced.testing.proxy.TcpProxy`; then ``applied`` is null for the affected calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.coordinator.backend import Blocked, CoordinatorBackend, Granted, GrantRequest, Ticket
from fenced.core._errors import (
    ConfigurationError,
    FencedError,
    IdempotencyConflict,
    LeaseLost,
    OutcomeUnknown,
    Rejected,
    Unavailable,
    VersionConflict,
)
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.core._token import FencingToken
from fenced.fence._store import Store
from fenced.fence._values import Item, Mode, Publication, Version
from fenced.verify._recorder import Recorder

__all__ = [
    "FAULTS",
    "AsyncRecordingBackend",
    "FaultPlan",
    "Planned",
    "RecordingBackend",
    "RecordingStore",
    "WireFault",
    "error_fields",
]

WireFault = Literal["unavailable", "lose_reply", "delay_request", "delay_reply"]
FAULTS: tuple[WireFault, ...] = ("unavailable", "lose_reply", "delay_request", "delay_reply")
_WEIGHTS = (0.2, 0.3, 0.2, 0.3)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Planned:
    """The fault chosen for one call."""

    fault: WireFault
    delay: float = 0.0


class FaultPlan:
    """Chooses the fault of each call: armed faults first, then seeded random ones.

    ``rates`` maps an operation (``try_grant``, ``renew``, ``release``, ``fence``, ``put``,
    ``publish``) to the probability that a call of it gets a random fault, of a kind drawn with
    the weights ``kinds`` (default: lost replies and delayed replies 30 % each, unavailability
    and delayed requests 20 % each); ``ttl`` scales
    the random delays, which are biased to land around the TTL boundaries: half of them are
    short (10-50 % of the ttl: around the safety margin), half are long (80-130 %: around
    expiry).
    Thread-safe (renewals run in a background thread).
    """

    def __init__(
        self,
        rng: random.Random | None = None,
        rates: dict[str, float] | None = None,
        ttl: float = 1,
        kinds: dict[str, float] | None = None,
    ) -> None:
        self._rng = rng
        self._rates = dict(rates or {})
        self._ttl = ttl
        chosen = kinds or dict(zip(FAULTS, _WEIGHTS, strict=True))
        self._kinds = [k for k in FAULTS if chosen.get(k)]
        self._weights = [chosen[k] for k in self._kinds]
        self._armed: dict[str, deque[Planned]] = {}
        self._lock = threading.Lock()

    def arm(self, op: str, fault: WireFault, *, delay: float = 0.0, times: int = 1) -> None:
        """Inject ``fault`` into the next ``times`` calls of ``op`` (after those already armed)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        with self._lock:
            queue = self._armed.setdefault(op, deque())
            queue.extend(Planned(fault, delay) for _ in range(times))

    def next(self, op: str) -> Planned | None:
        """The fault for this call of ``op``, or None."""
        with self._lock:
            queue = self._armed.get(op)
            if queue:
                return queue.popleft()
            rng = self._rng
            if rng is None or rng.random() >= self._rates.get(op, 0.0):
                return None
            fault = rng.choices(self._kinds, weights=self._weights)[0]
            delay = 0.0
            if fault in ("delay_request", "delay_reply"):
                short = rng.random() < 0.5
                delay = self._ttl * (rng.uniform(0.1, 0.5) if short else rng.uniform(0.8, 1.3))
            return Planned(fault, delay)


def error_fields(error: BaseException) -> dict[str, Any]:
    """The recorded description of an error the caller got: class, the first line of its
    message (at most 300 characters: what a reader of a kept history needs to tell a timeout from
    a cut connection) and, for rejections, epochs."""
    fields: dict[str, Any] = {"error": type(error).__name__}
    text = str(error).strip()
    if text:
        fields["message"] = text.splitlines()[0][:300]
    for name in ("presented", "floor"):
        value = getattr(error, name, None)
        if isinstance(value, int):
            fields[name] = value
    reason = getattr(error, "reason", None)
    if reason is not None:
        fields["reason"] = getattr(reason, "value", str(reason))
    return fields


def _definite(error: BaseException) -> bool:
    """True if ``error`` guarantees that the call did not take effect."""
    return isinstance(
        error,
        Rejected
        | LeaseLost
        | Unavailable
        | VersionConflict
        | IdempotencyConflict
        | ConfigurationError,
    )


class _Wire:
    """Shared machinery: number calls, inject the planned fault, record send and reply."""

    def __init__(self, recorder: Recorder, plan: FaultPlan, send_ev: str, reply_ev: str) -> None:
        self._rec = recorder
        self.plan = plan
        self._send_ev = send_ev
        self._reply_ev = reply_ev
        self._calls = itertools.count(1)
        self._prefix = f"{recorder.emitter}:{send_ev[0]}"

    def call(
        self,
        op: str,
        fields: dict[str, Any],
        forward: Callable[[], T],
        describe: Callable[[T], dict[str, Any]],
        *,
        faults: bool = True,
    ) -> T:
        planned, call, fields = self._plan(op, fields, faults)
        if planned is not None and planned.fault == "delay_request":
            time.sleep(planned.delay)
        reply = self._sent(op, call, fields, planned)
        try:
            result = forward()
        except Exception as error:
            failure = self._failed(op, reply, planned, error)
            if failure is error:
                raise
            raise failure from error
        delay = self._answered(op, reply, planned, describe(result))
        if delay:
            time.sleep(delay)
        self._rec.emit(self._reply_ev, ok=True, **reply)
        return result

    async def acall(
        self,
        op: str,
        fields: dict[str, Any],
        forward: Callable[[], Awaitable[T]],
        describe: Callable[[T], dict[str, Any]],
        *,
        faults: bool = True,
    ) -> T:
        """:meth:`call` for an awaited ``forward``: delays suspend the task."""
        planned, call, fields = self._plan(op, fields, faults)
        if planned is not None and planned.fault == "delay_request":
            await asyncio.sleep(planned.delay)
        reply = self._sent(op, call, fields, planned)
        try:
            result = await forward()
        except Exception as error:
            failure = self._failed(op, reply, planned, error)
            if failure is error:
                raise
            raise failure from error
        delay = self._answered(op, reply, planned, describe(result))
        if delay:
            await asyncio.sleep(delay)
        self._rec.emit(self._reply_ev, ok=True, **reply)
        return result

    def _plan(
        self, op: str, fields: dict[str, Any], faults: bool
    ) -> tuple[Planned | None, str, dict[str, Any]]:
        planned = self.plan.next(op) if faults else None
        call = f"{self._prefix}{next(self._calls)}"
        if planned is not None and planned.fault == "delay_request":
            fields = {**fields, "issued": self._rec.now()}
        return planned, call, fields

    def _sent(
        self, op: str, call: str, fields: dict[str, Any], planned: Planned | None
    ) -> dict[str, Any]:
        """Record the send; the fields of its reply event. Raises an injected Unavailable."""
        self._rec.emit(self._send_ev, call=call, op=op, **fields)
        fault = planned.fault if planned is not None else None
        reply: dict[str, Any] = {"call": call, "op": op, "fault": fault}
        if planned is not None:
            reply["delay"] = round(planned.delay, 4)
        if fault == "unavailable":
            self._rec.emit(self._reply_ev, ok=False, error="Unavailable", applied=False, **reply)
            raise Unavailable(f"injected fault: {op} did not reach its destination")
        return reply

    def _failed(
        self, op: str, reply: dict[str, Any], planned: Planned | None, error: Exception
    ) -> Exception:
        """Record a call that raised; the exception the caller gets."""
        truth = {"applied": False if _definite(error) else None, **error_fields(error)}
        if planned is not None and planned.fault == "lose_reply":
            truth = {f"true_{k}" if k == "error" else k: v for k, v in truth.items()}
            self._rec.emit(self._reply_ev, ok=False, error="OutcomeUnknown", **truth, **reply)
            return OutcomeUnknown(f"injected fault: the reply to {op} was lost")
        self._rec.emit(self._reply_ev, ok=False, **truth, **reply)
        return error

    def _answered(
        self, op: str, reply: dict[str, Any], planned: Planned | None, truth: dict[str, Any]
    ) -> float:
        """A call that returned: raise an injected lost reply, else add its truth to ``reply``
        and return how long to delay the reply."""
        if planned is not None and planned.fault == "lose_reply":
            self._rec.emit(self._reply_ev, ok=False, error="OutcomeUnknown", **truth, **reply)
            raise OutcomeUnknown(f"injected fault: the reply to {op} was lost (it took effect)")
        reply.update(truth)
        if planned is not None and planned.fault == "delay_reply":
            reply["applied_at"] = self._rec.now()
            return planned.delay
        return 0.0


class RecordingBackend:
    """A :class:`CoordinatorBackend` that records and faults ``try_grant``/``renew``/``release``.

    ``report``, ``enqueue`` and ``leave`` are recorded but never faulted (the checker matches
    reports with the coordinator's records exactly, and counts tickets for hand-offs). Waits,
    reads and watches pass through unrecorded.
    """

    def __init__(self, inner: CoordinatorBackend, recorder: Recorder, plan: FaultPlan) -> None:
        self.inner = inner
        self.url = inner.url
        self.coordinator_id = inner.coordinator_id
        self.capabilities = inner.capabilities
        self._wire = _Wire(recorder, plan, "c.send", "c.reply")

    @property
    def plan(self) -> FaultPlan:
        return self._wire.plan

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        return self._wire.call(
            "try_grant",
            _grant_fields(request, ticket),
            lambda: self.inner.try_grant(request, ticket),
            _describe_grant(request),
        )

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return self._wire.call(
            "renew",
            {"res": resource, "epoch": epoch, "ttl": ttl},
            lambda: self.inner.renew(resource, epoch, owner, ttl),
            _describe_renewal,
        )

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        return self._wire.call(
            "release",
            {"res": resource, "epoch": epoch},
            lambda: self.inner.release(resource, epoch, owner),
            _describe_release,
        )

    def report(
        self, resource: str, epoch: int, holder: str, kind: RecordKind, detail: dict[str, object]
    ) -> None:
        self._wire.call(
            "report",
            {"res": resource, "epoch": epoch, "kind": kind.value},
            lambda: self.inner.report(resource, epoch, holder, kind, detail),
            _applied,
            faults=False,
        )

    # Queue calls are recorded (never faulted): a release may hand the lease to a waiter that
    # gives up before it sees the grant; its leave then takes that lease (a grant, recorded like
    # try_grant's) or releases it. The checker needs them to account for grants and releases no
    # try_grant or release of the history made.

    def enqueue(self, request: GrantRequest) -> Ticket:
        return self._wire.call(
            "enqueue",
            {"res": request.resource, "ttl": request.ttl},
            lambda: self.inner.enqueue(request),
            _applied,
            faults=False,
        )

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        return self._wire.call(
            "leave",
            {"res": ticket.resource, "ticket": True, "take": take},
            lambda: self.inner.leave(ticket, take),
            _describe_leave,
            faults=False,
        )

    # -- pass-through ---------------------------------------------------------------------------

    def wait(self, ticket: Ticket, timeout: float) -> None:
        self.inner.wait(ticket, timeout)

    def current(self, resource: str) -> LeaseInfo | None:
        return self.inner.current(resource)

    def last_epoch(self, resource: str) -> int:
        return self.inner.last_epoch(resource)

    def resources(self) -> list[str]:
        return self.inner.resources()

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        self.inner.proclaim(resource, epoch, owner, value)

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        return self.inner.records(resource, after, limit)

    def watch(self, resource: str, after: int, timeout: float) -> None:
        self.inner.watch(resource, after, timeout)

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        return self.inner.advance(minimum, floors, detail)

    def close(self) -> None:
        self.inner.close()


def _grant_fields(request: GrantRequest, ticket: Ticket | None) -> dict[str, Any]:
    return {
        "res": request.resource,
        "ttl": request.ttl,
        "rid": request.request_id,
        "ticket": ticket is not None,
    }


def _describe_grant(request: GrantRequest) -> Callable[[Granted | Blocked], dict[str, Any]]:
    def describe(result: Granted | Blocked) -> dict[str, Any]:
        if isinstance(result, Granted):
            return {
                "applied": True,
                "granted": result.epoch,
                "ttl": result.ttl,
                "expires_in": round(result.expires_in, 6),
                "replayed": result.owner != request.owner,
            }
        return {"applied": False, "blocked": True, "epoch": result.epoch}

    return describe


def _describe_renewal(remaining: float) -> dict[str, Any]:
    return {"applied": True, "remaining": round(remaining, 6)}


def _describe_release(released: bool) -> dict[str, Any]:
    return {"applied": bool(released), "released": bool(released)}


def _applied(_: object) -> dict[str, Any]:
    return {"applied": True}


def _describe_leave(result: Granted | None) -> dict[str, Any]:
    if result is None:
        return {"applied": True}
    return {
        "applied": True,
        "granted": result.epoch,
        "ttl": result.ttl,
        "expires_in": round(result.expires_in, 6),
    }


class AsyncRecordingBackend:
    """:class:`RecordingBackend` around an asyncio backend: the same events, faults and truth
    (``fenced verify --api async``). Delays suspend the calling task."""

    def __init__(self, inner: AsyncCoordinatorBackend, recorder: Recorder, plan: FaultPlan) -> None:
        self.inner = inner
        self.url = inner.url
        self.coordinator_id = inner.coordinator_id
        self.capabilities = inner.capabilities
        self._wire = _Wire(recorder, plan, "c.send", "c.reply")

    @property
    def plan(self) -> FaultPlan:
        return self._wire.plan

    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        return await self._wire.acall(
            "try_grant",
            _grant_fields(request, ticket),
            lambda: self.inner.try_grant(request, ticket),
            _describe_grant(request),
        )

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return await self._wire.acall(
            "renew",
            {"res": resource, "epoch": epoch, "ttl": ttl},
            lambda: self.inner.renew(resource, epoch, owner, ttl),
            _describe_renewal,
        )

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        return await self._wire.acall(
            "release",
            {"res": resource, "epoch": epoch},
            lambda: self.inner.release(resource, epoch, owner),
            _describe_release,
        )

    async def report(
        self, resource: str, epoch: int, holder: str, kind: RecordKind, detail: dict[str, object]
    ) -> None:
        await self._wire.acall(
            "report",
            {"res": resource, "epoch": epoch, "kind": kind.value},
            lambda: self.inner.report(resource, epoch, holder, kind, detail),
            _applied,
            faults=False,
        )

    async def enqueue(self, request: GrantRequest) -> Ticket:
        return await self._wire.acall(
            "enqueue",
            {"res": request.resource, "ttl": request.ttl},
            lambda: self.inner.enqueue(request),
            _applied,
            faults=False,
        )

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        return await self._wire.acall(
            "leave",
            {"res": ticket.resource, "ticket": True, "take": take},
            lambda: self.inner.leave(ticket, take),
            _describe_leave,
            faults=False,
        )

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        await self.inner.wait(ticket, timeout)

    async def current(self, resource: str) -> LeaseInfo | None:
        return await self.inner.current(resource)

    async def last_epoch(self, resource: str) -> int:
        return await self.inner.last_epoch(resource)

    async def resources(self) -> list[str]:
        return await self.inner.resources()

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        await self.inner.proclaim(resource, epoch, owner, value)

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        return await self.inner.records(resource, after, limit)

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        await self.inner.watch(resource, after, timeout)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _version(v: Version) -> dict[str, Any]:
    return {"applied": True, "version": v.version, "epoch": v.epoch}


def _publication(p: Publication) -> dict[str, Any]:
    return {"applied": True, "object_id": p.object_id, "pub_epoch": p.epoch, "sha": p.sha256}


class RecordingStore:
    """A fenced :class:`~fenced.Store` (``name``: ``S`` or ``M``) whose calls are recorded.

    ``fence``, ``put`` and ``publish`` are recorded as ``s.send``/``s.reply`` and faulted by the
    plan; ``get``, ``latest`` and ``read`` are recorded as one ``s.read`` event each (with the
    time the read started, ``t0``). Extra keyword arguments of ``put``/``publish`` (``meta``) are
    recorded with the send: the worker's read-modify-write base, the retry number.
    """

    def __init__(self, store: Store, name: str, recorder: Recorder, plan: FaultPlan) -> None:
        self.store = store
        self.name = name
        self._rec = recorder
        self._wire = _Wire(recorder, plan, "s.send", "s.reply")

    @property
    def mode(self) -> Mode:
        return self.store.mode

    @property
    def plan(self) -> FaultPlan:
        return self._wire.plan

    def __repr__(self) -> str:
        return f"<verify store {self.name} {self.store.url} {self.mode}>"

    def fence(self, token: FencingToken) -> int:
        return self._wire.call(
            "fence",
            {"store": self.name, "res": token.resource, "epoch": token.epoch},
            lambda: self.store.fence(token),
            lambda floor: {"applied": True, "floor": floor},
        )

    def put(
        self,
        token: FencingToken,
        key: str,
        value: bytes,
        *,
        op_id: str,
        if_version: int | None,
        meta: dict[str, Any],
    ) -> Version:
        fields = {
            "store": self.name,
            "res": token.resource,
            "epoch": token.epoch,
            "key": key,
            "op_id": op_id,
            "if_version": if_version,
            **meta,
        }
        return self._wire.call(
            "put",
            fields,
            lambda: self.store.put(token, key, value, op_id=op_id, if_version=if_version),
            _version,
        )

    def publish(
        self, token: FencingToken, data: bytes, *, name: str, op_id: str, meta: dict[str, Any]
    ) -> Publication:
        fields = {
            "store": self.name,
            "res": token.resource,
            "epoch": token.epoch,
            "name": name,
            "op_id": op_id,
            "sha": hashlib.sha256(data).hexdigest(),
            "size": len(data),
            **meta,
        }
        return self._wire.call(
            "publish",
            fields,
            lambda: self.store.publish(token, data, name=name, op_id=op_id),
            _publication,
        )

    def get(self, resource: str, key: str) -> Item | None:
        t0 = self._rec.now()
        try:
            item = self.store.get(resource, key)
        except FencedError as error:
            self._rec.emit(
                "s.read", t0=t0, store=self.name, op="get", key=key, **error_fields(error)
            )
            raise
        self._rec.emit(
            "s.read",
            t0=t0,
            store=self.name,
            op="get",
            key=key,
            version=None if item is None else item.version,
            epoch=None if item is None else item.epoch,
        )
        return item

    def floor(self, resource: str) -> int | None:
        """The store's floor of ``resource`` (recorded as an ``s.read`` of op ``floor``)."""
        t0 = self._rec.now()
        floor = self.store.floor(resource)
        self._rec.emit("s.read", t0=t0, store=self.name, op="floor", floor=floor)
        return floor

    def latest(self, resource: str, name: str) -> Publication | None:
        t0 = self._rec.now()
        found = self.store.latest(resource, name)
        pointer = None
        if found is not None:
            pointer = {"epoch": found.epoch, "object_id": found.object_id, "sha": found.sha256}
        self._rec.emit("s.read", t0=t0, store=self.name, op="latest", name=name, pointer=pointer)
        return found

    def read(self, resource: str, name: str) -> bytes | None:
        """The current publication's bytes (checked by the store against its SHA-256), or None."""
        t0 = self._rec.now()
        try:
            data: bytes | None = self.store.read(resource, name)
        except LookupError:
            data = None
        except FencedError as error:
            self._rec.emit(
                "s.read", t0=t0, store=self.name, op="read", name=name, **error_fields(error)
            )
            raise
        sha = None if data is None else hashlib.sha256(data).hexdigest()
        self._rec.emit("s.read", t0=t0, store=self.name, op="read", name=name, sha=sha)
        return data

"""The client's logic, once, for the sync and the asyncio client: each backend step is a
generator that yields what to do (:class:`Send` a request to one server, or :class:`Pause`) and
receives the reply; a driver (:mod:`._backend` with httpx's ``Client``, :mod:`._aio` with its
``AsyncClient``) performs the I/O. Failover between the servers of one coordinator, the kept
places of waiters and the accounting of waited time live here, so both faces behave alike.

Failover: a request goes to the current server; when that server cannot be reached (nothing was
sent) or answers 503 (nothing happened), to the next one, each at most once per request. A
server that serves another coordinator (another id) is skipped. A reply lost after the request
was sent is not retried here: :class:`~fenced.OutcomeUnknown` for a mutating request, which its
caller retries with the same request id.

Waiting: a ticket is a place in a server's queue named by a request id. ``wait`` is a long poll
of ``:acquire`` for that id; a grant it returns is handed to the next ``try_grant`` with its
remaining time reduced by the time since the poll was *sent* plus nothing for the time the
server held it before granting (it says how long: ``waited``), so the local deadline never
counts from later than in-process. A waiter whose servers are away (restarting, killed) keeps
its ticket: it pauses, then asks again with the same request id, and its place is taken again.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator.backends.http._wire import (
    Call,
    HttpSettings,
    acquire_call,
    bad_reply,
    blocked_of,
    granted_of,
    lease_info_of,
    leases_call,
    records_of,
)
from fenced.core._errors import Busy, FencedError, OutcomeUnknown, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

__all__ = ["HttpSession", "HttpTicket", "Pause", "Plan", "Reply", "Send"]

T = TypeVar("T")
Reply = tuple[int, Any]
"""An answer's status and decoded JSON body (None when it has none)."""

RETRY_PAUSE = 0.2
"""Seconds a waiter pauses before asking again when no server answered."""


@dataclass(frozen=True, slots=True)
class Send:
    """Send ``call`` to the server at ``base``; the driver sends back its :data:`Reply`, or
    throws the :class:`~fenced.FencedError` it stands for."""

    base: str
    call: Call


@dataclass(frozen=True, slots=True)
class Pause:
    """Sleep ``seconds``; the driver sends back None."""

    seconds: float


Plan = Generator[Send | Pause, Reply | None, T]


class HttpTicket:
    """A place in the server's queue of ``resource``, named by ``request_id``."""

    __slots__ = ("_backend", "blocked", "handed", "request", "request_id", "resource")

    def __init__(self, backend: object, request: GrantRequest, request_id: str) -> None:
        self._backend = backend
        self.resource = request.resource
        self.request = request
        self.request_id = request_id
        self.blocked = Blocked(None, 0, 0.0, RETRY_PAUSE)
        """What the last answer said about the lease (kept while the servers are away)."""
        self.handed: tuple[Granted, float] | None = None
        """A grant a poll returned, and when its remaining time counts from (monotonic): the
        poll's send time plus the time the server says it held the poll."""

    def __repr__(self) -> str:
        return f"<HttpTicket {self.resource} {self.request_id}>"


class HttpSession:
    """Which server is current, and what each backend step sends (module docstring)."""

    def __init__(self, settings: HttpSettings) -> None:
        self.settings = settings
        self.serving = 0
        """The index in ``settings.bases`` of the server requests go to (sticky)."""
        self.coordinator_id = ""
        self.capabilities: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return ",".join(self.settings.bases)

    # -- transport --------------------------------------------------------------------------
    def exchange(self, call: Call) -> Plan[Reply]:
        """``call`` to the current server, failing over (module docstring)."""
        bases = self.settings.bases
        first = self.serving
        failure: FencedError | None = None
        for attempt in range(len(bases)):
            index = (first + attempt) % len(bases)
            try:
                if index != self.serving:
                    yield from self._check_identity(bases[index])
                reply = yield Send(bases[index], call)
            except Unavailable as error:
                failure = error
                continue
            assert reply is not None
            self.serving = index
            return reply
        assert failure is not None
        raise failure

    def _check_identity(self, base: str) -> Plan[None]:
        """Unavailable unless ``base`` serves this session's coordinator."""
        reply = yield Send(base, Call("GET", "/v1/coordinator", what="connect"))
        assert reply is not None
        found = reply[1].get("coordinator_id") if isinstance(reply[1], Mapping) else None
        if self.coordinator_id and found != self.coordinator_id:
            raise Unavailable(
                f"{base} serves coordinator {found!r}, not {self.coordinator_id!r}: skipped"
            )

    def _json(self, call: Call) -> Plan[Mapping[str, Any]]:
        _, body = yield from self.exchange(call)
        if not isinstance(body, Mapping):
            raise bad_reply(call, ValueError("not a JSON object"))
        return body

    def connect(self) -> Plan[None]:
        """Learn the coordinator's id and capabilities from the first server that answers."""
        call = Call("GET", "/v1/coordinator", what="connect")
        body = yield from self._json(call)
        coordinator_id, capabilities = body.get("coordinator_id"), body.get("capabilities")
        if not isinstance(coordinator_id, str) or not isinstance(capabilities, list):
            base = self.settings.bases[self.serving]
            raise Unavailable(f"{base} does not answer as fenced serve")
        self.coordinator_id = coordinator_id
        self.capabilities = frozenset(str(c) for c in capabilities)

    # -- grants and the queue ---------------------------------------------------------------
    def try_grant(self, request: GrantRequest, own: HttpTicket | None) -> Plan[Granted | Blocked]:
        if own is not None and own.handed is not None:
            handed = _handed(own)
            if handed is not None:
                return handed
            # It ended before it was taken (a caller paused past it): the server says what
            # its request id has now (410 lease-lost once its lease ended), as in-process.
        rid = request.request_id if own is None else own.request_id
        call = acquire_call(request if own is None else own.request, rid, 0.0, own is not None)
        try:
            status, body = yield from self.exchange(call)
        except Busy as busy:
            return Blocked(busy.holder, busy.epoch, busy.remaining, None)
        except (OutcomeUnknown, Unavailable):
            if own is None:
                raise
            # A waiter whose server went away keeps waiting (its request id keeps its grant,
            # if any, on the backend): as blocked as last seen, asked again after a pause.
            return own.blocked
        answer = _answer(call, status, body)
        if own is not None and isinstance(answer, Blocked):
            own.blocked = answer
        return answer

    def enqueue(self, ticket: HttpTicket) -> Plan[HttpTicket]:
        sent = time.monotonic()
        call = acquire_call(ticket.request, ticket.request_id, 0.0, True)
        status, body = yield from self.exchange(call)
        answer = _answer(call, status, body)
        if isinstance(answer, Blocked):
            ticket.blocked = answer
        else:
            ticket.handed = (answer, sent + _waited(body))
        return ticket

    def wait(self, own: HttpTicket, timeout: float) -> Plan[None]:
        if own.handed is not None:
            return
        call = acquire_call(own.request, own.request_id, max(timeout, 0.0), True)
        sent = time.monotonic()
        try:
            status, body = yield from self.exchange(call)
        except (OutcomeUnknown, Unavailable):
            # The next try_grant asks again, with the same request id, after a pause that
            # keeps a waiter from spinning while its servers are down or restarting.
            yield Pause(min(max(timeout, 0.0), RETRY_PAUSE))
            return
        answer = _answer(call, status, body)
        if isinstance(answer, Granted):
            own.handed = (answer, sent + _waited(body))
        else:
            own.blocked = answer

    def leave(self, own: HttpTicket, take: bool) -> Plan[Granted | None]:
        if own.handed is not None:
            granted = _handed(own)
            if granted is not None:
                if take:
                    return granted
                yield from self.release(own.resource, granted.epoch, granted.owner)
                return None
        call = leases_call(own.resource, "leave", {"request_id": own.request_id, "take": take})
        status, body = yield from self.exchange(call)
        if status == 204 or not take:
            return None
        return _granted(call, body)

    # -- a live lease -----------------------------------------------------------------------
    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> Plan[float]:
        call = leases_call(resource, "renew", {"epoch": epoch, "owner": owner, "ttl": ttl})
        body = yield from self._json(call)
        expires_in = body.get("expires_in")
        if not isinstance(expires_in, int | float) or isinstance(expires_in, bool):
            raise bad_reply(call, ValueError("expires_in"))
        return float(expires_in)

    def release(self, resource: str, epoch: int, owner: str) -> Plan[bool]:
        call = leases_call(resource, "release", {"epoch": epoch, "owner": owner})
        released = (yield from self._json(call)).get("released")
        if type(released) is not bool:
            raise bad_reply(call, ValueError("released"))
        return released

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> Plan[None]:
        body = {"epoch": epoch, "owner": owner, "value": value}
        yield from self.exchange(leases_call(resource, "proclaim", body))

    def current(self, resource: str) -> Plan[LeaseInfo | None]:
        call = leases_call(resource, "")
        body = yield from self._json(call)
        try:
            return lease_info_of(body)
        except (ValueError, TypeError) as error:
            raise bad_reply(call, error) from error

    def last_epoch(self, resource: str) -> Plan[int]:
        call = leases_call(resource, "epoch")
        found = (yield from self._json(call)).get("last_epoch")
        if type(found) is not int:
            raise bad_reply(call, ValueError("last_epoch"))
        return found

    def resources(self) -> Plan[list[str]]:
        call = Call("GET", "/v1/leases", what="resources")
        found = (yield from self._json(call)).get("resources")
        if not isinstance(found, list) or not all(isinstance(r, str) for r in found):
            raise bad_reply(call, ValueError("resources"))
        return list(found)

    # -- records ----------------------------------------------------------------------------
    def records(self, resource: str | None, after: int, limit: int) -> Plan[list[Record]]:
        params = {"after": after, "limit": limit}
        if resource is None:
            call = Call("GET", "/v1/records", params=params, what="history")
        else:
            call = leases_call(resource, "history", None, **params)
        body = yield from self._json(call)
        try:
            return records_of(body)
        except (ValueError, TypeError) as error:
            raise bad_reply(call, error) from error

    def report(
        self, resource: str, epoch: int, holder: str, kind: RecordKind, detail: dict[str, object]
    ) -> Plan[None]:
        if kind not in (RecordKind.RENEWAL_FAILED, RecordKind.LOST):
            return
        body = {"epoch": epoch, "holder": holder, "kind": kind.value, "detail": _plain(detail)}
        yield from self.exchange(leases_call(resource, "report", body))

    def watch(self, resource: str, after: int, timeout: float) -> Plan[None]:
        call = leases_call(resource, "watch", None, after=after, timeout=max(timeout, 0.0))
        yield from self.exchange(dataclasses.replace(call, waits=max(timeout, 0.0)))

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> Plan[int]:
        body = {"minimum": minimum, "floors": floors, "detail": _plain(detail)}
        call = Call("POST", "/v1/coordinator:advance", body, {}, mutating=True, what="advance")
        reached = (yield from self._json(call)).get("minimum")
        if type(reached) is not int:
            raise bad_reply(call, ValueError("minimum"))
        return reached


def new_ticket(backend: object, request: GrantRequest) -> HttpTicket:
    """A ticket of ``backend`` for ``request``: its request id, or a new one."""
    rid = request.request_id or "fenced-queue-" + secrets.token_hex(12)
    return HttpTicket(backend, request, rid)


def _granted(call: Call, body: Any) -> Granted:
    try:
        return granted_of(body)
    except (ValueError, TypeError, AttributeError) as error:
        raise bad_reply(call, error) from error


def _answer(call: Call, status: int, body: Any) -> Granted | Blocked:
    if status == 202:
        try:
            return blocked_of(body)
        except (ValueError, TypeError, AttributeError) as error:
            raise bad_reply(call, error) from error
    return _granted(call, body)


def _plain(detail: Mapping[str, object]) -> dict[str, object]:
    """A record's detail as JSON scalars (anything else as its ``str``)."""
    return {k: v if isinstance(v, str | int | float | bool) or v is None else str(v)
            for k, v in detail.items()}  # fmt: skip


def _waited(body: Any) -> float:
    """The seconds the server held a request (0 if it does not say): the lease was granted at
    the end of them, so counting from ``send time + waited`` is as safe as counting from the
    send time of a request that did not wait (the reply's travel is still counted)."""
    waited = body.get("waited", 0.0) if isinstance(body, Mapping) else 0.0
    if type(waited) not in (int, float) or not 0 <= waited < 86400:
        return 0.0
    return float(waited)


def _handed(ticket: HttpTicket) -> Granted | None:
    """The grant a poll returned, its remaining time counted from ``ticket.handed``'s time;
    None if none is left: a lease that ended before its waiter took it is never returned (a
    newer epoch may have been granted since; a release seen found verify's token-monotonic
    broken by such a grant, of no time, returned after a pause)."""
    assert ticket.handed is not None
    granted, since = ticket.handed
    ticket.handed = None
    left = granted.expires_in - (time.monotonic() - since)
    return dataclasses.replace(granted, expires_in=left) if left > 0 else None

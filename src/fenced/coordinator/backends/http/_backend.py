"""``HttpBackend``: the coordinator backend contract over ``fenced serve``'s ``/v1`` API, on
kept-alive ``http.client`` connections (:mod:`._connections`).

The :class:`~fenced.Coordinator` above it is the in-process one: it validates, waits, computes
the local deadline from the send time of the granting request and holds leases exactly as with
any other backend. What each step sends and how servers fail over is :mod:`._session`'s, shared
with the asyncio client (:mod:`._aio`); this module performs its requests and pauses.

Errors: a refused connection is :class:`~fenced.Unavailable` (nothing was sent); a reply lost
after a mutating request was sent is :class:`~fenced.OutcomeUnknown` (retry with the same
``request_id``); problem documents become the exceptions they name.
"""

from __future__ import annotations

import time
from typing import TypeVar

from fenced._drivers.http import request_headers, tls_context
from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket, owned_ticket
from fenced.coordinator.backends.http._connections import Connections
from fenced.coordinator.backends.http._session import (
    HttpSession,
    HttpTicket,
    Pause,
    Plan,
    Reply,
    Send,
    new_ticket,
)
from fenced.coordinator.backends.http._transport import (
    reply_of,
    timeout_of,
)
from fenced.coordinator.backends.http._wire import parse_url
from fenced.core._errors import FencedError
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

__all__ = ["HttpBackend"]

T = TypeVar("T")


class HttpBackend:
    """The client of ``fenced serve`` (module docstring). Thread-safe: one pool of connections
    serves every thread."""

    def __init__(self, url: str) -> None:
        settings = parse_url(url)
        self.url = url
        self._session = HttpSession(settings)
        self._connections = Connections(request_headers(), tls_context(settings.options))
        try:
            self._run(self._session.connect())
        except BaseException:
            self._connections.close()
            raise
        self.coordinator_id = self._session.coordinator_id
        self.capabilities = self._session.capabilities

    def __repr__(self) -> str:
        return f"<HttpBackend {self._session!r}>"

    def _run(self, plan: Plan[T]) -> T:
        """Perform ``plan``'s requests and pauses until it returns or raises."""
        reply: Reply | None = None
        error: FencedError | None = None
        while True:
            try:
                step = plan.send(reply) if error is None else plan.throw(error)
            except StopIteration as stop:
                result: T = stop.value
                return result
            reply, error = None, None
            if isinstance(step, Pause):
                time.sleep(step.seconds)
                continue
            try:
                reply = self._request(step)
            except FencedError as failure:
                error = failure

    def _request(self, send: Send) -> Reply:
        timeout = timeout_of(self._session.settings, send.call)
        status, content = self._connections.request(send.base, send.call, timeout)
        return reply_of(send.call, status, content)

    def _own(self, ticket: Ticket | None, resource: str) -> HttpTicket | None:
        return owned_ticket(self, ticket, resource, HttpTicket)

    # -- the backend contract ---------------------------------------------------------------
    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        return self._run(self._session.try_grant(request, self._own(ticket, request.resource)))

    def enqueue(self, request: GrantRequest) -> Ticket:
        return self._run(self._session.enqueue(new_ticket(self, request)))

    def wait(self, ticket: Ticket, timeout: float) -> None:
        own = self._own(ticket, ticket.resource)
        assert own is not None
        self._run(self._session.wait(own, timeout))

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        own = self._own(ticket, ticket.resource)
        assert own is not None
        return self._run(self._session.leave(own, take))

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return self._run(self._session.renew(resource, epoch, owner, ttl))

    def release(self, resource: str, epoch: int, owner: str) -> bool:
        return self._run(self._session.release(resource, epoch, owner))

    def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        self._run(self._session.proclaim(resource, epoch, owner, value))

    def current(self, resource: str) -> LeaseInfo | None:
        return self._run(self._session.current(resource))

    def last_epoch(self, resource: str) -> int:
        return self._run(self._session.last_epoch(resource))

    def resources(self) -> list[str]:
        return self._run(self._session.resources())

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        return self._run(self._session.records(resource, after, limit))

    def report(
        self, resource: str, epoch: int, holder: str, kind: RecordKind, detail: dict[str, object]
    ) -> None:
        self._run(self._session.report(resource, epoch, holder, kind, detail))

    def watch(self, resource: str, after: int, timeout: float) -> None:
        self._run(self._session.watch(resource, after, timeout))

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        return self._run(self._session.advance(minimum, floors, detail))

    def close(self) -> None:
        self._connections.close()

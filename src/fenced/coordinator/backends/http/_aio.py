"""``AsyncHttpBackend``: the asyncio backend contract over ``fenced serve``'s ``/v1`` API, on
httpx's ``AsyncClient``: the same steps, failover and errors as :class:`._backend.HttpBackend`
(both perform :mod:`._session`'s plans), with no thread. A cancelled call closes its request's
connection; a waiter's place on the server is then kept for the server's ``keep`` seconds and
left (the same as a lost client), so cancelling never leaves a lease to a task that is gone
beyond what the backend contract allows (:class:`~fenced.aio.AsyncCoordinator` leaves its ticket
on cancellation).
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import httpx

from fenced._drivers.http import NODELAY, request_headers, tls_context
from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket, owned_ticket
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
    failure_of,
    reply_of,
    timeout_of,
)
from fenced.coordinator.backends.http._wire import parse_url
from fenced.core._errors import FencedError
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind

__all__ = ["AsyncHttpBackend", "open_async_http"]

T = TypeVar("T")


async def open_async_http(url: str) -> AsyncHttpBackend:
    """Open the asyncio client of the ``fenced serve`` at ``url`` (``http(s)://host:port[,…]``):
    asks the first server that answers for the coordinator's id. ConfigurationError for a bad
    URL; Unavailable when no server answers."""
    backend = AsyncHttpBackend(url)
    try:
        await backend._run(backend._session.connect())
    except BaseException:
        await backend.aclose()
        raise
    backend.coordinator_id = backend._session.coordinator_id
    backend.capabilities = backend._session.capabilities
    return backend


class AsyncHttpBackend:
    """The asyncio client of ``fenced serve`` (module docstring); open it with
    :func:`open_async_http`. Used from one event loop."""

    def __init__(self, url: str) -> None:
        settings = parse_url(url)
        self.url = url
        self._session = HttpSession(settings)
        context = tls_context(settings.options)
        transport = httpx.AsyncHTTPTransport(
            verify=True if context is None else context, socket_options=NODELAY
        )
        # No proxy from the environment: a proxy is a hop that can lose replies unseen.
        self._client = httpx.AsyncClient(
            transport=transport,
            headers=request_headers(),
            timeout=httpx.Timeout(settings.options.timeout),
            trust_env=False,
        )
        self.coordinator_id = ""
        self.capabilities: frozenset[str] = frozenset()

    def __repr__(self) -> str:
        return f"<AsyncHttpBackend {self._session!r}>"

    async def _run(self, plan: Plan[T]) -> T:
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
                await asyncio.sleep(step.seconds)
                continue
            try:
                reply = await self._request(step)
            except FencedError as failure:
                error = failure

    async def _request(self, send: Send) -> Reply:
        call = send.call
        try:
            reply = await self._client.request(
                call.method, send.base + call.path, json=call.body,
                params=dict(call.params) or None,
                timeout=timeout_of(self._session.settings, call),
            )  # fmt: skip
        except httpx.TransportError as error:
            raise failure_of(call, send.base, error) from error
        return reply_of(call, reply.status_code, reply.content)

    def _own(self, ticket: Ticket | None, resource: str) -> HttpTicket | None:
        return owned_ticket(self, ticket, resource, HttpTicket)

    # -- the backend contract ---------------------------------------------------------------
    async def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        own = self._own(ticket, request.resource)
        return await self._run(self._session.try_grant(request, own))

    async def enqueue(self, request: GrantRequest) -> Ticket:
        return await self._run(self._session.enqueue(new_ticket(self, request)))

    async def wait(self, ticket: Ticket, timeout: float) -> None:
        own = self._own(ticket, ticket.resource)
        assert own is not None
        await self._run(self._session.wait(own, timeout))

    async def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        own = self._own(ticket, ticket.resource)
        assert own is not None
        return await self._run(self._session.leave(own, take))

    async def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        return await self._run(self._session.renew(resource, epoch, owner, ttl))

    async def release(self, resource: str, epoch: int, owner: str) -> bool:
        return await self._run(self._session.release(resource, epoch, owner))

    async def proclaim(self, resource: str, epoch: int, owner: str, value: str) -> None:
        await self._run(self._session.proclaim(resource, epoch, owner, value))

    async def current(self, resource: str) -> LeaseInfo | None:
        return await self._run(self._session.current(resource))

    async def last_epoch(self, resource: str) -> int:
        return await self._run(self._session.last_epoch(resource))

    async def resources(self) -> list[str]:
        return await self._run(self._session.resources())

    async def records(
        self, resource: str | None, after: int = 0, limit: int = 1000
    ) -> list[Record]:
        return await self._run(self._session.records(resource, after, limit))

    async def report(
        self, resource: str, epoch: int, holder: str, kind: RecordKind, detail: dict[str, object]
    ) -> None:
        await self._run(self._session.report(resource, epoch, holder, kind, detail))

    async def watch(self, resource: str, after: int, timeout: float) -> None:
        await self._run(self._session.watch(resource, after, timeout))

    async def aclose(self) -> None:
        await self._client.aclose()

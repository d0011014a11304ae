"""``/v1/leases``: acquire (long poll), renew, release, current, history, election steps.

Each route validates with the same functions as the library (``plan_acquire``, the name and ttl
checks) before any I/O and answers a refusal with the same exception class, as a problem
document (:mod:`fenced.core._problems`). Resource names contain no ``:``, so custom methods are
spelled ``/v1/leases/{resource}:acquire`` (Google's AIP-136 style) and a name never collides
with an action.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from fenced.coordinator._requests import lease_policy, plan_acquire
from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.core._errors import Busy, ConfigurationError, Unavailable
from fenced.core._names import validate_resource
from fenced.core._records import Record, RecordKind
from fenced.core._token import FencingToken
from fenced.server._auth import read_scope, require
from fenced.server._models import (
    AcquireBody,
    CurrentLease,
    Epoch,
    LeaseGrant,
    LeaseInfoBody,
    LeaveBody,
    ProclaimBody,
    RecordBody,
    Records,
    ReleaseBody,
    Released,
    RenewBody,
    Renewed,
    ReportBody,
    Resources,
    Waiting,
)
from fenced.server._places import Place
from fenced.server._state import ServerState, State

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["leases"])
MAX_RECORDS = 10_000


def _grant(
    state: ServerState,
    resource: str,
    granted: Granted,
    since: float | None = None,
    asked: float | None = None,
) -> LeaseGrant:
    """The body of a grant; ``since``: when the request arrived, ``asked``: when the backend
    call that granted it began (``time.monotonic()``). ``waited`` is ``asked - since``: the
    backend computed ``expires_in`` after ``asked``, so a client that counts the remaining time
    from its send time + ``waited`` never counts from later than the server did (measured when
    the answer is built instead, it would include the event loop's delay in resuming this
    request: under load the client's deadline came out milliseconds past the lease's end)."""
    token = FencingToken._of_checked(state.backend.coordinator_id, resource, granted.epoch)
    return LeaseGrant(
        resource=resource,
        epoch=granted.epoch,
        token=str(token),
        owner=granted.owner,
        holder=granted.holder,
        ttl=granted.ttl,
        expires_in=granted.expires_in,
        coordinator_id=state.backend.coordinator_id,
        waited=0.0 if since is None or asked is None else max(asked - since, 0.0),
    )


@router.post(
    "/leases/{resource:path}:acquire",
    dependencies=[require("hold")],
    response_model=None,
    responses={
        200: {"model": LeaseGrant, "description": "Granted."},
        202: {"model": Waiting, "description": "Not granted yet; the place is kept."},
    },
    summary="Acquire a lease (long poll)",
)
async def acquire(
    resource: str, body: AcquireBody, state: State, response: Response
) -> LeaseGrant | Waiting:
    """Grant the lease, waiting up to ``wait`` seconds (at most the server's poll bound).

    ``200``: granted. ``202``: not yet, the place in the queue is kept for the next poll with
    the same ``request_id`` (only with a ``request_id``, and ``wait > 0`` or ``queue``).
    ``409 busy``: not granted and no place kept. A ``request_id`` seen before returns the same
    lease while it lives, ``410 lease-lost`` once it has ended: never a second epoch.
    """
    backend = state.backend
    plan = plan_acquire(
        resource, body.ttl, body.wait, body.holder, body.request_id, None, body.value,
        backend.capabilities, backend.url,
    )  # fmt: skip
    if body.owner is not None:
        plan = dataclasses.replace(
            plan, request=dataclasses.replace(plan.request, owner=body.owner)
        )
    if body.queue and plan.request.request_id is None:
        raise ConfigurationError("queue=true keeps a place in the queue: it needs a request_id")
    rid = plan.request.request_id
    keeps = rid is not None and (body.wait > 0 or body.queue)
    arrived = time.monotonic()
    deadline = arrived + min(body.wait, state.poll)
    if rid is None:
        state.places.poll_started()
        try:
            return await _poll(state, plan.request, None, None, arrived, deadline, keeps, response)
        finally:
            state.places.poll_ended()
    key = (plan.request.resource, rid)
    async with state.places.polling(key) as place:
        return await _poll(state, plan.request, key, place, arrived, deadline, keeps, response)


async def _poll(
    state: ServerState,
    request: GrantRequest,
    key: tuple[str, str] | None,
    place: Place | None,
    arrived: float,
    deadline: float,
    keeps: bool,
    response: Response,
) -> LeaseGrant | Waiting:
    backend, places = state.backend, state.places
    if place is not None:
        request = place.request  # the place's first poll chose owner, ttl and holder
    ticket = None if place is None else place.ticket
    try:
        while True:
            asked = time.monotonic()
            result = await backend.try_grant(request, ticket)
            if isinstance(result, Granted):
                if place is not None and key is not None:
                    places.forget(key, place)
                ticket = None  # the grant consumed it
                return _grant(state, request.resource, result, arrived, asked)
            now = time.monotonic()
            if now >= deadline or places.stopping:
                return await _not_yet(
                    state, request, key, place, ticket, result, arrived, keeps, response
                )
            if ticket is None:
                ticket = await backend.enqueue(request)
                if key is not None and keeps:
                    place = places.keep_place(key, request, ticket)
                continue
            timeout = deadline - now
            if result.retry_in is not None:
                timeout = min(timeout, max(result.retry_in, 0.0))
            await backend.wait(ticket, timeout)
    except asyncio.CancelledError:
        if not places.stopping:
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        if place is None and ticket is not None:  # an anonymous waiter: its place goes
            await _leave_anonymous(backend, ticket)
        raise Unavailable("fenced serve is shutting down: poll again (another server)") from None


async def _not_yet(
    state: ServerState,
    request: GrantRequest,
    key: tuple[str, str] | None,
    place: Place | None,
    ticket: object,
    blocked: Blocked,
    arrived: float,
    keeps: bool,
    response: Response,
) -> LeaseGrant | Waiting:
    """The poll's time is up: 202 with the place kept, or leave and 409 busy."""
    backend = state.backend
    if keeps and key is not None:
        if place is None:  # a refused try without a place yet: take one now
            ticket = await backend.enqueue(request)
            state.places.keep_place(key, request, ticket)
        response.status_code = 202
        return Waiting(
            resource=request.resource,
            request_id=key[1],
            holder=blocked.holder,
            epoch=blocked.epoch,
            remaining=blocked.remaining,
            keep=state.places.keep,
        )
    if ticket is not None:
        if place is not None and key is not None:
            state.places.forget(key, place)
        asked = time.monotonic()
        handed = await backend.leave(ticket, take=True)  # type: ignore[arg-type]
        if handed is not None:
            return _grant(state, request.resource, handed, arrived, asked)
    raise Busy(request.resource, blocked.holder, blocked.epoch, blocked.remaining)


async def _leave_anonymous(backend: AsyncCoordinatorBackend, ticket: object) -> None:
    await asyncio.shield(backend.leave(ticket))  # type: ignore[arg-type]


@router.post(
    "/leases/{resource:path}:leave",
    dependencies=[require("hold")],
    response_model=None,
    responses={
        200: {"model": LeaseGrant, "description": "A lease handed to the place, taken."},
        204: {"description": "Left (no lease was handed to the place)."},
    },
    summary="Leave the queue",
)
async def leave(resource: str, body: LeaveBody, state: State) -> LeaseGrant | Response:
    """Give up a kept place. With ``take``, a lease a release handed to the place meanwhile is
    returned (``200``); without, it is released and passed on. ``204`` otherwise."""
    name = validate_resource(resource)
    handed = await state.places.leave((name, body.request_id), body.take)
    if handed is None:
        return Response(status_code=204)
    return _grant(state, name, handed)


@router.post(
    "/leases/{resource:path}:renew",
    dependencies=[require("hold")],
    response_model=Renewed,
    summary="Renew a lease",
)
async def renew(resource: str, body: RenewBody, state: State) -> Renewed:
    """Extend this owner's live lease by ``ttl`` from now; ``410 lease-lost`` if it is not
    live or not this owner's (an expired lease is never revived)."""
    name = validate_resource(resource)
    ttl = lease_policy(body.ttl, None).ttl
    remaining = await state.backend.renew(name, body.epoch, body.owner, ttl)
    return Renewed(expires_in=remaining)


@router.post(
    "/leases/{resource:path}:release",
    dependencies=[require("hold")],
    response_model=Released,
    summary="Release",
)
async def release(resource: str, body: ReleaseBody, state: State) -> Released:
    """Release if this owner's lease is still at this epoch; ``released: false`` otherwise (a
    delayed release never affects a newer lease)."""
    name = validate_resource(resource)
    released = await asyncio.shield(state.backend.release(name, body.epoch, body.owner))
    return Released(released=released)


@router.post(
    "/leases/{resource:path}:proclaim",
    dependencies=[require("hold")],
    status_code=204,
    summary="Proclaim a value",
)
async def proclaim(resource: str, body: ProclaimBody, state: State) -> None:
    """Replace the advertised value of this owner's live lease (election), same epoch."""
    name = validate_resource(resource)
    await state.backend.proclaim(name, body.epoch, body.owner, body.value)


@router.post(
    "/leases/{resource:path}:report",
    dependencies=[require("hold")],
    status_code=204,
    summary="Report trouble",
)
async def report(resource: str, body: ReportBody, state: State) -> None:
    """A holder's report (a failed renewal, a loss) for the timeline. Best effort."""
    name = validate_resource(resource)
    await state.backend.report(name, body.epoch, body.holder, RecordKind(body.kind),
                               dict(body.detail))  # fmt: skip


@router.get(
    "/leases/{resource:path}:epoch",
    dependencies=[require("read")],
    response_model=Epoch,
    summary="Last epoch",
)
async def last_epoch(resource: str, state: State) -> Epoch:
    """The largest epoch granted or reserved for the resource (0: never)."""
    name = validate_resource(resource)
    return Epoch(resource=name, last_epoch=await state.backend.last_epoch(name))


@router.get(
    "/leases/{resource:path}:history",
    dependencies=[require("read")],
    response_model=Records,
    summary="History",
)
async def history(
    resource: str,
    state: State,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_RECORDS)] = 1000,
) -> Records:
    """The resource's records with ``seq > after``, oldest first."""
    name = validate_resource(resource)
    return _records(await state.backend.records(name, after, limit))


@router.get(
    "/leases/{resource:path}:watch",
    dependencies=[require("read")],
    status_code=204,
    summary="Wait for a record",
)
async def watch(
    resource: str,
    state: State,
    after: Annotated[int, Query(ge=0)] = 0,
    timeout: Annotated[float, Query(ge=0, allow_inf_nan=False)] = 10.0,
) -> None:
    """Return when the resource has a record with ``seq > after``, or after ``timeout``
    (at most the poll bound); then read ``:history``."""
    name = validate_resource(resource)
    state.places.poll_started()
    try:
        await state.backend.watch(name, after, min(timeout, state.poll))
    except asyncio.CancelledError:
        if not state.places.stopping:
            raise
    finally:
        state.places.poll_ended()


@router.get(
    "/leases/{resource:path}",
    dependencies=[require("read")],
    response_model=CurrentLease,
    summary="Current lease",
)
async def current(resource: str, state: State) -> CurrentLease:
    """The live lease of the resource (holder, epoch, remaining time), or ``lease: null``."""
    name = validate_resource(resource)
    info = await state.backend.current(name)
    if info is None:
        return CurrentLease(resource=name, lease=None)
    return CurrentLease(
        resource=name,
        lease=LeaseInfoBody(
            resource=info.resource,
            epoch=info.epoch,
            holder=info.holder,
            expires_in=info.expires_in,
            ttl=info.ttl,
            coordinator_id=info.coordinator_id,
            value=info.value,
        ),
    )


Scope = Annotated[tuple[str, ...] | None, Depends(read_scope)]


def _within(resource: str, scope: tuple[str, ...] | None) -> bool:
    return scope is None or resource.startswith(scope)


@router.get("/leases", response_model=Resources, summary="Resources")
async def resources(state: State, scope: Scope) -> Resources:
    """Every resource that was ever granted, sorted (with a key limited to name prefixes: the
    resources under them)."""
    found = await state.backend.resources()
    return Resources(resources=[resource for resource in found if _within(resource, scope)])


@router.get("/records", response_model=Records, summary="Every resource's history")
async def records(
    state: State,
    scope: Scope,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_RECORDS)] = 1000,
) -> Records:
    """The records of every resource with ``seq > after``, oldest first, at most ``limit``
    (with a key limited to name prefixes: those of the resources under them; a page is then
    short only at the end, as without a key)."""
    found: list[Record] = []
    while len(found) < limit:
        page = await state.backend.records(None, after, limit)
        found += [record for record in page if _within(record.resource, scope)]
        if len(page) < limit:
            break
        after = page[-1].seq
    return _records(found[:limit])


def _records(found: list[Record]) -> Records:
    return Records(records=[RecordBody.model_validate(record.to_json()) for record in found])

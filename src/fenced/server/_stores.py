"""``/v1/stores``: the stores a server serves by name (``--store NAME=URL``), the fenced gateway.

Every route calls the server's own :class:`~fenced.aio.AsyncStore`: the token is checked by the
store atomically with the change, exactly as in-process, and a refusal is the same exception
class, as a problem document (:mod:`fenced.core._problems`). Names contain no ``:``, so a key is
addressed as ``{resource}:{key}``, a publication as ``{resource}[:{name}]`` and a custom method
as ``{resource}:fence`` (AIP-136, as ``/v1/leases``). The store's own URL never leaves the server.

Mutations carry the fencing token in ``Fenced-Token`` (its text form; it must be for the
resource the path names) and an optional operation id in ``Idempotency-Key`` (a structured-field
string, or a bare value): a retry with the same key returns the first outcome and applies
nothing. A malformed token, key or name is a 4xx problem before anything is read from the store.

Bodies: a value (``PUT /items``) is at most 16 MiB and read whole; a publication (``PUT
/publications``) is streamed to the store as it arrives, never held whole (a bounded queue of
1 MiB chunks); a publication is streamed back by ``GET`` (a snapshot: the object the pointer
showed when the request arrived). A refused publication's body is read to its end and discarded,
so that the client gets the refusal instead of a cut connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from fenced._drivers.http import decode_sf_string
from fenced.aio._store import AsyncReader, AsyncStore
from fenced.core._errors import (
    AccessDenied,
    ConfigurationError,
    FencedError,
    NotAuthenticated,
    NotFound,
    Unavailable,
)
from fenced.core._names import validate_key, validate_publication_name, validate_resource
from fenced.core._problems import problem_of_error
from fenced.core._token import FencingToken
from fenced.fence._ops import validate_op_id
from fenced.fence._store import MAX_VALUE_BYTES
from fenced.fence._values import Publication
from fenced.fence.http._wire import (
    EPOCH_HEADER,
    IDEMPOTENCY_HEADER,
    OBJECT_HEADER,
    PUBLISHED_HEADER,
    TOKEN_HEADER,
    VERSION_HEADER,
    digest_header,
    etag,
    unquote_etag,
)
from fenced.server._auth import require
from fenced.server._models import Records
from fenced.server._state import State
from fenced.server._store_models import (
    Floors,
    GcBody,
    GcResult,
    RebindBody,
    Rebound,
    ResourceState,
    StoreFence,
    StoreInfo,
    StoreList,
    StorePublication,
    StoreVersion,
    records_body,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/stores", tags=["stores"])

OCTETS = "application/octet-stream"
MAX_TOKEN_CHARS = 1024
OPEN_ATTEMPTS = 5
"""A publication GET retries its consistent open this often while publishers race it."""

_TOKEN_DOC = {
    "name": TOKEN_HEADER,
    "in": "header",
    "required": True,
    "schema": {"type": "string"},
    "description": "The fencing token (text form) for the resource in the path.",
}
_IDEMPOTENCY_DOC = {
    "name": IDEMPOTENCY_HEADER,
    "in": "header",
    "required": False,
    "schema": {"type": "string"},
    "description": "Operation id: a retry with the same key returns the first outcome.",
}


async def _known_key(request: Request) -> None:
    """Any known API key may see which stores exist and their modes (a client needs them to
    open a store, whatever its scope); without a keys file everyone may."""
    authority = request.app.state.fenced.authority
    if authority is None:
        return
    try:
        authority.check(request.headers.get("authorization"), "read", None)
    except NotAuthenticated:
        raise
    except AccessDenied:
        pass


_checker: Callable[[Request], Awaitable[None]] = _known_key
KnownKey = Depends(_checker)


def _store(state: State, name: str) -> AsyncStore:
    store = state.stores.get(name)
    if store is None:
        raise NotFound(f"this server serves no store named {name[:200]!r}")
    return store


def _token(request: Request, resource: str) -> FencingToken:
    """The ``Fenced-Token`` of a mutation of ``resource``: ConfigurationError (400) if it is
    missing, malformed or for another resource."""
    validate_resource(resource)
    text = request.headers.get(TOKEN_HEADER)
    if text is None:
        raise ConfigurationError(f"a mutation needs the fencing token in a {TOKEN_HEADER} header")
    if len(text) > MAX_TOKEN_CHARS:
        raise ConfigurationError(f"{TOKEN_HEADER} is longer than {MAX_TOKEN_CHARS} characters")
    token = FencingToken.parse(text)
    if token.resource != resource:
        raise ConfigurationError(
            f"the {TOKEN_HEADER} is for {token.resource!r}, but the path names {resource!r}"
        )
    return token


def _op_id(request: Request) -> str | None:
    value = request.headers.get(IDEMPOTENCY_HEADER)
    if value is None:
        return None
    return validate_op_id(decode_sf_string(value, IDEMPOTENCY_HEADER))


def _missing(error: NotFound, what: str) -> JSONResponse:
    """404 for an absent item or publication: a problem document that says so (``missing``),
    unlike an unknown store's."""
    status, document = problem_of_error(error)
    document["missing"] = what
    return JSONResponse(document, status_code=status, media_type="application/problem+json")


def _matches(request: Request, tag: str) -> bool:
    """Whether ``If-None-Match`` names ``tag`` (or is ``*``)."""
    header = request.headers.get("if-none-match")
    if header is None:
        return False
    candidates = [part.strip() for part in header.split(",")]
    return "*" in candidates or any(part.removeprefix("W/") == tag for part in candidates if part)


# -- the stores --------------------------------------------------------------------------------


def _info(name: str, store: AsyncStore) -> StoreInfo:
    return StoreInfo(name=name, mode=store.mode, capabilities=sorted(store.capabilities))


@router.get("", response_model=StoreList, dependencies=[KnownKey], summary="Stores")
async def stores(state: State) -> StoreList:
    """The stores this server serves, with their modes and capabilities (never their URLs)."""
    return StoreList(stores=[_info(name, store) for name, store in sorted(state.stores.items())])


@router.post(
    "/{store}:gc",
    response_model=GcResult,
    dependencies=[require("admin", "-")],
    summary="Garbage-collect a store (admin)",
)
async def gc(store: str, state: State, body: GcBody | None = None) -> GcResult:
    """``Store.gc``: delete unreferenced objects idle for longer than ``grace``; never a current
    publication nor one of the ``keep`` newest. Needs ``admin`` on every name."""
    given = body if body is not None else GcBody(keep=1, grace=None)
    return GcResult(deleted=await _store(state, store).gc(given.keep, given.grace))


@router.get("/{store}", response_model=StoreInfo, dependencies=[KnownKey], summary="A store")
async def store_info(store: str, state: State) -> StoreInfo:
    """The store's mode and capabilities; 404 ``not-found`` for a name the server does not
    serve."""
    return _info(store, _store(state, store))


@router.get(
    "/{store}/floors",
    response_model=Floors,
    dependencies=[require("admin", "-")],
    summary="Every floor (admin)",
)
async def floors(store: str, state: State) -> Floors:
    """``Store.floors``: every resource with a floor (what ``fenced restore --floor-from``
    reads); needs ``admin`` on every name."""
    return Floors(floors=await _store(state, store).floors())


# -- resources: fence, floor and binding, rebind, history --------------------------------------


@router.post(
    "/{store}/resources/{resource:path}:fence",
    response_model=StoreFence,
    dependencies=[require("write")],
    openapi_extra={"parameters": [_TOKEN_DOC]},
    summary="Install a token (fence)",
)
async def fence(store: str, resource: str, request: Request, state: State) -> StoreFence:
    """``Store.fence``: install the ``Fenced-Token``'s epoch as the floor. Idempotent. ``409
    stale-token`` if the floor is higher, ``409 foreign-token`` if bound to another
    coordinator; nothing changes then."""
    target = _store(state, store)
    token = _token(request, resource)
    return StoreFence(resource=resource, floor=await target.fence(token))


@router.post(
    "/{store}/resources/{resource:path}:rebind",
    response_model=Rebound,
    dependencies=[require("admin")],
    summary="Rebind a resource to another coordinator (admin)",
)
async def rebind(store: str, resource: str, body: RebindBody, state: State) -> Rebound:
    """``Store.rebind``: an operator's step after a coordinator was lost without a backup."""
    previous = await _store(state, store).rebind(
        validate_resource(resource), body.coordinator_id, previous=body.previous,
        ceiling=body.ceiling,
    )  # fmt: skip
    return Rebound(resource=resource, previous=previous)


@router.get(
    "/{store}/resources/{resource:path}:history",
    response_model=Records,
    dependencies=[require("read")],
    summary="A resource's store records",
)
async def history(
    store: str,
    resource: str,
    state: State,
    after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> Records:
    """``Store.history``: installs, accepted and rejected mutations with ``seq > after``."""
    found = await _store(state, store).history(validate_resource(resource), after)
    return records_body(found)


@router.get(
    "/{store}/resources/{resource:path}",
    response_model=ResourceState,
    dependencies=[require("read")],
    summary="A resource's floor and binding",
)
async def resource_state(store: str, resource: str, state: State) -> ResourceState:
    """``Store.floor`` and ``Store.binding`` (two reads of committed state)."""
    target = _store(state, store)
    validate_resource(resource)
    return ResourceState(
        resource=resource,
        floor=await target.floor(resource),
        coordinator_id=await target.binding(resource),
    )


# -- items -------------------------------------------------------------------------------------


def _if_version(request: Request) -> int | None:
    """``If-None-Match: *`` (must not exist: 0) or ``If-Match: "N"`` (must be at version N)."""
    none_match = request.headers.get("if-none-match")
    match = request.headers.get("if-match")
    if none_match is not None and match is not None:
        raise ConfigurationError("If-Match and If-None-Match do not go together on a PUT")
    if none_match is not None:
        if none_match.strip() != "*":
            raise ConfigurationError('a PUT takes If-None-Match: * only ("must not exist")')
        return 0
    if match is None:
        return None
    value = unquote_etag(match)
    if value is None or not value.isdigit() or len(value) > 19 or int(value) > 2**63 - 1:
        raise ConfigurationError('If-Match wants one item ETag, "<version>" (e.g. "3")')
    return int(value)


async def _value(request: Request) -> bytes:
    """The body of a put, refused beyond :data:`MAX_VALUE_BYTES` before it is read whole."""
    declared = request.headers.get("content-length")
    too_big = ConfigurationError(f"a value is at most {MAX_VALUE_BYTES} bytes: publish large data")
    if declared is not None and declared.isdigit() and int(declared) > MAX_VALUE_BYTES:
        raise too_big
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_VALUE_BYTES:
            raise too_big
        parts.append(chunk)
    return b"".join(parts)


@router.put(
    "/{store}/items/{resource:path}:{key:path}",
    response_model=StoreVersion,
    dependencies=[require("write")],
    openapi_extra={
        "parameters": [_TOKEN_DOC, _IDEMPOTENCY_DOC],
        "requestBody": {"content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}},
    },
    summary="Put a value",
)
async def put_item(
    store: str, resource: str, key: str, request: Request, response: Response, state: State
) -> StoreVersion:
    """``Store.put``: the body (raw bytes, at most 16 MiB) becomes the key's value. ``If-None-
    Match: *`` / ``If-Match: "N"`` are ``if_version`` 0 / N (``412 version-conflict``)."""
    target = _store(state, store)
    token = _token(request, resource)
    validate_key(key)
    op_id = _op_id(request)
    if_version = _if_version(request)
    value = await _value(request)
    version = await target.put(token, key, value, op_id=op_id, if_version=if_version)
    response.headers["ETag"] = etag(version.version)
    return StoreVersion.of(version)


@router.get(
    "/{store}/items/{resource:path}:{key:path}",
    response_class=Response,
    dependencies=[require("read")],
    responses={200: {"content": {OCTETS: {}}}, 304: {"description": "Not modified."}},
    summary="Get a value",
)
async def get_item(store: str, resource: str, key: str, request: Request, state: State) -> Response:
    """``Store.get``: the value as raw bytes; ``ETag`` ``"<version>"``, ``Fenced-Epoch``,
    ``Fenced-Version``. ``If-None-Match`` with the current ETag: ``304``. An absent key: ``404
    not-found`` with ``"missing": "item"``."""
    target = _store(state, store)
    item = await target.get(validate_resource(resource), validate_key(key))
    if item is None:
        return _missing(NotFound(f"{resource!r} has no key {key!r}"), "item")
    headers = {
        "ETag": etag(item.version),
        EPOCH_HEADER: str(item.epoch),
        VERSION_HEADER: str(item.version),
    }
    if _matches(request, headers["ETag"]):
        return Response(status_code=304, headers=headers)
    return Response(item.value, media_type=OCTETS, headers=headers)


# -- publications ------------------------------------------------------------------------------


class _Upload:
    """The request body as an async iterator of its chunks, for the store's publish; after a
    refusal, :meth:`drain` reads and drops the rest (the body iterator may have been closed
    by the cancellation that ended the publish, so it reads the ASGI messages itself)."""

    def __init__(self, request: Request) -> None:
        self._request = request
        self._chunks = request.stream()
        self.ended = False

    def __aiter__(self) -> _Upload:
        return self

    async def __anext__(self) -> bytes:
        from starlette.requests import ClientDisconnect  # noqa: PLC0415

        try:
            chunk = await self._chunks.__anext__()
        except ClientDisconnect:
            self.ended = True
            raise Unavailable("the client went away before the body ended") from None
        except StopAsyncIteration:
            self.ended = True
            raise
        return chunk

    async def drain(self) -> None:
        if self.ended or self._request._stream_consumed:
            return
        while True:
            message = await self._request.receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


@router.put(
    "/{store}/publications/{resource:path}:{name:path}",
    response_model=StorePublication,
    dependencies=[require("write")],
    openapi_extra={
        "parameters": [_TOKEN_DOC, _IDEMPOTENCY_DOC],
        "requestBody": {"content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}},
    },
    summary="Publish (streamed)",
)
async def publish_named(
    store: str, resource: str, name: str, request: Request, response: Response, state: State
) -> StorePublication:
    """``Store.publish`` of the body (streamed, any size) as ``(resource, name)``: staged whole,
    then the pointer moves only if the token is not below the floor nor the pointer's epoch."""
    return await _publish(state, store, resource, name, request, response)


@router.put(
    "/{store}/publications/{resource:path}",
    response_model=StorePublication,
    dependencies=[require("write")],
    openapi_extra={
        "parameters": [_TOKEN_DOC, _IDEMPOTENCY_DOC],
        "requestBody": {"content": {OCTETS: {"schema": {"type": "string", "format": "binary"}}}},
    },
    summary="Publish the default publication (streamed)",
)
async def publish(
    store: str, resource: str, request: Request, response: Response, state: State
) -> StorePublication:
    """As ``PUT /{store}/publications/{resource}:{name}``, for the default name ``""``."""
    return await _publish(state, store, resource, "", request, response)


async def _publish(
    state: State, store: str, resource: str, name: str, request: Request, response: Response
) -> StorePublication:
    upload = _Upload(request)
    try:
        target = _store(state, store)
        token = _token(request, resource)
        name = validate_publication_name(name)
        op_id = _op_id(request)
        publication = await target.publish(token, upload, name=name, op_id=op_id)
    except FencedError:
        await upload.drain()
        raise
    response.headers["ETag"] = etag(publication.object_id)
    return StorePublication.of(publication)


def _publication_headers(publication: Publication) -> dict[str, str]:
    return {
        "ETag": etag(publication.object_id),
        "Repr-Digest": digest_header(publication.sha256),
        "Content-Length": str(publication.size),
        EPOCH_HEADER: str(publication.epoch),
        OBJECT_HEADER: publication.object_id,
        PUBLISHED_HEADER: repr(publication.published_at),
    }


async def _opened(target: AsyncStore, resource: str, name: str) -> tuple[Publication, AsyncReader]:
    """The current publication and a reader of exactly its bytes: ``latest``, ``open``,
    ``latest`` again; equal answers mean the reader opened that object (object ids are never
    reused and a pointer never moves back). NotFound if nothing is published."""
    for _ in range(OPEN_ATTEMPTS):
        before = await target.latest(resource, name)
        if before is None:
            break
        reader = await target.open(resource, name)
        if await target.latest(resource, name) == before:
            return before, reader
        await reader.aclose()
    else:
        raise Unavailable(f"{resource!r} was republished {OPEN_ATTEMPTS} times while it was "
                          "being opened: retry")  # fmt: skip
    raise NotFound(f"nothing is published as {resource!r}" + (f" name {name!r}" if name else ""))


async def _chunks(reader: AsyncReader) -> AsyncIterator[bytes]:
    try:
        async for chunk in reader:
            yield chunk
    finally:
        await reader.aclose()


async def _download(
    state: State, store: str, resource: str, name: str, request: Request
) -> Response:
    target = _store(state, store)
    validate_resource(resource)
    name = validate_publication_name(name)
    latest = await target.latest(resource, name)
    if latest is None:
        shown = f"{resource!r}" + (f" name {name!r}" if name else "")
        return _missing(NotFound(f"nothing is published as {shown}"), "publication")
    if _matches(request, etag(latest.object_id)):
        headers = _publication_headers(latest)
        del headers["Content-Length"]
        return Response(status_code=304, headers=headers)
    if request.method == "HEAD":
        return Response(status_code=200, media_type=OCTETS, headers=_publication_headers(latest))
    try:
        publication, reader = await _opened(target, resource, name)
    except NotFound as error:
        return _missing(error, "publication")
    return StreamingResponse(
        _chunks(reader), media_type=OCTETS, headers=_publication_headers(publication)
    )


_DOWNLOAD_DOC: dict[int | str, dict[str, object]] = {
    200: {"content": {OCTETS: {}}, "description": "The bytes (a snapshot), streamed."},
    304: {"description": "Not modified (If-None-Match names the current ETag)."},
}


@router.head(
    "/{store}/publications/{resource:path}:{name:path}",
    response_class=Response,
    dependencies=[require("read")],
    responses=_DOWNLOAD_DOC,
    operation_id="head_publication_named",
    summary="A publication's headers",
)
@router.get(
    "/{store}/publications/{resource:path}:{name:path}",
    response_class=Response,
    dependencies=[require("read")],
    responses=_DOWNLOAD_DOC,
    operation_id="read_publication_named",
    summary="Read a publication (streamed)",
)
async def read_named(
    store: str, resource: str, name: str, request: Request, state: State
) -> Response:
    """``Store.open``/``read``: the current publication's bytes, streamed, with ``ETag``
    (its object id), ``Repr-Digest`` (SHA-256), ``Content-Length``, ``Fenced-Epoch``,
    ``Fenced-Object-Id``, ``Fenced-Published-At``; ``HEAD``: the headers only. An absent
    publication: ``404 not-found`` with ``"missing": "publication"``."""
    return await _download(state, store, resource, name, request)


@router.head(
    "/{store}/publications/{resource:path}",
    response_class=Response,
    dependencies=[require("read")],
    responses=_DOWNLOAD_DOC,
    operation_id="head_publication",
    summary="The default publication's headers",
)
@router.get(
    "/{store}/publications/{resource:path}",
    response_class=Response,
    dependencies=[require("read")],
    responses=_DOWNLOAD_DOC,
    operation_id="read_publication",
    summary="Read the default publication (streamed)",
)
async def read_default(store: str, resource: str, request: Request, state: State) -> Response:
    """As ``GET /{store}/publications/{resource}:{name}``, for the default name ``""``."""
    return await _download(state, store, resource, "", request)


async def _pointer(state: State, store: str, resource: str, name: str) -> Response:
    target = _store(state, store)
    found = await target.latest(validate_resource(resource), validate_publication_name(name))
    if found is None:
        shown = f"{resource!r}" + (f" name {name!r}" if name else "")
        return _missing(NotFound(f"nothing is published as {shown}"), "publication")
    body = StorePublication.of(found).model_dump()
    return JSONResponse(body, headers={"ETag": etag(found.object_id)})


@router.get(
    "/{store}/pointers/{resource:path}:{name:path}",
    response_model=StorePublication,
    dependencies=[require("read")],
    summary="The current publication's metadata",
)
async def pointer_named(store: str, resource: str, name: str, state: State) -> Response:
    """``Store.latest``: what the pointer of ``(resource, name)`` shows, as JSON."""
    return await _pointer(state, store, resource, name)


@router.get(
    "/{store}/pointers/{resource:path}",
    response_model=StorePublication,
    dependencies=[require("read")],
    summary="The default publication's metadata",
)
async def pointer(store: str, resource: str, state: State) -> Response:
    """As ``GET /{store}/pointers/{resource}:{name}``, for the default name ``""``."""
    return await _pointer(state, store, resource, "")

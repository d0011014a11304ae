"""The ASGI application of ``fenced serve``: FastAPI routes over an asyncio coordinator backend.

FastAPI rather than bare Starlette: the OpenAPI 3.1 document (``/openapi.json``) is generated
from the routes' type hints and the pydantic models of :mod:`fenced.server._models`, so the
document cannot drift from the code, and requests are validated against the same models before
a route runs. Every failure is an RFC 9457 problem document (:mod:`fenced.core._problems`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Match

from fenced import __version__
from fenced.aio._connect import open_async_backend
from fenced.aio._store import AsyncStore, open_store
from fenced.coordinator._connect import resolve_url
from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.core._errors import FencedError
from fenced.core._problems import PROBLEM_PREFIX, problem_of_error
from fenced.server._admin import router as admin
from fenced.server._auth import require_key
from fenced.server._events import router as events
from fenced.server._keys import open_keys
from fenced.server._leases import router as leases
from fenced.server._metrics import RequestTimer, ServerMetrics
from fenced.server._metrics import router as metrics
from fenced.server._models import CoordinatorInfo
from fenced.server._openapi import install_openapi
from fenced.server._page import router as page
from fenced.server._places import Places
from fenced.server._state import ServerState
from fenced.server._stores import router as stores_router

__all__ = ["DEFAULT_KEEP", "DEFAULT_POLL", "PROBLEM_JSON", "create_app"]

log = logging.getLogger("fenced.server")

DEFAULT_POLL = 20.0
"""Seconds one request waits at most on the server (``:acquire``, ``:watch``)."""
DEFAULT_KEEP = 10.0
"""Seconds a waiter's place is kept after its last poll ended."""
PROBLEM_JSON = "application/problem+json"


def problem_response(
    status: int, document: dict[str, object], extra: Mapping[str, str] | None = None
) -> JSONResponse:
    """A problem document; 503 says when to retry, 401 which credentials (RFC 9110 11.6.1);
    ``extra``: headers the answer must carry (``Allow`` of a 405)."""
    headers: dict[str, str] = dict(extra or {})
    if status == 503:
        headers["Retry-After"] = "1"
    elif status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="fenced"'
    return JSONResponse(document, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _allowed(request: Request) -> list[str]:
    """The methods the routes of ``request``'s path answer (RFC 9110 ``Allow`` of a 405)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def create_app(
    url: str | None = None,
    *,
    poll: float = DEFAULT_POLL,
    keep: float = DEFAULT_KEEP,
    stores: Mapping[str, str] | None = None,
    keys: str | Path | None = None,
) -> FastAPI:
    """The ``fenced serve`` application for the coordinator at ``url`` (None: ``$FENCED_URL``,
    else the embedded default), the stores ``stores`` (name → store URL) and the keys file
    ``keys`` (None: no keys, every request allowed).

    The keys file is read here (a bad one raises :class:`~fenced.ConfigurationError`); the
    backend and the stores are opened when the app starts (ASGI lifespan) and closed when it
    stops; a bad URL fails the start with :class:`~fenced.ConfigurationError`."""
    resolved = resolve_url(url)
    store_urls = dict(stores or {})
    authority = None if keys is None else open_keys(Path(keys))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend: AsyncCoordinatorBackend = await open_async_backend(resolved)
        opened: dict[str, AsyncStore] = {}
        try:
            for name, store_url in store_urls.items():
                opened[name] = await open_store(store_url)
        except BaseException:
            for store in opened.values():
                await store.aclose()
            await backend.aclose()
            raise
        places = Places(backend, keep)
        places.start()
        app.state.fenced = ServerState(backend, places, resolved, poll, authority, opened)
        log.info("serving %s (coordinator %s)", backend.url, backend.coordinator_id)
        try:
            yield
        finally:
            places.interrupt()
            await places.aclose()
            for store in opened.values():
                await store.aclose()
            await backend.aclose()

    app = FastAPI(
        title="fenced",
        version=__version__,
        summary="Leases with fencing tokens, and stores that reject stale owners.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.include_router(leases)
    app.include_router(metrics)
    app.state.metrics = ServerMetrics()
    app.add_middleware(RequestTimer, metrics=app.state.metrics)
    install_openapi(app)
    app.include_router(admin)
    app.include_router(stores_router)
    app.include_router(events)
    app.include_router(page)

    @app.get(
        "/v1/coordinator",
        response_model=CoordinatorInfo,
        tags=["service"],
        dependencies=[require_key()],
    )
    async def coordinator(request: Request) -> CoordinatorInfo:
        """Who answers: the coordinator id (tokens carry it), capabilities and bounds."""
        state: ServerState = request.app.state.fenced
        return CoordinatorInfo(
            coordinator_id=state.backend.coordinator_id,
            capabilities=sorted(state.backend.capabilities),
            version=__version__,
            poll=state.poll,
            keep=state.places.keep,
        )

    @app.get("/healthz", tags=["service"])
    async def healthz() -> dict[str, str]:
        """The process answers (liveness)."""
        return {"status": "ok"}

    @app.exception_handler(FencedError)
    async def fenced_error(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, FencedError)
        status, document = problem_of_error(error)
        if status >= 500:
            log.warning("%s: %s", type(error).__name__, error)
        return problem_response(status, document)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        where = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}"
            for e in error.errors()[:5]
        )
        return problem_response(422, {
            "type": PROBLEM_PREFIX + "invalid-request",
            "title": "The request does not match the API's schema",
            "status": 422,
            "detail": where[:1000],
        })  # fmt: skip

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, HTTPException)
        headers = dict(error.headers or {})
        if error.status_code == 405:  # every method of the path, not only the first route's
            headers["Allow"] = ", ".join(_allowed(request))
        return problem_response(error.status_code, {
            "type": "about:blank",
            "title": str(error.detail),
            "status": error.status_code,
        }, headers)  # fmt: skip

    return app

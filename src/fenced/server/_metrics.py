"""``/metrics`` (Prometheus text format) and ``/readyz`` of ``fenced serve``.

``/metrics`` serves two kinds of series:

- ownership, the same families as ``fenced metrics`` (:mod:`fenced.observe.metrics`: changes,
  lease ends, renewal failures, rejected writes of the served stores, epochs, held, flapping),
  computed by the same :class:`~fenced.observe.metrics.MetricsModel` from the records the server
  reads through its asyncio backend (each scrape reads only the records added since the last);
- the server's own: ``fenced_serve_requests_seconds{route,method,status}`` (a histogram of
  request durations, long polls included) and ``fenced_serve_waiting`` (requests waiting on the
  server now).

Both need the ``metrics`` extra (prometheus_client); without it ``/metrics`` answers 503 with a
problem document naming the extra, and everything else works. ``/readyz`` is 200 when the
backend answers a read, 503 otherwise (``/healthz``: the process answers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request, Response

from fenced.core._errors import FencedError, Unavailable
from fenced.server._state import State

__all__ = ["RequestTimer", "ServerMetrics", "router"]

router = APIRouter(tags=["service"])
_RECORD_PAGE = 1000


class _Ownership:
    """The ownership families, fed from the server's backend and stores (module docstring)."""

    def __init__(self) -> None:
        from fenced.observe.metrics import MetricsModel  # noqa: PLC0415 - the metrics extra

        self.model = MetricsModel()
        self.after = 0
        self.store_after: dict[tuple[str, str], int] = {}
        self.up = True
        self.lock = asyncio.Lock()

    async def refresh(self, state: Any) -> None:
        async with self.lock:
            try:
                while True:
                    page = await state.backend.records(None, self.after, _RECORD_PAGE)
                    if not page:
                        break
                    self.model.feed_coordinator(page)
                    self.after = page[-1].seq
                for name, store in state.stores.items():
                    for resource in self.model.resources:
                        key = (name, resource)
                        found = await store.history(resource, self.store_after.get(key, 0))
                        if found:
                            self.model.feed_store(name, found)
                            self.store_after[key] = found[-1].seq
                self.up = True
            except FencedError:
                self.up = False

    def collect(self) -> Iterator[Any]:
        yield from self.model.families(time.time(), up=self.up)


class ServerMetrics:
    """The registry of one app's ``/metrics`` (None without prometheus_client)."""

    def __init__(self) -> None:
        self.registry: Any = None
        try:
            from prometheus_client import CollectorRegistry, Gauge, Histogram  # noqa: PLC0415
        except ImportError:
            return
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Histogram(
            "fenced_serve_requests_seconds",
            "Seconds fenced serve took to answer a request (long polls included)",
            ["route", "method", "status"],
            registry=self.registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.waiting = Gauge(
            "fenced_serve_waiting", "Requests waiting on the server now", registry=self.registry
        )
        self.ownership = _Ownership()
        self.registry.register(self.ownership)


class RequestTimer:
    """ASGI middleware: the duration of every request by route template, method and status."""

    def __init__(self, app: Callable[..., Awaitable[None]], metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.metrics.registry is None:
            await self.app(scope, receive, send)
            return
        status = [500]

        async def sending(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        started = time.perf_counter()
        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.requests.labels(_template(scope), scope["method"], str(status[0])).observe(
                time.perf_counter() - started
            )


def _template(scope: Any) -> str:
    """The matched route's path template (bounded label values), or ``other``: the router
    leaves the route it matched in the request's scope."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else "other"


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(request: Request, state: State) -> Response:
    """Ownership and server metrics in Prometheus' text format (module docstring)."""
    served: ServerMetrics = request.app.state.metrics
    if served.registry is None:
        raise Unavailable("/metrics needs prometheus_client: pip install 'fenced[metrics]'")
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # noqa: PLC0415

    served.waiting.set(state.places.waiting)
    await served.ownership.refresh(state)
    return Response(generate_latest(served.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz", summary="Readiness")
async def readyz(state: State) -> dict[str, str]:
    """200 when the backend answers a read (503 ``unavailable`` otherwise)."""
    await state.backend.last_epoch("fenced/readyz")
    return {"status": "ready"}

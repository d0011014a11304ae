"""``GET /``: the page that draws each resource's ownership, live from ``/v1/events``.

Plain HTML, CSS and JavaScript served from the package (``fenced/server/page/``), no build step.
The page itself carries no data and needs no key; everything it shows comes from the event
stream, which needs role ``read`` (:mod:`fenced.server._events`). With a keys file the page asks
for a key, keeps it in the tab's ``sessionStorage`` (never in the URL, never in a cookie) and
sends it as ``Authorization: Bearer KEY`` on a ``fetch()`` of the stream (an ``EventSource``
cannot send that header). ``/?prefix=jobs/`` shows only the resources under ``jobs/``.

A strict ``Content-Security-Policy`` allows only the page's own script, style and requests.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.exceptions import HTTPException

__all__ = ["FILES", "router"]

router = APIRouter(include_in_schema=False)

FILES = {
    "index.html": "text/html; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
}
"""The page's files and their media types: nothing else is served."""

_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _file(name: str) -> Response:
    body = resources.files("fenced.server").joinpath("page", name).read_bytes()
    return Response(body, media_type=FILES[name], headers=_HEADERS)


@router.get("/")
async def page() -> Response:
    """The page (``index.html``)."""
    return _file("index.html")


@router.get("/page/{name}")
async def page_file(name: str) -> Response:
    """One of the page's :data:`FILES`; ``404`` for any other name."""
    if name not in FILES:
        raise HTTPException(404, "Not Found")
    return _file(name)

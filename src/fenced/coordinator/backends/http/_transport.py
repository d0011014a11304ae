"""What the sync and the asyncio driver share of httpx: client options, and the meaning of a
transport failure or of a reply (:data:`~._session.Reply`, or the exception it stands for)."""

from __future__ import annotations

import json
import os
import socket
import ssl
from typing import Any

import httpx

from fenced.coordinator.backends.http._session import Reply
from fenced.coordinator.backends.http._wire import Call, HttpSettings, error_of
from fenced.core._errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable

__all__ = [
    "API_KEY_ENV",
    "NODELAY",
    "client_options",
    "failure_of",
    "lost",
    "reply_of",
    "timeout_of",
    "unreachable",
    "verify_of",
]

API_KEY_ENV = "FENCED_API_KEY"
"""The environment variable whose value is sent as the bearer token (API key), if set."""

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
"""httpcore writes a request's headers and body separately; with Nagle's algorithm the body
waits for the server's delayed ACK (40 ms a request on Linux): the transports turn it off."""


def client_options(settings: HttpSettings) -> dict[str, Any]:
    """Keyword arguments of ``httpx.Client``/``AsyncClient`` (besides the transport): the API
    key from :data:`API_KEY_ENV` as a bearer token, the URL's timeout, no proxy from the
    environment (a coordinator is reached directly; a proxy would add a hop that can lose
    replies without fenced knowing)."""
    headers = {"Accept": "application/json"}
    key = os.environ.get(API_KEY_ENV)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return {"headers": headers, "timeout": httpx.Timeout(settings.timeout), "trust_env": False}


def verify_of(settings: HttpSettings) -> ssl.SSLContext | bool:
    """The transport's ``verify``: the system's CAs, or the URL's ``ca=`` and ``cert=``/``key=``."""
    if settings.ca is None and settings.cert is None:
        return True
    context = ssl.create_default_context(cafile=settings.ca)
    if settings.cert is not None:
        context.load_cert_chain(settings.cert, settings.key)
    return context


def failure_of(call: Call, base: str, error: Exception) -> FencedError:
    """A transport failure: Unavailable when nothing was sent (or for a read), OutcomeUnknown
    when a mutating request may have arrived."""
    if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return unreachable(call, base, error)
    return lost(call, error)


def unreachable(call: Call, base: str, error: BaseException) -> FencedError:
    """No connection to ``base``, so nothing was sent: Unavailable; ConfigurationError when
    TLS refused the server's certificate (no other server will do better)."""
    refused = _tls_refusal(error)
    if refused is not None:
        return ConfigurationError(f"{call.what}: TLS with {base} failed: {refused}")
    return Unavailable(f"{call.what}: cannot reach {base}: {error}")


def lost(call: Call, error: BaseException) -> FencedError:
    """The request was (perhaps) sent and no reply came: OutcomeUnknown for a change."""
    if call.mutating:
        return OutcomeUnknown(f"{call.what}: the reply was lost ({error!r})")
    return Unavailable(f"{call.what}: the reply was lost ({error!r})")


def _tls_refusal(error: BaseException) -> ssl.SSLError | None:
    """The certificate check that failed under ``error`` (a wrong CA, an expired or misnamed
    certificate), if that is what it was."""
    seen: BaseException | None = error
    for _ in range(8):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def reply_of(call: Call, status: int, content: bytes) -> Reply:
    """The status and JSON body of a reply; raises what a non-2xx answer stands for."""
    body: Any = None
    if content:
        try:
            body = json.loads(content)
        except ValueError:
            body = None
    if status >= 300:
        raise error_of(call, status, body)
    return status, body


def timeout_of(settings: HttpSettings, call: Call) -> float:
    """Seconds to wait for ``call``'s reply: the URL's timeout beyond a long poll's own wait."""
    return settings.timeout + call.waits

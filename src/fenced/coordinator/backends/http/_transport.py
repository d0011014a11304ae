"""What the sync and the asyncio driver share: the meaning of a transport failure or of a
reply (:data:`~._session.Reply`, or the exception it stands for). Headers, TLS and socket
options are :mod:`fenced._drivers.http`'s, as for the store client."""

from __future__ import annotations

import json
import ssl
from typing import Any

import httpx

from fenced.coordinator.backends.http._session import Reply
from fenced.coordinator.backends.http._wire import Call, HttpSettings, error_of
from fenced.core._errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable

__all__ = [
    "failure_of",
    "lost",
    "reply_of",
    "timeout_of",
    "unreachable",
]


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
    return settings.options.timeout + call.waits

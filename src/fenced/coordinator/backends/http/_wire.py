"""The ``/v1`` API's requests and answers, without I/O: what to send for each backend step and
what a reply means. The sync client (:mod:`._backend`) sends them with httpx; an asyncio client
would send the same :class:`Call` objects and read the answers with the same functions.

A reply is read strictly: a 2xx body that lacks a member or has the wrong type is not trusted
(:class:`~fenced.Unavailable` for a read; :class:`~fenced.OutcomeUnknown` for a mutating call,
whose effect cannot be known from it).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field

from fenced._drivers.http import HttpOptions, parse_options
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.core._answers import number, optional_text, records_of, text, whole
from fenced.core._errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable
from fenced.core._lease import LeaseInfo
from fenced.core._problems import error_of_problem

__all__ = [
    "Call",
    "HttpSettings",
    "acquire_call",
    "blocked_of",
    "error_of",
    "granted_of",
    "lease_info_of",
    "parse_url",
    "records_of",
]

Json = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class Call:
    """One request: ``method`` and ``path`` (below the base URL), a JSON body or query."""

    method: str
    path: str
    body: Json | None = None
    params: Mapping[str, str | int | float] = field(default_factory=dict)
    mutating: bool = False
    """A lost reply leaves the outcome unknown (:class:`~fenced.OutcomeUnknown`)."""
    waits: float = 0.0
    """Seconds the server may hold the request before it answers (a long poll)."""
    what: str = ""


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """What an ``http(s)://`` coordinator URL says (docs/server.md, "URLs")."""

    bases: tuple[str, ...]
    """``scheme://host:port[/prefix]`` of each server, without a trailing slash: servers of
    one coordinator, tried in turn when one cannot be reached."""
    options: HttpOptions
    """Timeout and TLS files of the URL's query."""


def parse_url(url: str) -> HttpSettings:
    """Check an ``http(s)://host:port[,host:port…][/prefix]`` URL; ConfigurationError names
    what is wrong (the URL is shown without any query: nothing secret is in it anyway)."""
    scheme, sep, rest = url.partition("://")
    cut = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    netloc = rest[:cut]
    try:  # the path and query; the servers are split below (urlsplit refuses "[::1]:1,h:2")
        parts = urllib.parse.urlsplit(f"{scheme}://server{rest[cut:]}")
    except ValueError as error:
        raise ConfigurationError(f"{url!r}: {error}") from error
    if scheme not in ("http", "https") or not sep or not netloc:
        raise ConfigurationError(f"{url!r}: expected http(s)://host:port[,host:port…][/prefix]")
    if "@" in netloc:
        raise ConfigurationError(
            "an http(s) coordinator URL carries no credentials; API keys come from "
            "$FENCED_API_KEY (docs/server.md)"
        )
    bases: list[str] = []
    for item in netloc.split(","):
        try:
            one = urllib.parse.urlsplit(f"{scheme}://{item.strip()}")
            one.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as error:
            raise ConfigurationError(f"{url!r}: {error}") from error
        if not one.hostname:
            raise ConfigurationError(f"{url!r}: a server address is empty")
        path = parts.path.rstrip("/")
        bases.append(urllib.parse.urlunsplit((scheme, one.netloc, path, "", "")))
    return HttpSettings(tuple(bases), parse_options(url, scheme, parts.query))


def _quoted(resource: str) -> str:
    return urllib.parse.quote(resource, safe="/")


def acquire_call(request: GrantRequest, request_id: str | None, wait: float, queue: bool) -> Call:
    """``:acquire`` for ``request`` (its ``request_id`` replaced by ``request_id``)."""
    body: dict[str, object] = {"ttl": request.ttl, "wait": wait, "holder": request.holder,
                               "owner": request.owner}  # fmt: skip
    if request_id is not None:
        body["request_id"] = request_id
    if queue:
        body["queue"] = True
    if request.value is not None:
        body["value"] = request.value
    return Call("POST", f"/v1/leases/{_quoted(request.resource)}:acquire", body, mutating=True,
                waits=wait, what=f"acquire of {request.resource}")  # fmt: skip


def leases_call(resource: str, action: str, body: Json | None = None, **params: str | int | float
                ) -> Call:  # fmt: skip
    """``/v1/leases/{resource}:{action}`` (``action`` empty: the lease itself, GET)."""
    path = f"/v1/leases/{_quoted(resource)}" + (f":{action}" if action else "")
    method = "POST" if body is not None else "GET"
    return Call(method, path, body, params, mutating=body is not None,
                what=f"{action or 'current'} of {resource}")  # fmt: skip


def granted_of(body: Json) -> Granted:
    """The :class:`Granted` of a ``LeaseGrant`` body (ValueError if it is not one)."""
    return Granted(
        epoch=whole(body, "epoch"),
        owner=text(body, "owner"),
        holder=text(body, "holder"),
        ttl=number(body, "ttl"),
        expires_in=number(body, "expires_in"),
    )


def blocked_of(body: Json) -> Blocked:
    """The :class:`Blocked` of a ``Waiting`` body or a ``busy`` problem (ValueError if
    neither). ``retry_in`` is None: the server itself tries again while a poll waits."""
    return Blocked(
        holder=optional_text(body, "holder"),
        epoch=whole(body, "epoch"),
        remaining=number(body, "remaining"),
        retry_in=None,
    )


def lease_info_of(body: Json) -> LeaseInfo | None:
    """The ``lease`` of a ``CurrentLease`` body (None: no live lease)."""
    lease = body.get("lease", ...)
    if lease is None:
        return None
    if not isinstance(lease, Mapping):
        raise ValueError("lease")
    return LeaseInfo(
        resource=text(lease, "resource"),
        epoch=whole(lease, "epoch"),
        holder=text(lease, "holder"),
        expires_in=number(lease, "expires_in"),
        ttl=number(lease, "ttl"),
        coordinator_id=text(lease, "coordinator_id"),
        value=optional_text(lease, "value"),
    )


def error_of(call: Call, status: int, body: object) -> FencedError:
    """The exception a non-2xx answer to ``call`` stands for. A problem document of fenced's
    becomes its exception; anything else (a proxy's 502, an HTML page) is
    :class:`Unavailable` for a read and, for a 5xx to a mutating call, :class:`OutcomeUnknown`:
    whatever stood between may have passed the request on."""
    document = body if isinstance(body, Mapping) else {}
    error = error_of_problem(status, document)
    if not str(document.get("type", "")).startswith("urn:fenced:problem:") and status >= 500:
        if call.mutating:
            return OutcomeUnknown(f"{call.what}: HTTP {status} from the server or a proxy")
        return Unavailable(f"{call.what}: HTTP {status} from the server or a proxy")
    return error


def bad_reply(call: Call, error: Exception) -> FencedError:
    """A 2xx reply whose body is not what the API promises."""
    message = f"{call.what}: the server's reply is not fenced's API ({error})"
    return OutcomeUnknown(message) if call.mutating else Unavailable(message)

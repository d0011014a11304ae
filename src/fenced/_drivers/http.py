"""HTTP plumbing shared by the clients of ``fenced serve`` (``pip install 'fenced[http]'``).

* :func:`client` — an ``httpx.Client`` as fenced's clients use it: TCP_NODELAY (httpcore writes a
  request's headers and body separately; with Nagle's algorithm the body waits for the server's
  delayed ACK, 40 ms a request on Linux), no proxies or credentials from the environment, the API
  key of ``$FENCED_API_KEY`` as a bearer token, TLS from explicit files only.
* :func:`encode_sf_string` / :func:`decode_sf_string` — a header value as an RFC 9651 structured
  field String (``"…"``) or Display String (``%"…"``, for text beyond printable ASCII), as the
  IETF ``Idempotency-Key`` draft spells its value; a bare value is accepted as itself.

Nothing here raises fenced's exceptions but :class:`~fenced.ConfigurationError` for a header
value that cannot be decoded; transport errors are the callers' to translate.
"""

from __future__ import annotations

import math
import os
import socket
import ssl
import urllib.parse
from dataclasses import dataclass

import httpx

from fenced.core._errors import ConfigurationError

__all__ = [
    "API_KEY_ENV",
    "NODELAY",
    "HttpOptions",
    "client",
    "decode_sf_string",
    "encode_sf_string",
    "parse_options",
    "request_headers",
    "tls_context",
]

API_KEY_ENV = "FENCED_API_KEY"
"""The environment variable whose value is sent as the bearer token (API key), if set."""


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """The query options every ``http(s)://`` URL of fenced takes (coordinator and store)."""

    timeout: float = 10.0
    """Seconds to connect and to wait for a reply (beyond a long poll's own wait)."""
    ca: str | None = None
    cert: str | None = None
    key: str | None = None


def parse_options(url: str, scheme: str, query: str) -> HttpOptions:
    """``timeout``, ``ca``, ``cert`` and ``key`` of ``url``'s ``query``; ConfigurationError for
    an unknown option, a bad timeout, ``cert`` without ``key`` or TLS files on ``http://``."""
    found = urllib.parse.parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(found) - {"timeout", "ca", "cert", "key"})
    if unknown:
        raise ConfigurationError(
            f"{url!r}: unknown option {unknown[0]!r} (known: timeout, ca, cert, key)"
        )
    values = {option: found[option][-1] for option in found}
    timeout = 10.0
    if "timeout" in values:
        try:
            timeout = float(values["timeout"])
        except ValueError:
            timeout = math.nan
        if not math.isfinite(timeout) or timeout <= 0:
            raise ConfigurationError(f"{url!r}: timeout must be a positive number of seconds")
    if ("cert" in values) != ("key" in values):
        raise ConfigurationError(f"{url!r}: cert= and key= go together")
    if scheme == "http" and ({"ca", "cert"} & set(values)):
        raise ConfigurationError(f"{url!r}: ca=, cert= and key= are for https:// URLs")
    return HttpOptions(timeout, values.get("ca"), values.get("cert"), values.get("key"))


def request_headers() -> dict[str, str]:
    """JSON accepted, and the API key of ``$FENCED_API_KEY`` as a bearer token, if set."""
    headers = {"Accept": "application/json"}
    api_key = os.environ.get(API_KEY_ENV)
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def tls_context(options: HttpOptions) -> ssl.SSLContext | None:
    """The TLS context of the URL's ``ca=`` and ``cert=``/``key=`` (None: the system's CAs)."""
    if options.ca is None and options.cert is None:
        return None
    context = ssl.create_default_context(cafile=options.ca)
    if options.cert is not None:
        context.load_cert_chain(options.cert, options.key)
    return context


NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
"""Socket options of every client transport (see the module docstring)."""


def client(options: HttpOptions) -> httpx.Client:
    """A new client (see the module docstring)."""
    context = tls_context(options)
    transport = httpx.HTTPTransport(
        verify=True if context is None else context, socket_options=NODELAY
    )
    return httpx.Client(
        headers=request_headers(),
        timeout=httpx.Timeout(options.timeout),
        transport=transport,
        trust_env=False,
    )


def encode_sf_string(text: str) -> str:
    """``text`` as a structured field String, or a Display String if it has characters beyond
    printable ASCII (their UTF-8 bytes percent-encoded)."""
    if all(" " <= c <= "~" for c in text):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    encoded = "".join(
        c if " " <= c <= "~" and c not in '%"' else urllib.parse.quote(c, safe="") for c in text
    )
    return f'%"{encoded}"'


def decode_sf_string(value: str, header: str) -> str:
    """The text of a header value :func:`encode_sf_string` wrote, or of a bare value (taken as
    it is, surrounding whitespace removed). ConfigurationError names ``header`` otherwise."""
    value = value.strip()
    if value.startswith('%"'):
        if len(value) < 3 or not value.endswith('"') or '"' in value[2:-1]:
            raise ConfigurationError(f"{header}: malformed display string")
        try:
            return urllib.parse.unquote(value[2:-1], errors="strict")
        except UnicodeDecodeError as error:
            raise ConfigurationError(f"{header}: not UTF-8 ({error.reason})") from None
    if not value.startswith('"'):
        return value
    if len(value) < 2 or not value.endswith('"'):
        raise ConfigurationError(f"{header}: unterminated string")
    out: list[str] = []
    inner = iter(value[1:-1])
    for char in inner:
        if char == "\\":
            escaped = next(inner, "")
            if escaped not in ('"', "\\"):
                raise ConfigurationError(f"{header}: bad escape in string")
            out.append(escaped)
        elif char == '"':
            raise ConfigurationError(f"{header}: unescaped quote in string")
        else:
            out.append(char)
    return "".join(out)

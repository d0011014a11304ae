"""``postgresql://`` / ``postgres://`` URLs and the defaults of their fenced options.

:func:`parse_url` takes fenced's own query parameters out of a URL; everything else goes to
libpq unchanged (and is validated by it). SQLAlchemy's driver suffix ``+psycopg``
(``postgresql+psycopg://``) is accepted; another driver is refused (see
:func:`fenced.core._urls.scheme_of`). :func:`parse_options` reads the same fenced parameters
from a mapping, for a user's pool or engine handed in instead of a URL. A malformed URL, an
unknown scheme, a bad schema name or an out-of-range option is a
:class:`~fenced.core._errors.ConfigurationError`; passwords never appear in the URL shown in
messages (:attr:`ParsedURL.display`, made by :func:`fenced.core._urls.redacted`, which masks a
nested ``listen_url``'s password too).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

import psycopg

from fenced.core._errors import ConfigurationError
from fenced.core._urls import SECRET_PARAMETERS, redacted, scheme_of

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_OP_TIMEOUT",
    "DEFAULT_POOL_SIZE",
    "DEFAULT_SCHEMA",
    "ParsedURL",
    "parse_options",
    "parse_url",
]

DEFAULT_SCHEMA = "fenced"
DEFAULT_POOL_SIZE = 10
DEFAULT_OP_TIMEOUT = 10.0
"""Seconds an operation may wait for its reply before its connection is cut (``?timeout=``)."""
DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds an operation waits for a connection (while the pool reconnects) before it finds out
why none came; also libpq's ``connect_timeout`` unless the URL sets one."""

_SCHEMA = re.compile(r"[a-z_][a-z0-9_]{0,47}")
_SCHEMES = ("postgresql", "postgres")


@dataclass(frozen=True, slots=True)
class ParsedURL:
    """A parsed ``postgresql://`` URL.

    ``conninfo`` is what libpq gets (fenced's parameters removed); ``display`` the URL with the
    password masked (safe in messages and ``repr``); ``schema`` the PostgreSQL schema of fenced's
    tables; ``options`` fenced's other query parameters (validated by their users).
    """

    conninfo: str
    display: str
    schema: str
    connect_timeout: float
    options: dict[str, str] = field(default_factory=dict)

    def option_float(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        text = self.options.get(name)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not value >= minimum or value == float("inf"):
            raise ConfigurationError(
                f"{self.display}: {name}={text!r} must be a number >= {minimum:g}"
            )
        return value

    def option_int(self, name: str, default: int, *, minimum: int = 1) -> int:
        text = self.options.get(name)
        if text is None:
            return default
        if not text.isdigit() or int(text) < minimum:
            raise ConfigurationError(
                f"{self.display}: {name}={text!r} must be an integer >= {minimum}"
            )
        return int(text)

    def option_flag(self, name: str, default: bool) -> bool:
        text = self.options.get(name)
        if text is None:
            return default
        lowered = text.lower()
        if lowered in ("1", "on", "true", "yes"):
            return True
        if lowered in ("0", "off", "false", "no"):
            return False
        raise ConfigurationError(f"{self.display}: {name}={text!r} must be on or off")


def parse_url(url: str, fenced_keys: Sequence[str]) -> ParsedURL:
    """Split ``url`` into libpq's conninfo and fenced's parameters (``schema`` + ``fenced_keys``).

    Raises :class:`ConfigurationError` for another scheme, a fragment, a bad schema name, a
    repeated parameter, or a parameter libpq does not know.
    """
    if not isinstance(url, str):
        raise ConfigurationError(f"a PostgreSQL URL is a string, not {type(url).__name__}")
    try:
        parts = urlsplit(url.strip())
    except ValueError as error:
        raise ConfigurationError(f"malformed PostgreSQL URL: {error}") from None
    if scheme_of(url.strip()) not in _SCHEMES:
        raise ConfigurationError(f"expected a postgresql:// URL, got scheme {parts.scheme!r}")
    display = redacted(url.strip())
    if parts.fragment:
        raise ConfigurationError(f"{display}: a fragment (#...) is not allowed")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as error:
        raise ConfigurationError(f"{display}: malformed query string: {error}") from None
    seen: set[str] = set()
    ours: dict[str, str] = {}
    libpq: list[tuple[str, str]] = []
    for key, value in pairs:
        if key in seen:
            raise ConfigurationError(f"{display}: parameter {key!r} given twice")
        seen.add(key)
        if key == "schema" or key in fenced_keys:
            ours[key] = value
        else:
            libpq.append((key, value))
    schema = _schema(ours, display)
    keys = {key for key, _ in libpq}
    connect_timeout = DEFAULT_CONNECT_TIMEOUT
    if "connect_timeout" in keys:
        text = dict(libpq)["connect_timeout"]
        if not text.isdigit() or int(text) < 1:
            raise ConfigurationError(f"{display}: connect_timeout must be a whole number >= 1")
        connect_timeout = float(text)
    else:
        libpq.append(("connect_timeout", str(int(DEFAULT_CONNECT_TIMEOUT))))
    if "application_name" not in keys:
        libpq.append(("application_name", "fenced"))
    # libpq percent-decodes a URI's query but does not read "+" as a space (as HTML forms do):
    # quote_via=quote keeps a space in ``options=-c name=value`` a space.
    query = urlencode(libpq, quote_via=quote)
    conninfo = _unsplit("postgresql", parts.netloc, parts.path, query)
    try:
        psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error as error:
        secrets = [parts.password, *(v for k, v in pairs if k.lower() in SECRET_PARAMETERS)]
        raise ConfigurationError(f"{display}: {_scrubbed(str(error), secrets)}") from None
    return ParsedURL(conninfo, display, schema, connect_timeout, ours)


def parse_options(
    options: Mapping[str, object] | None, fenced_keys: Sequence[str], display: str
) -> ParsedURL:
    """fenced's parameters (``schema`` + ``fenced_keys``) given as a mapping, for a user's pool
    or engine (no conninfo: the pool connects). Values may be strings, numbers or booleans
    (``True`` is ``on``). Raises :class:`ConfigurationError` for another key (``pool_size``
    among them: the pool is the user's) or a bad schema name; the other values are checked by
    their users, as those of a URL."""
    ours: dict[str, str] = {}
    for key, value in (options or {}).items():
        if key not in fenced_keys and key != "schema":
            allowed = ", ".join(["schema", *fenced_keys])
            raise ConfigurationError(
                f"{display}: unknown option {key!r} (with a pool or an engine: {allowed})"
            )
        if isinstance(value, bool):
            ours[key] = "on" if value else "off"
        elif isinstance(value, str | int | float):
            ours[key] = str(value)
        else:
            raise ConfigurationError(
                f"{display}: option {key}={value!r} must be a string, a number or a boolean"
            )
    schema = _schema(ours, display)
    return ParsedURL("", display, schema, DEFAULT_CONNECT_TIMEOUT, ours)


def _schema(ours: dict[str, str], display: str) -> str:
    """Take ``schema`` out of ``ours`` (default :data:`DEFAULT_SCHEMA`) and check it."""
    schema = ours.pop("schema", DEFAULT_SCHEMA)
    if not _SCHEMA.fullmatch(schema):
        raise ConfigurationError(
            f"{display}: schema={schema!r} must be 1-48 characters of [a-z0-9_], not starting "
            "with a digit"
        )
    return schema


def _scrubbed(message: str, secrets: list[str | None]) -> str:
    """``message`` (libpq's, which may quote a malformed part of the URL) without ``secrets``."""
    for secret in secrets:
        for text in {secret, unquote(secret)} if secret else ():
            message = message.replace(text, "***")
    return message.strip()


def _unsplit(scheme: str, netloc: str, path: str, query: str) -> str:
    """``scheme://netloc/path?query``, with ``//`` also when there is no host (``postgresql://``:
    libpq's defaults): ``urlunsplit`` drops it, and libpq reads ``postgresql:?…`` as no URI."""
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")

"""The one parser of the URLs fenced takes: schemes, driver suffixes, local paths. Pure.

Every command and backend goes through :func:`scheme_of` and :func:`parse_local` (through
:func:`fenced._drivers.local.local_path`, which adds the checks that need the file system), so a
URL means the same thing to ``connect``, ``open_store`` and every ``fenced`` command.

``sqlite:`` follows SQLAlchemy (and Alembic, dj-database-url):

=============================  ==================================================================
``sqlite:///rel/path.db``      ``rel/path.db``, relative to the current directory
``sqlite:////abs/path.db``     ``/abs/path.db`` (more leading slashes: the same absolute path)
``sqlite:rel/path.db``         ``rel/path.db``, relative
``sqlite:/abs/path.db``        ``/abs/path.db`` (SQLAlchemy has no such form; fenced keeps it)
=============================  ==================================================================

``file:`` follows RFC 8089, as curl and browsers do: ``file:///abs/dir`` and
``file://localhost/abs/dir`` are ``/abs/dir``, ``file:/abs/dir`` too; ``file:rel/dir`` is
relative (not in the RFC; kept). Paths are percent-decoded. Refused with
:class:`ConfigurationError`: a host (``sqlite://host/x``, ``file://host/x``), a query or a
fragment, no path at all (``sqlite://``, SQLAlchemy's in-memory database: a coordinator or store
shared by processes lives in a file), ``:memory:``, a path starting with ``~`` (URLs are not
shell words: nothing expands it, and a directory named ``~`` is never what was meant) and a NUL.

Driver suffixes follow SQLAlchemy's ``dialect+driver`` spelling: ``postgresql+psycopg://`` is
``postgresql://`` (psycopg 3 is fenced's PostgreSQL driver); any other driver, or a suffix on
another scheme, is a :class:`ConfigurationError` naming the supported spelling.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

from fenced.core._errors import ConfigurationError

__all__ = [
    "SECRET_PARAMETERS",
    "LocalURL",
    "parse_local",
    "path_from_url",
    "redacted",
    "scheme_of",
    "url_of_path",
]

DRIVERS = {"postgresql": "psycopg", "postgres": "psycopg"}
"""The driver suffix each scheme accepts (SQLAlchemy's ``dialect+driver``)."""

LOCAL_SCHEMES = ("sqlite", "file")
_SPELLINGS = {
    "sqlite": "sqlite:///relative/path.db, sqlite:////absolute/path.db or sqlite:relative/path.db",
    "file": "file:///absolute/dir or file:relative/dir",
}


SECRET_PARAMETERS = frozenset({"password", "passwd", "pass", "token", "secret", "sslpassword"})
"""Query parameters whose values :func:`redacted` hides."""

_USERINFO = re.compile(r"([^\s:/@'\"?&#]+):[^\s/@'\"?#]*@")
_SECRET_VALUE = re.compile(
    r"\b(" + "|".join(sorted(SECRET_PARAMETERS)) + r")=[^&\s'\"#]*", re.IGNORECASE
)


def redacted(url: object) -> str:
    """``url`` as it may appear in an error, a log line or a ``repr``: its password ``***``.

    Any scheme: the password of ``scheme://user:password@host…`` (also with several hosts), the
    values of query (or fragment) parameters named in :data:`SECRET_PARAMETERS`, and the same
    inside a query value that is itself a URL (percent-encoded, as ``listen_url=``). The rest is
    kept as written; without ``://``, anything shaped like ``user:password@`` is masked too. Not
    a string (bytes, a path, any object): its ``repr`` with anything shaped like
    ``user:password@`` or ``password=…`` masked. Nothing here raises.
    """
    if not isinstance(url, str):
        text = repr(url)
        return _SECRET_VALUE.sub(r"\1=***", _USERINFO.sub(r"\1:***@", text))
    head, sep, rest = url.partition("://")
    if not sep:  # no authority: a password can only be a slip ("user:pw@host/db")
        url = _USERINFO.sub(r"\1:***@", url)
    else:
        end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0),
                  default=len(rest))  # fmt: skip
        netloc = rest[:end]
        if "@" in netloc:
            userinfo, _, hosts = netloc.rpartition("@")
            if ":" in userinfo:
                userinfo = userinfo.split(":", 1)[0] + ":***"
            rest = f"{userinfo}@{hosts}{rest[end:]}"
        url = head + sep + rest
    url, hash_, fragment = url.partition("#")
    fragment = _SECRET_VALUE.sub(r"\1=***", fragment)
    base, question, query = url.partition("?")
    if not question:
        return f"{url}{hash_}{fragment}"
    parts = []
    for item in query.split("&"):
        name, equals, value = item.partition("=")
        inner = unquote(value)
        if equals and unquote(name).lower() in SECRET_PARAMETERS:
            parts.append(f"{name}=***")
        elif equals and "://" in inner and (shown := redacted(inner)) != inner:
            parts.append(f"{name}={quote(shown, safe=':/@*,')}")  # a URL in a URL: listen_url
        else:
            parts.append(item)
    return f"{base}?{'&'.join(parts)}{hash_}{fragment}"


def _quoted(url: object) -> str:
    """``url`` for a message: :func:`redacted`, quoted as ``repr`` quotes a string."""
    return repr(redacted(url)) if isinstance(url, str) else redacted(url)


def scheme_of(url: str) -> str:
    """The lower-cased scheme of ``url``, without an accepted driver suffix.

    ``postgresql+psycopg://…`` → ``"postgresql"``. Raises :class:`ConfigurationError` for a text
    without a scheme and for a driver suffix fenced does not use.
    """
    shown = _quoted(url)
    if not isinstance(url, str) or ":" not in url:
        raise ConfigurationError(
            f"not a URL: {shown} (expected e.g. sqlite:///relative/path.db or "
            "sqlite:////absolute/path.db)"
        )
    scheme = url.split(":", 1)[0].lower()
    if not scheme or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        raise ConfigurationError(f"not a URL: {shown}")
    base, plus, driver = scheme.partition("+")
    if not plus:
        return scheme
    accepted = DRIVERS.get(base)
    if accepted is None:
        raise ConfigurationError(
            f"{base}: URLs take no driver suffix (+{driver}); write {base}:"
            + ("" if base in LOCAL_SCHEMES else "//…")
        )
    if driver != accepted:
        raise ConfigurationError(
            f"{base}+{driver}: fenced's PostgreSQL driver is psycopg 3; write "
            f"{base}+{accepted}:// or {base}://"
        )
    return base


@dataclass(frozen=True, slots=True)
class LocalURL:
    """What a ``sqlite:`` or ``file:`` URL names."""

    scheme: str
    """``"sqlite"`` or ``"file"``."""
    path: str
    """The path, absolute or relative to the current directory, percent-decoded."""
    former: str | None = None
    """For ``sqlite:///rel`` (three slashes, now relative): the absolute path ``/rel`` that
    fenced read it as before it followed SQLAlchemy (the transition check's other candidate)."""


def parse_local(url: str, scheme: str | None = None) -> LocalURL:
    """Parse a ``sqlite:`` or ``file:`` URL (see the module docstring).

    ``scheme``, if given, is the one expected. Raises :class:`ConfigurationError` (one line,
    naming the accepted spellings) for anything else.
    """
    found = scheme_of(url)
    shown = _quoted(url)
    if found not in LOCAL_SCHEMES or (scheme is not None and found != scheme):
        wanted = f"{scheme}:" if scheme else "sqlite: or file:"
        raise ConfigurationError(f"expected a {wanted} URL, got {shown}")
    spellings = _SPELLINGS[found]
    rest = url[len(found) + 1 :]
    if "?" in rest or "#" in rest:
        raise ConfigurationError(
            f"{shown}: {found}: URLs take no query string or fragment (percent-encode a ? or # "
            f"in a name as %3F, %23); expected {spellings}"
        )
    three_slashes = False
    if rest.startswith("//"):
        host, slash, path = rest[2:].partition("/")
        if host and not (found == "file" and host.lower() == "localhost"):
            raise ConfigurationError(
                f"{shown} names host {host.rpartition('@')[2]!r}: {found}: URLs name a local "
                f"path; expected "
                f"{spellings}"
            )
        path = slash + path
        if found == "sqlite":  # SQLAlchemy: the path after "sqlite:///"
            path = path[1:]
            three_slashes = True
    else:
        path = rest
    path = unquote(path)
    if path.startswith("/"):
        path = "/" + path.lstrip("/")  # "//abs" is "/abs" (POSIX leaves "//" to the system)
    former = "/" + path if three_slashes and path and not path.startswith("/") else None
    if not path or path == "/":
        what = (
            "database file (fenced has no in-memory SQLite database: what processes share "
            "lives in a file)"
            if found == "sqlite"
            else "directory"
        )
        raise ConfigurationError(f"{shown} names no {what}; expected {spellings}")
    if "\x00" in path:
        raise ConfigurationError(f"{shown}: a path cannot contain NUL; expected {spellings}")
    if path == ":memory:":
        raise ConfigurationError(
            f"{shown}: fenced has no in-memory SQLite database; name a file ({spellings}), or "
            "use memory://NAME for an in-process coordinator in tests"
        )
    if path == "~" or path.startswith("~/"):
        example = "sqlite:////home/me/x.db" if found == "sqlite" else "file:///home/me/x"
        raise ConfigurationError(
            f"{shown}: '~' is not expanded in URLs (it would name a directory called '~'); "
            f"write the absolute path, e.g. {example}"
        )
    return LocalURL(found, path, former)


def path_from_url(url: str, scheme: str) -> str:
    """The path a ``scheme:`` URL names (absolute, or relative to the current directory)."""
    return parse_local(url, scheme).path


def url_of_path(scheme: str, path: str) -> str:
    """The canonical URL of the absolute ``path``: ``sqlite:////abs`` or ``file:///abs``.

    :func:`parse_local` gives ``path`` back from it. Raises :class:`ConfigurationError` for a
    relative path (its URL would depend on the current directory).
    """
    if scheme not in LOCAL_SCHEMES:
        raise ConfigurationError(f"no path URLs for {scheme}:")
    if not path.startswith("/"):
        raise ConfigurationError(f"the URL of a path needs an absolute path, got {path!r}")
    quoted = quote("/" + path.lstrip("/"), safe="/")
    return f"sqlite:///{quoted}" if scheme == "sqlite" else f"file://{quoted}"

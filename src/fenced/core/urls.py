"""Parsing of path URLs (``sqlite:`` and ``file:``). Pure.

``scheme:///abs/path`` names an absolute path (as in RFC 8089 file URLs); ``scheme:rel/path`` a
path relative to the current directory. A host part (``scheme://host/…``), a query or a fragment
is a :class:`ConfigurationError`: these stores live on the local file system.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from fenced.core.errors import ConfigurationError

__all__ = ["path_from_url", "scheme_of"]


def scheme_of(url: str) -> str:
    """The lower-cased scheme of ``url``, or raise :class:`ConfigurationError` if it has none."""
    if not isinstance(url, str) or ":" not in url:
        raise ConfigurationError(f"not a URL: {url!r} (expected e.g. sqlite:///path/to/file.db)")
    scheme = url.split(":", 1)[0].lower()
    if not scheme or not scheme.replace("+", "").replace("-", "").isalnum():
        raise ConfigurationError(f"not a URL: {url!r}")
    return scheme


def path_from_url(url: str, scheme: str) -> str:
    """The file-system path named by a ``scheme:`` URL (absolute or relative)."""
    parts = urlsplit(url)
    if parts.scheme.lower() != scheme:
        raise ConfigurationError(f"expected a {scheme}: URL, got {url!r}")
    if parts.netloc and parts.netloc != "localhost":
        raise ConfigurationError(
            f"{url!r} names host {parts.netloc!r}; use {scheme}:///absolute/path "
            f"or {scheme}:relative/path"
        )
    if parts.query or parts.fragment:
        raise ConfigurationError(f"{url!r}: query strings and fragments are not supported")
    path = unquote(parts.path)
    if not path or "\x00" in path:
        raise ConfigurationError(f"{url!r} names no usable path")
    return path

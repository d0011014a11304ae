"""The ``/v1/stores`` API without I/O: store URLs, request paths and headers, and what a reply
means. The client (:mod:`._store`) sends them with httpx; ``fenced serve``
(:mod:`fenced.server._stores`) reads the same headers with the same functions.

Paths: a resource name, key or publication name never contains ``:``, so
``{resource}:{key}`` names a key of a resource without ambiguity (and ``{resource}:action``
a custom method, as in ``/v1/leases``). A reply is read strictly: a 2xx body that lacks a
member or has the wrong type is not trusted (:class:`~fenced.Unavailable` for a read,
:class:`~fenced.OutcomeUnknown` for a mutation, whose effect cannot be known from it).
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass

from fenced._drivers.http import HttpOptions, parse_options
from fenced.core._answers import number, records_of, text, whole
from fenced.core._errors import ConfigurationError
from fenced.fence._values import Item, Publication, Version

__all__ = [
    "EPOCH_HEADER",
    "IDEMPOTENCY_HEADER",
    "OBJECT_HEADER",
    "PUBLISHED_HEADER",
    "TOKEN_HEADER",
    "VERSION_HEADER",
    "StoreUrl",
    "digest_header",
    "etag",
    "item_of_headers",
    "item_path",
    "parse_store_url",
    "publication_of",
    "publication_of_headers",
    "publication_path",
    "records_of",
    "resource_path",
    "sha256_of_digest",
    "unquote_etag",
    "version_of",
]

TOKEN_HEADER = "Fenced-Token"  # noqa: S105 - a header name
"""The fencing token of a mutation, in its text form (``FencingToken.parse``)."""
IDEMPOTENCY_HEADER = "Idempotency-Key"
"""The operation id (``op_id``) of a mutation, as the IETF draft names it."""
EPOCH_HEADER = "Fenced-Epoch"
"""The epoch that wrote an item or a publication (answers)."""
VERSION_HEADER = "Fenced-Version"
"""An item's version (answers)."""
OBJECT_HEADER = "Fenced-Object-Id"
"""A publication's object id (answers)."""
PUBLISHED_HEADER = "Fenced-Published-At"
"""A publication's time, seconds since the Unix epoch, for display (answers)."""

_STORE_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True, slots=True)
class StoreUrl:
    """What an ``http(s)://host:port[/prefix]/stores/NAME`` store URL says."""

    base: str
    """``scheme://host:port[/prefix]/v1/stores/NAME``: the store's API root."""
    name: str
    options: HttpOptions


def parse_store_url(url: str) -> StoreUrl:
    """Check a store URL (options ``timeout``, ``ca``, ``cert``, ``key`` as for the coordinator's
    ``http(s)://`` URLs); ConfigurationError names what is wrong."""
    parts = urllib.parse.urlsplit(url)
    shape = "expected http(s)://host:port[/prefix]/stores/NAME"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"{url!r}: {shape}")
    if parts.username or parts.password:
        raise ConfigurationError(
            "an http(s) store URL carries no credentials; API keys come from $FENCED_API_KEY "
            "(docs/server.md)"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as error:
        raise ConfigurationError(f"{url!r}: {error}") from None
    prefix, sep, name = parts.path.rstrip("/").rpartition("/stores/")
    if not sep or not _STORE_NAME.fullmatch(name):
        raise ConfigurationError(f"{url!r}: {shape} (NAME: 1-128 of A-Z a-z 0-9 . _ -)")
    options = parse_options(url, parts.scheme, parts.query)
    root = urllib.parse.urlunsplit((parts.scheme, parts.netloc, prefix, "", ""))
    return StoreUrl(f"{root}/v1/stores/{name}", name, options)


def _quoted(name: str) -> str:
    return urllib.parse.quote(name, safe="/")


def resource_path(resource: str, action: str = "") -> str:
    """``/resources/{resource}[:{action}]`` below the store's root."""
    return f"/resources/{_quoted(resource)}" + (f":{action}" if action else "")


def item_path(resource: str, key: str) -> str:
    """``/items/{resource}:{key}`` below the store's root."""
    return f"/items/{_quoted(resource)}:{_quoted(key)}"


def publication_path(kind: str, resource: str, name: str) -> str:
    """``/{kind}/{resource}[:{name}]`` (``kind``: ``publications`` for the bytes, ``pointers``
    for the metadata) below the store's root; the default publication has no ``:``."""
    return f"/{kind}/{_quoted(resource)}" + (f":{_quoted(name)}" if name else "")


def etag(value: str | int) -> str:
    """A strong entity tag: an item's version, a publication's object id."""
    return f'"{value}"'


def unquote_etag(tag: str) -> str | None:
    """The value of a strong entity tag (None for a weak or malformed one)."""
    tag = tag.strip()
    if len(tag) >= 2 and tag[0] == tag[-1] == '"':
        return tag[1:-1]
    return None


def digest_header(sha256_hex: str) -> str:
    """``Repr-Digest`` (RFC 9530) of a publication's bytes."""
    return "sha-256=:" + base64.b64encode(bytes.fromhex(sha256_hex)).decode() + ":"


def sha256_of_digest(value: str) -> str:
    """The lowercase hex SHA-256 of a ``Repr-Digest`` value (ValueError if it has none)."""
    for member in value.split(","):
        algorithm, _, encoded = member.strip().partition("=")
        if algorithm.strip().lower() == "sha-256" and encoded.startswith(":"):
            try:
                raw = base64.b64decode(encoded.strip(":"), validate=True)
            except binascii.Error as error:
                raise ValueError("Repr-Digest") from error
            if len(raw) == 32:
                return raw.hex()
    raise ValueError("Repr-Digest")


def version_of(body: Mapping[str, object]) -> Version:
    """The :class:`Version` of a ``StoreVersion`` body (ValueError if it is not one)."""
    return Version(text(body, "resource"), text(body, "key"), whole(body, "epoch"),
                   whole(body, "version"))  # fmt: skip


def publication_of(body: Mapping[str, object]) -> Publication:
    """The :class:`Publication` of a ``StorePublication`` body (ValueError if it is not one)."""
    return Publication(
        text(body, "resource"),
        text(body, "name"),
        whole(body, "epoch"),
        text(body, "object_id"),
        text(body, "sha256"),
        whole(body, "size"),
        number(body, "published_at"),
    )


def publication_of_headers(resource: str, name: str, headers: Mapping[str, str]) -> Publication:
    """The :class:`Publication` a publication's ``GET``/``HEAD`` answer describes in its
    headers (ValueError if one is missing or malformed)."""
    try:
        published_at = float(headers[PUBLISHED_HEADER])
        if not math.isfinite(published_at):
            raise ValueError(PUBLISHED_HEADER)
        return Publication(
            resource,
            name,
            int(headers[EPOCH_HEADER]),
            headers[OBJECT_HEADER],
            sha256_of_digest(headers["Repr-Digest"]),
            int(headers["Content-Length"]),
            published_at,
        )
    except KeyError as missing:
        raise ValueError(f"header {missing} missing") from None


def item_of_headers(resource: str, key: str, value: bytes, headers: Mapping[str, str]) -> Item:
    """The :class:`Item` of an item's ``GET`` answer (ValueError if a header is missing)."""
    try:
        return Item(resource, key, value, int(headers[EPOCH_HEADER]),
                    int(headers[VERSION_HEADER]))  # fmt: skip
    except KeyError as missing:
        raise ValueError(f"header {missing} missing") from None

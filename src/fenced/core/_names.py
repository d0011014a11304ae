"""Validation of resource names, keys and publication names. Pure: no I/O.

A resource name is 1–255 bytes of ``[A-Za-z0-9._-]`` in ``/``-separated segments, with no empty,
``.`` or ``..`` segment. Keys and publication names follow the same rule (a publication name may
also be empty: the default publication). Every violation raises :class:`InvalidName` before any
I/O, with a message that says what is wrong.
"""

from __future__ import annotations

import re

from fenced.core._errors import InvalidName

__all__ = ["MAX_NAME_BYTES", "validate_key", "validate_publication_name", "validate_resource"]

MAX_NAME_BYTES = 255
_SEGMENT = re.compile(r"[A-Za-z0-9._-]+")


def _validate(kind: str, name: object) -> str:
    if not isinstance(name, str):
        raise InvalidName(f"{kind} must be a str, not {type(name).__name__}")
    if not name:
        raise InvalidName(f"{kind} must not be empty")
    if len(name) > MAX_NAME_BYTES:
        raise InvalidName(f"{kind} is {len(name)} bytes long; the limit is {MAX_NAME_BYTES}")
    for segment in name.split("/"):
        if not segment:
            raise InvalidName(f"{kind} {name!r} has an empty segment (leading, trailing or '//')")
        if segment in (".", ".."):
            raise InvalidName(f"{kind} {name!r} has a {segment!r} segment")
        if not _SEGMENT.fullmatch(segment):
            bad = next(c for c in segment if not _SEGMENT.fullmatch(c))
            raise InvalidName(
                f"{kind} {name!r} contains {bad!r}; allowed are A-Z a-z 0-9 . _ - and '/'"
            )
    return name


# Resource names already found valid (every acquire, release and token checks its name): a set
# lookup instead of a regex per segment. Bounded: cleared when full.
_VALID_RESOURCES: set[str] = set()
_VALID_RESOURCES_MAX = 4096


def validate_resource(name: object) -> str:
    """Return ``name`` if it is a valid resource name, else raise :class:`InvalidName`."""
    if type(name) is str and name in _VALID_RESOURCES:
        return name
    checked = _validate("resource name", name)
    if type(name) is str:  # not a str subclass, whose __eq__/__hash__ could differ
        if len(_VALID_RESOURCES) >= _VALID_RESOURCES_MAX:
            _VALID_RESOURCES.clear()
        _VALID_RESOURCES.add(checked)
    return checked


def validate_key(key: object) -> str:
    """Return ``key`` if it is a valid store key, else raise :class:`InvalidName`."""
    return _validate("key", key)


def validate_publication_name(name: object) -> str:
    """Return ``name`` if it is a valid publication name ('' is the default), else raise."""
    if name == "":
        return ""
    return _validate("publication name", name)

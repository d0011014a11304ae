"""The values a store returns: :class:`Version`, :class:`Item`, :class:`Publication`. Pure.

All are frozen: a value describes the store at one instant and never changes afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["MODES", "Item", "Mode", "Publication", "Version"]

Mode = Literal["strict", "monotonic"]
"""How a store treats an epoch above its floor (see :mod:`fenced.fence._rules`)."""

MODES: tuple[Mode, ...] = ("strict", "monotonic")


@dataclass(frozen=True, slots=True)
class Version:
    """The outcome of an accepted ``put``: ``key`` of ``resource`` is now at ``version``.

    ``version`` counts the accepted writes of that key, starting at 1; ``epoch`` is the epoch of
    the token that wrote it.
    """

    resource: str
    key: str
    epoch: int
    version: int


@dataclass(frozen=True, slots=True)
class Item:
    """The current value of one key, as returned by ``get``."""

    resource: str
    key: str
    value: bytes = field(repr=False)
    epoch: int
    version: int


@dataclass(frozen=True, slots=True)
class Publication:
    """A visible publication: what the pointer of ``(resource, name)`` shows.

    ``object_id`` names the immutable object holding the bytes (``size`` bytes whose SHA-256 is
    ``sha256``, lowercase hex); ids are unique per publish attempt and never reused.
    ``published_at`` is the store's wall-clock time of the publication, for display only.
    """

    resource: str
    name: str
    epoch: int
    object_id: str
    sha256: str
    size: int
    published_at: float

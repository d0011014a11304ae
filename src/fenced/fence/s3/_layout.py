"""Where an ``s3://`` store keeps what, under its prefix ``P`` (docs/s3.md, Layout). Pure.

``P/fenced-store.json``
    The store's identity and mode, created once with ``If-None-Match: *``.
``P/state/<r>.json``
    One resource's state (:mod:`fenced.fence.s3._state`): binding, floor, pointers, the key
    index, recent op outcomes and records. Changed only by a conditional PUT.
``P/objects/<r>/<object id>``
    A publication's bytes: immutable, written completely before a state names it.
``P/values/<r>/<uuid>``
    A key's value too large to keep in the state (immutable, like objects).
``P/ops/<r>/<sha256 of op id>.json``
    An op outcome moved out of the state (written only from committed state).
``P/records/<r>/<first seq>-<last seq>.json``
    Records moved out of the state, in segments (written only from committed state).
``P/probe/<uuid>``
    The conditional-write probe of ``open_store`` (deleted at once).

``<r>`` is the resource name with ``/`` spelled ``%2F`` (``%`` is not allowed in names), so one
resource's keys are never under another's prefix.
"""

from __future__ import annotations

import hashlib

__all__ = ["META", "op_name", "resource_of", "segment", "segment_name", "seqs_of"]

META = "fenced-store.json"


def segment(resource: str) -> str:
    """``resource`` as one key segment."""
    return resource.replace("/", "%2F")


def resource_of(name: str) -> str:
    """The resource whose :func:`segment` is ``name``."""
    return name.replace("%2F", "/")


def op_name(op_id: str) -> str:
    """The key name of ``op_id``'s moved-out outcome."""
    return hashlib.sha256(op_id.encode()).hexdigest() + ".json"


def segment_name(first: int, last: int) -> str:
    """The key name of the records segment holding seqs ``first`` … ``last``."""
    return f"{first:020d}-{last:020d}.json"


def seqs_of(name: str) -> tuple[int, int] | None:
    """The (first, last) seqs of a segment key name; None for another name."""
    stem = name.removesuffix(".json")
    first, _, last = stem.partition("-")
    if not (first.isdigit() and last.isdigit()):
        return None
    return int(first), int(last)

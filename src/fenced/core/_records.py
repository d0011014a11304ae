"""Structured ownership records: what happened to which resource, at which epoch, when. Pure.

Coordinator backends append records in the same transaction as the change they describe (a
grant, a release, a detected expiry, a restore); stores append theirs in the same transaction as
the mutation (installs, accepted and rejected writes, an operator's rebind). Holders report
renewal failures. A record never carries the owner secret.

``at`` is wall-clock time (seconds since the Unix epoch): for display and for merging the records
of several sources into one timeline, never for deciding anything.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps's, for str

__all__ = ["Record", "RecordKind"]


class RecordKind(enum.Enum):
    """What a record says happened."""

    GRANTED = "granted"
    """A lease was granted (detail ``after``: "released" / "expired" / "none")."""
    RELEASED = "released"
    """The holder released the lease."""
    EXPIRED = "expired"
    """The lease expired at the coordinator (``at`` is the expiry instant)."""
    RENEWAL_FAILED = "renewal-failed"
    """A holder reported that a renewal failed (detail ``error``)."""
    LOST = "lost"
    """A holder reported that it considers its lease lost (detail ``reason``)."""
    PROCLAIMED = "proclaimed"
    """An election leader advertised a new value (detail ``value``), same term."""
    RESTORED = "restored"
    """State was restored from a backup; epochs were advanced (detail ``era``, ``jump``)."""
    INSTALLED = "installed"
    """A store installed an epoch (its floor moved to ``epoch``)."""
    ACCEPTED = "accepted"
    """A store accepted a mutation (detail ``op``: put / publish, ``key`` or ``name``)."""
    REJECTED = "rejected"
    """A store rejected a mutation (detail ``reason``, ``presented``, ``floor``)."""
    REBOUND = "rebound"
    """An operator bound a store's resource to another coordinator, its floor kept (``epoch``;
    detail ``previous``: the old coordinator id, ``coordinator``: the new one)."""


@dataclass(frozen=True, slots=True)
class Record:
    """One event. ``seq`` orders the records of one source (a coordinator or a store)."""

    seq: int
    at: float
    kind: RecordKind
    resource: str
    epoch: int
    holder: str | None = None
    detail: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        """A JSON-able dict (stable shape: seq, at, kind, resource, epoch, holder, detail)."""
        return {
            "seq": self.seq,
            "at": self.at,
            "kind": self.kind.value,
            "resource": self.resource,
            "epoch": self.epoch,
            "holder": self.holder,
            "detail": dict(self.detail),
        }


_DETAIL_JSON = json.JSONEncoder(separators=(",", ":"), default=str)


def detail_json(detail: Mapping[str, object]) -> str:
    """``json.dumps(dict(detail), separators=(",", ":"), default=str)``: a record's detail as the
    stores keep it, character for character. The usual detail (str keys; str, int or None
    values) is written here with json's own string escaping; anything else goes to the encoder."""
    parts = []
    for name, value in detail.items():
        if type(name) is not str:
            return _DETAIL_JSON.encode(dict(detail))
        if value is None:
            encoded = "null"
        elif type(value) is str:
            encoded = _json_str(value)
        elif type(value) is int:
            encoded = int.__repr__(value)
        else:
            return _DETAIL_JSON.encode(dict(detail))
        parts.append(f"{_json_str(name)}:{encoded}")
    return "{" + ",".join(parts) + "}"

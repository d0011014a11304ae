"""One resource's state in an ``s3://`` store: the JSON document at ``P/state/<r>.json``. Pure.

Everything a decision about the resource reads lives in this one document, so one conditional
PUT (``If-Match`` the ETag that was read) changes the floor, a pointer, a key, an op outcome and
the records together or not at all (docs/s3.md, Why one state object). Fields:

``nonce``
    Fresh for every write: identical bodies would give identical ETags (an MD5), and a writer
    that read version A could then commit over A → B → A.
``commits``
    ``[nonce, parent nonce]`` of the last :data:`COMMITS_KEPT` writes: which write replaced
    which version. Exactly one write can replace a version (each is conditional on it), so a
    writer whose reply was lost finds out whether its write is the one that replaced the version
    it read, even after later writes (:meth:`State.successor`).
``coordinator``, ``floor``
    The :class:`~fenced.fence._rules.Head`.
``items``
    key → ``[epoch, version, inline value (base64) | None, value key name | None]``.
``pointers``
    name → ``[epoch, object id, sha256, size, published_at]``.
``published``
    object id → ``[name, epoch, published_at, superseded_at | None]`` for gc.
``condemned``
    object ids (and value key names) gc has claimed: never pointed at again, deleted next.
``ops``
    op id → ``[digest, outcome, recorded_at]``: the newest outcomes (older ones are moved out).
``seq``, ``records``
    The last record seq, and the newest records ``[seq, at, kind, epoch, detail]``.
"""

from __future__ import annotations

import base64
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from fenced.core._errors import CorruptData
from fenced.core._records import Record, RecordKind
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head
from fenced.fence._values import Item, Publication

__all__ = ["COMMITS_KEPT", "INLINE_BYTES", "State"]

FORMAT = 1
COMMITS_KEPT = 16
"""Writes remembered in ``commits``."""
INLINE_BYTES = 4096
"""Values up to this size are kept inside the state; larger ones in a value object."""


@dataclass(slots=True)
class State:
    """A resource's state as read (see the module docstring); changed in place by a transaction."""

    resource: str
    nonce: str = ""
    coordinator: str | None = None
    floor: int | None = None
    items: dict[str, list[Any]] = field(default_factory=dict)
    pointers: dict[str, list[Any]] = field(default_factory=dict)
    published: dict[str, list[Any]] = field(default_factory=dict)
    condemned: dict[str, float] = field(default_factory=dict)
    ops: dict[str, list[Any]] = field(default_factory=dict)
    seq: int = 0
    records: list[list[Any]] = field(default_factory=list)
    commits: list[list[str]] = field(default_factory=list)

    # -- codec -----------------------------------------------------------------------------

    def encode(self) -> bytes:
        """The document with a fresh :attr:`nonce` (set on self), replacing the version whose
        nonce it had (noted in ``commits``)."""
        parent, self.nonce = self.nonce, uuid.uuid4().hex
        self.commits = [*self.commits[-(COMMITS_KEPT - 1) :], [self.nonce, parent]]
        document = {
            "format": FORMAT,
            "resource": self.resource,
            "nonce": self.nonce,
            "coordinator": self.coordinator,
            "floor": self.floor,
            "items": self.items,
            "pointers": self.pointers,
            "published": self.published,
            "condemned": self.condemned,
            "ops": self.ops,
            "seq": self.seq,
            "records": self.records,
            "commits": self.commits,
        }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, resource: str, body: bytes, where: str) -> State:
        """The state in ``body``; :class:`CorruptData` if it is not one of ``resource``."""
        try:
            document = json.loads(body)
            if document.get("format") != FORMAT or document.get("resource") != resource:
                raise ValueError("not a fenced resource state of this format")
            return cls(
                resource=resource,
                nonce=str(document["nonce"]),
                coordinator=document["coordinator"],
                floor=document["floor"],
                items=dict(document["items"]),
                pointers=dict(document["pointers"]),
                published=dict(document["published"]),
                condemned=dict(document["condemned"]),
                ops=dict(document["ops"]),
                seq=int(document["seq"]),
                records=list(document["records"]),
                commits=list(document["commits"]),
            )
        except KeyError as error:
            raise CorruptData(
                f"{where}: the state of {resource} is damaged: it has no {error} field"
            ) from None
        except (ValueError, TypeError, AttributeError) as error:
            raise CorruptData(f"{where}: the state of {resource} is damaged: {error}") from None

    def copy(self) -> State:
        """A copy a transaction may change without touching this one (one level deep: the
        entries themselves are replaced, never changed in place)."""
        return State(
            self.resource,
            self.nonce,
            self.coordinator,
            self.floor,
            dict(self.items),
            dict(self.pointers),
            dict(self.published),
            dict(self.condemned),
            dict(self.ops),
            self.seq,
            list(self.records),
            list(self.commits),
        )

    # -- views -----------------------------------------------------------------------------

    @property
    def head(self) -> Head:
        return Head(self.coordinator, self.floor)

    def pointer(self, name: str) -> Publication | None:
        entry = self.pointers.get(name)
        if entry is None:
            return None
        epoch, object_id, sha256, size, published_at = entry
        return Publication(self.resource, name, epoch, object_id, sha256, size, published_at)

    def item(self, key: str, stored: bytes | None = None) -> Item | None:
        """The item of ``key``; ``stored``: its value read from its value object."""
        entry = self.items.get(key)
        if entry is None:
            return None
        epoch, version, inline, _ = entry
        value = base64.b64decode(inline) if inline is not None else stored
        if value is None:
            raise ValueError("the value lives in a value object: read it first")
        return Item(self.resource, key, value, epoch, version)

    def op(self, op_id: str) -> OpRecord | None:
        entry = self.ops.get(op_id)
        return None if entry is None else OpRecord(entry[0], entry[1], entry[2])

    def successor(self, parent: str) -> str | None:
        """The nonce of the write that replaced the version with nonce ``parent``; None if that
        is not among the remembered writes (none yet, or too long ago)."""
        for nonce, replaced in self.commits:
            if replaced == parent:
                return nonce
        return None

    def record_list(self) -> list[Record]:
        return [record_of(self.resource, entry) for entry in self.records]

    # -- changes ---------------------------------------------------------------------------

    def set_item(self, item: Item, value_name: str | None) -> None:
        inline = None if value_name else base64.b64encode(item.value).decode()
        self.items[item.key] = [item.epoch, item.version, inline, value_name]

    def set_pointer(self, publication: Publication, now: float) -> None:
        previous = self.pointers.get(publication.name)
        if previous is not None and previous[1] in self.published:
            name, epoch, published_at, _ = self.published[previous[1]]
            self.published[previous[1]] = [name, epoch, published_at, now]
        p = publication
        self.pointers[p.name] = [p.epoch, p.object_id, p.sha256, p.size, p.published_at]
        self.published[p.object_id] = [p.name, p.epoch, p.published_at, None]

    def append(self, record: Record) -> None:
        self.seq += 1
        self.records.append(
            [self.seq, record.at, record.kind.value, record.epoch, dict(record.detail)]
        )


def record_of(resource: str, entry: list[Any]) -> Record:
    """The record an entry of ``records`` (or of a segment) holds."""
    seq, at, kind, epoch, detail = entry
    return Record(seq, at, RecordKind(kind), resource, epoch, None, detail)

"""A resource's state in the file store, and its JSON form (the content of ``state.json`` and of
each ``state.log`` line).

:class:`State` holds the binding, the floor, keys and values, pointers, superseded
publications, the last record ``seq`` and a generation ``gen`` (+1 per commit), plus the
records and op records of its own commit(s) that are not in the journals yet. There is one
format, ``fenced.file-state`` version :data:`STATE_VERSION`: :meth:`State.from_json` refuses any
other format or version and any deviation from the expected types with
ValueError/TypeError/KeyError, which the callers report as a corrupt state file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fenced.core._records import Record, RecordKind
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head
from fenced.fence._values import Publication
from fenced.fence.file._layout import OBJECT_ID

STATE_FORMAT = "fenced.file-state"
STATE_VERSION = 1
COMPACT_AT = 256 * 1024
"""Journal bytes before its first compaction (then twice what the last compaction kept)."""


@dataclass(frozen=True, slots=True)
class StoredItem:
    value: str  # base64
    epoch: int
    version: int


@dataclass(frozen=True, slots=True)
class Superseded:
    object_id: str
    name: str
    epoch: int
    published_at: float
    superseded_at: float


@dataclass(slots=True)
class State:
    """Everything the store holds for one resource at one generation."""

    resource: str
    head: Head = field(default_factory=Head)
    items: dict[str, StoredItem] = field(default_factory=dict)
    pointers: dict[str, Publication] = field(default_factory=dict)
    superseded: list[Superseded] = field(default_factory=list)
    seq: int = 0
    """The largest record seq given so far (rejections in the journal may have larger ones)."""
    gen: int = 0
    records: list[Record] = field(default_factory=list)
    """Records of this state's commit(s) that are not in the journal yet, oldest first."""
    ops: dict[str, OpRecord] = field(default_factory=dict)
    """Op records of this state's commit(s) that are not in ``ops.jsonl`` yet."""
    compact_at: int = COMPACT_AT
    oldest: float | None = None
    """The time of the oldest record in the journal as of the last checkpoint."""
    ops_compact_at: int = COMPACT_AT
    ops_oldest: float | None = None
    journal_mark: list[int] | None = None
    """(inode, size, mtime_ns) of the journal when ``seq`` last accounted for it."""

    def successor(self) -> State:
        """A copy to change in a transaction: the same data, no entries of its own yet."""
        return State(
            self.resource,
            self.head,
            dict(self.items),
            dict(self.pointers),
            list(self.superseded),
            self.seq,
            self.gen,
            [],
            {},
            self.compact_at,
            self.oldest,
            self.ops_compact_at,
            self.ops_oldest,
            self.journal_mark,
        )

    def to_json(self) -> bytes:
        document = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "gen": self.gen,
            "resource": self.resource,
            "coordinator_id": self.head.coordinator_id,
            "floor": self.head.floor,
            "items": {k: [i.value, i.epoch, i.version] for k, i in self.items.items()},
            "pointers": {
                n: [p.epoch, p.object_id, p.sha256, p.size, p.published_at]
                for n, p in self.pointers.items()
            },
            "superseded": [
                [s.object_id, s.name, s.epoch, s.published_at, s.superseded_at]
                for s in self.superseded
            ],
            "ops": {o: op_json(r) for o, r in self.ops.items()},
            "seq": self.seq,
            "records": [record_json(r) for r in self.records],
            "compact_at": self.compact_at,
            "oldest": self.oldest,
            "ops_compact_at": self.ops_compact_at,
            "ops_oldest": self.ops_oldest,
            "journal_mark": self.journal_mark,
        }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> State:
        """Parse a state; any deviation (another format or version included) raises
        ValueError/TypeError/KeyError."""
        doc = json.loads(data)
        version = doc["version"]
        if doc["format"] != STATE_FORMAT or version != STATE_VERSION or version is True:
            raise ValueError(f"unknown state format {doc['format']!r} {version!r}")
        resource = typed(doc["resource"], str)
        floor = doc["floor"]
        coordinator = doc["coordinator_id"]
        head = Head(
            None if coordinator is None else typed(coordinator, str),
            None if floor is None else integer(floor),
        )
        items = {
            typed(k, str): StoredItem(typed(v, str), integer(e), integer(n))
            for k, (v, e, n) in doc["items"].items()
        }
        pointers = {
            typed(n, str): Publication(
                resource, n, integer(e), checked_object_id(o), typed(s, str), integer(z), number(t)
            )
            for n, (e, o, s, z, t) in doc["pointers"].items()
        }
        superseded = [
            Superseded(checked_object_id(o), typed(n, str), integer(e), number(p), number(t))
            for o, n, e, p, t in doc["superseded"]
        ]
        ops = {typed(o, str): op_from(r) for o, r in doc["ops"].items()}
        records = [record_from(r, resource) for r in doc["records"]]
        return cls(
            resource,
            head,
            items,
            pointers,
            superseded,
            integer(doc["seq"]),
            integer(doc["gen"]),
            records,
            ops,
            integer(doc["compact_at"]),
            optional_number(doc["oldest"]),
            integer(doc["ops_compact_at"]),
            optional_number(doc["ops_oldest"]),
            _journal_mark_from(doc["journal_mark"]),
        )


def record_json(record: Record) -> dict[str, object]:
    return {
        "seq": record.seq,
        "at": record.at,
        "kind": record.kind.value,
        "epoch": record.epoch,
        "detail": dict(record.detail),
    }


def record_from(doc: Any, resource: str) -> Record:
    """A record from its JSON form; any deviation raises ValueError/TypeError/KeyError."""
    detail = typed(doc["detail"], dict)
    return Record(
        integer(doc["seq"]),
        number(doc["at"]),
        RecordKind(doc["kind"]),
        resource,
        integer(doc["epoch"]),
        None,
        detail,
    )


def op_json(record: OpRecord) -> list[object]:
    return [record.digest, record.outcome, record.recorded_at]


def op_from(doc: Any) -> OpRecord:
    digest, outcome, at = doc
    return OpRecord(typed(digest, str), typed(outcome, str), number(at))


def json_line(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode() + b"\n"


_T = TypeVar("_T")


def typed(value: Any, kind: type[_T]) -> _T:
    if not isinstance(value, kind):
        raise TypeError(f"expected {kind.__name__}, got {value!r}")
    return value


def integer(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError(f"expected an integer, got {value!r}")
    return typed(value, int)


def number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _journal_mark_from(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3:
        raise ValueError(f"bad journal mark {value!r}")
    return [integer(v) for v in value]


def optional_number(value: Any) -> float | None:
    return None if value is None else number(value)


def checked_object_id(value: Any) -> str:
    if not isinstance(value, str) or not OBJECT_ID.fullmatch(value):
        raise ValueError(f"bad object id {value!r}")
    return value

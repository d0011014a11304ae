"""The etcd key layout of fenced, and the JSON values stored under it. No I/O.

Under a prefix ``P`` (default ``/fenced``; resource names cannot contain ``:``, so ``NAME:`` never
is a prefix of another resource's keys)::

    P/meta/id                 coordinator id (32 hex), written once
    P/meta/minimum            coordinator-wide minimum epoch (decimal; absent = 0); see advance
    P/res/NAME                durable per-resource state: last epoch, how its lease ended, and
                              the number N of its last record
    P/lease/NAME              the live lease (attached to an etcd lease: etcd deletes it at expiry)
    P/queue/NAME:TICKET       a waiter (attached to its process's queue lease); order = create rev;
                              its value says how to hand the lease to it (see QueueValue)
    P/req/REQUEST_ID          a grant made with a request_id (attached to a 24 h retention lease)
    P/log/NAME:N              the records of the resource's N-th recorded change (a JSON list:
                              the ones its transaction wrote; N zero-padded to 20 digits)

Epochs live in ``P/res/NAME`` and the minimum in ``P/meta/minimum``; etcd revisions are never
used as epochs (they move back after ``etcdctl snapshot restore``).

**No key is written by every change.** A resource's record keys are numbered by its own
counter, kept in ``P/res/NAME`` and raised in the transaction that writes them (every such
transaction compares that key's mod revision anyway), so changes of different resources never
conflict. One transaction writes one record key per resource it records (a release that hands
over: ``released`` and ``granted`` in one key). A record's ``seq`` — its place among *all*
records of the coordinator — is the etcd revision that wrote it, times
:data:`SEQ_PER_REVISION`, plus its index ``i`` among the records of that transaction (stored
with it): ``seq`` follows commit order, because etcd revisions do. Like any etcd revision it
moves back after a snapshot restore (as the earlier layout's counter key did).

(The development layout before 0.1.0 kept one counter ``P/meta/seq`` and records under
``P/rec/SEQ``: every change of every resource compared and wrote that one key, so changes of
different resources conflicted and retried. Those keys are neither read nor written now.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fenced.core._errors import ConfigurationError
from fenced.core._records import Record, RecordKind

__all__ = [
    "DEFAULT_PREFIX",
    "STAMP_LATER",
    "Keys",
    "LeaseValue",
    "QueueValue",
    "ResourceState",
    "record_seq",
    "records_from",
    "records_value",
    "stamped",
]

DEFAULT_PREFIX = "/fenced"
SEQ_DIGITS = 20
SEQ_PER_REVISION = 128
"""Records per transaction at most (etcd's default ``--max-txn-ops`` is 128 operations)."""


def prefix_end(prefix: bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class Keys:
    """Key names under one prefix (see the module docstring)."""

    def __init__(self, prefix: str) -> None:
        if (
            not prefix.startswith("/")
            or prefix.endswith("/")
            or not prefix.isprintable()
            or "//" in prefix
            or len(prefix) > 200
        ):
            raise ConfigurationError(
                f"etcd key prefix must look like /fenced (starts with '/', no trailing '/'), "
                f"got {prefix!r}"
            )
        self.prefix = prefix
        base = prefix.encode()
        self.meta_prefix = base + b"/meta/"
        self.coordinator_id = base + b"/meta/id"
        self.minimum = base + b"/meta/minimum"
        self.res_prefix = base + b"/res/"
        self.lease_prefix = base + b"/lease/"
        self.queue_prefix = base + b"/queue/"
        self.req_prefix = base + b"/req/"
        self.log_prefix = base + b"/log/"
        self.all = base + b"/"

    def res(self, name: str) -> bytes:
        return self.res_prefix + name.encode()

    def lease(self, name: str) -> bytes:
        return self.lease_prefix + name.encode()

    def queue(self, name: str) -> bytes:
        """The prefix of ``name``'s waiters."""
        return self.queue_prefix + name.encode() + b":"

    def ticket(self, name: str, ticket_id: str) -> bytes:
        return self.queue(name) + ticket_id.encode()

    def request(self, request_id: str) -> bytes:
        return self.req_prefix + request_id.encode()

    def log(self, name: str) -> bytes:
        """The prefix of ``name``'s records."""
        return self.log_prefix + name.encode() + b":"

    def record(self, name: str, number: int) -> bytes:
        """The key of ``name``'s record number ``number``."""
        return self.log(name) + str(number).zfill(SEQ_DIGITS).encode()

    def name_of(self, key: bytes, prefix: bytes) -> str:
        return key[len(prefix) :].decode()


def _loads(raw: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as error:
        raise ConfigurationError(f"unreadable {what} in etcd: {raw[:100]!r}") from error
    if not isinstance(value, dict):
        raise ConfigurationError(f"unreadable {what} in etcd: {raw[:100]!r}")
    return value


_encode = json.JSONEncoder(separators=(",", ":")).encode


def dumps(value: dict[str, Any]) -> bytes:
    """Compact JSON (values are compared by revision, never byte for byte)."""
    return _encode(value).encode()


def _encode_fields(value: LeaseValue | QueueValue | ResourceState) -> bytes:
    """A value object as a JSON object of its fields, named as in the class (``last_record``
    is stored as ``n``)."""
    return dumps({_STORED_AS.get(name, name): getattr(value, name) for name in value.__slots__})


_STORED_AS = {"last_record": "n"}


@dataclass(frozen=True, slots=True)
class LeaseValue:
    """The value of ``P/lease/NAME``. ``owner`` is the owner secret (never put in a record).

    ``last_record`` is the number of the resource's last record, written by the same
    transaction (0: unknown), as in :class:`ResourceState`: a waiter handed the lease by a
    release learns from the watch event alone everything its own release will compare and
    write.
    """

    epoch: int
    owner: str
    holder: str
    ttl: float
    value: str | None = None
    last_record: int = 0

    def encode(self) -> bytes:
        return _encode_fields(self)

    @classmethod
    def decode(cls, raw: bytes) -> LeaseValue:
        data = _loads(raw, "lease")
        value = data.get("value")
        return cls(
            int(data["epoch"]),
            str(data["owner"]),
            str(data["holder"]),
            float(data["ttl"]),
            None if value is None else str(value),
            int(data.get("n", 0)),
        )


@dataclass(frozen=True, slots=True)
class QueueValue:
    """The value of ``P/queue/NAME:ID``: a waiter, and what a release needs to hand it the lease.

    ``lease`` is the etcd lease the waiter created for its grant when it queued (kept alive by
    its process while it waits): a release that hands over puts ``P/lease/NAME`` attached to it,
    so the grant dies with the waiter's process like any other grant. ``owner`` is the waiter's
    owner secret (stored like the lease key stores it). A value without them (``handoff`` False)
    is never handed the lease: its waiter takes the lease itself once the key is deleted.
    """

    holder: str
    owner: str = ""
    ttl: float = 0.0
    lease: int = 0
    value: str | None = None
    request_id: str | None = None

    @property
    def handoff(self) -> bool:
        return bool(self.owner) and self.lease != 0 and self.ttl > 0

    def encode(self) -> bytes:
        return _encode_fields(self)

    @classmethod
    def decode(cls, raw: bytes) -> QueueValue:
        data = _loads(raw, "waiter")
        value, request_id = data.get("value"), data.get("request_id")
        return cls(
            str(data.get("holder", "")),
            str(data.get("owner") or ""),
            float(data.get("ttl", 0.0)),
            int(data.get("lease", 0)),
            None if value is None else str(value),
            None if request_id is None else str(request_id),
        )


@dataclass(frozen=True, slots=True)
class ResourceState:
    """The value of ``P/res/NAME``: the last epoch, and whether its lease's end is recorded.

    ``state`` is ``"held"`` while the lease of ``epoch`` may live (its end not recorded yet), else
    how it ended: ``"released"``, ``"expired"``, ``"restored"``, or ``"none"`` (never granted).
    ``holder`` is the holder label of ``epoch`` (for the expiry record). ``last_record`` is the
    number of the resource's last record (``P/log/NAME:N``; 0: none yet): the next record is
    ``last_record + 1``. Every transaction that writes this key carries ``last_record`` over or
    raises it — a record key is never written twice.
    """

    epoch: int = 0
    state: str = "none"
    holder: str | None = None
    last_record: int = 0

    def encode(self) -> bytes:
        return _encode_fields(self)

    @classmethod
    def decode(cls, raw: bytes) -> ResourceState:
        data = _loads(raw, "resource state")
        holder = data.get("holder")
        return cls(
            int(data["epoch"]),
            str(data["state"]),
            None if holder is None else str(holder),
            int(data.get("n", 0)),
        )


STAMP_LATER = -8.125
"""An ``at`` that no record has: records built with it are given their time by
:func:`stamped` (a transaction prepared before it is sent)."""
_STAMP_FIELD = b'"at":' + float.__repr__(STAMP_LATER).encode() + b","  # as json writes it


def stamped(value: bytes, at: float) -> bytes:
    """A :func:`records_value` built with ``at = STAMP_LATER``, with ``at`` in its place.

    The pattern ``"at":-8.125,`` can only be a record's own field: inside a JSON string its
    quotes would be escaped."""
    return value.replace(_STAMP_FIELD, b'"at":' + float.__repr__(at).encode() + b",")


def records_value(records: list[tuple[int, Record]]) -> bytes:
    """A record key's value: the records ``(i, record)`` that one transaction writes for one
    resource, each without ``seq`` (known once etcd commits) and with ``i``, its index among
    the records of that transaction."""
    value = []
    for index, record in records:
        fields = record.to_json()
        del fields["seq"]
        fields["i"] = index
        value.append(fields)
    return _encode(value).encode()


def record_seq(create_revision: int, index: int) -> int:
    """The ``seq`` of the record with index ``index`` in the transaction of ``create_revision``."""
    return create_revision * SEQ_PER_REVISION + index


def records_from(raw: bytes, create_revision: int) -> list[Record]:
    """The records stored as ``raw`` by the transaction of ``create_revision``."""
    try:
        value = json.loads(raw)
    except ValueError as error:
        raise ConfigurationError(f"unreadable records in etcd: {raw[:100]!r}") from error
    if not isinstance(value, list) or not all(isinstance(data, dict) for data in value):
        raise ConfigurationError(f"unreadable records in etcd: {raw[:100]!r}")
    try:
        return [
            Record(
                record_seq(create_revision, int(data["i"])),
                float(data["at"]),
                RecordKind(data["kind"]),
                str(data["resource"]),
                int(data["epoch"]),
                None if data.get("holder") is None else str(data["holder"]),
                dict(data.get("detail") or {}),
            )
            for data in value
        ]
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigurationError(f"unreadable records in etcd: {raw[:100]!r}") from error

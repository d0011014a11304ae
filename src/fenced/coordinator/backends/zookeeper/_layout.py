"""Where fenced keeps its state in ZooKeeper, and the JSON documents of its znodes. Pure.

Under the chroot ``C`` (``/fenced`` by default):

=========================  ==========================================================  ==========
znode                      data                                                        kind
=========================  ==========================================================  ==========
``C/meta``                 ``{"format": 1, "id": coordinator id, "minimum": m}``       persistent
``C/clock``                empty; written to read the leader's clock (its ``mtime``)    persistent
``C/res/R``                the resource's counter: ``{"epoch": e, "holder": h,          persistent
                           "state": "none"|"live"|"released"|"expired"|"restored"}``
``C/res/R/lease``          the live lease: epoch, owner, holder, ttl, value, base       persistent
``C/queue/R``              empty; its version counts the waiters that ever queued       persistent
``C/queue/R/w-N``          a waiter's place (``N``: ZooKeeper's sequence)               ephemeral,
                                                                                        sequential
``C/log/R@N``              one record (kind, epoch, holder, detail, at); ``N + 1`` is  persistent,
                           its ``seq``: ZooKeeper's sequence of ``C/log``, global      sequential
``C/request/ID``           ``{"resource", "epoch", "owner"}`` of a ``request_id``'s     persistent
                           grant
=========================  ==========================================================  ==========

``R`` is the resource name with ``/`` written as ``%2F`` (names are letters, digits, ``.``,
``_``, ``-`` and ``/``), ``ID`` the request id percent-encoded.

A lease expires at ``base + ttl``, where ``base`` is the ``mtime`` of the lease znode (the
leader's clock when the grant or the last renewal was committed) unless the document carries a
``base`` of its own (a ``proclaim`` keeps the expiry it had); the end of a session does not end
a lease.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from fenced.core._errors import ConfigurationError
from fenced.core._records import Record, RecordKind

__all__ = [
    "FORMAT",
    "Counter",
    "LeaseDoc",
    "Paths",
    "decode_record",
    "encode_record",
]

FORMAT = 1
_SEQ_DIGITS = 10


def _foreign(path: str) -> ConfigurationError:
    return ConfigurationError(f"ZooKeeper node {path} holds data fenced did not write")


def _load(data: bytes, path: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _foreign(path)
    return value


_ENCODER = json.JSONEncoder(separators=(",", ":"))


def _dump(value: dict[str, Any]) -> bytes:
    return _ENCODER.encode(value).encode()


@functools.lru_cache(maxsize=4096)
def _name(text: str) -> str:
    """``text`` as one znode name (``/`` and every other reserved character percent-encoded)."""
    return quote(text, safe="")


@dataclass(frozen=True)
class Paths:
    """The znode paths under one chroot."""

    root: str

    @property
    def meta(self) -> str:
        return f"{self.root}/meta"

    @property
    def clock(self) -> str:
        return f"{self.root}/clock"

    @property
    def resources(self) -> str:
        return f"{self.root}/res"

    @property
    def queues(self) -> str:
        return f"{self.root}/queue"

    @property
    def log(self) -> str:
        return f"{self.root}/log"

    @property
    def requests(self) -> str:
        return f"{self.root}/request"

    def dirs(self) -> tuple[str, ...]:
        """The persistent directories created with the state."""
        return (self.resources, self.queues, self.log, self.requests)

    def counter(self, resource: str) -> str:
        return f"{self.resources}/{_name(resource)}"

    def lease(self, resource: str) -> str:
        return f"{self.counter(resource)}/lease"

    def queue(self, resource: str) -> str:
        return f"{self.queues}/{_name(resource)}"

    def waiter_prefix(self, resource: str) -> str:
        return f"{self.queue(resource)}/w-"

    def record_prefix(self, resource: str) -> str:
        return f"{self.log}/{_name(resource)}@"

    def request(self, request_id: str) -> str:
        return f"{self.requests}/{_name(request_id)}"

    @staticmethod
    def resource_of(child: str) -> str:
        """The resource name of a child of ``res`` or ``queue``."""
        return unquote(child)

    @staticmethod
    def record_name(child: str) -> tuple[str, int] | None:
        """``(resource, seq)`` of a child of ``log`` (None for a name fenced did not write):
        ``seq`` is ZooKeeper's sequence number + 1 (records count from 1)."""
        name, at, number = child.rpartition("@")
        if not at or len(number) != _SEQ_DIGITS or not number.isdigit():
            return None
        return unquote(name), int(number) + 1


@dataclass(frozen=True)
class Counter:
    """A resource's counter znode: the last epoch and how its lease stands."""

    epoch: int = 0
    holder: str | None = None
    state: str = "none"

    @classmethod
    def decode(cls, data: bytes, path: str) -> Counter:
        doc = _load(data, path)
        try:
            epoch, holder, state = doc["epoch"], doc.get("holder"), doc["state"]
        except KeyError as error:
            raise ConfigurationError(f"ZooKeeper node {path} lacks {error}") from error
        if not isinstance(epoch, int) or state not in (
            "none",
            "live",
            "released",
            "expired",
            "restored",
        ):
            raise _foreign(path)
        return cls(epoch, holder, state)

    def encode(self) -> bytes:
        return _dump({"epoch": self.epoch, "holder": self.holder, "state": self.state})


@dataclass(frozen=True)
class LeaseDoc:
    """The data of a lease znode."""

    epoch: int
    owner: str
    holder: str
    ttl: float
    value: str | None = None
    base: int | None = None
    """Milliseconds (the leader's clock) the expiry counts from; None: the znode's mtime."""

    @classmethod
    def decode(cls, data: bytes, path: str) -> LeaseDoc:
        doc = _load(data, path)
        try:
            return cls(
                int(doc["epoch"]),
                str(doc["owner"]),
                str(doc["holder"]),
                float(doc["ttl"]),
                doc.get("value"),
                doc.get("base"),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise _foreign(path) from error

    def encode(self) -> bytes:
        doc: dict[str, Any] = {
            "epoch": self.epoch,
            "owner": self.owner,
            "holder": self.holder,
            "ttl": self.ttl,
        }
        if self.value is not None:
            doc["value"] = self.value
        if self.base is not None:
            doc["base"] = self.base
        return _dump(doc)

    def expires_ms(self, mtime: int) -> float:
        """The leader-clock instant (ms) this lease expires, given its znode's mtime."""
        return (mtime if self.base is None else self.base) + self.ttl * 1000.0


def encode_record(
    kind: RecordKind, epoch: int, holder: str | None, detail: dict[str, object], at: float
) -> bytes:
    return _dump({"kind": kind.value, "epoch": epoch, "holder": holder, "detail": detail, "at": at})


def decode_record(resource: str, seq: int, data: bytes, path: str) -> Record:
    doc = _load(data, path)
    try:
        return Record(
            seq,
            float(doc["at"]),
            RecordKind(doc["kind"]),
            resource,
            int(doc["epoch"]),
            doc.get("holder"),
            dict(doc.get("detail") or {}),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigurationError(
            f"ZooKeeper node {path} holds data fenced did not write"
        ) from error


def encode_request(resource: str, epoch: int, owner: str) -> bytes:
    return _dump({"resource": resource, "epoch": epoch, "owner": owner})


def decode_request(data: bytes, path: str) -> tuple[str, int, str]:
    doc = _load(data, path)
    try:
        return str(doc["resource"]), int(doc["epoch"]), str(doc["owner"])
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigurationError(
            f"ZooKeeper node {path} holds data fenced did not write"
        ) from error


def encode_meta(coordinator_id: str, minimum: int) -> bytes:
    return _dump({"format": FORMAT, "id": coordinator_id, "minimum": minimum})


def decode_meta(data: bytes, path: str) -> tuple[str, int]:
    doc = _load(data, path)
    if doc.get("format") != FORMAT or not isinstance(doc.get("id"), str):
        raise ConfigurationError(
            f"ZooKeeper node {path} is not fenced's (format {doc.get('format')!r}); "
            "use another chroot"
        )
    return str(doc["id"]), int(doc.get("minimum", 0))

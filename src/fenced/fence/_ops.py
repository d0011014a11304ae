"""Operation ids: content digests, recorded outcomes and the replay decision. Pure: no I/O.

A mutation given an ``op_id`` is recorded, in the same atomic step as its effect, as
``(resource, op_id) → (digest of its content, outcome, recorded_at)``. A later call with the same
``op_id`` in the same resource is looked up *before* any other check:

* same digest → the recorded outcome is returned and nothing is applied, even if the floor has
  moved since (the first attempt did land, and that is what the caller wants to know);
* other digest (another key, value, ``if_version``, data, name, epoch, coordinator or kind of
  operation) → :class:`IdempotencyConflict`, nothing applied.

Only accepted operations are recorded: a rejected attempt wrote nothing, so its retry is judged
afresh. A record is honoured for ``retention`` seconds after it was written; after that the op id
is forgotten (and the record is pruned).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from fenced.core._errors import ConfigurationError, IdempotencyConflict, InvalidName
from fenced.core._token import FencingToken
from fenced.fence._values import Publication, Version

__all__ = [
    "MAX_OP_ID_CHARS",
    "OpRecord",
    "decode_publication",
    "decode_version",
    "encode_outcome",
    "publish_digest",
    "put_digest",
    "replay",
    "validate_op_id",
]

MAX_OP_ID_CHARS = 255


@dataclass(frozen=True, slots=True)
class OpRecord:
    """What a store keeps for one accepted operation with an op id."""

    digest: str
    outcome: str
    recorded_at: float


def validate_op_id(op_id: object) -> str:
    """Return ``op_id`` if it is 1–255 printable characters, else raise :class:`InvalidName`."""
    if not isinstance(op_id, str):
        raise InvalidName(f"op_id must be a str, not {type(op_id).__name__}")
    if not 1 <= len(op_id) <= MAX_OP_ID_CHARS:
        raise InvalidName(f"op_id must be 1 to {MAX_OP_ID_CHARS} characters, got {len(op_id)}")
    if not op_id.isprintable():
        raise InvalidName(f"op_id {op_id!r} contains a control character")
    return op_id


def _digest(kind: str, token: FencingToken, **content: object) -> str:
    fields = {"op": kind, "coordinator_id": token.coordinator_id, "epoch": token.epoch, **content}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def put_digest(token: FencingToken, key: str, value: bytes, if_version: int | None) -> str:
    """The content digest of a put."""
    value_sha = hashlib.sha256(value).hexdigest()
    return _digest("put", token, key=key, value=value_sha, if_version=if_version)


def publish_digest(token: FencingToken, name: str, sha256: str, size: int) -> str:
    """The content digest of a publish (of ``size`` bytes with SHA-256 ``sha256``)."""
    return _digest("publish", token, name=name, sha256=sha256, size=size)


def replay(record: OpRecord | None, digest: str, *, now: float, retention: float) -> str | None:
    """The recorded outcome to return instead of applying, or None to go on.

    Raises :class:`IdempotencyConflict` when the op id was used for other content.
    """
    if record is None or record.recorded_at < now - retention:
        return None
    if record.digest != digest:
        raise IdempotencyConflict(
            "this op_id was already used for a different operation in this resource "
            "(other key, value, data, name, if_version or token); nothing was applied"
        )
    return record.outcome


def encode_outcome(outcome: Version | Publication) -> str:
    """The text form of an outcome, as recorded with its op id."""
    return json.dumps(asdict(outcome), sort_keys=True, separators=(",", ":"))


def _fields(text: str) -> dict[str, Any]:
    try:
        fields = json.loads(text)
    except ValueError as error:
        raise ConfigurationError(f"corrupt op record: {error}") from error
    if not isinstance(fields, dict):
        raise ConfigurationError("corrupt op record: not an object")
    return fields


def decode_version(text: str) -> Version:
    """The :class:`Version` recorded by :func:`encode_outcome`."""
    try:
        return Version(**_fields(text))
    except TypeError as error:
        raise ConfigurationError(f"corrupt op record: {error}") from error


def decode_publication(text: str) -> Publication:
    """The :class:`Publication` recorded by :func:`encode_outcome`."""
    try:
        return Publication(**_fields(text))
    except TypeError as error:
        raise ConfigurationError(f"corrupt op record: {error}") from error

"""Strict reading of the JSON answers of ``fenced serve`` (pure: no I/O), shared by the
coordinator client (:mod:`fenced.coordinator.backends.http`) and the store client
(:mod:`fenced.fence.http`). A member that is missing or of the wrong type is a ``ValueError``
naming it; the callers turn it into ``Unavailable`` or ``OutcomeUnknown`` (a reply they cannot
trust)."""

from __future__ import annotations

import math
from collections.abc import Mapping

from fenced.core._records import Record, RecordKind

__all__ = ["number", "optional_text", "records_of", "text", "whole"]

Json = Mapping[str, object]


def text(body: Json, name: str) -> str:
    value = body.get(name)
    if type(value) is not str:
        raise ValueError(name)
    return value


def optional_text(body: Json, name: str) -> str | None:
    value = body.get(name)
    if value is not None and type(value) is not str:
        raise ValueError(name)
    return value


def whole(body: Json, name: str) -> int:
    value = body.get(name)
    if type(value) is not int:
        raise ValueError(name)
    return value


def number(body: Json, name: str) -> float:
    """A finite number (an integer is accepted as a float)."""
    value = body.get(name)
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError(name)
    return float(value)  # type: ignore[arg-type]


def records_of(body: Json) -> list[Record]:
    """The records of a ``Records`` body (the shape of :meth:`Record.to_json`)."""
    found = body.get("records")
    if not isinstance(found, list):
        raise ValueError("records")
    records = []
    for item in found:
        if not isinstance(item, Mapping):
            raise ValueError("record")
        detail = item.get("detail")
        if not isinstance(detail, Mapping):
            raise ValueError("detail")
        records.append(
            Record(
                seq=whole(item, "seq"),
                at=number(item, "at"),
                kind=RecordKind(text(item, "kind")),
                resource=text(item, "resource"),
                epoch=whole(item, "epoch"),
                holder=optional_text(item, "holder"),
                detail=dict(detail),
            )
        )
    return records

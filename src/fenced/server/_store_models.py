"""The JSON bodies of ``/v1/stores``, as pydantic models (strict, unknown members refused), from
which FastAPI validates requests and generates the OpenAPI document.

Values and publications travel as raw bytes (``application/octet-stream``), not in JSON: these
models describe only what is said about them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from fenced.core._records import Record
from fenced.fence._values import Publication, Version
from fenced.server._models import RecordBody, Records

__all__ = [
    "Floors",
    "GcBody",
    "GcResult",
    "RebindBody",
    "Rebound",
    "ResourceState",
    "StoreFence",
    "StoreInfo",
    "StoreList",
    "StorePublication",
    "StoreVersion",
    "records_body",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StoreInfo(BaseModel):
    """A store the server serves (``--store NAME=URL``); its URL stays on the server."""

    name: str
    mode: str = Field(description="strict or monotonic, chosen when the store was created.")
    capabilities: list[str]


class StoreList(BaseModel):
    stores: list[StoreInfo]


class ResourceState(BaseModel):
    """A resource's committed floor and binding at the store."""

    resource: str
    floor: int | None = Field(description="The largest epoch accepted or installed (null: none).")
    coordinator_id: str | None = Field(
        description="The coordinator the resource is bound to (null: unbound)."
    )


class StoreFence(BaseModel):
    """The answer of ``:fence``: the floor now installed."""

    resource: str
    floor: int


class StoreVersion(BaseModel):
    """An accepted put: the key is now at ``version``."""

    resource: str
    key: str
    epoch: int
    version: int

    @classmethod
    def of(cls, version: Version) -> StoreVersion:
        return cls(resource=version.resource, key=version.key, epoch=version.epoch,
                   version=version.version)  # fmt: skip


class StorePublication(BaseModel):
    """A visible publication: what the pointer of ``(resource, name)`` shows."""

    resource: str
    name: str
    epoch: int
    object_id: str = Field(description="The immutable object; never reused. Also the ETag.")
    sha256: str = Field(description="Lowercase hex SHA-256 of the bytes.")
    size: int
    published_at: float = Field(description="Seconds since the Unix epoch, for display only.")

    @classmethod
    def of(cls, publication: Publication) -> StorePublication:
        p = publication
        return cls(resource=p.resource, name=p.name, epoch=p.epoch, object_id=p.object_id,
                   sha256=p.sha256, size=p.size, published_at=p.published_at)  # fmt: skip


class GcBody(_Body):
    """``POST /v1/stores/{store}:gc``."""

    keep: Annotated[int, Field(strict=True, ge=0, le=2**31)] = Field(
        1, description="Newest publications kept per (resource, name), the current one included."
    )
    grace: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)] | None = Field(
        None, description="Seconds an unreferenced object is kept (null: the store's default)."
    )


class GcResult(BaseModel):
    deleted: int


class RebindBody(_Body):
    """``POST /v1/stores/{store}/resources/{resource}:rebind`` (an operator's step)."""

    coordinator_id: Annotated[str, Field(strict=True, max_length=256)]
    previous: Annotated[str, Field(strict=True, max_length=256)] | None = Field(
        None, description="Refuse unless the resource is bound to this coordinator (or unbound)."
    )
    ceiling: Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)] = Field(
        description="The new coordinator's last epoch: refuse if the floor is above it."
    )


class Rebound(BaseModel):
    resource: str
    previous: str | None = Field(description="The coordinator it was bound to before.")


class Floors(BaseModel):
    floors: dict[str, int]


def records_body(records: list[Record]) -> Records:
    """The ``Records`` body of a store's history (the lease history's shape)."""
    return Records(
        records=[
            RecordBody(
                seq=r.seq,
                at=r.at,
                kind=r.kind.value,
                resource=r.resource,
                epoch=r.epoch,
                holder=r.holder,
                detail=dict(r.detail),
            )
            for r in records
        ]
    )

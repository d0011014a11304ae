"""The JSON bodies of the ``/v1`` API, as pydantic models: FastAPI validates requests with them
and generates the OpenAPI document from them (``/openapi.json``).

Numbers are strict (``"5"`` is not a ttl), unknown members are refused, every bound is stated
in the schema; a request that does not match gets a 422 ``invalid-request`` problem before
anything is done.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AcquireBody",
    "CoordinatorInfo",
    "CurrentLease",
    "Epoch",
    "LeaseGrant",
    "LeaseInfoBody",
    "LeaveBody",
    "ProclaimBody",
    "RecordBody",
    "Records",
    "ReleaseBody",
    "Released",
    "RenewBody",
    "Renewed",
    "ReportBody",
    "Resources",
    "Waiting",
]

Seconds = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Text = Annotated[str, Field(strict=True, max_length=1024)]
Secret = Annotated[str, Field(strict=True, min_length=1, max_length=256)]
EpochNumber = Annotated[int, Field(strict=True, ge=1, le=2**63 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class AcquireBody(_Body):
    """``POST /v1/leases/{resource}:acquire``."""

    ttl: Seconds = Field(gt=0, description="Lease time to live, seconds (> 0).")
    wait: Seconds = Field(
        0.0,
        ge=0,
        description="Seconds this request may wait for the lease (0: try once). The server "
        "waits at most its poll bound per request; with a request_id the place in the queue "
        "is kept after the request, for the next poll with the same request_id.",
    )
    queue: bool = Field(
        False, description="Keep a place in the queue after a refused try (needs request_id)."
    )
    holder: Text | None = Field(None, description="Who holds the lease (shown to others).")
    request_id: Text | None = Field(
        None,
        description="Idempotency of the grant: a retry returns the same lease, never a second "
        "epoch; also the name of this waiter's place in the queue between polls.",
    )
    value: Text | None = Field(None, description="An election candidate's advertised value.")
    owner: Secret | None = Field(
        None,
        description="The owner secret to grant the lease under (default: the server makes one "
        "up). A client that makes its own keeps it from the moment it asks, as in-process: "
        "a retry with the same request_id returns the first grant's owner.",
    )


class LeaseGrant(BaseModel):
    """A granted lease (``200`` of ``:acquire``)."""

    granted: Literal[True] = True
    resource: str
    epoch: int
    token: str = Field(description="The fencing token to present to stores.")
    owner: str = Field(description="The owner secret: renew and release need it. Keep it.")
    holder: str
    ttl: float
    expires_in: float = Field(description="Seconds the lease had left when the server answered.")
    coordinator_id: str
    waited: float = Field(
        0.0,
        description="Seconds the server held this request before the backend call that granted "
        "it began (expires_in was computed after). A client counts the lease's remaining time "
        "from its send time plus this, never from its receive time.",
    )


class Waiting(BaseModel):
    """Not granted yet; the place in the queue is kept (``202`` of ``:acquire``)."""

    granted: Literal[False] = False
    resource: str
    request_id: str
    holder: str | None = Field(description="The current holder (null: earlier waiters queued).")
    epoch: int
    remaining: float
    keep: float = Field(description="Seconds the place is kept without a poll.")


class RenewBody(_Body):
    epoch: EpochNumber
    owner: Secret
    ttl: Seconds = Field(gt=0)


class Renewed(BaseModel):
    expires_in: float


class ReleaseBody(_Body):
    epoch: EpochNumber
    owner: Secret


class Released(BaseModel):
    released: bool


class LeaveBody(_Body):
    request_id: Text
    take: bool = Field(
        False,
        description="Return a lease a release handed to this place meanwhile (else release it).",
    )


class ProclaimBody(_Body):
    epoch: EpochNumber
    owner: Secret
    value: Text


class ReportBody(_Body):
    epoch: Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]
    holder: Text
    kind: Literal["renewal-failed", "lost"]
    detail: dict[str, str | int | float | bool | None] = Field(default_factory=dict)


class LeaseInfoBody(BaseModel):
    resource: str
    epoch: int
    holder: str
    expires_in: float
    ttl: float
    coordinator_id: str
    value: str | None = None


class CurrentLease(BaseModel):
    resource: str
    lease: LeaseInfoBody | None


class Epoch(BaseModel):
    resource: str
    last_epoch: int


class Resources(BaseModel):
    resources: list[str]


class RecordBody(BaseModel):
    seq: int
    at: float
    kind: str
    resource: str
    epoch: int
    holder: str | None
    detail: dict[str, object]


class Records(BaseModel):
    records: list[RecordBody]


class CoordinatorInfo(BaseModel):
    coordinator_id: str
    capabilities: list[str]
    version: str
    poll: float = Field(description="The longest a request waits on the server, seconds.")
    keep: float = Field(description="Seconds a waiter's place is kept between polls.")


class AdvanceBody(_Body):
    """``POST /v1/coordinator:advance`` (``fenced restore``'s last step; role ``admin``)."""

    minimum: Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]
    floors: dict[str, Annotated[int, Field(strict=True, ge=0, le=2**63 - 1)]] = Field(
        default_factory=dict, max_length=100_000
    )
    detail: dict[str, str | int | float | bool | None] = Field(default_factory=dict, max_length=64)


class Advanced(BaseModel):
    minimum: int
    """The coordinator-wide minimum epoch now in force."""

"""The decisions of a coordinator client, without I/O: shared by the sync and asyncio faces.

:class:`~fenced.coordinator._client.Coordinator` (blocking calls) and
:class:`fenced.aio.AsyncCoordinator` (awaited calls) are two thin shells around these functions:
each shell only sends what these functions decide and hands the replies back to them. So both
faces validate the same parameters before any I/O with the same exceptions, compute a lease's
local deadline from the same send time, queue and give up by the same rules, and read the same
history pages (docs/asyncio.md, "One source of truth").

The waiting loop of ``acquire`` is written once, as :class:`AcquireSteps`: a shell asks it
:meth:`~AcquireSteps.next_step` after every ``try_grant`` and does what it says (enqueue, wait
for so long, give up by leaving the queue with ``take=True``), then hands the result back.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import os
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from fenced.coordinator.backend import CAP_REQUEST_ID, Blocked, Granted, GrantRequest
from fenced.core._errors import Busy, ConfigurationError, LeaseLost, LossReason
from fenced.core._lease import Lease
from fenced.core._names import validate_resource
from fenced.core._policy import LeasePolicy, validate_holder, validate_wait
from fenced.core._records import Record, RecordKind
from fenced.core._token import FencingToken
from fenced.election._campaign import validate_value

__all__ = [
    "HISTORY_PAGE",
    "MAX_WAIT_SLICE",
    "AcquirePlan",
    "AcquireSteps",
    "BackendIdentity",
    "HistoryQuery",
    "Report",
    "Step",
    "busy",
    "check_lease",
    "default_holder",
    "lease_policy",
    "plan_acquire",
    "renewable",
    "renewed_lease",
    "trouble_report",
    "validate_fence",
    "validate_request_id",
]

_MAX_REQUEST_ID = 200
HISTORY_PAGE = 1000
"""Records ``history`` asks its backend for in one request."""
MAX_WAIT_SLICE = 3600.0
"""The longest single ``wait`` on a backend; the loop then asks again."""

Report = tuple[str, int, str, RecordKind, dict[str, object]]
"""A holder's report for the coordinator's records: resource, epoch, holder, kind, detail."""

_holder: str | None = None  # the default label of this process, validated


def _forget_holder() -> None:
    global _holder  # noqa: PLW0603 - a per-process memo
    _holder = None


os.register_at_fork(after_in_child=_forget_holder)  # a forked child gets its own pid


def default_holder() -> str:
    """The default holder label: ``host:pid`` (the host name as it was at this process's first
    call; a forked child gets its own pid). Computed and validated once per process."""
    global _holder  # noqa: PLW0603 - a per-process memo
    if _holder is None:
        _holder = validate_holder(f"{socket.gethostname()}:{os.getpid()}")
    return _holder


def lease_policy(ttl: object, safety_margin: object) -> LeasePolicy:
    """:meth:`LeasePolicy.create`, remembered for plain ``int``/``float``/None settings (a
    process uses a handful). The memo is keyed by type and value, so ``True`` never passes for
    ``1``; a setting that fails validation raises every time and is never remembered."""
    if type(ttl) in _PLAIN_SETTING and type(safety_margin) in _PLAIN_SETTING:
        return _remembered_policy(ttl, safety_margin)
    return LeasePolicy.create(ttl, safety_margin)


_PLAIN_SETTING = (int, float, type(None))


@functools.lru_cache(maxsize=256, typed=True)
def _remembered_policy(ttl: object, safety_margin: object) -> LeasePolicy:
    return LeasePolicy.create(ttl, safety_margin)


def validate_request_id(request_id: object) -> str | None:
    """``request_id`` if it is None or a printable string of 1-200 characters."""
    if request_id is None:
        return None
    if (
        not isinstance(request_id, str)
        or not 1 <= len(request_id) <= _MAX_REQUEST_ID
        or not request_id.isprintable()
    ):
        raise ConfigurationError(
            f"request_id must be a printable string of 1-{_MAX_REQUEST_ID} characters"
        )
    return request_id


@dataclass(frozen=True, slots=True)
class AcquirePlan:
    """A validated acquire: what to send (``request``), the lease timing and the patience."""

    request: GrantRequest
    policy: LeasePolicy
    patience: float | None


def plan_acquire(
    resource: object,
    ttl: object,
    wait: object,
    holder: object,
    request_id: object,
    safety_margin: object,
    value: object,
    capabilities: frozenset[str],
    url: str,
) -> AcquirePlan:
    """Validate an acquire's parameters (before any I/O) and build its request.

    Raises :class:`ConfigurationError` / :class:`~fenced.InvalidName`; a ``request_id`` on a
    backend without request-id deduplication is a ConfigurationError too.
    """
    name = validate_resource(resource)
    policy = lease_policy(ttl, safety_margin)
    patience = validate_wait(wait)
    label = default_holder() if holder is None else validate_holder(holder)
    rid = validate_request_id(request_id)
    advertised = None if value is None else validate_value(value)
    if rid is not None and CAP_REQUEST_ID not in capabilities:
        raise ConfigurationError(f"{url} does not support {CAP_REQUEST_ID!r}")
    request = GrantRequest(
        name, policy.ttl, secrets.token_hex(16), label, rid, advertised, patience != 0
    )
    return AcquirePlan(request, policy, patience)


def validate_fence(stores: Iterable[object], on_lost: object) -> tuple[object, ...]:
    """The ``fence=`` stores of a hold as a tuple, each with a ``fence`` method; ``on_lost``
    None or callable. Else :class:`ConfigurationError`."""
    found = tuple(stores)
    for store in found:
        if not callable(getattr(store, "fence", None)):
            raise ConfigurationError(f"{store!r} in fence= has no fence(token) method")
    if on_lost is not None and not callable(on_lost):
        raise ConfigurationError("on_lost must be callable")
    return found


def lease_of(coordinator_id: str, plan: AcquirePlan, granted: Granted, sent: float) -> Lease:
    """The lease a grant gives: its local deadline is ``sent + min(ttl, remaining) - margin``,
    ``sent`` being when the granting request was sent, never when its reply came.

    A backend may grant a shorter ttl than asked (ZooKeeper: at most its session timeout); the
    safety margin then shrinks in proportion, so it stays the same share of the lease."""
    request, policy = plan.request, plan.policy
    lifetime = min(granted.ttl, granted.expires_in)
    margin = policy.safety_margin
    if granted.ttl < request.ttl:
        margin *= granted.ttl / request.ttl
    return Lease(
        # the coordinator id was checked at connect and the name by plan_acquire
        token=FencingToken._of_checked(coordinator_id, request.resource, granted.epoch),
        owner=granted.owner,
        holder=granted.holder,
        ttl=granted.ttl,
        safety_margin=margin,
        deadline=sent + lifetime - margin,
        expires_in=granted.expires_in,
        request_id=request.request_id,
    )


def busy(resource: str, blocked: Blocked) -> Busy:
    """The :class:`Busy` a refused acquire raises."""
    return Busy(resource, blocked.holder, blocked.epoch, blocked.remaining)


class Step(enum.Enum):
    """What an acquire does after a ``try_grant`` that did not grant."""

    ENQUEUE = "enqueue"
    """Take a place in the queue, then try again at once."""
    WAIT = "wait"
    """Wait for a notification for :attr:`AcquireSteps.timeout` seconds, then try again."""
    GIVE_UP = "give up"
    """Leave the queue with ``take=True`` (a lease handed over meanwhile is the answer), else
    raise :func:`busy`."""


class AcquireSteps:
    """The waiting loop of ``acquire``, first come first served, as decisions (module docstring).

    ``give_up`` is when the patience runs out (None: never), on the deadline clock.
    """

    __slots__ = ("give_up", "queued", "timeout")

    def __init__(self, plan: AcquirePlan, now: float) -> None:
        self.give_up = None if plan.patience is None else now + plan.patience
        self.queued = False
        self.timeout = 0.0

    def next_step(self, blocked: Blocked, now: float) -> Step:
        """After ``blocked`` at ``now``: give up (patience over), enqueue (not queued yet), or
        wait up to :attr:`timeout` (the patience left, shortened to ``blocked.retry_in``)."""
        if self.give_up is not None and now >= self.give_up:
            return Step.GIVE_UP
        if not self.queued:
            self.queued = True
            return Step.ENQUEUE
        timeout = math.inf if self.give_up is None else self.give_up - now
        if blocked.retry_in is not None:
            timeout = min(timeout, max(blocked.retry_in, 0.0))
        self.timeout = min(timeout, MAX_WAIT_SLICE)
        return Step.WAIT


def check_lease(lease: object, coordinator_id: str, url: str) -> Lease:
    """``lease`` if it is a :class:`Lease` of this coordinator, else ConfigurationError."""
    if not isinstance(lease, Lease):
        raise ConfigurationError(f"expected a Lease, got {type(lease).__name__}")
    if lease.coordinator_id != coordinator_id:
        raise ConfigurationError(
            f"this lease comes from coordinator {lease.coordinator_id}, "
            f"not from {coordinator_id} ({url})"
        )
    return lease


def renewable(lease: Lease, sent: float) -> None:
    """Raise LeaseLost(EXPIRED) if the local deadline passed before a renewal was sent at
    ``sent``: the holder treats the lease as lost from then on, whatever the coordinator says."""
    if sent >= lease.deadline:
        raise LeaseLost(LossReason.EXPIRED, "the local deadline passed before renewal")


def renewed_lease(lease: Lease, sent: float, remaining: float) -> Lease:
    """``lease`` after a renewal sent at ``sent`` that the coordinator answered with
    ``remaining`` seconds."""
    return dataclasses.replace(
        lease,
        deadline=sent + min(remaining, lease.ttl) - lease.safety_margin,
        expires_in=remaining,
    )


def trouble_report(lease: Lease, error: BaseException) -> Report:
    """The record a holder reports after a failed renewal or a loss."""
    kind = RecordKind.LOST if isinstance(error, LeaseLost) else RecordKind.RENEWAL_FAILED
    detail: dict[str, object] = {"error": f"{type(error).__name__}: {error}"}
    if isinstance(error, LeaseLost):
        detail["reason"] = error.reason.value
    return (lease.resource, lease.epoch, lease.holder, kind, detail)


class HistoryQuery:
    """The pages ``history(resource, after=, limit=)`` reads: validated before any I/O.

    ``limit=None`` reads every retained record in pages of :data:`HISTORY_PAGE` until one comes
    back short; ``limit=N`` reads at most the ``N`` oldest (a keyset cursor on ``seq``).
    """

    __slots__ = ("after", "found", "limit", "resource")

    def __init__(self, resource: object, after: object, limit: object) -> None:
        self.resource = None if resource is None else validate_resource(resource)
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ConfigurationError(f"after must be an integer >= 0, got {after!r}")
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ConfigurationError(f"limit must be None or an integer >= 1, got {limit!r}")
        self.after: int = after
        self.limit: int | None = limit
        self.found: list[Record] = []

    def want(self) -> int:
        """How many records to ask for next; 0 when done."""
        if self.limit is None:
            return HISTORY_PAGE
        return min(HISTORY_PAGE, self.limit - len(self.found))

    def take(self, page: list[Record], want: int) -> bool:
        """Add a page read with ``want``; True if another page must be read."""
        self.found += page
        if len(page) < want:
            return False
        self.after = page[-1].seq
        return self.want() > 0


class _Identified(Protocol):
    url: str
    coordinator_id: str
    capabilities: frozenset[str]


class BackendIdentity:
    """What a coordinator of either face says of its backend: ``url`` (password masked),
    ``coordinator_id``, ``capabilities``, and :meth:`require`."""

    _backend: _Identified

    @property
    def url(self) -> str:
        return self._backend.url

    @property
    def coordinator_id(self) -> str:
        return self._backend.coordinator_id

    @property
    def capabilities(self) -> frozenset[str]:
        return self._backend.capabilities

    def require(self, capability: str) -> None:
        """Raise :class:`ConfigurationError` unless the backend has ``capability``."""
        if capability not in self._backend.capabilities:
            raise ConfigurationError(f"{self.url} does not support {capability!r}")

"""Lease values and the lease state machine. Pure: time is passed in, never read.

A holder's view of a lease is one of three states:

``HELD``
    the last acquire/renew succeeded and the local deadline has not passed;
``UNCERTAIN``
    a renewal failed (unreachable coordinator, lost reply) but the deadline has not passed: finish
    nothing new, start no new protected work; the runtime keeps retrying;
``LOST``
    the deadline passed, the coordinator said no, a store reported a newer epoch, or the lease was
    released. Final.

UNCERTAIN is never treated as HELD. The local deadline is measured from when the request was
*sent* (``sent_at + ttl - safety_margin``), never from when its reply arrived, so a slow reply can
only shorten the holder's belief, not extend it past the coordinator's expiry.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from fenced.core._errors import LeaseLost, LossReason
from fenced.core._token import FencingToken

__all__ = ["Lease", "LeaseInfo", "LeaseState", "LeaseTracker"]


class LeaseState(enum.Enum):
    """A holder's knowledge of its lease. Only HELD allows protected work to start."""

    HELD = "held"
    UNCERTAIN = "uncertain"
    LOST = "lost"


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease: token, secret owner id, holder label, ttl and the local deadline.

    ``owner`` is a 128-bit random secret proving ownership to the coordinator; ``request_id``
    returns this lease to whoever presents it again (a retried acquire), so it is a bearer
    credential too. Both are excluded from ``repr`` and never logged or recorded. ``deadline``
    is on the deadline clock (``Clock.now``, CLOCK_BOOTTIME on Linux) of the process that sent
    the request; ``expires_in`` is the coordinator's remaining time when it answered (for
    display only).
    """

    token: FencingToken
    owner: str = field(repr=False)
    holder: str
    ttl: float
    safety_margin: float
    deadline: float
    expires_in: float
    request_id: str | None = field(default=None, repr=False)

    @property
    def resource(self) -> str:
        return self.token.resource

    @property
    def epoch(self) -> int:
        return self.token.epoch

    @property
    def coordinator_id(self) -> str:
        return self.token.coordinator_id


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """What anyone may know about the live lease of a resource (never the owner secret)."""

    resource: str
    epoch: int
    holder: str
    expires_in: float
    ttl: float
    coordinator_id: str
    value: str | None = None
    """The advertised value of an election leader (None for plain leases)."""

    @property
    def token(self) -> FencingToken:
        return FencingToken(self.coordinator_id, self.resource, self.epoch)


class LeaseTracker:
    """Thread-safe state machine of one held lease; the runtime feeds it events and times.

    Every method takes the current time ``now`` on the deadline clock (``Clock.now``,
    CLOCK_BOOTTIME on Linux) from the caller's clock. Once LOST, the tracker stays LOST and
    remembers the first reason.
    """

    def __init__(self, deadline: float) -> None:
        self._lock = threading.Lock()
        self._deadline = deadline
        self._uncertain = False
        self._lost: LeaseLost | None = None

    @property
    def deadline(self) -> float:
        with self._lock:
            return self._deadline

    def state(self, now: float) -> LeaseState:
        """The state at ``now`` on the deadline clock (LOST once ``now`` reaches the deadline)."""
        with self._lock:
            return self._state_locked(now)

    def _state_locked(self, now: float) -> LeaseState:
        if self._lost is not None or now >= self._deadline:
            return LeaseState.LOST
        return LeaseState.UNCERTAIN if self._uncertain else LeaseState.HELD

    def loss(self, now: float) -> LeaseLost | None:
        """The reason the lease is lost at ``now``, or None while HELD or UNCERTAIN."""
        with self._lock:
            if self._lost is None and now >= self._deadline:
                self._lost = LeaseLost(LossReason.EXPIRED, "the local deadline passed")
            return self._lost

    def renewed(self, now: float, new_deadline: float) -> None:
        """A renewal succeeded; ``new_deadline`` = its send time + ttl - margin.

        A reply that arrives after the old deadline passed does not resurrect the lease: the
        holder may already have been told it was lost, so the lease stays LOST (EXPIRED).
        """
        with self._lock:
            if self._lost is None and now >= self._deadline:
                self._lost = LeaseLost(LossReason.EXPIRED, "the local deadline passed")
            if self._lost is None:
                self._deadline = max(self._deadline, new_deadline)
                self._uncertain = False

    def renewal_failed(self) -> None:
        """A renewal failed without a definite answer: HELD becomes UNCERTAIN."""
        with self._lock:
            if self._lost is None:
                self._uncertain = True

    def mark_lost(self, error: LeaseLost) -> bool:
        """Record a definite loss; returns True the first time only."""
        with self._lock:
            if self._lost is not None:
                return False
            self._lost = error
            return True

"""The runtime's renewal schedule (:class:`fenced.runtime.keeper.HeldLease`), against a fake
coordinator that never answers: only the timing of the keeper's own attempts is under test."""

from __future__ import annotations

import itertools
import time

from fenced.core.clock import SystemClock
from fenced.core.errors import Unavailable
from fenced.core.lease import Lease
from fenced.core.token import FencingToken
from fenced.runtime.keeper import HeldLease


class _Unreachable:
    """LeaseOps of a coordinator that never answers a renewal."""

    def __init__(self) -> None:
        self.attempts: list[float] = []

    def renew(self, lease: Lease) -> Lease:
        self.attempts.append(time.monotonic())
        raise Unavailable("unreachable (test)")

    def release(self, lease: Lease) -> bool:
        return False

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        pass


def test_failed_renewals_are_retried_more_often_as_the_deadline_nears() -> None:
    """Every ttl/10 at first; in the last 30 % of the lease, a quarter of the time left (at
    least 10 ms): a lease that began short, or lost several renewals, still gets tries."""
    ttl = 1.0
    ops = _Unreachable()
    now = time.monotonic()
    lease = Lease(FencingToken("c" * 32, "r", 1), "o" * 32, "h", ttl, 0.1, now + 0.9, ttl)
    held = HeldLease(ops, lease, clock=SystemClock())
    held.start()
    try:
        assert held.lost.wait(5)
    finally:
        held.stop(release=False)
    deadline = lease.deadline
    # while more than 40 % of the lease is left, ttl/10 (-10 % jitter) is the sooner
    early = [b - a for a, b in itertools.pairwise(ops.attempts) if deadline - a >= 0.4 * ttl]
    assert early and all(gap >= 0.085 for gap in early), early
    late = [t for t in ops.attempts if t >= deadline - 0.3 * ttl]
    assert len(late) >= 6, [round(deadline - t, 3) for t in ops.attempts]  # every ttl/10: 3

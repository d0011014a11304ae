"""The Coordinator's own checks, before any backend is asked."""

from __future__ import annotations

import math

import pytest

import fenced
from fenced.coordinator._requests import lease_of, plan_acquire
from fenced.coordinator.backend import Granted
from fenced.core._errors import ConfigurationError


def test_a_remembered_policy_never_lets_a_bad_setting_through() -> None:
    # The coordinator remembers policies by (type, value): after 1 and 1.0 were accepted, True
    # (== 1, same hash) is still refused, and so is a NaN margin (never equal to itself).
    with fenced.connect("memory://") as coord:
        for ttl, margin in ((1, None), (1.0, None), (1, 0.5), (1, 0.5)):
            lease = coord.acquire("policy/memo", ttl=ttl, wait=0, safety_margin=margin)
            assert (lease.ttl, lease.safety_margin) == (1.0, margin or 0.1)
            assert coord.release(lease)
        bad: tuple[tuple[object, object], ...] = (
            (True, None),
            (1, True),
            (1, math.nan),
            (1, 1),
            ("1", None),
            ([1], None),
        )
        for bad_ttl, bad_margin in bad:
            with pytest.raises(ConfigurationError):
                coord.acquire("policy/memo", bad_ttl, 0, safety_margin=bad_margin)  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError):
                coord.hold("policy/memo", bad_ttl, wait=0, safety_margin=bad_margin)  # type: ignore[arg-type]


def test_a_shorter_ttl_than_asked_keeps_the_margin_in_proportion() -> None:
    """A backend may grant less than the ttl asked (ZooKeeper: at most its session timeout):
    the lease's ttl and deadline are the granted ones, and the safety margin keeps its share."""
    plan = plan_acquire("r", 30.0, 0, "h", None, 3.0, None, frozenset(), "memory://x")
    lease = lease_of("c" * 32, plan, Granted(1, "o", "h", 2.0, 2.0), sent=100.0)
    assert lease.ttl == 2.0
    assert lease.safety_margin == pytest.approx(0.2)
    assert lease.deadline == pytest.approx(101.8)
    full = lease_of("c" * 32, plan, Granted(2, "o", "h", 30.0, 30.0), sent=100.0)
    assert (full.safety_margin, full.deadline) == (3.0, 127.0)

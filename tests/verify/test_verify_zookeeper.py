"""``fenced verify --coordinator zk://…``: the practice table of failure cases and seeded fault
schedules against the session's real 3-member ZooKeeper ensemble
(``tests/support/zookeeper_fixtures.py``).

Every worker process reaches the ensemble through its own TCP proxy per member, as ``fenced
verify`` does for any networked coordinator on loopback, so the nemesis delays, blackholes and
drops real replies on the wire (and, as root, cuts workers off in network namespaces), besides
the in-process lost and delayed replies. Every case must pass with no violation of any
invariant, except case 6 (restore), which verify never runs against a coordinator it did not
create. Three short seeded schedules must keep every invariant.
"""

from __future__ import annotations

import uuid

import pytest

from fenced.testing.zookeeper import ZooKeeperEnsemble
from fenced.verify._target import Target
from support.verify_networked import assert_mutants_pass, assert_verify_passes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cases_and_random_schedules_pass_on_zookeeper(zk_ensemble: ZooKeeperEnsemble) -> None:
    url = zk_ensemble.url(f"/verify-{uuid.uuid4().hex[:10]}", session_timeout=2, timeout=2)
    target = Target.create(url)
    assert target.lease_overrun(0.6) == 0.0  # expiry by the leader's clock, at the ttl
    assert_verify_passes(target, seed=301, schedules=3)


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_seeded_defects_are_caught_or_na_on_zookeeper(zk_ensemble: ZooKeeperEnsemble) -> None:
    """The client's defects (deadline-from-reply, renewal-failure-ignored, waiter-keeps-place)
    and the stores' are caught against the ensemble; the other coordinators' are n/a."""
    url = zk_ensemble.url(f"/verify-{uuid.uuid4().hex[:10]}", session_timeout=2, timeout=2)
    assert_mutants_pass(url, seed=302, kind="zk")

"""``fenced verify --coordinator etcd://…``: the practice table of failure cases and seeded fault
schedules against the session's real 3-member etcd cluster (``tests/support/etcd_fixtures.py``).

Every worker process reaches the cluster through its own TCP proxy per member, as ``fenced
verify`` does for any networked coordinator on loopback, so the nemesis delays, blackholes and
drops real replies on the wire, besides the in-process lost and delayed replies. Every case must
pass with no violation of any invariant, except case 6 (restore), which verify never runs
against a coordinator it did not create (*not available*: shown, neither a pass nor a failure).
Three short seeded schedules (kills, pauses, wire faults) must keep every invariant; their
histories carry etcd's lease overrun (whole-second TTLs, a 500 ms expiry tick). ``fenced verify
--mutants`` against the cluster exits 0: every seeded defect with a hook there (or in the
embedded stores) is caught, the embedded coordinator's are n/a.
"""

from __future__ import annotations

import uuid

import pytest

from fenced.testing.etcd import EtcdCluster
from fenced.verify._target import Target
from support.verify_networked import assert_mutants_pass, assert_verify_passes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cases_and_random_schedules_pass_on_etcd(etcd_cluster: EtcdCluster) -> None:
    target = Target.create(etcd_cluster.url(prefix=f"/verify-{uuid.uuid4().hex[:10]}"))
    overrun = target.lease_overrun(0.6)
    assert 0.9 <= overrun <= 2.0, overrun  # a 0.6 s ttl lives ≥ 1 s in etcd, + a 0.5 s tick

    assert_verify_passes(target, seed=101, schedules=3)


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_seeded_defects_are_caught_or_na_on_etcd(etcd_cluster: EtcdCluster) -> None:
    assert_mutants_pass(etcd_cluster.url(prefix=f"/verify-{uuid.uuid4().hex[:10]}"), seed=102)

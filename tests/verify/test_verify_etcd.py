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
embedded stores) is caught — ``etcd-grant-no-revision-compare`` among them — and the other
coordinators' are n/a.
"""

from __future__ import annotations

import uuid
from contextlib import closing

import pytest

from fenced.coordinator.backend import Granted, GrantRequest
from fenced.coordinator.backends.etcd._backend import EtcdBackend
from fenced.testing.etcd import EtcdCluster
from fenced.verify._seeded import ETCD_GRANT_NO_REVISION_COMPARE
from fenced.verify._seeded_etcd import SeededEtcdBackend
from fenced.verify._target import Target
from support.verify_networked import assert_mutants_pass, assert_verify_passes


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cases_and_random_schedules_pass_on_etcd(etcd_cluster: EtcdCluster) -> None:
    target = Target.create(etcd_cluster.url(prefix=f"/verify-{uuid.uuid4().hex[:10]}"))
    overrun = target.lease_overrun(0.6)
    assert 0.9 <= overrun <= 2.0, overrun  # a 0.6 s ttl lives ≥ 1 s in etcd, + a 0.5 s tick

    assert_verify_passes(target, seed=101, schedules=3)


def _granted(backend: EtcdBackend, owner: str) -> int:
    lease = backend.try_grant(GrantRequest("r", 5.0, owner * 32, owner), None)
    assert isinstance(lease, Granted), lease
    assert backend.release("r", lease.epoch, owner * 32)
    return lease.epoch


@pytest.mark.timeout(60)
def test_a_careless_etcd_grant_issues_an_epoch_again(etcd_cluster: EtcdCluster) -> None:
    """A grants epoch 1 and releases it; B grants 2 and releases it. A's view of the resource
    is stale (epoch 1): the correct grant's compare of the state's revision fails and it reads
    again (epoch 3); the careless one writes epoch 1 + 1 = 2 once more."""
    for careless, expected in ((False, 3), (True, 2)):
        url = etcd_cluster.url(prefix=f"/verify-{uuid.uuid4().hex[:10]}")
        defects = frozenset({ETCD_GRANT_NO_REVISION_COMPARE} if careless else ())
        with closing(SeededEtcdBackend(url, defects)) as a, closing(EtcdBackend(url)) as b:
            assert _granted(a, "a") == 1
            assert _granted(b, "b") == 2
            assert _granted(a, "a") == expected


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_seeded_defects_are_caught_or_na_on_etcd(etcd_cluster: EtcdCluster) -> None:
    assert_mutants_pass(
        etcd_cluster.url(prefix=f"/verify-{uuid.uuid4().hex[:10]}"), seed=102, kind="etcd"
    )

"""Randomized schedules with real network partitions (:mod:`fenced.testing.netlab`) against
networked coordinators: every worker runs on a lab host of its own and reaches the coordinator
and the networked stores through relays; the nemesis cuts it from the coordinator, from the
stores, from both, or thins what it receives, then heals. Every invariant holds, the
partitions are in the history, and no namespace outlives the run. Without root, verify says so
in one line (and uses its other faults).

Root only (CI runs as root); a test fails, never skips, without it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from fenced.fence._store import open_store
from fenced.testing.etcd import EtcdCluster
from fenced.testing.netlab import PREFIX, lab_namespaces, unavailable
from fenced.testing.postgres import PostgresServer
from fenced.verify._schedule import run_random
from fenced.verify._target import Target
from support.local_users import as_nobody

SRC = str(Path(__file__).resolve().parents[2] / "src")


@pytest.fixture(autouse=True)
def _root() -> None:
    why = unavailable()
    if why is not None:
        pytest.fail(f"the lab cannot be built: {why} (run the test suite as root, as CI does)")


def _ours() -> list[str]:
    return [name for name in lab_namespaces() if name.startswith(f"{PREFIX}{os.getpid()}-")]


def _assert_partitions_keep_every_invariant(target: Target, seed: int) -> None:
    assert target.partitions
    assert "; real network partitions" in target.describe()
    summary = run_random(2, seed, target, duration=3.0)
    assert summary.ok, [(r.schedule.seed, r.report.violations) for r in summary.failed]
    totals = summary.totals()
    assert totals["fault partition"] >= 1, dict(totals)
    assert totals["grants"] >= 2
    assert _ours() == []


@pytest.mark.slow
def test_partitions_keep_every_invariant_on_postgres(postgres_server: PostgresServer) -> None:
    name = uuid.uuid4().hex[:10]
    store = postgres_server.url("postgres", schema=f"vps_{name}")
    open_store(store, "strict").close()
    target = Target.create(postgres_server.url("postgres", schema=f"vpc_{name}"), (store,))
    _assert_partitions_keep_every_invariant(target, seed=4)


@pytest.mark.slow
def test_partitions_keep_every_invariant_on_etcd(etcd_cluster: EtcdCluster) -> None:
    target = Target.create(etcd_cluster.url(f"/vp-{uuid.uuid4().hex[:8]}"))
    _assert_partitions_keep_every_invariant(target, seed=88)


def test_without_root_verify_says_so_in_one_line_and_uses_its_other_faults() -> None:
    said = as_nobody(
        f"""
        import sys
        sys.path.insert(0, {SRC!r})
        from fenced.verify._target import Target
        target = Target("postgresql://u@127.0.0.1:5432/db")
        print(target.partitions)
        print(target.describe())
        """
    )
    assert said.splitlines() == [
        "False",
        "coordinator postgresql://u@127.0.0.1:5432/db; stores embedded; no network partitions "
        "(network partitions need root (network namespaces and nftables)): in-process and proxy "
        "faults only",
    ]

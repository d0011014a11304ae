"""The session's throwaway 3-member etcd cluster (see :mod:`fenced.testing.etcd`).

Registered by ``tests/conftest.py``. If etcd cannot be started, every test that needs it fails
with the reason (they never skip).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.etcd import EtcdCluster

__all__ = ["etcd_cluster"]


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """Three etcd members on loopback for the whole session (tests use their own key prefix)."""
    cluster = EtcdCluster(3)
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()

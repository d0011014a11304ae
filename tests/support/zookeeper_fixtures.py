"""The session's throwaway 3-member ZooKeeper ensemble (see :mod:`fenced.testing.zookeeper`).

Registered by ``tests/conftest.py``. If ZooKeeper cannot be started, every test that needs it
fails with the reason (they never skip). Tests that kill, pause or restart members start an
ensemble of their own: the session's stays healthy.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient

from fenced.testing.zookeeper import ZooKeeperEnsemble

__all__ = ["zk_ensemble", "zk_url"]


@pytest.fixture(scope="session")
def zk_ensemble() -> Iterator[ZooKeeperEnsemble]:
    """Three ZooKeeper members on loopback for the whole session (tests use their own chroot)."""
    ensemble = ZooKeeperEnsemble(3)
    try:
        ensemble.start()
    except BaseException:
        ensemble.stop()
        raise
    yield ensemble
    ensemble.stop()


@pytest.fixture
def zk_url(zk_ensemble: ZooKeeperEnsemble) -> str:
    """``zk://`` URL of the session's ensemble with a chroot of this test's own, ``/t-<hex>``.

    The chroot's node is created (kazoo warns about a chroot that does not exist, and warnings
    are errors here) and left behind: the ensemble lives for the session only."""
    chroot = f"/t-{secrets.token_hex(6)}"
    client = KazooClient(hosts=zk_ensemble.connect_string(), timeout=10.0)
    try:
        client.start(timeout=10)
        client.create(chroot)
    finally:
        client.stop()
        client.close()
    return zk_ensemble.url(chroot=chroot)

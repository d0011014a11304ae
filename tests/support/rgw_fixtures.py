"""The session's throwaway S3 server, Ceph RGW (see :mod:`fenced.testing.rgw`).

Registered by ``tests/conftest.py``. If RGW cannot be started (its Debian packages missing, a
daemon that exits), every test that needs it fails with the reason (they never skip).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fenced.testing.rgw import RgwServer

__all__ = ["rgw_server"]


@pytest.fixture(scope="session")
def rgw_server() -> Iterator[RgwServer]:
    """One RGW (mon + memstore OSD + radosgw) for the whole session (tests use own buckets)."""
    server = RgwServer()
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    yield server
    server.stop()

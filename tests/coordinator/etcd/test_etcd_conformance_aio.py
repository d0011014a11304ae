"""The coordinator conformance suite on the asyncio face of etcd (``grpc.aio``, an async watch),
on the 3-member cluster the test session starts."""

from __future__ import annotations

import uuid

import pytest

from fenced.testing.aio_conformance import AsyncCoordinatorConformance, AsyncHistoryConformance
from fenced.testing.etcd import EtcdCluster


@pytest.fixture
def etcd_aio_url(etcd_cluster: EtcdCluster) -> str:
    return etcd_cluster.url(prefix="/a" + uuid.uuid4().hex[:12], timeout=2)


class TestEtcdCoordinatorAsync(AsyncCoordinatorConformance):
    @pytest.fixture
    def url(self, etcd_aio_url: str) -> str:
        return etcd_aio_url


class TestEtcdHistoryAsync(AsyncHistoryConformance):
    @pytest.fixture
    def url(self, etcd_aio_url: str) -> str:
        return etcd_aio_url

"""``/metrics`` (Prometheus text) and ``/readyz`` of ``fenced serve``, on a live server."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

import fenced
from fenced.testing.conformance import wait_for
from fenced.testing.postgres import PostgresServer
from fenced.testing.proxy import TcpProxy
from fenced.testing.server import ServedCoordinator


def test_metrics_show_ownership_requests_and_rejected_writes(tmp_path: Path) -> None:
    stores = {"main": f"sqlite:///{tmp_path / 'store.db'}"}
    with (
        ServedCoordinator(f"memory://{uuid.uuid4().hex}", stores=stores) as served,
        fenced.connect(served.url) as coord,
        fenced.open_store(served.url + "/stores/main") as store,
    ):
        first = coord.acquire("jobs/a", ttl=5, wait=0)
        store.fence(first.token)
        coord.release(first)
        second = coord.acquire("jobs/a", ttl=5, wait=0)
        store.fence(second.token)
        with pytest.raises(fenced.StaleToken):
            store.put(first.token, "k", b"stale")
        text = httpx.get(served.url + "/metrics").text
        coord.release(second)
    assert 'fenced_ownership_changes_total{resource="jobs/a"} 2.0' in text
    assert 'fenced_held{resource="jobs/a"} 1.0' in text
    assert 'fenced_rejected_writes_total{reason="stale",resource="jobs/a",store="main"} 1.0' in text
    assert "fenced_observe_up 1.0" in text
    route = 'route="/v1/leases/{resource:path}:acquire"'
    assert f'fenced_serve_requests_seconds_count{{method="POST",{route},status="200"}} 2.0' in text
    assert "fenced_serve_waiting 0.0" in text


def test_readyz_is_503_while_the_backend_does_not_answer(
    postgres_server: PostgresServer,
) -> None:
    """``/readyz`` asks the backend; ``/healthz`` only the process."""
    schema = f"r{uuid.uuid4().hex[:12]}"
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        url = f"postgresql://{postgres_server.user}@127.0.0.1:{proxy.port}/postgres"
        with ServedCoordinator(f"{url}?schema={schema}&timeout=0.5&connect_timeout=1") as served:
            assert httpx.get(served.url + "/readyz").json() == {"status": "ready"}
            proxy.refuse()
            proxy.cut()
            not_ready = httpx.get(served.url + "/readyz", timeout=10)
            assert not_ready.status_code == 503
            assert not_ready.json()["type"] == "urn:fenced:problem:unavailable"
            assert httpx.get(served.url + "/healthz").status_code == 200
            proxy.forward()
            wait_for(
                lambda: httpx.get(served.url + "/readyz", timeout=10).status_code == 200,
                timeout=10,
                what="ready again",
            )

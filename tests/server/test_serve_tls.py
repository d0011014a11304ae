"""``fenced serve --tls-cert … --tls-key … [--tls-client-ca …]``: HTTPS with the client's CA
check, and client certificates when asked for (a real server process, real certificates)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced.testing.server import ServeProcess
from fenced.testing.tls import Authority


@pytest.fixture
def ca(tmp_path: Path) -> Authority:
    return Authority(tmp_path / "tls")


@pytest.fixture
def mutual(tmp_path: Path, ca: Authority) -> Iterator[ServeProcess]:
    server = ca.issue("server", hosts=["127.0.0.1"])
    db = f"sqlite:///{tmp_path / 'fenced.db'}"
    tls = ["--tls-cert", str(server.cert), "--tls-key", str(server.key),
           "--tls-client-ca", str(ca.cert)]  # fmt: skip
    with ServeProcess(db, *tls) as process:
        yield process


def test_mutual_tls_grants_to_a_client_with_a_certificate(
    mutual: ServeProcess, ca: Authority
) -> None:
    assert mutual.url.startswith("https://127.0.0.1:")
    client = ca.issue("worker", client=True)
    url = f"{mutual.url}?ca={ca.cert}&cert={client.cert}&key={client.key}"
    with fenced.connect(url) as coordinator:
        lease = coordinator.acquire("jobs/tls", ttl=5, wait=0)
        assert coordinator.release(lease)


def test_a_client_without_a_certificate_is_refused_and_changes_nothing(
    mutual: ServeProcess, ca: Authority
) -> None:
    with pytest.raises(fenced.FencedError):
        fenced.connect(f"{mutual.url}?ca={ca.cert}&timeout=2")
    client = ca.issue("worker", client=True)
    url = f"{mutual.url}?ca={ca.cert}&cert={client.cert}&key={client.key}"
    with fenced.connect(url) as coordinator:
        assert coordinator.resources() == []


def test_a_server_certificate_from_another_ca_is_a_configuration_error(
    mutual: ServeProcess, tmp_path: Path
) -> None:
    other = Authority(tmp_path / "other", name="other")
    client = other.issue("worker", client=True)
    url = f"{mutual.url}?ca={other.cert}&cert={client.cert}&key={client.key}"
    with pytest.raises(fenced.ConfigurationError, match="TLS with"):
        fenced.connect(url)

"""``Coordinator.history`` returns every retained record, past the backend's page of 1,000, and
with ``limit`` is a cursor (``after`` = the last seq seen), on every backend."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.coordinator._client import HISTORY_PAGE, Coordinator
from fenced.coordinator._connect import connect
from fenced.core._errors import ConfigurationError
from fenced.core._records import RecordKind
from fenced.core._urls import url_of_path
from fenced.testing.etcd import EtcdCluster
from fenced.testing.postgres import PostgresServer

R = "jobs/many"
CYCLES = HISTORY_PAGE // 2 + 10  # a grant and a release each: more records than one page


@pytest.fixture(params=["memory", "sqlite", "postgres", "etcd"])
def coord(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Coordinator]:
    if request.param == "memory":
        url = f"memory://history-{uuid.uuid4().hex}"
    elif request.param == "sqlite":
        url = url_of_path("sqlite", f"{tmp_path}/fenced.db")
    elif request.param == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.url("postgres", schema="t_" + uuid.uuid4().hex[:12])
    else:
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        url = cluster.url(prefix="/t" + uuid.uuid4().hex[:12], timeout=2)
    with connect(url) as opened:
        yield opened


def test_history_returns_every_record_past_one_page(coord: Coordinator) -> None:
    for _ in range(CYCLES):
        coord.release(coord.acquire(R, ttl=30, wait=0))
    history = coord.history(R)
    assert len(history) == 2 * CYCLES > HISTORY_PAGE
    assert [r.kind for r in history] == [RecordKind.GRANTED, RecordKind.RELEASED] * CYCLES
    assert [r.epoch for r in history[::2]] == list(range(1, CYCLES + 1))
    seqs = [r.seq for r in history]
    assert seqs == sorted(set(seqs))
    assert coord.history() == history  # all resources: the same, only one was used

    pages: list[list[int]] = []
    after = 0
    while page := coord.history(R, after=after, limit=300):
        pages.append([r.seq for r in page])
        after = page[-1].seq
    assert [len(p) for p in pages] == [300, 300, 300, 2 * CYCLES - 900]
    assert [seq for page in pages for seq in page] == seqs
    assert coord.history(R, after=seqs[-2]) == history[-1:]


@pytest.mark.parametrize("coord", ["memory"], indirect=True)
@pytest.mark.parametrize(
    "bad", [{"after": -1}, {"after": True}, {"limit": 0}, {"limit": 2.5}, {"limit": False}]
)
def test_bad_cursor_arguments_are_refused(coord: Coordinator, bad: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        coord.history(R, **bad)  # type: ignore[arg-type]

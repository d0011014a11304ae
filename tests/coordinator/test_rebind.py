"""A coordinator lost without a backup: advance the new one past the store's floors, then rebind.

The whole recorded procedure (docs/operations.md, "Lost coordinator without a backup"), on each
store kind (sqlite, file, postgresql): coordinator A grants and the store is fenced at epoch N;
A's database is deleted; the new coordinator B's tokens are ForeignToken; a rebind before the
advance is refused (naming the advance step) and changes nothing; after ``advance(B,
stores=[store])`` the rebind binds the resource to B with its floor N kept and records REBOUND;
B's next token (epoch > N) is accepted, every A token is refused, whatever its epoch.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect
from fenced.coordinator._rebind import rebind
from fenced.coordinator._restore import advance
from fenced.core._errors import ConfigurationError, ForeignToken, NotInstalled, StaleToken
from fenced.core._records import RecordKind
from fenced.core._token import FencingToken
from fenced.core._urls import url_of_path
from fenced.fence._store import Store, open_store
from fenced.testing.postgres import PostgresServer

R = "exports/daily"
OTHER = "exports/weekly"


@pytest.fixture(params=["sqlite", "file", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = url_of_path("sqlite", f"{tmp_path}/store.db")
    elif request.param == "file":
        url = url_of_path("file", f"{tmp_path}/store")
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.url("postgres", schema="s_" + uuid.uuid4().hex[:12])
    opened = open_store(url)
    yield opened
    opened.close()


def _delete_database(path: Path) -> None:
    for suffix in ("", "-wal", "-shm", ".coordinator-id"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)


def _lost_coordinator(tmp_path: Path, store: Store) -> tuple[str, FencingToken]:
    """Coordinator A grants R three times and OTHER once; the store is fenced at each last
    epoch and written; then A's database is deleted. Returns A's id and its last R token."""
    path = tmp_path / "a" / "fenced.db"
    with connect(url_of_path("sqlite", str(path))) as a:
        for _ in range(2):
            a.release(a.acquire(R, ttl=30, wait=0))
        lease = a.acquire(R, ttl=30, wait=0)
        store.fence(lease.token)
        store.put(lease.token, "k", b"from A")
        other = a.acquire(OTHER, ttl=30, wait=0)
        store.fence(other.token)
        a_id = a.coordinator_id
    _delete_database(path)
    assert not path.exists()
    return a_id, lease.token


def _new_coordinator(tmp_path: Path) -> Coordinator:
    return connect(url_of_path("sqlite", str(tmp_path / "b" / "fenced.db")))


def test_the_whole_procedure_gives_the_store_to_the_new_coordinator(
    tmp_path: Path, store: Store
) -> None:
    a_id, a_token = _lost_coordinator(tmp_path, store)
    floor = a_token.epoch
    with _new_coordinator(tmp_path) as b:
        early = b.acquire(R, ttl=30, wait=0)  # before the procedure: foreign, whatever its epoch
        with pytest.raises(ForeignToken):
            store.fence(early.token)
        b.release(early)

        with pytest.raises(ConfigurationError, match=r"fenced restore --advance --floor-from"):
            rebind(store, b)
        assert store.binding(R) == a_id  # refused before anything changed

        advance(b, stores=[store])
        report = rebind(store, b)
        assert dict(report.rebound) == {R: floor, OTHER: 1}
        assert report.previous == (a_id,) and report.coordinator_id == b.coordinator_id
        assert store.binding(R) == b.coordinator_id and store.floor(R) == floor  # floor kept

        lease = b.acquire(R, ttl=30, wait=0)
        assert lease.epoch > floor
        with pytest.raises(NotInstalled):  # strict: the new owner installs first, as always
            store.put(lease.token, "k", b"from B")
        store.fence(lease.token)
        store.put(lease.token, "k", b"from B")
        item = store.get(R, "k")
        assert item is not None and item.value == b"from B"
        for stale in (a_token, FencingToken(a_id, R, lease.epoch + 1)):
            with pytest.raises(ForeignToken):
                store.put(stale, "k", b"late A")
        with pytest.raises(StaleToken):  # B's token from before the procedure
            store.put(early.token, "k", b"early B")

        rebound = [r for r in store.history(R) if r.kind is RecordKind.REBOUND]
        assert [(r.epoch, dict(r.detail)) for r in rebound] == [
            (floor, {"previous": a_id, "coordinator": b.coordinator_id})
        ]
        again = rebind(store, b)  # a retry changes nothing
        assert not again.rebound and set(again.unchanged) == {R, OTHER}
        assert len([r for r in store.history(R) if r.kind is RecordKind.REBOUND]) == 1


def test_rebind_selects_by_resource_and_by_lost_coordinator(tmp_path: Path, store: Store) -> None:
    a_id, a_token = _lost_coordinator(tmp_path, store)
    with _new_coordinator(tmp_path) as b:
        advance(b, stores=[store])
        with pytest.raises(ConfigurationError, match="bound to coordinator"):
            rebind(store, b, resources=[R], previous="f" * 32)
        assert store.binding(R) == a_id
        with pytest.raises(ConfigurationError, match="itself"):
            rebind(store, b, previous=b.coordinator_id)
        report = rebind(store, b, resources=[R], previous=a_id)
        assert dict(report.rebound) == {R: a_token.epoch}
        assert store.binding(OTHER) == a_id  # not named: untouched
        assert rebind(store, b, resources=["never/used"]).unchanged == ("never/used",)


def test_a_store_bound_to_two_other_coordinators_needs_to_be_told_which_was_lost(
    tmp_path: Path, store: Store
) -> None:
    a_id, _ = _lost_coordinator(tmp_path, store)
    third = FencingToken("c" * 32, "elsewhere/job", 7)
    store.fence(third)
    with _new_coordinator(tmp_path) as b:
        advance(b, stores=[store])
        with pytest.raises(ConfigurationError, match="--from"):
            rebind(store, b)
        report = rebind(store, b, previous=a_id)
        assert set(report.rebound) == {R, OTHER}
        assert store.binding("elsewhere/job") == "c" * 32


def test_the_store_checks_the_ceiling_in_its_own_atomic_step(tmp_path: Path, store: Store) -> None:
    a_id, a_token = _lost_coordinator(tmp_path, store)
    new = "b" * 32
    with pytest.raises(ConfigurationError, match="above the last epoch"):
        store.rebind(R, new, previous=a_id, ceiling=a_token.epoch - 1)
    with pytest.raises(ConfigurationError, match="not " + "9" * 32):
        store.rebind(R, new, previous="9" * 32, ceiling=a_token.epoch)
    assert store.binding(R) == a_id
    assert store.rebind(R, new, previous=a_id, ceiling=a_token.epoch) == a_id
    assert store.rebind(R, new, previous=a_id, ceiling=a_token.epoch) == new  # unchanged
    assert (store.binding(R), store.floor(R)) == (new, a_token.epoch)

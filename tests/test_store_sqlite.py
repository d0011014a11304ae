"""The store conformance suite on ``sqlite:///``, and what only the SQLite store does."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced.fence
from fenced.core.clock import ManualClock
from fenced.core.errors import ConfigurationError, Unavailable
from fenced.fence import Store, open_store
from fenced.fence.sqlite_store import SCHEMA_VERSION
from fenced.fence.values import Mode
from fenced.testing.store_conformance import (
    MakeStore,
    R,
    StoreConformance,
    sqlite_snapshot,
    token,
)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    area = tmp_path / "area"
    area.mkdir()
    return f"sqlite://{area}/fenced.db"


@pytest.fixture
def make_sqlite_store(sqlite_url: str) -> Iterator[MakeStore]:
    opened: list[Store] = []

    def make(mode: Mode | None = None, **options: Any) -> Store:
        opened.append(open_store(sqlite_url, mode, **options))
        return opened[-1]

    yield make
    for store in opened:
        store.close()


class TestSQLiteStore(StoreConformance):
    @pytest.fixture
    def make_store(self, make_sqlite_store: MakeStore) -> MakeStore:
        return make_sqlite_store

    @pytest.fixture
    def snapshot(self) -> Callable[[Store], object]:
        return sqlite_snapshot


def test_the_fence_package_exports_exactly_its_public_names() -> None:
    assert set(fenced.fence.__all__) == {
        "Capability",
        "Item",
        "Mode",
        "Publication",
        "Store",
        "Version",
        "guard",
        "open_store",
    }


def test_wal_full_sync_and_a_versioned_schema(make_sqlite_store: MakeStore) -> None:
    store = make_sqlite_store("monotonic")
    path = store.url.removeprefix("sqlite://")
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    finally:
        conn.close()
    assert meta == {
        "format": "fenced.sqlite-store",
        "schema_version": str(SCHEMA_VERSION),
        "mode": "monotonic",
    }


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"this is not a database at all, just text" * 200, "not a usable SQLite database"),
        (None, "not a fenced store"),
    ],
)
def test_a_file_that_is_not_a_fenced_store_is_refused(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "other.db"
    if content is None:
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE users(name TEXT)")
        conn.commit()
        conn.close()
    else:
        path.write_bytes(content)
    before = path.read_bytes()
    with pytest.raises(ConfigurationError, match=message):
        open_store(f"sqlite://{path}")
    assert path.read_bytes() == before


def test_a_newer_schema_is_refused(make_sqlite_store: MakeStore, sqlite_url: str) -> None:
    make_sqlite_store().close()
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite://"))
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(ConfigurationError, match="newer than this fenced"):
        open_store(sqlite_url)


def test_unusable_paths_are_configuration_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="cannot open"):
        open_store(f"sqlite://{tmp_path}/file/fenced.db")  # the parent is a file
    with pytest.raises(ConfigurationError, match="cannot open"):
        open_store(f"sqlite://{tmp_path}/missing/fenced.db")
    with pytest.raises(ConfigurationError, match="directory"):
        open_store(f"sqlite://{tmp_path}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize(
    "url",
    ["sqlite://host/fenced.db", "sqlite:///x.db?mode=ro", "mysql:///x", "ftp:///x", "x"],
)
def test_bad_urls_are_configuration_errors(url: str) -> None:
    with pytest.raises(ConfigurationError):
        open_store(url)


def test_relative_and_four_slash_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with open_store("sqlite:relative.db") as store:
        store.fence(token(1))
    assert (tmp_path / "relative.db").is_file()
    with open_store(f"sqlite:///{tmp_path}/four.db") as store:  # SQLAlchemy's absolute form
        assert store.floor(R) is None
    assert (tmp_path / "four.db").is_file()


def test_a_busy_database_is_unavailable_and_nothing_changes(
    make_sqlite_store: MakeStore, sqlite_url: str
) -> None:
    store = make_sqlite_store("monotonic", busy_timeout=0.2)
    store.put(token(1), "k", b"v")
    blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite://"), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(Unavailable, match="busy"):
            store.put(token(2), "k", b"w")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    item = store.get(R, "k")
    assert item is not None and (item.value, item.version) == (b"v", 1)
    assert store.put(token(2), "k", b"w").version == 2


def test_a_store_is_shared_by_threads(make_sqlite_store: MakeStore) -> None:
    store = make_sqlite_store("monotonic")
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for n in range(5):
                store.put(token(1, f"thread/{index}"), "k", str(n).encode())
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    for index in range(4):
        item = store.get(f"thread/{index}", "k")
        assert item is not None and (item.value, item.version) == (b"4", 5)


def test_expired_op_records_are_pruned_inside_write_transactions(
    make_sqlite_store: MakeStore, sqlite_url: str
) -> None:
    clock = ManualClock()
    store = make_sqlite_store("monotonic", clock=clock, op_retention=60)
    store.put(token(1), "k", b"v", op_id="old")
    clock.advance(61)
    for n in range(64):  # pruning runs every 64th write of a Store object
        store.put(token(1), "k", str(n).encode())
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite://"))
    try:
        assert conn.execute("SELECT count(*) FROM ops").fetchone() == (0,)
    finally:
        conn.close()

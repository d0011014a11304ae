"""The store conformance suite on ``file:///``, and what only the file store does."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced.core.clock import ManualClock
from fenced.core.errors import ConfigurationError, Unavailable
from fenced.fence import Store, open_store
from fenced.fence.values import Mode
from fenced.testing.store_conformance import (
    MakeStore,
    R,
    StoreConformance,
    directory_snapshot,
    token,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    area = tmp_path / "area"
    area.mkdir()
    return area / "store"


@pytest.fixture
def make_file_store(root: Path) -> Iterator[MakeStore]:
    opened: list[Store] = []

    def make(mode: Mode | None = None, **options: Any) -> Store:
        opened.append(open_store(f"file://{root}", mode, **options))
        return opened[-1]

    yield make
    for store in opened:
        store.close()


class TestFileStore(StoreConformance):
    @pytest.fixture
    def make_store(self, make_file_store: MakeStore) -> MakeStore:
        return make_file_store

    @pytest.fixture
    def snapshot(self) -> Callable[[Store], object]:
        return directory_snapshot


def _resource_dir(root: Path) -> Path:
    (only,) = (root / "resources").iterdir()
    return only


def test_no_caller_given_name_becomes_a_path(make_file_store: MakeStore, root: Path) -> None:
    store = make_file_store("monotonic")
    store.put(token(1, "zebra/resource"), "giraffe-key", b"okapi-value")
    store.publish(token(1, "zebra/resource"), b"data", name="lemur/name")
    paths = [str(p.relative_to(root)) for p in root.rglob("*")]
    for word in ("zebra", "giraffe", "okapi", "lemur"):
        assert not [p for p in paths if word in p]
    state = json.loads((_resource_dir(root) / "state.json").read_bytes())
    assert state["resource"] == "zebra/resource"
    assert set(state["items"]) == {"giraffe-key"}


def test_a_directory_that_is_not_a_fenced_store_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigurationError, match="not a fenced store"):
        open_store(f"file://{tmp_path}")
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ('{"format": "fenced.file-store", "version": 99, "mode": "strict"}', "newer than"),
        ('{"format": "something-else", "version": 1, "mode": "strict"}', "not a fenced store"),
        ("{not json", "corrupt"),
        ('{"format": "fenced.file-store", "version": 1, "mode": "lenient"}', "unknown mode"),
    ],
)
def test_bad_metadata_is_refused(tmp_path: Path, meta: str, message: str) -> None:
    (tmp_path / "fenced-store.json").write_text(meta)
    with pytest.raises(ConfigurationError, match=message):
        open_store(f"file://{tmp_path}")


def test_a_corrupt_state_file_is_a_configuration_error(
    make_file_store: MakeStore, root: Path
) -> None:
    store = make_file_store("monotonic")
    store.put(token(1), "k", b"v")
    state = _resource_dir(root) / "state.json"
    good = state.read_bytes()
    for bad in (b"{truncated", b'{"format": "fenced.file-state", "version": 1}', b"[]"):
        state.write_bytes(bad)
        with pytest.raises(ConfigurationError, match="corrupt state file"):
            store.get(R, "k")
        with pytest.raises(ConfigurationError, match="corrupt state file"):
            store.put(token(1), "k", b"w")
        assert state.read_bytes() == bad  # a failed write does not "repair" it either
    document = json.loads(good)
    document["pointers"] = {"": [1, "../../../etc/passwd", "0" * 64, 1, 1.0]}
    state.write_text(json.dumps(document))
    with pytest.raises(ConfigurationError, match="bad object id"):
        store.latest(R)


def test_unusable_paths_are_configuration_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="not a directory"):
        open_store(f"file://{tmp_path}/file")
    with pytest.raises(ConfigurationError, match="parent directory does not exist"):
        open_store(f"file://{tmp_path}/missing/store")
    with pytest.raises(ConfigurationError):
        open_store(f"file://elsewhere{tmp_path}/store")


def test_concurrent_creation_agrees_on_one_store(root: Path) -> None:
    results: list[str] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            with open_store(f"file://{root}", "monotonic") as store:
                results.append(store.mode)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=create) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert results == ["monotonic"] * 6
    assert sorted(p.name for p in root.iterdir()) == ["fenced-store.json", "locks", "resources"]


def test_a_held_lock_makes_writers_unavailable_and_changes_nothing(
    make_file_store: MakeStore, root: Path
) -> None:
    store = make_file_store("monotonic", busy_timeout=0.2)
    store.put(token(1), "k", b"v")
    (lock_path,) = (root / "locks").iterdir()
    fd = os.open(lock_path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        before = directory_snapshot(store)
        with pytest.raises(Unavailable, match="lock"):
            store.put(token(2), "k", b"w")
        assert directory_snapshot(store) == before
        item = store.get(R, "k")  # reads need no lock
        assert item is not None and item.value == b"v"
    finally:
        os.close(fd)
    assert store.put(token(2), "k", b"w").version == 2


def test_gc_removes_debris_of_interrupted_writes_after_the_grace(
    make_file_store: MakeStore, root: Path
) -> None:
    clock = ManualClock(wall=2_000_000_000.0)
    store = make_file_store("monotonic", clock=clock, gc_grace=60)
    current = store.publish(token(1), b"current")
    rdir = _resource_dir(root)
    orphan = rdir / "objects" / f"{1:020d}-{'a' * 32}"  # staged, then the publisher was killed
    orphan.write_bytes(b"never published")
    part = rdir / "staging" / f"{1:020d}-{'b' * 32}.part"  # killed while staging
    part.write_bytes(b"half")
    commit = rdir / "state.json.tmp-0123"  # killed while committing
    commit.write_bytes(b"{")
    for path in (orphan, part):
        os.utime(path, (clock.wall(), clock.wall()))
    assert store.gc() == 0
    assert orphan.exists() and part.exists()
    assert not commit.exists()  # under the lock, a temporary state file is always debris
    clock.advance(61)
    assert store.gc() == 1
    assert not orphan.exists() and not part.exists()
    assert store.latest(R) == current and store.read(R) == b"current"

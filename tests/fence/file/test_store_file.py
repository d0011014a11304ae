"""The store conformance suite on ``file:///``, and what only the file store does."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced.core._clock import ManualClock
from fenced.core._errors import ConfigurationError, IdempotencyConflict, StaleToken, Unavailable
from fenced.fence import Store, open_store
from fenced.fence._background import drain, later
from fenced.fence._values import Mode, Publication
from fenced.fence.file import _gc as file_gc
from fenced.fence.file import _meta as file_meta
from fenced.fence.file import _store as file_store
from fenced.fence.file._files import write_file
from fenced.fence.file._layout import META
from fenced.fence.file._store import CHECKPOINT_AT, JOURNAL, LOG, OPS, STATE
from fenced.testing.store_conformance import (
    MakeStore,
    R,
    StoreConformance,
    directory_snapshot,
    token,
)
from support.small_disk import free_bytes, mounted_tmpfs
from support.store_damage import (
    DAMAGES,
    assert_no_read_returns_it,
    damage_file_object,
    original,
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


def _hash(resource: str) -> str:
    return hashlib.sha256(resource.encode()).hexdigest()


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
        ('{"format": "fenced.file-store", "version": 2, "mode": "strict"}', "upgrade fenced"),
        ('{"format": "fenced.file-store", "version": 0, "mode": "strict"}', "corrupt"),
        ('{"format": "fenced.file-store", "version": true, "mode": "strict"}', "corrupt"),
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
    newer = json.dumps({**json.loads(good), "version": 2}).encode()  # another format version
    for bad in (b"{truncated", b'{"format": "fenced.file-state", "version": 1}', b"[]", newer):
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


def test_concurrent_creation_agrees_on_one_store(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six threads create one new store at once, three in each mode. None writes its metadata
    before all six found the directory empty and decided to create it: one creation wins, and
    every opener then sees the winner's mode (the other three are refused for asking another)."""
    modes: list[Mode] = ["monotonic", "strict"] * 3
    all_creating = threading.Barrier(len(modes))
    creating: list[int] = []

    def gated_write_file(path: str | Path, data: bytes) -> None:
        if Path(path).name.startswith(f".{META}."):  # the new store's metadata
            creating.append(threading.get_ident())
            all_creating.wait(timeout=30)
        write_file(path, data)

    monkeypatch.setattr(file_meta, "write_file", gated_write_file)
    opened: list[tuple[Mode, str]] = []
    refused: list[tuple[Mode, BaseException]] = []

    def create(mode: Mode) -> None:
        try:
            with open_store(f"file://{root}", mode) as store:
                opened.append((mode, store.mode))
        except BaseException as error:
            refused.append((mode, error))

    threads = [threading.Thread(target=create, args=(mode,)) for mode in modes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(set(creating)) == len(modes)  # every thread raced to create the store
    stored = json.loads((root / META).read_bytes())["mode"]
    assert sorted(opened) == [(stored, stored)] * 3
    assert [mode for mode, _ in refused] == [next(m for m in modes if m != stored)] * 3
    for _, error in refused:
        assert isinstance(error, ConfigurationError) and f"created in {stored} mode" in str(error)
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


def test_gc_moves_victims_out_of_sight_and_a_killed_process_leaves_nothing_for_long(
    make_file_store: MakeStore, root: Path
) -> None:
    """gc renames its victims to ``trash/`` and the reaper thread unlinks them; a reader that
    opened one first reads it whole; what a process killed with SIGKILL before its reaper ran
    left in ``trash/`` goes at the next gc of another process."""
    store = make_file_store("monotonic")
    first = store.publish(token(1), b"first")
    rdir = _resource_dir(root)
    with store.open(R) as reader:
        store.publish(token(1), b"second")
        assert store.gc(keep=1, grace=0) == 1
        assert not (rdir / "objects" / first.object_id).exists()  # gone when gc returns
        assert reader.read() == b"first"  # an opened object stays readable
    assert drain(timeout=10)
    assert list((root / "trash").iterdir()) == []  # the reaper freed it
    pid = os.fork()
    if pid == 0:  # pragma: no cover - killed before its reaper unlinks anything
        try:
            later(threading.Event().wait)  # the reaper is stuck: gc's unlinks wait behind this
            store.publish(token(1), b"third")
            store.gc(keep=1, grace=0)
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    left = [p.name for p in (root / "trash").iterdir()]
    assert len(left) == 1  # the second publication's object, never unlinked
    assert store.read(R) == b"third"
    assert store.gc(keep=1, grace=0) == 0  # nothing new to collect, but the trash is emptied
    assert drain(timeout=10)
    assert list((root / "trash").iterdir()) == []
    latest = store.latest(R)
    assert latest is not None
    assert [p.name for p in (rdir / "objects").iterdir()] == [latest.object_id]
    (root / "trash" / "a-directory").mkdir()  # cannot be unlinked: must not stop the rest
    (root / "trash" / "a-file").write_bytes(b"x")
    store.gc(keep=1, grace=0)
    assert drain(timeout=10)
    assert [p.name for p in (root / "trash").iterdir()] == ["a-directory"]


def test_a_gc_stopped_part_way_says_what_it_removed_and_the_next_gc_finishes(
    make_file_store: MakeStore, root: Path
) -> None:
    """gc takes the resources one by one; one locked for longer than ``busy_timeout`` stops it
    after the others' victims were removed, and its error says so (not "nothing was changed")."""
    store = make_file_store("monotonic", busy_timeout=0.2)
    first, second = sorted(["a", "b"], key=lambda r: hashlib.sha256(r.encode()).hexdigest())
    for resource in (first, second):
        for n in range(3):
            store.publish(token(1, resource), b"%d" % n)
    fd = os.open(root / "locks" / f"{hashlib.sha256(second.encode()).hexdigest()}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(Unavailable) as stopped:
            store.gc(keep=1, grace=0)
    finally:
        os.close(fd)
    message = str(stopped.value)
    assert "nothing was changed" not in message
    assert "gc removed 2 unreferenced objects before it stopped" in message
    assert "run gc again" in message
    assert len(list((root / "resources" / _hash(first) / "objects").iterdir())) == 1
    assert len(list((root / "resources" / _hash(second) / "objects").iterdir())) == 3
    assert store.gc(keep=1, grace=0) == 2
    for resource in (first, second):
        assert store.read(resource) == b"2"
        assert len(list((root / "resources" / _hash(resource) / "objects").iterdir())) == 1


# -- a fenced error inside an OSError translation passes unchanged ---------------------------
# Unavailable is also a ConnectionError, so an OSError: the file store's ``translated(...)`` and
# gc's ``except OSError`` must let the lock's own Unavailable through, not translate it again.


def _holding_the_lock(root: Path, resource: str) -> int:
    fd = os.open(root / "locks" / f"{_hash(resource)}.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_held_lock_reaches_a_writer_as_the_locks_own_unavailable(
    make_file_store: MakeStore, root: Path
) -> None:
    store = make_file_store("monotonic", busy_timeout=0.2)
    store.put(token(1), "k", b"v")
    fd = _holding_the_lock(root, R)
    try:
        with pytest.raises(Unavailable) as refused:
            store.put(token(2), "k", b"w")
    finally:
        os.close(fd)
    message = str(refused.value)
    assert message.startswith("another writer held the lock "), message
    assert message.count("nothing was changed") == 1, message
    assert refused.value.__cause__ is None  # raised by the lock, not translated from an OSError


def test_a_held_lock_stops_gc_with_the_locks_own_unavailable(
    make_file_store: MakeStore, root: Path
) -> None:
    store = make_file_store("monotonic", busy_timeout=0.2)
    for n in range(2):
        store.publish(token(1), b"%d" % n)
    fd = _holding_the_lock(root, R)
    try:
        with pytest.raises(Unavailable) as stopped:
            store.gc(keep=1, grace=0)
    finally:
        os.close(fd)
    message = str(stopped.value)
    assert message.startswith("another writer held the lock "), message
    assert "collecting garbage" not in message
    assert message.count("gc removed nothing") == 1, message
    assert stopped.value.__cause__ is None
    assert store.gc(keep=1, grace=0) == 1


# -- gc on a full disk --------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs (see :mod:`support.small_disk`)."""
    with mounted_tmpfs(tmp_path / "disk", "8m") as disk:
        try:
            yield disk
        finally:
            drain(timeout=10)


def _fill(store: Store) -> list[Publication]:
    """Publish ever smaller objects until not even one byte fits: the disk is full.

    A 12 KiB value of the resource comes first: every state (every log line, gc's too) carries
    it, so no line fits in what is left of a page of ``state.log``.
    """
    store.put(token(1), "config", os.urandom(12 * 1024))
    published: list[Publication] = []
    size = 128 * 1024
    while size:
        try:
            data = b"%d\n" % len(published) + os.urandom(size)
            published.append(store.publish(token(1), data))
        except Unavailable as error:
            assert "No space left on device" in str(error)
            size //= 2
    return published


def _superseded(store: Store) -> list[str]:
    """The objects the current state of :data:`R` remembers as superseded (for gc)."""
    backend = store._backend
    assert isinstance(backend, file_store.FileBackend)
    loaded = backend.load(backend._dir(R), R)
    assert loaded is not None
    return [old.object_id for old in loaded.current.superseded]


def test_gc_frees_a_full_disk_and_the_store_goes_on(small_disk: Path) -> None:
    """On a full disk, gc cannot write the line that forgets what it removed before it frees
    space: it frees first (the trash at once), then records. The store stays as it was."""
    with open_store(f"file://{small_disk}/store", "monotonic") as store:
        published = _fill(store)
        assert len(published) > 20 and free_bytes(small_disk) < 12 * 1024  # less than one line
        latest, data, history = store.latest(R), store.read(R), store.history(R)
        assert latest == published[-1]
        assert store.gc(keep=1, grace=0) == len(published) - 1
        assert list((small_disk / "store" / "trash").iterdir()) == []  # freed before gc returned
        assert free_bytes(small_disk) > 6 * 1024 * 1024
        assert store.latest(R) == latest and store.read(R) == data
        assert store.history(R) == history and store.floor(R) == 1
        assert _superseded(store) == []  # what gc removed is forgotten too
        big = os.urandom(4 * 1024 * 1024)
        after = store.publish(token(1), big)
        assert store.latest(R) == after and store.read(R) == big
        assert store.gc(keep=1, grace=0) == 1


def test_a_put_refused_by_a_full_disk_is_applied_once_when_retried_after_gc(
    small_disk: Path,
) -> None:
    """A put with an op id on the full disk is refused (``Unavailable``, one line) and changes
    nothing; after gc the same op id applies it, and a further retry returns that outcome."""
    with open_store(f"file://{small_disk}/store", "monotonic") as store:
        published = _fill(store)
        history = store.history(R)
        value = os.urandom(64 * 1024)
        with pytest.raises(Unavailable) as refused:
            store.put(token(1), "report", value, op_id="report-1")
        assert "\n" not in str(refused.value) and "No space left" in str(refused.value)
        assert store.get(R, "report") is None and store.history(R) == history
        assert store.gc(keep=1, grace=0) == len(published) - 1
        done = store.put(token(1), "report", value, op_id="report-1")
        assert done.version == 1
        assert store.put(token(1), "report", value, op_id="report-1") == done
        item = store.get(R, "report")
        assert item is not None and item.value == value


@pytest.mark.parametrize("point", ["moved", "freed"])
def test_a_gc_killed_part_way_on_a_full_disk_is_finished_by_the_next(
    small_disk: Path, point: str
) -> None:
    """A gc killed (SIGKILL) after moving three victims to ``trash/`` ("moved": nothing freed
    or recorded yet), or after freeing them but before recording it ("freed"), leaves a store
    that reads as before, and the next gc, on the disk still full or not, finishes the work."""
    with open_store(f"file://{small_disk}/store", "monotonic") as store:
        published = _fill(store)
        latest, data, history = store.latest(R), store.read(R), store.history(R)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - killed in the middle of its gc
            try:
                if point == "moved":
                    renamed, rename = iter(range(3, 0, -1)), os.rename

                    def killed_at_third(source: Any, target: Any) -> None:
                        rename(source, target)
                        if next(renamed) == 1:
                            os.kill(os.getpid(), signal.SIGKILL)

                    os.rename = killed_at_third  # type: ignore[assignment]
                else:
                    unlink_all = file_gc._unlink_all

                    def killed_after(paths: list[str]) -> None:
                        unlink_all(paths)
                        os.kill(os.getpid(), signal.SIGKILL)

                    file_gc._unlink_all = killed_after
                store.gc(keep=1, grace=0)
            finally:
                os._exit(3)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        trash = small_disk / "store" / "trash"
        moved = 3 if point == "moved" else len(published) - 1
        assert len(list(trash.iterdir())) == (3 if point == "moved" else 0)
        assert store.latest(R) == latest and store.read(R) == data
        assert store.gc(keep=1, grace=0) == len(published) - 1 - moved
        assert drain(timeout=10)
        assert list(trash.iterdir()) == []
        assert free_bytes(small_disk) > 6 * 1024 * 1024
        assert store.latest(R) == latest and store.read(R) == data
        assert store.history(R) == history
        assert _superseded(store) == []
        big = os.urandom(4 * 1024 * 1024)
        assert store.publish(token(1), big) == store.latest(R) and store.read(R) == big


# -- the commit log, the checkpoint and the journals -------------------------------------------


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines() if path.exists() else []


def test_commits_append_to_the_log_and_a_checkpoint_truncates_it(
    make_file_store: MakeStore, root: Path
) -> None:
    store = make_file_store("monotonic")
    store.fence(token(1))  # the first commit of a resource writes state.json itself
    rdir = _resource_dir(root)
    assert json.loads((rdir / STATE).read_bytes())["gen"] == 1
    assert (rdir / LOG).read_bytes() == b""
    store.publish(token(1), b"first")
    (line,) = _lines(rdir / LOG)
    _crc, gen, body = line.split(b" ", 2)
    assert int(gen) == 2 and json.loads(body)["pointers"][""][0] == 1
    largest = 0
    for number in range(200):
        store.put(token(1), "k", b"%d" % number)
        largest = max(largest, (rdir / LOG).stat().st_size)
    assert 0 < largest <= CHECKPOINT_AT + 2 * len(line)
    assert json.loads((rdir / STATE).read_bytes())["gen"] > 2  # checkpointed meanwhile
    item = store.get(R, "k")
    assert item is not None and item.value == b"199" and item.version == 200
    assert store.read(R) == b"first"


def test_a_torn_or_damaged_log_line_is_ignored_and_the_next_commit_starts_a_new_line(
    make_file_store: MakeStore, root: Path
) -> None:
    store = make_file_store("monotonic")
    store.put(token(1), "k", b"v1")
    store.put(token(1), "k", b"v2")
    log = _resource_dir(root) / LOG
    intact = log.read_bytes()
    damaged = intact.replace(b'"floor":1', b'"floor":9')  # same length, wrong CRC
    log.write_bytes(intact + damaged + b"0badf00d 99 {")  # and a torn append
    item = store.get(R, "k")
    assert item is not None and item.value == b"v2" and store.floor(R) == 1
    store.put(token(1), "k", b"v3")
    assert _lines(log)[-2] == b"0badf00d 99 {" and _lines(log)[-1].endswith(b"}")
    item = store.get(R, "k")
    assert item is not None and (item.value, item.version) == (b"v3", 3)
    assert [r.detail.get("version") for r in store.history(R)] == [None, 1, 2, 3]


def test_an_op_id_is_honoured_after_its_record_moved_to_the_journal(
    make_file_store: MakeStore, root: Path
) -> None:
    clock = ManualClock()
    store = make_file_store("monotonic", clock=clock, op_retention=100)
    first = store.publish(token(1), b"export", op_id="publish-1")
    rdir = _resource_dir(root)
    while not (rdir / OPS).exists():  # until a checkpoint moved it
        store.put(token(1), "k", b"x" * 1000, op_id=f"put-{clock.wall()}")
        clock.advance(0.001)
    assert b'"publish-1"' in (rdir / OPS).read_bytes()
    assert b'"publish-1"' not in (rdir / STATE).read_bytes() + (rdir / LOG).read_bytes()
    assert store.publish(token(1), b"export", op_id="publish-1") == first
    with pytest.raises(IdempotencyConflict):
        store.publish(token(1), b"other", op_id="publish-1")
    clock.advance(101)  # expired: judged afresh, and the journal drops it at a checkpoint
    again = store.publish(token(1), b"export", op_id="publish-1")
    assert again != first and store.latest(R) == again
    for number in range(200):
        store.put(token(1), "k", b"y" * 1000, op_id=f"later-{number}")
    assert store.publish(token(1), b"export", op_id="publish-1") == again
    ops = [json.loads(line)["op_id"] for line in _lines(rdir / OPS)]
    assert ops.count("publish-1") == 1 and not any(o.startswith("put-") for o in ops)


def test_the_state_the_log_and_the_journals_stay_bounded(
    make_file_store: MakeStore, root: Path
) -> None:
    clock = ManualClock()
    store = make_file_store(
        "monotonic", clock=clock, record_limit=50, record_retention=30, op_retention=30
    )
    sizes: list[list[int]] = []
    for number in range(1500):
        store.publish(token(2 + number // 100), b"%d" % number, op_id=f"publish-{number}")
        with pytest.raises(StaleToken):
            store.publish(token(1 + number // 100), b"late")
        clock.advance(0.1)
        if number % 8 == 7:
            store.gc(keep=1, grace=0)
        rdir = _resource_dir(root)
        sizes.append([_size(rdir / name) for name in (STATE, LOG, JOURNAL, OPS)])
    late = sizes[500:]
    assert max(s[0] for s in late) < 4096  # state.json: no records, no op records
    assert max(s[1] for s in late) < 2 * CHECKPOINT_AT
    assert max(s[2] for s in late) < 200 * 1024  # about 600 records (30 s), not 3000
    assert max(s[3] for s in late) < 200 * 1024  # about 300 op records (30 s), not 1500
    assert len(store.history(R)) == 50
    assert store.read(R) == b"1499"


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


class _Gated(io.BytesIO):
    """``data`` as a stream whose second read waits at ``gate`` (with the other streams of a
    test): once all have passed it, each has handed its first chunk to the hashing thread."""

    def __init__(self, data: bytes, gate: threading.Barrier) -> None:
        super().__init__(data)
        self._gate = gate
        self._reads = 0

    def read(self, size: int | None = -1, /) -> bytes:
        self._reads += 1
        if self._reads == 2:
            self._gate.wait(timeout=30)
        return super().read(size)


def test_large_publishes_hash_on_one_helper_thread_that_a_forked_child_replaces(
    root: Path,
) -> None:
    """Chunks of 1 MiB are hashed on the process's helper thread (started once, kept); a child
    forked while it exists starts its own, so a publish in the child neither hangs nor hashes
    wrong, and threads publishing at once each get their own digest: their chunks are forced to
    interleave on the helper thread (none reads its second chunk before all fed their first)."""
    data = [os.urandom(2 * 1024 * 1024 + 1 + n) for n in range(4)]  # three chunks each
    with open_store(f"file://{root}", "monotonic") as store:
        store.publish(token(1), data[0])
        helpers = [t for t in threading.enumerate() if t.name == "fenced-helper"]
        assert len(helpers) == 1
        store.publish(token(1), data[1])
        assert [t for t in threading.enumerate() if t.name == "fenced-helper"] == helpers
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through its exit status
            status = 1
            try:
                publication = store.publish(token(2), data[2])
                good = publication.sha256 == hashlib.sha256(data[2]).hexdigest()
                status = 0 if good and store.read(R) == data[2] else 2
            finally:
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        results: dict[int, Publication] = {}
        errors: list[BaseException] = []
        gate = threading.Barrier(4)

        def publish(n: int) -> None:
            try:
                results[n] = store.publish(token(3), _Gated(data[n], gate), name=f"n{n}")
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=publish, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == [] and not gate.broken
        assert sorted(results) == [0, 1, 2, 3]
        for n, publication in results.items():
            assert publication.sha256 == hashlib.sha256(data[n]).hexdigest()
            assert publication.size == len(data[n])
            assert store.read(R, f"n{n}") == data[n]


@pytest.mark.parametrize("damage", DAMAGES)
def test_no_read_returns_a_damaged_object(
    make_file_store: MakeStore, root: Path, damage: str
) -> None:
    """An object file cut to 1 MiB of its 5 MiB, with a flipped byte or a byte too many: read(),
    and a stream from open() before its clean end, raise CorruptData."""
    store = make_file_store("monotonic")
    publication = store.publish(token(1), original())
    damage_file_object(root, publication, damage)
    assert_no_read_returns_it(store, publication, damage)

"""The store conformance suite on ``file:///``, and what only the file store does."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced.core.clock import ManualClock
from fenced.core.errors import ConfigurationError, IdempotencyConflict, StaleToken, Unavailable
from fenced.fence import Store, open_store, ops
from fenced.fence.file_store import CHECKPOINT_AT, JOURNAL, LOG, OPS, STATE
from fenced.fence.helpers import drain, later
from fenced.fence.values import Mode, Publication, Version
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
            later(lambda: time.sleep(60))  # the reaper is busy: gc's unlinks wait behind this
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


def _format_1_store(root: Path) -> tuple[Publication, bytes]:
    """A store as fenced wrote it before the commit log (format 1), with one of everything."""
    rdir = root / "resources" / hashlib.sha256(R.encode()).hexdigest()
    for path in (root / "locks", rdir / "objects", rdir / "staging"):
        path.mkdir(parents=True)
    (root / "fenced-store.json").write_text(
        json.dumps({"format": "fenced.file-store", "version": 1, "mode": "strict"})
    )
    data = b"the export of epoch 3"
    publication = Publication(
        R, "", 3, f"{3:020d}-{'a' * 32}", hashlib.sha256(data).hexdigest(), len(data), 1000.0
    )
    (rdir / "objects" / publication.object_id).write_bytes(data)

    def record(seq: int, kind: str, detail: dict[str, object]) -> dict[str, object]:
        return {"seq": seq, "at": 1000.0 + seq, "kind": kind, "epoch": 3, "detail": detail}

    journal = [record(1, "installed", {"op": "fence", "previous": None})]
    (rdir / JOURNAL).write_text("".join(json.dumps(r) + "\n" for r in journal))
    put = Version(R, "k", 3, 2)
    state = {
        "format": "fenced.file-state",
        "version": 1,
        "resource": R,
        "coordinator_id": token(3).coordinator_id,
        "floor": 3,
        "items": {"k": [base64.b64encode(b"old").decode(), 3, 2]},
        "pointers": {"": [3, publication.object_id, publication.sha256, len(data), 1000.0]},
        "superseded": [],
        "ops": {
            "write-1": [ops.put_digest(token(3), "k", b"old", None), ops.encode_outcome(put), 1e3]
        },
        "seq": 3,
        "records": [
            record(2, "accepted", {"op": "put", "key": "k", "version": 2, "op_id": "write-1"}),
            record(3, "accepted", {"op": "publish", "name": ""}),
        ],
        "compact_at": 262144,
        "oldest": 1001.0,
    }
    (rdir / STATE).write_text(json.dumps(state))
    return publication, data


def test_a_format_1_store_opens_and_migrates_at_its_first_commit(root: Path) -> None:
    publication, data = _format_1_store(root)
    clock = ManualClock(wall=2000.0)
    with open_store(f"file://{root}", clock=clock) as store:
        meta = json.loads((root / "fenced-store.json").read_bytes())
        assert meta == {"format": "fenced.file-store", "version": 2, "mode": "strict"}
        assert store.mode == "strict" and store.floor(R) == 3
        item = store.get(R, "k")
        assert item is not None and (item.value, item.version) == (b"old", 2)
        assert store.latest(R) == publication and store.read(R) == data
        assert [r.seq for r in store.history(R)] == [1, 2, 3]
        rdir = _resource_dir(root)
        assert store.put(token(3), "k", b"old", op_id="write-1") == Version(R, "k", 3, 2)
        assert json.loads((rdir / STATE).read_bytes())["version"] == 1  # a replay commits nothing
        assert store.put(token(3), "k", b"new").version == 3  # the first commit migrates
        state = json.loads((rdir / STATE).read_bytes())
        assert state["version"] == 2 and "write-1" in state["ops"] and len(state["records"]) == 3
        for _ in range(200):  # past a checkpoint: the format-1 entries reach the journals
            store.put(token(3), "other", b"x" * 1000)
        assert json.loads((rdir / STATE).read_bytes())["records"] == []
        assert b'"write-1"' in (rdir / OPS).read_bytes()
        assert store.put(token(3), "k", b"old", op_id="write-1") == Version(R, "k", 3, 2)
        history = store.history(R)
        assert [r.seq for r in history] == list(range(1, len(history) + 1))
        assert [r.detail.get("version") for r in history[:4]] == [None, 2, None, 3]


def test_large_publishes_hash_on_one_helper_thread_that_a_forked_child_replaces(
    root: Path,
) -> None:
    """Chunks of 1 MiB are hashed on the process's helper thread (started once, kept); a child
    forked while it exists starts its own, so a publish in the child neither hangs nor hashes
    wrong, and threads publishing at once each get their own digest."""
    data = [os.urandom(1024 * 1024 + n) for n in range(4)]  # two chunks each
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

        def publish(n: int) -> None:
            results[n] = store.publish(token(3), data[n], name=f"n{n}")

        threads = [threading.Thread(target=publish, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for n, publication in results.items():
            assert publication.sha256 == hashlib.sha256(data[n]).hexdigest()
            assert publication.size == len(data[n])
            assert store.read(R, f"n{n}") == data[n]

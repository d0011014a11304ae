"""The store conformance suite on ``sqlite:``, and what only the SQLite store does."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced.fence
import fenced.fence._store as store_module
from fenced.core._clock import ManualClock
from fenced.core._errors import ConfigurationError, StaleToken, Unavailable
from fenced.core._records import RecordKind, detail_json
from fenced.fence import Store, open_store
from fenced.fence._values import Mode
from fenced.fence.sqlite import _store as sqlite_store
from fenced.fence.sqlite._store import MIGRATIONS, SCHEMA_VERSION, SqliteBackend
from fenced.testing.conformance import wait_for
from fenced.testing.store_conformance import (
    MakeStore,
    R,
    StoreConformance,
    sqlite_snapshot,
    token,
)
from support.simultaneous import run_together
from support.store_damage import DAMAGES, assert_no_read_returns_it, damage_sqlite_object, original


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    area = tmp_path / "area"
    area.mkdir()
    return f"sqlite:///{area}/fenced.db"


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
        "install_postgres_guard",
        "open_store",
    }


def test_wal_full_sync_and_a_versioned_schema(make_sqlite_store: MakeStore) -> None:
    store = make_sqlite_store("monotonic")
    path = store.url.removeprefix("sqlite:///")
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
        open_store(f"sqlite:///{path}")
    assert path.read_bytes() == before


def test_a_newer_schema_is_refused(make_sqlite_store: MakeStore, sqlite_url: str) -> None:
    make_sqlite_store().close()
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(ConfigurationError, match="newer than this fenced"):
        open_store(sqlite_url)


def test_unusable_paths_are_configuration_errors(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigurationError, match="cannot open"):
        open_store(f"sqlite:///{tmp_path}/file/fenced.db")  # the parent is a file
    with pytest.raises(ConfigurationError, match="cannot open"):
        open_store(f"sqlite:///{tmp_path}/missing/fenced.db")
    with pytest.raises(ConfigurationError, match="directory"):
        open_store(f"sqlite:///{tmp_path}")
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
    blocker = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
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


def _idents(threads: list[threading.Thread]) -> set[int | None]:
    """The threads' idents (None for one not started yet)."""
    return {thread.ident for thread in threads}


def test_a_store_is_shared_by_threads(
    make_sqlite_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four threads write through one Store at once. The first to get the database's write lock
    keeps its transaction open until the three others have started their own ``BEGIN
    IMMEDIATE`` (seen by a trace of their connections): the writes overlap, each thread's
    transaction is its own (one connection shared by the threads would refuse a transaction
    within a transaction), and every write lands."""
    lock = threading.Lock()
    began: set[int] = set()  # the threads whose BEGIN IMMEDIATE has started
    holders: list[int] = []  # the threads that entered a transaction, in order
    seen: list[set[int]] = []  # the threads that had begun while the first one held the lock
    connect = SqliteBackend._connect

    def traced_connect(backend: SqliteBackend) -> sqlite3.Connection:
        conn = connect(backend)

        def trace(statement: str) -> None:
            if statement.startswith("BEGIN IMMEDIATE"):
                with lock:
                    began.add(threading.get_ident())

        conn.set_trace_callback(trace)
        return conn

    enter = sqlite_store._Writing.__enter__
    threads: list[threading.Thread] = []

    def holding_enter(writing: Any) -> Any:
        tx = enter(writing)
        with lock:
            first = not holders
            holders.append(threading.get_ident())
        if first:
            try:
                wait_for(lambda: _idents(threads) <= began, 30, "the other writers to begin")
                seen.append(began & _idents(threads))
            except BaseException as error:
                writing.__exit__(type(error), error, None)  # roll back
                raise
        return tx

    monkeypatch.setattr(SqliteBackend, "_connect", traced_connect)
    monkeypatch.setattr(sqlite_store._Writing, "__enter__", holding_enter)
    store = make_sqlite_store("monotonic", busy_timeout=30)
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for n in range(5):
                store.put(token(1, f"thread/{index}"), "k", str(n).encode())
        except BaseException as error:
            errors.append(error)

    threads.extend(threading.Thread(target=work, args=(i,)) for i in range(4))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert seen == [_idents(threads)]  # all four were writing at once
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
    conn = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    try:
        assert conn.execute("SELECT count(*) FROM ops").fetchone() == (0,)
    finally:
        conn.close()


@pytest.mark.parametrize(
    "detail",
    [
        {"op": "put", "key": 'a"b\u00e9\n/\\', "version": 3},
        {"op": "fence", "previous": None},
        {"op": "fence", "previous": 12345678901234567890},
        {},
        {"flag": True},
        {"ratio": 1.5},
        {"list": [1, "x"]},
        {1: "int key"},
    ],
)
def test_record_details_encode_exactly_as_json_dumps(detail: dict[Any, object]) -> None:
    expected = json.dumps(detail, separators=(",", ":"), default=str)
    assert detail_json(detail) == expected


def test_records_are_pruned_in_batches_and_history_keeps_the_limit(tmp_path: Path) -> None:
    clock = ManualClock(wall=1000.0)
    with open_store(f"sqlite:///{tmp_path}/s.db", clock=clock, record_limit=10) as store:
        store.fence(token(1))
        for n in range(700):  # the Store prunes every 64th write
            store.put(token(1), "k", b"%d" % n)
        assert len(store.history(R)) == 10
        conn = sqlite3.connect(tmp_path / "s.db")
        (stored,) = conn.execute("SELECT count(*) FROM records").fetchone()
        conn.close()
        assert 10 <= stored <= 10 + 512 + 64


def _version_2_store(path: Path, newest: str) -> int:
    """A store at schema version 2 (records with AUTOINCREMENT); returns the highest seq it
    handed out. ``newest``: "kept", "pruned" (the store's newest records were deleted, so
    sqlite_sequence is above every row left), "all pruned" or "none" (no record was ever
    written)."""
    conn = sqlite3.connect(path)
    for step in MIGRATIONS[:2]:
        for statement in step:
            conn.execute(statement)
    conn.executemany(
        "INSERT INTO meta(key, value) VALUES (?, ?)",
        [("format", "fenced.sqlite-store"), ("schema_version", "2"), ("mode", "strict")],
    )
    conn.execute("INSERT INTO domains VALUES (?, ?, 4)", (R, token(4).coordinator_id))
    conn.execute("INSERT INTO items VALUES (?, 'k', x'76', 4, 1)", (R,))
    if newest != "none":
        rows = [
            (R, 1000.0, "installed", 4, '{"op":"fence","previous":null}'),
            *[(R, 1000.0 + n, "accepted", 4, f'{{"op":"put","key":"k","version":{n}}}')
              for n in (1, 2, 3)],
            ("other", 1010.0, "installed", 1, '{"op":"fence","previous":null}'),
            ("other", 1011.0, "rejected", 0, '{"op":"put","floor":1}'),
        ]  # fmt: skip
        conn.executemany(
            "INSERT INTO records(resource, at, kind, epoch, detail) VALUES (?, ?, ?, ?, ?)", rows
        )
    if newest == "pruned":
        conn.execute("DELETE FROM records WHERE resource = 'other'")
    if newest == "all pruned":
        conn.execute("DELETE FROM records")
    (handed_out,) = conn.execute(
        "SELECT coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'records'), 0)"
    ).fetchone()
    conn.commit()
    conn.close()
    return int(handed_out)


@pytest.mark.parametrize("newest", ["kept", "pruned", "all pruned", "none"])
def test_a_version_2_store_keeps_its_records_and_never_reuses_a_seq(
    tmp_path: Path, newest: str
) -> None:
    path = tmp_path / "v2.db"
    handed_out = _version_2_store(path, newest)
    conn = sqlite3.connect(path)
    before = conn.execute("SELECT * FROM records ORDER BY seq").fetchall()
    conn.close()
    assert handed_out == {"kept": 6, "pruned": 6, "all pruned": 6, "none": 0}[newest]
    assert len(before) == {"kept": 6, "pruned": 4, "all pruned": 0, "none": 0}[newest]

    clock = ManualClock(wall=2000.0)
    with open_store(f"sqlite:///{path}", clock=clock) as store:
        history = store.history(R)
        assert [(r.seq, r.at, r.kind.value, r.epoch, r.detail) for r in history] == [
            (seq, at, kind, epoch, json.loads(detail))
            for seq, resource, at, kind, epoch, detail in before
            if resource == R
        ]
        item = store.get(R, "k")
        assert item is not None and (item.value, item.version) == (b"v", 1)
        store.put(token(4), "k", b"w")
        (new,) = store.history(R, after=history[-1].seq if history else 0)
        assert new.kind is RecordKind.ACCEPTED
        assert new.seq == handed_out + 1  # above every seq handed out, even pruned ones
        if newest == "kept":
            assert [r.seq for r in store.history("other")] == [5, 6]

    conn = sqlite3.connect(path)
    try:
        meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert meta["schema_version"] == str(SCHEMA_VERSION) == "3"
        (table,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'records'").fetchone()
        assert "AUTOINCREMENT" not in table.upper()
        assert conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'records_by_resource'"
        ).fetchone() == (1,)
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        after = conn.execute("SELECT * FROM records WHERE seq <= ? ORDER BY seq", (handed_out,))
        placeholder = [(handed_out, "", 0.0, "seq-high-water", 0, "{}")]
        assert after.fetchall() == before + (placeholder if "pruned" in newest else [])
    finally:
        conn.close()
    with open_store(f"sqlite:///{path}", clock=clock) as store:  # at version 3: nothing to do
        assert [r.seq for r in store.history(R)][-1] == handed_out + 1


def test_pruning_keeps_the_newest_record_so_no_seq_is_reused(tmp_path: Path) -> None:
    # A new seq is max(seq) + 1: had pruning deleted the store's newest record (here every
    # record of R has expired, and a no-op fence writes none), the next one would reuse it.
    clock = ManualClock(wall=1000.0)
    url = f"sqlite:///{tmp_path}/s.db"
    highest = 0
    with open_store(url, clock=clock, record_retention=100, record_limit=3) as store:
        for round_ in range(3):
            store.fence(token(1))
            store.fence(token(1, "other"))
            for n in range(5):
                store.put(token(1), "k", b"%d" % n)
                store.put(token(1, "other"), "k", b"%d" % n)
            store.put(token(1), "k", b"last")  # R holds the store's newest record
            seqs = [r.seq for r in store.history(R) + store.history("other")]
            assert min(seqs) > highest, round_  # nothing handed out twice
            highest = max(seqs)
            clock.advance(200)  # every record has expired
            for _ in range(64):  # the Store prunes every 64th write: a no-op fence is one
                store.fence(token(1))
            assert store.history(R) == [], round_
            conn = sqlite3.connect(tmp_path / "s.db")
            kept = conn.execute("SELECT seq FROM records WHERE resource = ?", (R,)).fetchall()
            conn.close()
            assert kept == [(highest,)], round_  # all of R's pruned but the store's newest
        store.put(token(1), "k", b"again")
        (new,) = store.history(R)
        assert new.seq == highest + 1


def test_a_failing_prune_rolls_back_the_write_it_rides_on(tmp_path: Path) -> None:
    """The periodic prune runs inside the mutation's transaction: when the database refuses it
    (a trigger that aborts every delete of a record), the mutation is rolled back as a whole
    and the error reaches the caller; the writes before and after it are kept."""
    clock = ManualClock(wall=2_000_000_000.0)
    path = tmp_path / "s.db"
    store = open_store(f"sqlite:///{path}", "monotonic", clock=clock, record_retention=60)
    store.put(token(1), "k", b"before")
    clock.advance(120)  # every record so far is past its retention: the prune deletes some
    with sqlite3.connect(path) as admin:
        admin.execute(
            "CREATE TRIGGER refuse_prune BEFORE DELETE ON records"
            " BEGIN SELECT RAISE(ABORT, 'refused: records may not be deleted'); END"
        )
    failures = 0
    for n in range(store_module._PRUNE_EVERY + 1):
        try:
            store.put(token(1), "k", f"v{n}".encode())
        except Unavailable as error:
            assert "refused: records may not be deleted" in str(error)
            failures += 1
            item = store.get(R, "k")
            assert item is not None and item.value == f"v{n - 1}".encode()  # nothing changed
    assert failures == 1
    item = store.get(R, "k")
    assert item is not None and item.value == f"v{store_module._PRUNE_EVERY}".encode()
    store.close()


def test_the_one_call_put_records_what_the_general_path_records(tmp_path: Path) -> None:
    """An installed holder's plain put runs as one backend call (``put_current``); a put that
    installs (monotonic), is refused, or carries an op id or if_version takes the general path.
    Either way the history holds the same records, each once."""
    store = open_store(f"sqlite:///{tmp_path}/s.db", "monotonic")
    calls: list[object] = []
    backend = store._backend
    one_call = backend.put_current  # type: ignore[attr-defined]

    def counted(*args: object) -> object:
        result = one_call(*args)
        calls.append(result)
        return result

    backend.put_current = counted  # type: ignore[attr-defined]
    store.put(token(3), "k", b"a")  # installs epoch 3: the one call declines, nothing written
    store.put(token(3), "k", b"b")  # the usual put: one call
    store.put(token(3), "k", b"c", op_id="op-1")  # general path
    store.put(token(3), "k", b"d", if_version=3)  # general path
    with pytest.raises(StaleToken):
        store.put(token(2), "k", b"old")  # declined, then refused and recorded by the general path
    assert [type(c).__name__ for c in calls] == ["NoneType", "Version", "NoneType"]
    item = store.get(R, "k")
    assert item is not None and (item.value, item.version) == (b"d", 4)
    kinds = [(r.kind, r.epoch, r.detail) for r in store.history(R)]
    assert kinds == [
        (RecordKind.INSTALLED, 3, {"op": "put", "previous": None}),
        (RecordKind.ACCEPTED, 3, {"op": "put", "key": "k", "version": 1}),
        (RecordKind.ACCEPTED, 3, {"op": "put", "key": "k", "version": 2}),
        (RecordKind.ACCEPTED, 3, {"op": "put", "key": "k", "version": 3, "op_id": "op-1"}),
        (RecordKind.ACCEPTED, 3, {"op": "put", "key": "k", "version": 4}),
        (
            RecordKind.REJECTED,
            2,
            {"op": "put", "key": "k", "reason": "stale", "presented": 2, "floor": 3},
        ),
    ]
    store.close()


_OPENER = """
import sqlite3
import fenced
import fenced.fence.sqlite._store as sqlite_store
from fenced._drivers.sqlite import is_busy, retrying

path = sys.argv[1]
refused = 0

def counting(step, *args, timeout):
    def attempt(*step_args):
        global refused
        try:
            return step(*step_args)
        except sqlite3.OperationalError as error:
            if is_busy(error):
                refused += 1
                if refused == 1:  # tell the test
                    open(f"{path}.refused-{os.getpid()}", "x").close()
            raise
    return retrying(attempt, *args, timeout=timeout)

sqlite_store.retrying = counting
fenced.open_store("sqlite:///" + path, busy_timeout=60).close()
print(refused)
"""


def test_processes_opening_one_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    """Six processes open the same new store file at the same instant, while another
    connection holds the new file's lock (as a process in the middle of creating it does).
    Setting up a new file (``auto_vacuum``, then the switch to WAL, which answers SQLITE_BUSY
    at once, without SQLite's busy handler) is retried: each process is refused at least once
    (the test waits for all six refusals before it lets go of the lock), retries, and opens
    the store."""
    path = tmp_path / "new.db"
    creator = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    creator.execute("BEGIN IMMEDIATE")
    stop = threading.Event()
    refused_while_locked: list[int] = []

    def release_once_all_were_refused() -> None:
        deadline = time.monotonic() + 60
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                refused = len(list(tmp_path.glob("new.db.refused-*")))
                if refused == 6:
                    refused_while_locked.append(refused)
                    return
                time.sleep(0.005)
        finally:
            creator.execute("ROLLBACK")

    releaser = threading.Thread(target=release_once_all_were_refused)
    releaser.start()
    try:
        results = run_together(_OPENER, [str(path)], 6, tmp_path / "go")
    finally:
        stop.set()
        releaser.join(timeout=60)
        creator.close()
    assert [code for code, _, _ in results] == [0] * 6, [err for _, _, err in results]
    assert refused_while_locked == [6]
    assert all(int(out) >= 1 for _, out, _ in results)  # each retried after SQLITE_BUSY
    store = open_store(f"sqlite:///{path}")
    assert store.mode == "strict"
    store.close()
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA auto_vacuum").fetchone() == (2,)  # INCREMENTAL, set by all
    check.close()


@pytest.mark.parametrize("damage", DAMAGES)
def test_no_read_returns_a_damaged_object(
    make_sqlite_store: MakeStore, sqlite_url: str, damage: str
) -> None:
    """Chunks that hold 1 MiB of the recorded 5 MiB, a flipped byte or a byte too many: read(),
    and a stream from open() before its clean end, raise CorruptData."""
    store = make_sqlite_store("monotonic")
    publication = store.publish(token(1), original())
    damage_sqlite_object(Path(sqlite_url.removeprefix("sqlite:///")), publication, damage)
    assert_no_read_returns_it(store, publication, damage)

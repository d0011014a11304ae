"""Store records beyond the conformance suite: migrations, the file journal, failure paths.

:class:`fenced.testing.store_conformance.RecordsConformance` (run by test_store_sqlite.py and
test_store_file.py) covers what every store does; this module covers how the two local stores
keep their records.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

import fenced
from fenced.core._errors import ConfigurationError, StaleToken, Unavailable
from fenced.core._records import Record, RecordKind
from fenced.fence import Capability
from fenced.fence.file._store import JOURNAL, LOG, STATE
from fenced.fence.sqlite._store import MIGRATIONS, SCHEMA_VERSION
from fenced.testing.store_conformance import R, token


def resource_dir(root: Path) -> Path:
    (only,) = (root / "resources").iterdir()
    return only


def test_a_first_version_sqlite_store_gains_records_and_keeps_its_data(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.executemany(
        "INSERT INTO meta(key, value) VALUES (?, ?)",
        [("format", "fenced.sqlite-store"), ("schema_version", "1"), ("mode", "strict")],
    )
    conn.execute("INSERT INTO domains VALUES (?, ?, 4)", (R, token(4).coordinator_id))
    conn.commit()
    conn.close()
    with fenced.open_store(f"sqlite:///{path}") as store:
        assert store.floor(R) == 4
        assert store.history(R) == []
        store.put(token(4), "k", b"v")
        assert [r.kind for r in store.history(R)] == [RecordKind.ACCEPTED]
    conn = sqlite3.connect(path)
    assert dict(conn.execute("SELECT key, value FROM meta"))["schema_version"] == str(
        SCHEMA_VERSION
    )
    conn.close()


def test_the_file_journal_survives_a_torn_line(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with fenced.open_store(f"file://{root}") as store:
        store.fence(token(2))
        with pytest.raises(StaleToken):
            store.put(token(1), "k", b"v")  # a rejection goes to the journal
        journal = resource_dir(root) / JOURNAL
        with journal.open("ab") as stream:
            stream.write(b'{"seq": 99, "at": 1.0, "ki')  # a power failure mid-append
        with pytest.raises(StaleToken):
            store.put(token(1), "k", b"v")
        store.fence(token(3))
        history = store.history(R)
    assert [(r.kind, r.epoch) for r in history] == [
        (RecordKind.INSTALLED, 2),
        (RecordKind.REJECTED, 1),
        (RecordKind.REJECTED, 1),
        (RecordKind.INSTALLED, 3),
    ]
    assert [r.seq for r in history] == [1, 2, 3, 4]
    lines = journal.read_bytes().split(b"\n")
    assert lines[-2].startswith(b'{"seq":3')  # it started a line of its own


def test_a_file_checkpoint_moves_committed_records_to_the_journal(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with fenced.open_store(f"file://{root}", "monotonic") as store:
        store.put(token(1), "k", b"v" * 1000)
        puts = 1
        while not (resource_dir(root) / JOURNAL).exists():  # until the first checkpoint
            store.put(token(1), "k", b"v" * 1000)
            puts += 1
        assert puts < 200
        rdir = resource_dir(root)
        state = json.loads((rdir / STATE).read_bytes())
        assert state["records"] == [] and state["ops"] == {}
        assert (rdir / LOG).stat().st_size == 0
        journal = rdir / JOURNAL
        assert journal.read_bytes().count(b"\n") == puts + 1  # one install, the accepted puts
        # A crash after the journal was synced but before state.json was replaced leaves the
        # records in both places: readers keep one per seq.
        with journal.open("ab") as stream:
            stream.write(journal.read_bytes())
        store.put(token(1), "k", b"w")
        history = store.history(R)
    assert [r.seq for r in history] == list(range(1, puts + 3))
    assert [r.kind for r in history] == [
        RecordKind.INSTALLED,
        *[RecordKind.ACCEPTED] * (puts + 1),
    ]


def test_a_failure_to_record_a_rejection_never_masks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fenced.open_store(f"sqlite:///{tmp_path}/s.db") as store:
        store.fence(token(2))

        def broken(record: Record) -> None:
            raise Unavailable("the disk is full")

        monkeypatch.setattr(store._backend, "record_rejection", broken)
        with pytest.raises(StaleToken):
            store.put(token(1), "k", b"v")
        assert [r.kind for r in store.history(R)] == [RecordKind.INSTALLED]


def test_a_store_without_records_says_so_and_still_works(tmp_path: Path) -> None:
    with fenced.open_store(f"sqlite:///{tmp_path}/s.db") as store:
        without = frozenset(Capability) - {Capability.RECORDS}
        store._backend.capabilities = without
        store.fence(token(2))
        store.put(token(2), "k", b"v")
        with pytest.raises(StaleToken):
            store.put(token(1), "k", b"v")
        with pytest.raises(ConfigurationError, match="does not keep records"):
            store.history(R)
        with pytest.raises(ConfigurationError, match="does not keep records"):
            store.floors()
        store._backend.capabilities = frozenset(Capability)
        assert store.history(R) == []  # nothing was recorded meanwhile

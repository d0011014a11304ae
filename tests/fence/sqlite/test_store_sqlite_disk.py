"""Disk space on ``sqlite:``: gc frees pages without rewriting them, hands them back to the file
system, keeps the WAL bounded, and is the way out of a full disk (real tmpfs mounts)."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest

from fenced.core._errors import Unavailable
from fenced.fence import Store, open_store
from fenced.fence.sqlite._space import RESERVE, WAL_LIMIT
from fenced.testing.store_conformance import R, token
from support.small_disk import fill_up, free_bytes, mounted_tmpfs

MIB = 1024 * 1024


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _scalar(db: Path, sql: str) -> int:
    """The one integer ``sql`` answers, read on a connection of the test's own."""
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


def _pragma(db: Path, name: str) -> int:
    return _scalar(db, f"PRAGMA {name}")


def _staged_objects(db: Path) -> int:
    """How many objects have chunks in the database (sealed or not)."""
    return _scalar(db, "SELECT count(DISTINCT object_id) FROM chunks")


def _publish_until_refused(store: Store, size: int) -> tuple[list[object], str]:
    """Publish objects of ``size`` bytes until the store refuses one; the refusal's message."""
    published: list[object] = []
    while True:
        try:
            published.append(store.publish(token(1), os.urandom(size)))
        except Unavailable as refused:
            return published, str(refused)


def test_gc_is_the_way_out_of_a_disk_the_store_filled(tmp_path: Path) -> None:
    """The store fills a 32 MiB tmpfs with 3 MiB objects until a publish is refused: one line,
    nothing published, its staged chunks gone. A put with an op id is refused the same way. gc
    removes all but the newest object, the free space comes back to the file system (the
    database file shrinks), the WAL stays within its limit, and the put retried with the same
    op id is applied once."""
    with mounted_tmpfs(tmp_path / "disk", "32m") as disk:
        db, wal = disk / "store.db", disk / "store.db-wal"
        with open_store(f"sqlite:///{db}") as store:
            store.fence(token(1))
            published, refusal = _publish_until_refused(store, 3 * MIB)
            assert len(published) >= 3, refusal
            assert "\n" not in refusal and "kept free so that gc can run" in refusal, refusal
            assert "nothing was changed" in refusal and str(db) in refusal, refusal
            assert free_bytes(disk) < 2 * 3 * MIB + _size(wal) + RESERVE  # the refusal was due
            assert _staged_objects(db) == len(published)  # the refused one's chunks are gone
            latest, data, history = store.latest(R), store.read(R), store.history(R)
            assert latest == published[-1]

            with pytest.raises(Unavailable, match="kept free so that gc can run"):
                store.put(token(1), "report", b"r" * 4096, op_id="report-1")
            assert store.get(R, "report") is None and store.history(R) == history

            free, size = free_bytes(disk), _size(db)
            assert store.gc(keep=1, grace=0) == len(published) - 1
            returned = (len(published) - 1) * 3 * MIB
            assert free_bytes(disk) - free >= returned * 0.9  # back in the file system
            assert size - _size(db) >= returned * 0.9  # the database file shrank
            assert _size(wal) <= WAL_LIMIT
            assert _pragma(db, "freelist_count") == 0
            assert store.latest(R) == latest and store.read(R) == data

            done = store.put(token(1), "report", b"r" * 4096, op_id="report-1")
            assert done.version == 1 and store.get(R, "report") is not None
            assert store.put(token(1), "report", b"r" * 4096, op_id="report-1") == done


def test_gc_on_a_disk_another_program_filled_says_how_much_to_free(tmp_path: Path) -> None:
    """Objects published while a reader holds a snapshot stay in the WAL, and another program
    then fills the disk: the WAL cannot be copied into the database, so gc can free nothing.
    It says so in one line, with the space to free; once that much is freed, gc succeeds,
    leaves the disk with free space and the WAL within its limit. The store's own writes
    still keep its reserve free; with the other program's file gone, a put goes through."""
    with mounted_tmpfs(tmp_path / "disk", "32m") as disk:
        db, wal = disk / "store.db", disk / "store.db-wal"
        filler = disk / "filler"
        with open_store(f"sqlite:///{db}") as store:
            store.fence(token(1))
            store.publish(token(1), os.urandom(256 * 1024))
            with store.open(R):  # its snapshot keeps every later commit in the WAL
                for _ in range(8):
                    store.publish(token(1), os.urandom(256 * 1024))
            latest, data = store.latest(R), store.read(R)
            fill_up(filler)
            assert free_bytes(disk) == 0

            with pytest.raises(Unavailable) as full:
                store.gc(keep=1, grace=0)
            message = str(full.value)
            assert "\n" not in message and "the disk is full" in message, message
            assert "gc removed nothing" in message and str(db) in message, message
            needed = re.search(r"free (\d+\.\d) MiB on the file system", message)
            assert needed is not None, message
            os.truncate(filler, _size(filler) - int(float(needed[1]) * MIB))

            assert store.gc(keep=1, grace=0) == 8
            assert free_bytes(disk) > 0 and _size(wal) <= WAL_LIMIT
            assert _size(db) < 2 * MIB  # one object of 256 KiB left
            assert store.latest(R) == latest and store.read(R) == data
            with pytest.raises(Unavailable, match="kept free so that gc can run"):
                store.put(token(1), "report", b"r", op_id="report-1")
            filler.unlink()
            assert store.put(token(1), "report", b"r", op_id="report-1").version == 1


def test_gc_writes_page_lists_not_bytes_and_a_reader_defers_handing_space_back(
    tmp_path: Path,
) -> None:
    """A new store is ``auto_vacuum=INCREMENTAL``. While a stream is open its snapshot keeps
    the WAL from being copied back, so every page gc writes stays in it: deleting 32 MiB
    grows the WAL by far less than the WAL limit (deleted pages are freed, not overwritten),
    and the free pages stay in the file. The stream reads on; once it is closed, the next gc
    hands them back to the file system."""
    db, wal = tmp_path / "store.db", tmp_path / "store.db-wal"
    with open_store(f"sqlite:///{db}") as store:
        assert _pragma(db, "auto_vacuum") == 2  # INCREMENTAL
        store.fence(token(1))
        for _ in range(5):
            store.publish(token(1), os.urandom(8 * MIB))
        data = store.read(R)
        with store.open(R) as stream:
            before = _size(wal)
            assert store.gc(keep=1, grace=0) == 4
            assert _size(wal) - before < WAL_LIMIT
            assert _pragma(db, "freelist_count") * 4096 >= 32 * MIB
            assert stream.read() == data
        assert store.gc(keep=1, grace=0) == 0
        assert _pragma(db, "freelist_count") == 0
        assert _size(db) < 9 * MIB and _size(wal) <= WAL_LIMIT
        assert store.read(R) == data


def test_a_store_made_without_auto_vacuum_reuses_the_pages_gc_frees(tmp_path: Path) -> None:
    """A store whose file was set up before fenced made stores ``auto_vacuum=INCREMENTAL`` (here:
    an empty WAL database) works as any other; gc frees its pages for reuse, so publishing
    again does not grow the file."""
    db = tmp_path / "store.db"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")  # writes the first page: auto_vacuum is NONE now
    conn.close()
    with open_store(f"sqlite:///{db}") as store:
        assert _pragma(db, "auto_vacuum") == 0
        store.fence(token(1))
        for _ in range(3):
            store.publish(token(1), os.urandom(2 * MIB))
        assert store.gc(keep=1, grace=0) == 2
        assert _pragma(db, "freelist_count") * 4096 >= 4 * MIB
        size = _size(db)
        data = os.urandom(2 * MIB)
        store.publish(token(1), data)
        assert store.read(R) == data
        assert _size(db) <= size

"""Disk space of the ``sqlite:`` store: the free-space reserve of writes that add data, the WAL's
size limit, and gc, which frees space and hands it back to the file system.

* **Reserve**: a write that adds data (a value, an object's chunk) first asks :class:`Room`
  whether the file system keeps :data:`RESERVE` free beside twice its size and the WAL; if not,
  it fails with :class:`Unavailable` before anything is written. The store therefore never
  fills a disk past what gc needs to free it. A file system that cannot be asked refuses
  nothing.
* **WAL**: truncated to :data:`WAL_LIMIT` when it restarts (the store's connections set it as
  ``journal_size_limit``).
* **gc** (:func:`collect_garbage`): deletes in small transactions, then, in an
  ``auto_vacuum=INCREMENTAL`` store, hands the free pages back to the file system in steps of
  :data:`_RECLAIM_STEP`, with a checkpoint after each. It is not one atomic step: failing part
  way, it leaves what it deleted deleted and every other object as it was, and its
  :class:`Unavailable` says how many objects it removed and, on a full disk, how much space to
  free before it can run again. Handing pages back is best effort: a failure is logged.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import time

from fenced._drivers.sqlite import error_code, rollback, translate
from fenced.core._errors import FencedError, Unavailable
from fenced.fence._rules import StoredObject
from fenced.fence.backend import Chooser

__all__ = ["RESERVE", "WAL_LIMIT", "Room", "collect_garbage"]

log = logging.getLogger("fenced.store")

_MIB = 1024 * 1024
RESERVE = 8 * _MIB
"""Bytes a write that adds data leaves free on the store's file system, beyond twice its own
size and the WAL: what gc needs to checkpoint the WAL and free space on a disk the store filled."""
WAL_LIMIT = 4 * _MIB
"""``journal_size_limit``: the WAL is truncated to this size (at most) when it restarts."""
_ROOM_FOR = 1.0
"""Seconds an answer of the file system's free space is used for (see :meth:`Room.check`)."""
_INCREMENTAL = 2
"""``PRAGMA auto_vacuum`` of a store whose free pages gc can hand back (``INCREMENTAL``)."""
_DELETE_BATCH = 16
"""Chunk rows (1 MiB each) gc deletes per transaction."""
_RECLAIM_STEP = 256
"""Free pages gc hands back to the file system per transaction (``incremental_vacuum``): each
may move one page of live data into a hole, so a step writes about this many pages to the WAL."""
_FORGET_OBJECT = (
    "DELETE FROM objects WHERE object_id = ? AND object_id NOT IN (SELECT object_id FROM pointers)"
)
_DELETE_CHUNKS = (
    "DELETE FROM chunks WHERE rowid IN (SELECT rowid FROM chunks WHERE object_id = :id LIMIT :n)"
    " AND NOT EXISTS (SELECT 1 FROM objects WHERE object_id = :id)"
)
_DEBRIS = (
    "SELECT DISTINCT object_id FROM chunks WHERE object_id NOT IN (SELECT object_id FROM objects)"
)


def _mib(size: int) -> str:
    """``size`` for a message: MiB with one decimal, or KiB below 1 MiB."""
    return f"{size / _MIB:.1f} MiB" if size >= _MIB else f"{size / 1024:.1f} KiB"


class Room:
    """The free-space check of the writes that add data (see :meth:`check`)."""

    __slots__ = ("_budget", "_path", "_until")

    def __init__(self, path: str) -> None:
        self._path = path
        self._budget = 0
        self._until = 0.0

    def forget(self) -> None:
        """Ask the file system at the next write (gc changed what it would answer)."""
        self._budget = 0

    def check(self, size: int, what: str) -> None:
        """Refuse (:class:`Unavailable`, before anything is written) a write of ``size`` bytes
        that would leave less than :data:`RESERVE` free on the database's file system, counting
        twice ``size`` (the WAL, then the database) and the WAL's present size (what a
        checkpoint may still copy). A file system that cannot be asked refuses nothing.

        The file system is asked again once this process's writes since the last answer may
        have used an eighth of the room that answer left above the need (other processes may
        write too), or a second after it: rarely while the disk has room, at every write near
        the reserve.
        """
        cost = 2 * size
        if cost < self._budget and time.monotonic() < self._until:
            self._budget -= cost
            return
        try:
            fs = os.statvfs(self._path)
            try:
                wal = os.stat(f"{self._path}-wal").st_size
            except FileNotFoundError:
                wal = 0
        except OSError:
            return
        free = fs.f_bavail * fs.f_frsize
        needed = cost + wal + RESERVE
        if free < needed:
            self._budget = 0
            raise Unavailable(
                f"{what}: only {_mib(free)} free on the file system of {self._path}, which "
                f"needs {_mib(needed)} (twice the {_mib(size)} written, its {_mib(wal)} "
                f"write-ahead log and the {_mib(RESERVE)} kept free so that gc can run); "
                "nothing was changed: run gc or free space, then retry"
            )
        self._budget, self._until = (free - needed) // 8, time.monotonic() + _ROOM_FOR


def collect_garbage(conn: sqlite3.Connection, path: str, choose: Chooser, cutoff: float) -> int:
    """Remove the objects ``choose`` picks and the chunks of objects never sealed (staged
    before ``cutoff``) from the database at ``path`` (``conn``: this thread's connection); then
    hand the free pages back to the file system. Returns how many objects it removed.

    1. A checkpoint, so that the WAL restarts: gc's commits then reuse its space.
    2. Per resource, the victims are chosen in one read; each is deleted by transactions of
       its own: its ``objects`` row (unless a pointer names it) and :data:`_DELETE_BATCH`
       chunks, then the rest of its chunks in batches. Chunks without an ``objects`` row
       staged before ``cutoff`` (a killed publisher's) go the same way.
    3. A checkpoint, then (``auto_vacuum=INCREMENTAL``) steps of
       ``incremental_vacuum(``:data:`_RECLAIM_STEP` ``)`` each followed by a checkpoint,
       which truncates the file. While a reader's snapshot keeps a checkpoint from
       finishing (an open stream), the reclaim stops (or does not start): the free pages
       are reused by later writes, and the next gc hands back what is left. The reclaim is
       best effort (a failure is logged).

    Not one atomic step: failing part way, it leaves what it deleted deleted and every
    other object as it was, and its :class:`Unavailable` says how many objects it removed
    and, on a full disk, how much space to free before a gc can run again.
    """
    removed = 0
    try:
        _checkpoint(conn)
        resources = [row[0] for row in conn.execute("SELECT DISTINCT resource FROM objects")]
        for resource in resources:
            for object_id in _victims(conn, resource, choose):
                if _delete(conn, object_id, victim=True):
                    removed += 1
        for (object_id,) in conn.execute(_DEBRIS).fetchall():
            staged = conn.execute(
                "SELECT staged_at FROM chunks WHERE object_id = ? LIMIT 1", (object_id,)
            ).fetchone()
            if staged is not None and staged[0] < cutoff:
                _delete(conn, object_id, victim=False)
        copied = _checkpoint(conn)
    except sqlite3.Error as error:
        rollback(conn)
        raise _gc_failure(conn, path, error, removed) from error
    if copied:  # else a reader's snapshot holds the WAL: moving pages now would only grow it
        _reclaim(conn, path)
    return removed


def _victims(conn: sqlite3.Connection, resource: str, choose: Chooser) -> list[str]:
    """What ``choose`` picks among ``resource``'s objects, read in one snapshot."""
    conn.execute("BEGIN")
    try:
        objects = [
            StoredObject(
                object_id,
                idle_since=superseded_at or published_at or staged_at,
                name=name,
                epoch=epoch,
                published_at=published_at,
            )
            for object_id, staged_at, name, epoch, published_at, superseded_at in (
                conn.execute(
                    "SELECT object_id, staged_at, name, epoch, published_at, superseded_at"
                    " FROM objects WHERE resource = ?",
                    (resource,),
                )
            )
        ]
        current = {
            row[0]
            for row in conn.execute(
                "SELECT object_id FROM pointers WHERE resource = ?", (resource,)
            )
        }
    finally:
        rollback(conn)
    return list(choose(objects, current))


def _delete(conn: sqlite3.Connection, object_id: str, *, victim: bool) -> bool:
    """Delete an object (``victim``: its row first, unless a pointer names it; else the
    chunks of one that has no row), :data:`_DELETE_BATCH` chunks per transaction. A batch
    deletes nothing of an object that has a row: a publisher may seal it meanwhile.
    Returns False if the victim was a pointer target (then nothing is deleted)."""
    first = victim
    while True:
        conn.execute("BEGIN IMMEDIATE")
        if first and not conn.execute(_FORGET_OBJECT, (object_id,)).rowcount:
            conn.execute("ROLLBACK")
            return False
        first = False
        deleted = conn.execute(_DELETE_CHUNKS, {"id": object_id, "n": _DELETE_BATCH}).rowcount
        conn.execute("COMMIT")
        if deleted < _DELETE_BATCH:
            return True


def _checkpoint(conn: sqlite3.Connection) -> bool:
    """A passive checkpoint (it never waits); True if it copied the whole WAL, so that the
    next write restarts it from the beginning."""
    busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return bool(busy == 0 and frames == copied)


def _reclaim(conn: sqlite3.Connection, path: str) -> None:
    """Hand the free pages back to the file system, in steps (see :func:`collect_garbage`)."""
    try:
        if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != _INCREMENTAL:
            return  # a store made before fenced set it: its free pages are reused instead
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        for _ in range(math.ceil(free / _RECLAIM_STEP)):
            # executescript steps the pragma to the end (execute would free one page)
            conn.executescript(f"PRAGMA incremental_vacuum({_RECLAIM_STEP})")
            if not _checkpoint(conn):
                break  # a reader holds the WAL: later writes reuse the rest, or the next gc
    except sqlite3.Error as error:
        rollback(conn)
        log.warning("gc of %s: free pages not handed back to the file system: %s", path, error)


def _gc_failure(
    conn: sqlite3.Connection, path: str, error: sqlite3.Error, removed: int
) -> FencedError:
    """The error of a gc stopped by ``error`` after it removed ``removed`` objects."""
    done = (
        f"gc removed {removed} unreferenced objects before it stopped (the store is "
        "consistent: every other object is as it was)"
        if removed
        else "gc removed nothing"
    )
    if error_code(error) == sqlite3.SQLITE_FULL:
        return Unavailable(
            f"collecting garbage: the disk is full ({error}); {done}; free "
            f"{_mib(_checkpoint_needs(conn, path))} on the file system of {path} (what "
            "its write-ahead log needs to be copied into the database) and run gc again"
        )
    failure = translate(error, "collecting garbage", where=path)
    if not isinstance(failure, Unavailable):
        return failure
    return Unavailable(f"collecting garbage: the database failed ({error}); {done}; run gc again")


def _checkpoint_needs(conn: sqlite3.Connection, path: str) -> int:
    """About what a checkpoint must add to the database file (the pages the WAL holds
    beyond its end), plus 1 MiB for gc's own commits."""
    try:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        grows = int(pages) * int(page_size) - os.path.getsize(path)
    except (sqlite3.Error, OSError):
        grows = 0
    return max(grows, 0) + _MIB

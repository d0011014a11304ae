"""One SQLite connection shared by the threads of a process: the driver boundary.

:class:`Database` runs the three kinds of step the embedded backend needs, each under one lock
and with every ``sqlite3`` error translated into a fenced error (``raise … from``):

- :meth:`Database.read` — autocommit SELECTs (in WAL mode readers never wait for writers);
- :meth:`Database.write` — one data-changing statement in autocommit mode: SQLite wraps it in
  its own write transaction, so it is atomic and costs no ``BEGIN``/``COMMIT`` round trips;
- :meth:`Database.transaction` — ``BEGIN IMMEDIATE`` … ``COMMIT`` for several statements.

Durability: the connection runs at ``synchronous=NORMAL``, so a commit is written to the OS at
once (it survives the death of any process; only an OS crash or power cut can lose it) but not
fsynced. Durable steps come in two kinds:

- :meth:`Database.write` with ``durable=True`` (the uncontended grant: one autocommit statement
  whose result only its caller receives) ``fdatasync``-s the WAL right after the commit, before
  it returns: what ``synchronous=FULL`` does inside the commit, done just after it (SQLite
  refuses to change ``synchronous`` inside a transaction, so a connection at FULL would need two
  ``PRAGMA synchronous`` statements around every non-durable step). The commit is then visible
  to other connections before it is durable, between the commit and the ``fdatasync``. Nothing
  can act on it in between in a way that outlives a power cut without it: only the caller gets
  the token, after the fsync; a release of that lease (the only way to hand it on) comes after
  that; and any durable step of any process fsyncs the same WAL, which holds this commit too (a
  checkpoint fsyncs the WAL before it copies it, and the database file before the WAL is
  written from the start again). A reader may see the grant in that window (``current()``, an
  observer); if the power fails before the fsync, the grant is gone and its epoch may be granted
  after the reboot, to one caller only: the first never received it. If the fsync fails the
  step raises :class:`~fenced.OutcomeUnknown` (the commit is visible but may not survive a power
  cut); the next durable step fsyncs the WAL again.
- :meth:`Database.transaction` with ``durable=True`` (grants to a waiter, epoch reservations on
  whose strength others hand out tokens without an fsync, restores) runs at ``synchronous=FULL``
  for that transaction: SQLite fsyncs the WAL before it publishes the commit, so nobody sees it
  before it is durable. These are off the uncontended path.

The WAL is opened once per connection and the file descriptor kept: it is the file SQLite writes
to as long as this connection is open (SQLite deletes or replaces the WAL only when the last
connection closes).

Waiting for the write lock: SQLite's own busy handler sleeps 1, 2, 5, 10 … ms between attempts,
which would turn a 0.3 ms wait behind another process's commit into milliseconds and let the
process that just released win again and again. Writers here retry ``BEGIN IMMEDIATE`` (or the
autocommit statement) themselves after sleeps of 50 µs doubling up to 1 ms, for at most
:data:`~.schema.BUSY_TIMEOUT` seconds.

Errors: the write lock held by another process for longer than the busy timeout →
:class:`~fenced.Unavailable`; a failure while committing a write (or anywhere in an autocommit
write) → :class:`~fenced.OutcomeUnknown`; an unusable file → :class:`~fenced.ConfigurationError`.

The write-ahead log is kept allocated (:meth:`Database._preallocate_wal`): SQLite appends to the
WAL until a checkpoint (every ~1000 pages), then writes it again from the start. While it grows,
every fsync also commits the file's new size to the file system journal, which makes a commit
slower than the same bytes written in place. SQLite deletes
the WAL when the last connection closes, so every restart would pay that again for ~1000 pages;
before its first durable commit each connection extends a short WAL with zeros instead (once,
~1 MiB). Zeros past the last frame are not a frame (their checksum and salt do not match) and
are never read; they are written under the WAL's write lock (``BEGIN IMMEDIATE``), beyond the
current end of the file, where no frame of anyone can be.

After ``fork()`` the child opens its own connection on first use (and gets a new lock: another
thread of the parent may have held the old one); the inherited connection is parked, never used
or closed in the child, as SQLite requires.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

from fenced._drivers.sqlite import commit, retrying, rollback, translate
from fenced.coordinator.backends.sqlite._schema import (
    BUSY_TIMEOUT,
    connect,
    is_exclusive,
    open_database,
)
from fenced.core._errors import ConfigurationError, OutcomeUnknown, Unavailable

__all__ = ["Database"]

T = TypeVar("T")

# Connections inherited through fork(): kept referenced so that the child never finalises them.
_inherited: list[sqlite3.Connection] = []
_fork_generation = 0
_WAL_HEADER = 32
_WAL_FRAME_HEADER = 24
_WAL_FRAMES = 1100  # SQLite checkpoints (and restarts the WAL) after 1000 pages, plus slack


def _after_fork_in_child() -> None:
    global _fork_generation  # noqa: PLW0603 - a process-wide fact, bumped once per fork
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


class Database:
    """The fenced database at ``path``: created, checked and migrated when constructed
    (``create=False``: an existing one only, see :func:`~.schema.open_database`; on a full file
    system it is then read through a connection per read, and every write raises
    :class:`~fenced.Unavailable`).

    ``coordinator_id`` is the database's coordinator id. Thread-safe. Raises
    :class:`~fenced.ConfigurationError` for an unusable file, and for a missing or empty one
    where its marker says a database lived (see :func:`~.schema.open_database`).
    """

    def __init__(
        self,
        path: Path,
        coordinator_id_for_new: str | None = None,
        *,
        marker: bool = True,
        create: bool = True,
    ) -> None:
        self.path = path
        conn, self.coordinator_id = open_database(
            path, coordinator_id_for_new, marker=marker, create=create
        )
        # A reader on a full file system got a connection in exclusive locking mode (see
        # schema.connect): it would lock every other process out while open. It is closed at
        # once; each read opens its own (the lock is held for that read only) and writes fail.
        self._snapshots = is_exclusive(conn)
        if self._snapshots:
            conn.close()
        self._conn: sqlite3.Connection | None = None if self._snapshots else _tuned(conn)
        self._lock = threading.Lock()
        self._generation = _fork_generation
        self._wal_ready = False
        self._wal_fd: int | None = None  # the WAL, for the fdatasync of durable steps

    def _connection(self) -> sqlite3.Connection:
        """The connection of this process; call with the lock held."""
        if self._conn is None:
            raise ConfigurationError(f"the fenced database {self.path} is closed")
        return self._conn

    def _check_fork(self) -> None:
        if self._generation != _fork_generation:
            self._lock = threading.Lock()
            self._generation = _fork_generation
            if self._conn is not None:
                _inherited.append(self._conn)
                self._conn = None
                self._conn = _tuned(connect(self.path))
                self._wal_ready = False
            self._close_wal()  # the parent's: this process opens its own

    def read(
        self, sql: str, params: dict[str, object] | tuple[object, ...], doing: str
    ) -> list[Any]:
        """Run one SELECT and return its rows."""
        self._check_fork()
        with self._lock:
            try:
                if self._snapshots:
                    return _read_once(self.path, sql, params)
                return self._connection().execute(sql, params).fetchall()
            except sqlite3.Error as error:
                raise translate(error, doing, where=str(self.path)) from error

    def _writable(self, doing: str) -> None:
        """Refuse a write on a database opened for reads on a full file system (call with the
        lock held)."""
        if self._snapshots:
            raise Unavailable(
                f"{doing}: {self.path} is open for reads only, its file system being full (no "
                "room for SQLite's shared memory); nothing was changed"
            )

    @contextmanager
    def _writing(self, doing: str) -> Iterator[sqlite3.Connection]:
        """This process's connection, under the lock, for a write (refused while the database
        is open for reads only)."""
        self._check_fork()
        with self._lock:
            self._writable(doing)
            yield self._connection()

    def write(self, sql: str, params: dict[str, object], doing: str, *, durable: bool) -> list[Any]:
        """Run one data-changing statement as its own transaction; return its RETURNING rows.

        All rows are fetched, so the statement completes and commits before this returns.
        ``durable``: the WAL is fdatasync-ed after the commit, before this returns; the commit
        may be seen by others just before (see the module doc: for a step whose result only
        the caller receives).
        """
        with self._writing(doing) as conn:
            try:
                if durable:
                    self._preallocate_wal(conn)
                rows = retrying(_run, conn, sql, params, timeout=BUSY_TIMEOUT)
            except sqlite3.Error as error:
                raise translate(error, doing, where=str(self.path), committing=True) from error
            if durable:
                self._sync_wal(doing)
            return rows

    @contextmanager
    def transaction(self, doing: str, *, durable: bool) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` under the lock; yields the connection.

        ``durable``: the commit is durable before any other connection can see it
        (``synchronous=FULL`` for this transaction; see the module doc).

        A driver error before the commit rolls back (Unavailable / ConfigurationError); a failed
        commit is OutcomeUnknown. Any exception raised by the body rolls back and propagates.
        """
        with self._writing(doing) as conn:
            try:
                if durable:
                    self._preallocate_wal(conn)
                    conn.execute("PRAGMA synchronous=FULL")
                try:
                    retrying(conn.execute, "BEGIN IMMEDIATE", timeout=BUSY_TIMEOUT)
                    try:
                        yield conn
                    except BaseException:
                        rollback(conn)
                        raise
                    try:
                        commit(conn)
                    except sqlite3.Error as error:
                        raise translate(
                            error, doing, where=str(self.path), committing=True
                        ) from error
                finally:
                    if durable:
                        conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as error:
                raise translate(error, doing, where=str(self.path)) from error

    def _sync_wal(self, doing: str) -> None:
        """``fdatasync`` the WAL after a commit (call with the lock held): that commit, and every
        one before it, is durable when this returns. OutcomeUnknown if the fsync fails."""
        try:
            os.fdatasync(self._wal())
        except OSError as error:
            raise OutcomeUnknown(
                f"{doing}: the commit to {self.path} was written but its fsync failed "
                f"({error.strerror or error}); it may not survive a power cut"
            ) from error

    def _wal(self) -> int:
        """This connection's WAL, opened once (call with the lock held; OSError if it cannot)."""
        if self._wal_fd is None:
            self._wal_fd = os.open(f"{self.path}-wal", os.O_WRONLY | os.O_CLOEXEC)
        return self._wal_fd

    def _close_wal(self) -> None:
        fd, self._wal_fd = self._wal_fd, None
        if fd is not None:
            with suppress(OSError):
                os.close(fd)

    def _preallocate_wal(self, conn: sqlite3.Connection) -> None:
        """Once per connection, before its first durable commit: extend a WAL shorter than
        SQLite lets it grow with zeros and fsync it (see the module doc). Call with the lock
        held. Best effort: any failure leaves the WAL as it was and is not retried."""
        if self._wal_ready:
            return
        self._wal_ready = True
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        target = _WAL_HEADER + _WAL_FRAMES * (int(page_size) + _WAL_FRAME_HEADER)
        try:
            retrying(
                conn.execute, "BEGIN IMMEDIATE", timeout=BUSY_TIMEOUT
            )  # the WAL's write lock: nobody appends
        except sqlite3.Error:
            return
        try:
            wal = self._wal()
            size = os.fstat(wal).st_size
            if size < target:
                os.pwrite(wal, bytes(target - size), size)
                os.fdatasync(wal)
        except OSError:
            pass
        finally:
            rollback(conn)

    def close(self) -> None:
        """Close the connection (a connection inherited through fork is only dropped)."""
        with self._lock:
            self._close_wal()
            self._snapshots = False  # a later read finds it closed
            conn, self._conn = self._conn, None
            if conn is None:
                return
            if self._generation == _fork_generation:
                conn.close()
            else:
                _inherited.append(conn)


def _tuned(conn: sqlite3.Connection) -> sqlite3.Connection:
    """Make lock waits fail at once with SQLITE_BUSY (:func:`retrying` waits instead), and
    commits skip the fsync (durable steps fsync the WAL themselves: see the module doc)."""
    conn.execute("PRAGMA busy_timeout=0")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def _read_once(path: Path, sql: str, params: dict[str, object] | tuple[object, ...]) -> list[Any]:
    """One SELECT on a connection of its own (a reader's on a full file system)."""
    conn = connect(path, create=False)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _run(conn: sqlite3.Connection, sql: str, params: dict[str, object]) -> list[Any]:
    return conn.execute(sql, params).fetchall()

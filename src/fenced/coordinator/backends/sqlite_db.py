"""One SQLite connection shared by the threads of a process: the driver boundary.

:class:`Database` runs the three kinds of step the embedded backend needs, each under one lock
and with every ``sqlite3`` error translated into a fenced error (``raise … from``):

- :meth:`Database.read` — autocommit SELECTs (in WAL mode readers never wait for writers);
- :meth:`Database.write` — one data-changing statement in autocommit mode: SQLite wraps it in
  its own write transaction, so it is atomic and costs no ``BEGIN``/``COMMIT`` round trips;
- :meth:`Database.transaction` — ``BEGIN IMMEDIATE`` … ``COMMIT`` for several statements.

``durable=True`` commits at ``synchronous=FULL`` (the WAL is fsynced before the call returns);
``durable=False`` at ``synchronous=NORMAL`` (written to the OS, fsynced by the next FULL commit;
only an OS crash or power cut can lose it). SQLite refuses to change ``synchronous`` inside a
transaction, so the choice is made per step, before it begins.

Waiting for the write lock: SQLite's own busy handler sleeps 1, 2, 5, 10 … ms between attempts,
which would turn a 0.3 ms wait behind another process's commit into milliseconds and let the
process that just released win again and again. Writers here retry ``BEGIN IMMEDIATE`` (or the
autocommit statement) themselves after sleeps of 50 µs doubling up to 1 ms, for at most
:data:`~.sqlite_schema.BUSY_TIMEOUT` seconds.

Errors: the write lock held by another process for longer than the busy timeout →
:class:`~fenced.Unavailable`; a failure while committing a write (or anywhere in an autocommit
write) → :class:`~fenced.OutcomeUnknown`; an unusable file → :class:`~fenced.ConfigurationError`.

The write-ahead log is kept allocated (:meth:`Database._preallocate_wal`): SQLite appends to the
WAL until a checkpoint (every ~1000 pages), then writes it again from the start. While it grows,
every fsync also commits the file's new size to the file system journal, which measured
550-620 µs per commit instead of 200-330 µs for the same bytes written in place. SQLite deletes
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

from fenced.coordinator.backends.sqlite_schema import (
    BUSY_TIMEOUT,
    connect,
    open_database,
    translate,
)
from fenced.core.errors import ConfigurationError
from fenced.fence.sqlite_busy import retrying

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
    """The fenced database at ``path``: created, checked and migrated when constructed.

    ``coordinator_id`` is the database's coordinator id. Thread-safe. Raises
    :class:`~fenced.ConfigurationError` for an unusable file.
    """

    def __init__(self, path: Path, coordinator_id_for_new: str | None = None) -> None:
        self.path = path
        conn, self.coordinator_id = open_database(path, coordinator_id_for_new)
        self._conn: sqlite3.Connection | None = _without_busy_handler(conn)
        self._lock = threading.Lock()
        self._generation = _fork_generation
        self._wal_ready = False

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
                self._conn = _without_busy_handler(connect(self.path))
                self._wal_ready = False

    def read(
        self, sql: str, params: dict[str, object] | tuple[object, ...], doing: str
    ) -> list[Any]:
        """Run one SELECT and return its rows."""
        self._check_fork()
        with self._lock:
            try:
                return self._connection().execute(sql, params).fetchall()
            except sqlite3.Error as error:
                raise translate(error, self.path, doing) from error

    def write(self, sql: str, params: dict[str, object], doing: str, *, durable: bool) -> list[Any]:
        """Run one data-changing statement as its own transaction; return its RETURNING rows.

        All rows are fetched, so the statement completes and commits before this returns.
        """
        self._check_fork()
        with self._lock:
            conn = self._connection()
            try:
                if durable:
                    self._preallocate_wal(conn)
                    return retrying(_run, conn, sql, params, timeout=BUSY_TIMEOUT)
                conn.execute("PRAGMA synchronous=NORMAL")
                try:
                    return retrying(_run, conn, sql, params, timeout=BUSY_TIMEOUT)
                finally:
                    conn.execute("PRAGMA synchronous=FULL")
            except sqlite3.Error as error:
                raise translate(error, self.path, doing, committing=True) from error

    @contextmanager
    def transaction(self, doing: str, *, durable: bool) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT`` under the lock; yields the connection.

        A driver error before the commit rolls back (Unavailable / ConfigurationError); a failed
        commit is OutcomeUnknown. Any exception raised by the body rolls back and propagates.
        """
        self._check_fork()
        with self._lock:
            conn = self._connection()
            try:
                if durable:
                    self._preallocate_wal(conn)
                else:
                    conn.execute("PRAGMA synchronous=NORMAL")
                try:
                    retrying(conn.execute, "BEGIN IMMEDIATE", timeout=BUSY_TIMEOUT)
                    try:
                        yield conn
                    except BaseException:
                        _rollback_quietly(conn)
                        raise
                    try:
                        conn.execute("COMMIT")
                    except sqlite3.Error as error:
                        _rollback_quietly(conn)
                        raise translate(error, self.path, doing, committing=True) from error
                finally:
                    if not durable:
                        conn.execute("PRAGMA synchronous=FULL")
            except sqlite3.Error as error:
                raise translate(error, self.path, doing) from error

    def _preallocate_wal(self, conn: sqlite3.Connection) -> None:
        """Once per connection, before its first durable commit: extend a WAL shorter than
        SQLite lets it grow with zeros and fsync it (see the module doc). Call with the lock
        held. Best effort: any failure leaves the WAL as it was and is not retried."""
        if self._wal_ready:
            return
        self._wal_ready = True
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        target = _WAL_HEADER + _WAL_FRAMES * (int(page_size) + _WAL_FRAME_HEADER)
        wal = f"{self.path}-wal"
        try:
            retrying(
                conn.execute, "BEGIN IMMEDIATE", timeout=BUSY_TIMEOUT
            )  # the WAL's write lock: nobody appends
        except sqlite3.Error:
            return
        try:
            fd = os.open(wal, os.O_WRONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if size < target:
                    os.pwrite(fd, bytes(target - size), size)
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
        finally:
            _rollback_quietly(conn)

    def close(self) -> None:
        """Close the connection (a connection inherited through fork is only dropped)."""
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            if self._generation == _fork_generation:
                conn.close()
            else:
                _inherited.append(conn)


def _without_busy_handler(conn: sqlite3.Connection) -> sqlite3.Connection:
    """Make lock waits fail at once with SQLITE_BUSY: :func:`retrying` waits instead."""
    conn.execute("PRAGMA busy_timeout=0")
    return conn


def _run(conn: sqlite3.Connection, sql: str, params: dict[str, object]) -> list[Any]:
    return conn.execute(sql, params).fetchall()


def _rollback_quietly(conn: sqlite3.Connection) -> None:
    if conn.in_transaction:
        with suppress(sqlite3.Error):
            conn.execute("ROLLBACK")

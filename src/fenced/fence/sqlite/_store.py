"""The ``sqlite:`` store backend: one SQLite database, WAL, ``synchronous=FULL``.

* **Critical section**: one ``BEGIN IMMEDIATE`` write transaction per mutation. It takes the
  database's write lock, so the checks and the change are atomic across threads and processes;
  a writer waits up to ``busy_timeout`` for another one, then gets :class:`Unavailable` (nothing
  happened). A failed ``COMMIT`` is :class:`OutcomeUnknown`.
* **Durability**: WAL with ``synchronous=FULL``: a commit is on disk when it returns.
* **Objects**: staged as 1 MiB chunk rows, each in its own short transaction (a slow or huge
  publish never holds the write lock for long), then sealed by inserting the ``objects`` row in
  a final transaction that first checks that every chunk is present. An object row therefore
  exists only for a complete object; chunks of a killed publisher are debris for ``gc``.
* **Snapshot reads**: :meth:`SqliteBackend.open_current` reads the pointer and the chunks in one
  read transaction of a connection of its own, so the stream is unaffected by later
  publications or gc until it is closed. Close the stream: an open read transaction keeps the
  WAL from being checkpointed past it.
* **Records** (:attr:`Capability.RECORDS`): the ``records`` table. Installs and accepted
  mutations are inserted in the mutation's own transaction; a rejection is inserted by a small
  transaction of its own committed at ``synchronous=NORMAL`` (no fsync: the next durable commit
  syncs it; a power failure may lose it, a process crash cannot). ``seq`` is one sequence for the
  whole store, never reused after pruning: it is the rowid (``max(seq) + 1`` for a new row) and
  pruning never deletes the store's newest record (no ``AUTOINCREMENT``, whose
  ``sqlite_sequence`` row would be one more page in every commit).
* **Schema**: versioned in the ``meta`` table (``format``, ``schema_version``, ``mode``), with a
  list of migrations from the first version on. A database that is not a fenced store, a newer
  schema, a corrupt or unwritable file is a :class:`ConfigurationError`.
* **Threads and processes**: one connection per thread (and per process after a fork).
* **Disk space**: deleted pages are freed, not overwritten (``secure_delete=FAST``: SQLite zeroes
  only what it rewrites anyway), so deleting an object writes a few pages per MiB, not its bytes.
  A new store is ``auto_vacuum=INCREMENTAL``. The WAL's size limit, the free-space reserve of
  writes that add data (:class:`Unavailable` if it is short, nothing changed) and gc are in
  :mod:`fenced.fence.sqlite._space`.
* **Files**: a new database is ``0600`` whatever the umask (``0660`` in a shared directory: see
  :mod:`fenced._drivers.permissions`); SQLite gives its ``-wal`` and ``-shm`` the same mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import BinaryIO, cast

from fenced._drivers.local import check_database_file
from fenced._drivers.permissions import create_missing, new_file_mode
from fenced._drivers.sqlite import retrying, rollback, translate
from fenced.core._errors import ConfigurationError, CorruptData, Rejected, Unavailable
from fenced.core._records import Record, RecordKind, detail_json
from fenced.core._token import FencingToken
from fenced.core._urls import url_of_path
from fenced.fence._chunks import ChunkReader
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head, admit_mutation, next_version, resolve_mode
from fenced.fence._translated import Translated
from fenced.fence._values import Item, Mode, Publication, Version
from fenced.fence.backend import ORDINARY, Capability, Chooser, FastPath, Intent, StoreOptions
from fenced.fence.sqlite._ending import commit
from fenced.fence.sqlite._space import WAL_LIMIT, Room, collect_garbage

__all__ = ["SCHEMA_VERSION", "SqliteBackend", "open_sqlite_backend"]

FORMAT = "fenced.sqlite-store"

_SCHEMA_1 = (
    "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE domains(resource TEXT PRIMARY KEY, coordinator_id TEXT NOT NULL,"
    " floor INTEGER NOT NULL)",
    "CREATE TABLE items(resource TEXT NOT NULL, key TEXT NOT NULL, value BLOB NOT NULL,"
    " epoch INTEGER NOT NULL, version INTEGER NOT NULL, PRIMARY KEY(resource, key))",
    "CREATE TABLE pointers(resource TEXT NOT NULL, name TEXT NOT NULL, object_id TEXT NOT NULL,"
    " epoch INTEGER NOT NULL, sha256 TEXT NOT NULL, size INTEGER NOT NULL,"
    " published_at REAL NOT NULL, PRIMARY KEY(resource, name))",
    "CREATE TABLE objects(object_id TEXT PRIMARY KEY, resource TEXT NOT NULL,"
    " chunks INTEGER NOT NULL, size INTEGER NOT NULL, staged_at REAL NOT NULL,"
    " name TEXT, epoch INTEGER, published_at REAL, superseded_at REAL)",
    "CREATE INDEX objects_by_resource ON objects(resource)",
    "CREATE TABLE chunks(object_id TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL,"
    " staged_at REAL NOT NULL, PRIMARY KEY(object_id, seq))",
    "CREATE TABLE ops(resource TEXT NOT NULL, op_id TEXT NOT NULL, digest TEXT NOT NULL,"
    " outcome TEXT NOT NULL, recorded_at REAL NOT NULL, PRIMARY KEY(resource, op_id))",
    "CREATE INDEX ops_by_age ON ops(resource, recorded_at)",
)
_SCHEMA_2 = (
    "CREATE TABLE records(seq INTEGER PRIMARY KEY AUTOINCREMENT, resource TEXT NOT NULL,"
    " at REAL NOT NULL, kind TEXT NOT NULL, epoch INTEGER NOT NULL, detail TEXT NOT NULL)",
    "CREATE INDEX records_by_resource ON records(resource, seq)",
)
_SCHEMA_3 = (
    # ``records`` without AUTOINCREMENT: a put commits one page fewer (no ``sqlite_sequence``).
    # A new seq is max(seq) + 1, and pruning never deletes the store's newest record, so no seq
    # is ever handed out twice. Rebuilt in the migration's transaction: SQLite cannot drop
    # AUTOINCREMENT from a table in place.
    "CREATE TABLE records_v3(seq INTEGER PRIMARY KEY, resource TEXT NOT NULL,"
    " at REAL NOT NULL, kind TEXT NOT NULL, epoch INTEGER NOT NULL, detail TEXT NOT NULL)",
    "INSERT INTO records_v3(seq, resource, at, kind, epoch, detail)"
    " SELECT seq, resource, at, kind, epoch, detail FROM records",
    # If the newest records were pruned before (version 2 pruned any), sqlite_sequence holds a
    # seq above every row left: keep it as a placeholder row whose resource ('') no resource
    # can have, so that new seqs continue above it. Reads and pruning select one resource: none
    # ever sees it.
    "INSERT INTO records_v3(seq, resource, at, kind, epoch, detail)"
    " SELECT seq, '', 0, 'seq-high-water', 0, '{}' FROM sqlite_sequence"
    " WHERE name = 'records' AND seq > (SELECT coalesce(max(seq), 0) FROM records)",
    "DROP TABLE records",  # with its index and its sqlite_sequence row
    "ALTER TABLE records_v3 RENAME TO records",
    "CREATE INDEX records_by_resource ON records(resource, seq)",
)
MIGRATIONS: tuple[tuple[str, ...], ...] = (_SCHEMA_1, _SCHEMA_2, _SCHEMA_3)
"""``MIGRATIONS[n]`` brings a database from schema version n to n + 1 (0: empty database).
Append a step to change the schema; never edit a released one."""
SCHEMA_VERSION = len(MIGRATIONS)

_PRUNE_SLACK = 512
"""Records a resource may hold beyond ``record_limit`` before they are pruned (in a batch);
``history`` returns at most ``record_limit`` whatever is stored."""
_SEQ_RANGE = (
    "SELECT (SELECT min(seq) FROM records WHERE resource = :r),"
    " (SELECT max(seq) FROM records WHERE resource = :r)"
)
# Both prunes spare the store's newest record (``seq < max(seq)``, one b-tree descent): a new
# seq is max(seq) + 1, so deleting the newest record would let the next one reuse its seq.
_PRUNE_BY_COUNT = (
    "DELETE FROM records WHERE resource = :r AND seq <= (SELECT seq FROM records"
    " WHERE resource = :r ORDER BY seq DESC LIMIT 1 OFFSET :keep)"
    " AND seq < (SELECT max(seq) FROM records)"
)
_PRUNE_BY_AGE = (
    "DELETE FROM records WHERE resource = :r AND seq < coalesce((SELECT seq FROM records"
    " WHERE resource = :r AND at >= :before ORDER BY seq LIMIT 1), 9223372036854775807)"
    " AND seq < (SELECT max(seq) FROM records)"
)


_forks = 0
"""How many times this process's ancestry forked since this module was imported: a connection
opened at another count belongs to an ancestor."""


def _forked() -> None:
    global _forks  # noqa: PLW0603 - counts forks, in the child
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class _translated(Translated):
    """``with _translated(what):`` turns a sqlite3 error into the fenced error for ``what``."""

    __slots__ = ()
    catches = sqlite3.Error
    translate = staticmethod(translate)


class _Writing:
    """The context manager of one ``BEGIN IMMEDIATE`` transaction (see ``transaction``)."""

    __slots__ = ("_conn", "_key", "_resource", "_room")

    def __init__(
        self, conn: sqlite3.Connection, room: Room, resource: str, key: str | None
    ) -> None:
        self._conn = conn
        self._room = room
        self._resource = resource
        self._key = key

    def __enter__(self) -> _SqliteTransaction:
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as error:
            raise translate(error, f"writing {self._resource!r}") from error
        tx = _SqliteTransaction(self._conn, self._room, self._resource)
        if self._key is not None:  # the announced key: its version and the head in one read
            try:
                tx.prefetch(self._key)
            except BaseException as failure:
                self.__exit__(type(failure), failure, failure.__traceback__)
                raise
        return tx

    def __exit__(self, kind: object, error: BaseException | None, tb: object) -> None:
        if error is not None:
            rollback(self._conn)
            if isinstance(error, sqlite3.Error):
                raise translate(error, f"writing {self._resource!r}") from error
            return
        commit(self._conn, f"committing a write to {self._resource!r}")


def open_sqlite_backend(path: str, mode: Mode | None, options: StoreOptions) -> SqliteBackend:
    """Open (or create, unless ``options.create`` is False) the SQLite store at ``path``; see
    the module docstring."""
    if not options.create and not os.path.lexists(path):
        raise ConfigurationError(f"no fenced store at {path}: it does not exist")
    check_database_file(path, "the sqlite store", create=options.create, parents=False)
    if options.create:
        _create_database(path)
    backend = SqliteBackend(path, options)
    try:
        backend.initialise(mode)
    except BaseException:
        backend.close()
        raise
    return backend


def _create_database(path: str) -> None:
    """Create a missing database file empty, with the mode its directory gives (``0600``, or
    ``0660`` in a shared directory), before SQLite opens it with the umask's. A path that cannot
    be created is left to SQLite's open, which says why."""
    with contextlib.suppress(OSError):
        create_missing(path, new_file_mode(os.path.dirname(os.path.abspath(path))))


class SqliteBackend:
    """See the module docstring. Created by :func:`open_sqlite_backend`."""

    capabilities = frozenset(Capability)
    fast_paths = frozenset({FastPath.CURRENT_PUT})

    def __init__(self, path: str, options: StoreOptions) -> None:
        self.path = path
        self.url = url_of_path("sqlite", os.path.abspath(path))
        self.mode: Mode = "strict"
        self._busy_timeout = options.busy_timeout
        self._create = options.create
        self._room = Room(path)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[tuple[int, sqlite3.Connection]] = []

    def _connect(self) -> sqlite3.Connection:
        with _translated(f"opening the sqlite store {self.path!r}"):
            conn = sqlite3.connect(
                self.path,
                timeout=self._busy_timeout,
                isolation_level=None,
                check_same_thread=False,
            )
            try:
                conn.execute("PRAGMA synchronous=FULL")
                # gc frees pages without rewriting them, and the WAL shrinks back when it restarts
                conn.execute("PRAGMA secure_delete=FAST")
                conn.execute(f"PRAGMA journal_size_limit={WAL_LIMIT}")
            except BaseException:
                conn.close()
                raise
        return conn

    def _conn(self) -> sqlite3.Connection:
        """This thread's connection (a new one in a forked child: never share across fork)."""
        local = self._local
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        if conn is None or local.forks != _forks:  # opened before a fork: an ancestor's
            conn = self._connect()
            local.conn, local.forks = conn, _forks
            with self._lock:
                self._connections.append((os.getpid(), conn))
        return conn

    def initialise(self, requested: Mode | None) -> None:
        """Check the database is a fenced store (or empty), set WAL, create or migrate."""
        conn = self._conn()
        with _translated(f"opening the sqlite store {self.path!r}"):
            if not self._stored_meta(conn):  # refuse a foreign database before any change
                if not self._create:
                    raise ConfigurationError(
                        f"no fenced store at {self.path}: the database is not initialised"
                    )
                self._set_incremental(conn)
            # Switching a new file to WAL needs its exclusive lock, and SQLite answers
            # SQLITE_BUSY at once, without its busy handler, while another process opens the
            # same new file.
            (journal,) = retrying(
                conn.execute, "PRAGMA journal_mode=WAL", timeout=self._busy_timeout
            ).fetchone()
            if str(journal).lower() != "wal":
                raise ConfigurationError(f"{self.path!r}: cannot use WAL (got {journal})")
            conn.execute("BEGIN IMMEDIATE")
            try:
                self.mode = self._migrate(conn, requested)
            except BaseException:
                rollback(conn)
                raise
            conn.execute("COMMIT")

    def _set_incremental(self, conn: sqlite3.Connection) -> None:
        """Make a new (empty) database ``auto_vacuum=INCREMENTAL``, so that gc can hand the
        space it frees back to the file system. Decided when the first page is written (the
        switch to WAL writes it), so before. The pragma takes the write lock: while another
        process creates the same file it is retried like the switch to WAL (same timeout)."""
        conn.execute("PRAGMA busy_timeout=0")
        try:
            retrying(conn.execute, "PRAGMA auto_vacuum=INCREMENTAL", timeout=self._busy_timeout)
        finally:
            conn.execute(f"PRAGMA busy_timeout={round(self._busy_timeout * 1000)}")

    def _stored_meta(self, conn: sqlite3.Connection) -> dict[str, str]:
        """The ``meta`` rows ({} for an empty database); refuses a database of something else."""
        where = f"sqlite store {self.path!r}"
        tables = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if not tables:
            return {}
        if "meta" not in tables:
            raise ConfigurationError(f"{where} is a database but not a fenced store (no meta)")
        stored: dict[str, str] = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        if stored.get("format") != FORMAT:
            raise ConfigurationError(
                f"{where} is not a fenced store (format {stored.get('format')})"
            )
        return stored

    def _migrate(self, conn: sqlite3.Connection, requested: Mode | None) -> Mode:
        where = f"sqlite store {self.path!r}"
        stored = self._stored_meta(conn)
        try:
            version = int(stored.get("schema_version", "0"))
        except ValueError as error:
            raise ConfigurationError(f"{where} has a corrupt schema version") from error
        if version > SCHEMA_VERSION:
            raise ConfigurationError(
                f"{where} has schema version {version}, newer than this fenced understands "
                f"({SCHEMA_VERSION}): upgrade fenced"
            )
        mode = resolve_mode(stored.get("mode"), requested, where)
        if version == SCHEMA_VERSION:
            return mode
        for step in MIGRATIONS[version:]:
            for statement in step:
                conn.execute(statement)
        conn.executemany(
            "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
            [("format", FORMAT), ("schema_version", str(SCHEMA_VERSION)), ("mode", mode)],
        )
        return mode

    # -- the critical section --------------------------------------------------------------

    def transaction(
        self, resource: str, intent: Intent = ORDINARY
    ) -> AbstractContextManager[_SqliteTransaction]:
        """``BEGIN IMMEDIATE``; commits when the block ends, rolls back if it raises.

        ``intent.key``: read the head and that key's version at once (see ``prefetch``).
        """
        return _Writing(self._conn(), self._room, resource, intent.key)

    def put_current(
        self, token: FencingToken, key: str, value: bytes, detail: dict[str, object], now: float
    ) -> Version | None:
        """An unconditional ``put`` whose token changes nothing but the item; else None.

        :attr:`~fenced.fence.backend.FastPath.CURRENT_PUT` (``Store.put`` calls it for a put
        without ``op_id`` or ``if_version``): the usual put, by the holder whose epoch is installed,
        in one transaction with no step the general path would skip: the head and the key's
        version in one read, :func:`~fenced.fence._rules.admit_mutation` (the same rule), the
        item and its ``accepted`` record (``detail`` plus the new ``version``), committed with
        fsync. When the token would change the head (an implicit install) or is refused, this
        writes nothing and returns None: the caller takes the general path, which installs or
        rejects and records it. Errors are those of a write (:class:`Unavailable`,
        :class:`OutcomeUnknown` for a commit that may have happened).
        """
        resource = token.resource
        with self.transaction(resource, Intent(key=key)) as tx:
            head = tx.head()
            try:
                if admit_mutation(self.mode, head, token) != head:
                    return None  # an implicit install: the general path records it
            except Rejected:
                return None  # the general path raises it and records the rejection
            version = next_version(resource, key, tx.version_of(key), None)
            tx.put_item(Item(resource, key, value, token.epoch, version))
            accepted = {**detail, "version": version}
            tx.append_record(
                Record(0, now, RecordKind.ACCEPTED, resource, token.epoch, None, accepted)
            )
        return Version(resource, key, token.epoch, version)

    # -- records ---------------------------------------------------------------------------

    def record_rejection(self, record: Record) -> None:
        """Insert ``record`` in a transaction of its own, committed without fsync (NORMAL)."""
        conn = self._conn()
        with _translated(f"recording a rejection on {record.resource!r}"):
            conn.execute("PRAGMA synchronous=NORMAL")
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    _insert_record(conn, record)
                    conn.execute("COMMIT")
                except BaseException:
                    rollback(conn)
                    raise
            finally:
                conn.execute("PRAGMA synchronous=FULL")

    def history(self, resource: str, after: int, *, since: float, keep: int) -> list[Record]:
        with _translated(f"reading the records of {resource!r}"):
            rows = (
                self._conn()
                .execute(
                    "SELECT seq, at, kind, epoch, detail FROM records WHERE resource = :r"
                    " AND seq > :after AND at >= :since AND seq > coalesce((SELECT seq FROM"
                    " records WHERE resource = :r ORDER BY seq DESC LIMIT 1 OFFSET :keep), 0)"
                    " ORDER BY seq",
                    {"r": resource, "after": after, "since": since, "keep": keep},
                )
                .fetchall()
            )
        try:
            return [
                Record(seq, at, RecordKind(kind), resource, epoch, None, json.loads(detail))
                for seq, at, kind, epoch, detail in rows
            ]
        except ValueError as error:
            raise ConfigurationError(f"corrupt records of {resource!r} in {self.path!r}") from error

    def floors(self) -> dict[str, int]:
        with _translated("reading floors"):
            rows = self._conn().execute("SELECT resource, floor FROM domains").fetchall()
        return {str(resource): int(floor) for resource, floor in rows}

    # -- reads -----------------------------------------------------------------------------

    def head(self, resource: str) -> Head:
        with _translated(f"reading {resource!r}"):
            return _head(self._conn(), resource)

    def get(self, resource: str, key: str) -> Item | None:
        with _translated(f"reading {resource!r}"):
            row = (
                self._conn()
                .execute(
                    "SELECT value, epoch, version FROM items WHERE resource = ? AND key = ?",
                    (resource, key),
                )
                .fetchone()
            )
        return None if row is None else Item(resource, key, bytes(row[0]), row[1], row[2])

    def pointer(self, resource: str, name: str) -> Publication | None:
        with _translated(f"reading {resource!r}"):
            return _pointer(self._conn(), resource, name)

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        conn = self._connect()
        try:
            with _translated(f"reading {resource!r}"):
                conn.execute("BEGIN")
                publication = _pointer(conn, resource, name)
                row = None
                if publication is not None:
                    row = conn.execute(
                        "SELECT chunks FROM objects WHERE object_id = ?",
                        (publication.object_id,),
                    ).fetchone()
            if publication is None:
                conn.close()
                return None
            if row is None:
                raise CorruptData(
                    f"the pointer of {resource!r} names a missing object: the store is corrupt"
                )
        except BaseException:
            conn.close()
            raise
        reader = _ChunkReader(conn, publication.object_id, row[0])
        return publication, cast(BinaryIO, reader)

    # -- objects ---------------------------------------------------------------------------

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        conn = self._conn()
        count = size = 0
        last: bytes | None = None  # the last chunk goes into the sealing transaction

        def insert(seq: int, chunk: bytes) -> None:
            self._room.check(len(chunk), f"staging an object of {resource!r}")
            conn.execute(
                "INSERT INTO chunks(object_id, seq, data, staged_at) VALUES (?, ?, ?, ?)",
                (object_id, seq, chunk, now),
            )

        with _translated(f"staging an object of {resource!r}"):
            try:
                for chunk in chunks:
                    if last is not None:
                        insert(count - 1, last)
                    last, count, size = chunk, count + 1, size + len(chunk)
                conn.execute("BEGIN IMMEDIATE")
                if last is not None:
                    insert(count - 1, last)
                found = conn.execute(
                    "SELECT count(*), coalesce(sum(length(data)), 0) FROM chunks"
                    " WHERE object_id = ?",
                    (object_id,),
                ).fetchone()
                if tuple(found) != (count, size):
                    raise Unavailable(
                        f"object {object_id} lost chunks while it was staged (gc removed them "
                        "after a pause longer than the gc grace); nothing was published, retry"
                    )
                conn.execute(
                    "INSERT INTO objects(object_id, resource, chunks, size, staged_at)"
                    " VALUES (?, ?, ?, ?, ?)",
                    (object_id, resource, count, size, now),
                )
            except BaseException:
                rollback(conn)
                self.discard(resource, object_id)
                raise
        commit(conn, f"staging an object of {resource!r}")

    def discard(self, resource: str, object_id: str) -> None:
        conn = self._conn()
        try:
            conn.execute("BEGIN IMMEDIATE")
            _delete_object(conn, object_id)
            conn.execute("COMMIT")
        except sqlite3.Error:
            rollback(conn)  # best effort: gc removes it later

    def gc(self, choose: Chooser, cutoff: float) -> int:
        """Remove the objects ``choose`` picks and the chunks of objects never sealed (staged
        before ``cutoff``), then hand the free pages back to the file system: see
        :func:`~fenced.fence.sqlite._space.collect_garbage`."""
        conn = self._conn()
        self._room.forget()
        return collect_garbage(conn, self.path, choose, cutoff)

    def close(self) -> None:
        with self._lock:
            mine = [conn for pid, conn in self._connections if pid == os.getpid()]
            self._connections.clear()
        for conn in mine:
            conn.close()
        self._local = threading.local()


def _insert_record(conn: sqlite3.Connection, record: Record) -> None:
    conn.execute(
        "INSERT INTO records(resource, at, kind, epoch, detail) VALUES (?, ?, ?, ?, ?)",
        (
            record.resource,
            record.at,
            record.kind.value,
            record.epoch,
            detail_json(record.detail),
        ),
    )


def _delete_object(conn: sqlite3.Connection, object_id: str) -> None:
    conn.execute("DELETE FROM chunks WHERE object_id = ?", (object_id,))
    conn.execute("DELETE FROM objects WHERE object_id = ?", (object_id,))


def _head(conn: sqlite3.Connection, resource: str) -> Head:
    row = conn.execute(
        "SELECT coordinator_id, floor FROM domains WHERE resource = ?", (resource,)
    ).fetchone()
    return Head() if row is None else Head(row[0], row[1])


def _pointer(conn: sqlite3.Connection, resource: str, name: str) -> Publication | None:
    row = conn.execute(
        "SELECT epoch, object_id, sha256, size, published_at FROM pointers"
        " WHERE resource = ? AND name = ?",
        (resource, name),
    ).fetchone()
    return None if row is None else Publication(resource, name, *row)


class _SqliteTransaction:
    """The :class:`~fenced.fence.backend.Transaction` of one ``BEGIN IMMEDIATE`` transaction."""

    def __init__(self, conn: sqlite3.Connection, room: Room, resource: str) -> None:
        self._conn = conn
        self._room = room
        self._resource = resource
        self._head: Head | None = None
        self._versions: dict[str, int | None] = {}

    def prefetch(self, key: str) -> None:
        """Read the head and ``key``'s version in one statement (a put needs both).

        Called when the transaction opens for a mutation that announced ``key``. What it read is
        answered by :meth:`head` and :meth:`version_of`, and kept current by this
        transaction's own writes (nobody else can write: it holds the write lock).
        """
        coordinator, floor, version = self._conn.execute(
            "SELECT d.coordinator_id, d.floor, (SELECT version FROM items"
            " WHERE resource = ?1 AND key = ?2) FROM (SELECT 1) LEFT JOIN domains AS d"
            " ON d.resource = ?1",
            (self._resource, key),
        ).fetchone()
        self._head = Head() if coordinator is None else Head(coordinator, floor)
        self._versions[key] = None if version is None else int(version)

    def head(self) -> Head:
        if self._head is None:
            self._head = _head(self._conn, self._resource)
        return self._head

    def set_head(self, head: Head) -> None:
        self._head = head
        self._conn.execute(
            "INSERT INTO domains(resource, coordinator_id, floor) VALUES (?, ?, ?)"
            " ON CONFLICT(resource) DO UPDATE SET"
            " coordinator_id = excluded.coordinator_id, floor = excluded.floor",
            (self._resource, head.coordinator_id, head.floor),
        )

    def op(self, op_id: str) -> OpRecord | None:
        row = self._conn.execute(
            "SELECT digest, outcome, recorded_at FROM ops WHERE resource = ? AND op_id = ?",
            (self._resource, op_id),
        ).fetchone()
        return None if row is None else OpRecord(*row)

    def record_op(self, op_id: str, record: OpRecord) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO ops(resource, op_id, digest, outcome, recorded_at)"
            " VALUES (?, ?, ?, ?, ?)",
            (self._resource, op_id, record.digest, record.outcome, record.recorded_at),
        )

    def prune_ops(self, before: float) -> None:
        self._conn.execute(
            "DELETE FROM ops WHERE resource = ? AND recorded_at < ?", (self._resource, before)
        )

    def append_record(self, record: Record) -> None:
        _insert_record(self._conn, record)

    def prune_records(self, before: float, keep: int) -> None:
        """Two range deletes on ``records_by_resource`` (one ``OR`` would scan every record).

        By count, only once the resource may hold over ``keep`` + :data:`_PRUNE_SLACK` records
        (its range of ``seq`` says so without counting): finding the ``keep``-th newest walks
        that many index entries, so it is done in batches. By age, the oldest records up to
        the first one dated ``before`` or later go: a record that is older than a newer one
        before it (the clock went back) waits until that one expires too. Neither deletes the
        store's newest record, whatever its resource (its seq must stay the highest: see
        :data:`_SCHEMA_3`). All are deferrals the protocol allows; ``history`` applies both
        limits exactly whatever is stored.
        """
        params = {"r": self._resource, "before": before, "keep": keep}
        low, high = self._conn.execute(_SEQ_RANGE, params).fetchone()
        if low is not None and high - low + 1 > keep + _PRUNE_SLACK:  # else at most that many
            self._conn.execute(_PRUNE_BY_COUNT, params)  # walks `keep` index entries
        self._conn.execute(_PRUNE_BY_AGE, params)

    def version_of(self, key: str) -> int | None:
        if key in self._versions:
            return self._versions[key]
        row = self._conn.execute(
            "SELECT version FROM items WHERE resource = ? AND key = ?", (self._resource, key)
        ).fetchone()
        return None if row is None else int(row[0])

    def put_item(self, item: Item) -> None:
        self._room.check(len(item.value), f"writing {item.resource!r}")
        # an upsert changes the row in place; REPLACE would delete it and insert a new row,
        # rewriting the primary key's index entry too
        self._conn.execute(
            "INSERT INTO items(resource, key, value, epoch, version) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT(resource, key) DO UPDATE SET"
            " value = excluded.value, epoch = excluded.epoch, version = excluded.version",
            (item.resource, item.key, item.value, item.epoch, item.version),
        )
        self._versions[item.key] = item.version

    def pointer(self, name: str) -> Publication | None:
        return _pointer(self._conn, self._resource, name)

    def has_object(self, object_id: str) -> bool:
        row = self._conn.execute(
            "SELECT 1 FROM objects WHERE object_id = ? AND resource = ?",
            (object_id, self._resource),
        ).fetchone()
        return row is not None

    def set_pointer(self, publication: Publication, now: float) -> None:
        p = publication
        self._conn.execute(
            "UPDATE objects SET superseded_at = ? WHERE object_id ="
            " (SELECT object_id FROM pointers WHERE resource = ? AND name = ?)",
            (now, p.resource, p.name),
        )
        self._conn.execute(
            "INSERT OR REPLACE INTO pointers"
            "(resource, name, object_id, epoch, sha256, size, published_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (p.resource, p.name, p.object_id, p.epoch, p.sha256, p.size, p.published_at),
        )
        self._conn.execute(
            "UPDATE objects SET name = ?, epoch = ?, published_at = ? WHERE object_id = ?",
            (p.name, p.epoch, p.published_at, p.object_id),
        )


class _ChunkReader(ChunkReader):
    """A stream over one object's chunks, read inside its own connection's read transaction."""

    def __init__(self, conn: sqlite3.Connection, object_id: str, chunks: int) -> None:
        super().__init__(object_id, chunks)
        self._db = conn

    def _read_chunk(self, seq: int) -> bytes | None:
        with _translated(f"reading object {self._object_id}"):
            row = self._db.execute(
                "SELECT data FROM chunks WHERE object_id = ? AND seq = ?",
                (self._object_id, seq),
            ).fetchone()
        return None if row is None else bytes(row[0])

    def close(self) -> None:
        if not self.closed:
            rollback(self._db)
            self._db.close()
        super().close()

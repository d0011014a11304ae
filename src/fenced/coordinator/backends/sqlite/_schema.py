"""The embedded coordinator's database file: opening, its schema, and its version check.

``meta`` holds ``schema_version`` and the ``coordinator_id`` (32 lowercase hex digits, created
once when the file is initialised and kept forever); the SQLite header's ``application_id`` marks
the file as fenced's. :data:`MIGRATIONS` lists the schema steps in order (one today: the initial
format, version 1); :func:`open_database` applies the missing ones in one write transaction, so
a crash mid-initialisation leaves the file empty and re-initialisable, and concurrent openers
serialise on the write lock (exactly one of them initialises). A later format is a
:class:`~fenced._drivers.migrations.Migration` appended to :data:`MIGRATIONS`; a released one is
never edited.

Where the file lives — directory and file modes, and the marker that stops a coordinator from
being re-created silently where its database was — is :mod:`.files`.

Failure behaviour: a file that is not a database, a database that is not fenced's, a database
written by a newer fenced, a path that cannot be created or written, and a database that is
missing or empty where its marker says one lived all raise a one-line
:class:`~fenced.ConfigurationError` (driver errors are chained with ``raise … from``).
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

from fenced._drivers.migrations import Migration, checked_version
from fenced._drivers.sqlite import error_code, retrying, rollback, translate
from fenced.coordinator.backends.sqlite import _files as sqlite_files
from fenced.core._errors import ConfigurationError
from fenced.core._token import validate_coordinator_id

__all__ = [
    "APPLICATION_ID",
    "BUSY_TIMEOUT",
    "MIGRATIONS",
    "PAGE_SIZE",
    "RECOMPUTE_WATCHED",
    "SCHEMA_VERSION",
    "connect",
    "is_exclusive",
    "open_database",
]

APPLICATION_ID = 0x46454E43
"""``PRAGMA application_id`` of a fenced database ("FENC")."""
BUSY_TIMEOUT = 5.0
"""Seconds a statement waits for another process's write lock before :class:`Unavailable`."""
PAGE_SIZE = 1024
"""Page size of a new database (rows are small; smaller pages are fewer bytes per commit)."""


RECOMPUTE_WATCHED = (
    "UPDATE resources SET watched = "
    "EXISTS (SELECT 1 FROM watchers AS w WHERE w.name = resources.name)"
)
"""Set every resource's ``watched`` flag from the watchers table (see the backend module)."""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "resources with their lease, epoch reservation and watched flag; minimum epoch; "
        "request_id dedup; the queue with each waiter's grant request; watchers; records",
        (
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
            # One row per resource ever granted (or given a floor by a restore). ``epoch`` is the
            # last granted epoch: durable, never decreases. The lease columns describe the lease
            # *of that epoch*, live iff owner IS NOT NULL AND boot_id = the current boot AND
            # expires_at > boottime(). When it ends, ``ended`` says how ('released', 'expired',
            # 'restored'), ``ended_at`` when (wall clock), and ``end_recorded`` whether its
            # record exists yet (a release leaves that to the next grant or reader: no record
            # page in the release's commit).
            """CREATE TABLE resources (
                name TEXT PRIMARY KEY,
                epoch INTEGER NOT NULL CHECK (typeof(epoch) = 'integer' AND epoch > 0),
                owner TEXT,
                holder TEXT,
                ttl REAL,
                expires_at REAL,
                boot_id TEXT,
                value TEXT,
                granted_at REAL,
                ended TEXT,
                ended_at REAL,
                end_recorded INTEGER NOT NULL DEFAULT 1,
                -- Epochs reserved durably for hand-offs: every epoch up to ``reserved`` may have
                -- been granted by a commit without fsync during boot ``reserved_boot``. Another
                -- boot (the only way such a commit can be lost) grants above ``reserved``.
                reserved INTEGER NOT NULL DEFAULT 0,
                reserved_boot TEXT,
                -- Whether the resource has watchers (kept by the backend, see RECOMPUTE_WATCHED):
                -- a grant and a release read this column, not the watchers table.
                watched INTEGER NOT NULL DEFAULT 0
            ) WITHOUT ROWID""",
            # Coordinator-wide: every later grant of any resource gets an epoch above this
            # (raised by restores, never lowered).
            """CREATE TABLE minimum_epoch (
                id INTEGER PRIMARY KEY CHECK (id = 1),
                epoch INTEGER NOT NULL CHECK (typeof(epoch) = 'integer' AND epoch >= 0)
            )""",
            "INSERT INTO minimum_epoch (id, epoch) VALUES (1, 0)",
            # Grants made with a request_id, kept for a retention period (pruned oldest first).
            """CREATE TABLE requests (
                seq INTEGER PRIMARY KEY,
                request_id TEXT NOT NULL UNIQUE,
                name TEXT NOT NULL,
                epoch INTEGER NOT NULL,
                owner TEXT NOT NULL,
                holder TEXT NOT NULL,
                ttl REAL NOT NULL,
                created_wall REAL NOT NULL
            )""",
            # The waiting queue: id order is arrival order (AUTOINCREMENT: ids are never reused).
            """CREATE TABLE waiters (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                name TEXT NOT NULL,
                addr TEXT NOT NULL,
                netns TEXT NOT NULL,
                pid INTEGER NOT NULL,
                holder TEXT NOT NULL,
                expires_at REAL NOT NULL,
                boot_id TEXT NOT NULL,
                -- The waiter's grant request, so that a release can hand it the lease. NULL
                -- owner: a waiter that grants itself when woken (one with a request_id, whose
                -- grant must also be remembered in ``requests``).
                owner TEXT,
                ttl REAL,
                value TEXT
            )""",
            "CREATE INDEX waiters_by_name ON waiters (name, id)",
            # Processes blocked in watch(): woken after every record of their resource.
            """CREATE TABLE watchers (
                id INTEGER PRIMARY KEY,
                name TEXT NOT NULL,
                addr TEXT NOT NULL,
                netns TEXT NOT NULL,
                expires_at REAL NOT NULL,
                boot_id TEXT NOT NULL
            )""",
            "CREATE INDEX watchers_by_name ON watchers (name)",
            # Ownership records (docs/operations.md). seq only grows: rows are pruned oldest first,
            # never the newest, so a rowid is never reused. ``at`` is wall-clock time, for display.
            """CREATE TABLE records (
                seq INTEGER PRIMARY KEY,
                at REAL NOT NULL,
                kind TEXT NOT NULL,
                resource TEXT NOT NULL,
                epoch INTEGER NOT NULL,
                holder TEXT,
                detail TEXT NOT NULL
            )""",
            # No index on (resource, seq): it would add a b-tree insert and a WAL frame to every
            # grant. One resource's history is read by scanning from ``after``.
            # The records of grants and lease ends are written by the database itself, in the
            # statement that changes the lease: none can be forgotten by a code path.
            """CREATE TRIGGER record_first_grant AFTER INSERT ON resources
            WHEN NEW.owner IS NOT NULL
            BEGIN
                INSERT INTO records (at, kind, resource, epoch, holder, detail)
                VALUES (NEW.granted_at, 'granted', NEW.name, NEW.epoch, NEW.holder,
                        CASE WHEN NEW.value IS NULL THEN '{"after": "none"}'
                             ELSE json_object('after', 'none', 'value', NEW.value) END);
            END""",
            # A grant over an existing row: first the end of the previous lease if it is not
            # recorded yet (an unnoticed expiry, dated at the expiry instant: granted_at minus
            # the boottime elapsed since expires_at; or a pending release), then the grant.
            """CREATE TRIGGER record_grant AFTER UPDATE OF epoch ON resources
            WHEN NEW.owner IS NOT NULL
            BEGIN
                INSERT INTO records (at, kind, resource, epoch, holder, detail)
                SELECT CASE WHEN OLD.boot_id = NEW.boot_id
                            THEN NEW.granted_at
                                 - max(0.0, NEW.expires_at - NEW.ttl - OLD.expires_at)
                            ELSE NEW.granted_at END,
                       'expired', OLD.name, OLD.epoch, OLD.holder, '{}'
                WHERE OLD.owner IS NOT NULL;
                INSERT INTO records (at, kind, resource, epoch, holder, detail)
                SELECT OLD.ended_at, OLD.ended, OLD.name, OLD.epoch, OLD.holder, '{}'
                WHERE OLD.owner IS NULL AND NOT OLD.end_recorded;
                INSERT INTO records (at, kind, resource, epoch, holder, detail)
                VALUES (NEW.granted_at, 'granted', NEW.name, NEW.epoch, NEW.holder,
                        CASE WHEN NEW.value IS NULL
                             THEN json_object('after', CASE WHEN OLD.owner IS NOT NULL
                                                            THEN 'expired'
                                                            ELSE coalesce(OLD.ended, 'none') END)
                             ELSE json_object('after', CASE WHEN OLD.owner IS NOT NULL
                                                            THEN 'expired'
                                                            ELSE coalesce(OLD.ended, 'none') END,
                                              'value', NEW.value) END);
            END""",
            # A pending lease end (release, detected expiry) being recorded.
            """CREATE TRIGGER record_end AFTER UPDATE OF end_recorded ON resources
            WHEN NEW.owner IS NULL AND NOT OLD.end_recorded AND NEW.end_recorded
            BEGIN
                INSERT INTO records (at, kind, resource, epoch, holder, detail)
                VALUES (OLD.ended_at, OLD.ended, OLD.name, OLD.epoch, OLD.holder, '{}');
            END""",
        ),
    ),
)

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The newest schema this code knows."""


def connect(path: Path, *, create: bool = True) -> sqlite3.Connection:
    """Open a connection with fenced's settings: WAL, ``synchronous=FULL``, busy timeout.

    Autocommit mode (``isolation_level=None``): every write step issues its own
    ``BEGIN IMMEDIATE`` … ``COMMIT``. Usable from any thread; the caller serialises access.

    ``create=False`` (readers) never creates the file (SQLite's ``mode=rw``). On a full file
    system, where SQLite cannot size the ``-shm`` file (its shared-memory index of the WAL), such
    a connection falls back to exclusive locking mode, which keeps that index in its own memory
    and needs no room on disk; it then holds the database's lock from its first read until it
    is closed, so :class:`~.database.Database` opens one per read (see :func:`is_exclusive`).
    """
    try:
        return _open(path, create=create, exclusive=False)
    except sqlite3.Error as error:
        if create or (error_code(error) != sqlite3.SQLITE_FULL and not _shm_failed(error)):
            raise translate(error, "opening the database", where=str(path)) from error
    try:
        return _open(path, create=False, exclusive=True)
    except sqlite3.Error as error:
        raise translate(error, "opening the database", where=str(path)) from error


def is_exclusive(conn: sqlite3.Connection) -> bool:
    """True for a connection :func:`connect` opened in exclusive locking mode (a full disk)."""
    (mode,) = conn.execute("PRAGMA locking_mode").fetchone()
    return str(mode).lower() == "exclusive"


def _shm_failed(error: sqlite3.Error) -> bool:
    code = getattr(error, "sqlite_errorcode", None)
    return code in (
        sqlite3.SQLITE_IOERR_SHMOPEN,
        sqlite3.SQLITE_IOERR_SHMSIZE,
        sqlite3.SQLITE_IOERR_SHMMAP,
    )


def _open(path: Path, *, create: bool, exclusive: bool) -> sqlite3.Connection:
    """:func:`connect`'s steps; raises ``sqlite3.Error`` (or ConfigurationError: no WAL)."""
    if create:
        conn = sqlite3.connect(
            str(path), timeout=BUSY_TIMEOUT, isolation_level=None, check_same_thread=False
        )
    else:
        conn = sqlite3.connect(
            f"file:{quote(str(path.absolute()))}?mode=rw",
            uri=True,
            timeout=BUSY_TIMEOUT,
            isolation_level=None,
            check_same_thread=False,
        )
    try:
        if exclusive:  # before the first access: SQLite then never maps the -shm file
            conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        # Only a new file takes it (before its first write): 1 KiB pages make each WAL frame a
        # quarter of the default, and a grant writes three.
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
        # Switching a new file to WAL needs its exclusive lock, and SQLite answers SQLITE_BUSY
        # at once, without its busy handler, while another process opens the same new file.
        (mode,) = retrying(conn.execute, "PRAGMA journal_mode=WAL", timeout=BUSY_TIMEOUT).fetchone()
        if str(mode).lower() != "wal":
            raise ConfigurationError(
                f"{path}: SQLite refused WAL mode (journal_mode={mode}); fenced needs a local "
                "file system"
            )
        conn.execute("PRAGMA synchronous=FULL")
        # RETURNING and subqueries use ephemeral tables: kept in memory, never in a temporary
        # file.
        conn.execute("PRAGMA temp_store=MEMORY")
    except BaseException:
        conn.close()
        raise
    return conn


def open_database(
    path: Path,
    coordinator_id_for_new: str | None = None,
    *,
    marker: bool = True,
    create: bool = True,
) -> tuple[sqlite3.Connection, str]:
    """Create or open the database at ``path``; return the connection and the coordinator id.

    Creates missing parent directories and a missing file with fenced's modes (see
    :mod:`.files`). A new (or empty) file is initialised with a fresh random coordinator
    id, or ``coordinator_id_for_new`` if given (ignored for an existing database), unless the
    marker (or a ``-wal``/``-shm``/``-journal`` file beside a missing database) shows that a
    database lived there: then ConfigurationError, and nothing is created. A database of an
    older format is migrated in one transaction; a newer one is refused. ``marker``: keep the
    marker beside the database (False only for a transient copy, such as a restore's staging
    file). ``create=False`` (readers): a missing, empty or uninitialised database is a
    ConfigurationError and nothing is created (see :func:`connect` for a full file system).
    """
    if coordinator_id_for_new is not None:
        validate_coordinator_id(coordinator_id_for_new)
    sqlite_files.prepare_location(path, create=create)
    conn = connect(path, create=create)
    try:
        coordinator_id = _prepare(conn, path, coordinator_id_for_new, create=create)
        if marker:
            sqlite_files.mark(path, coordinator_id)
    except sqlite3.Error as error:
        rollback(conn)
        conn.close()
        raise translate(error, "initialising the database", where=str(path)) from error
    except BaseException:
        rollback(conn)
        conn.close()
        raise
    return conn, coordinator_id


def _prepare(conn: sqlite3.Connection, path: Path, new_id: str | None, *, create: bool) -> str:
    """Check identity and version; initialise (or migrate), all in one write transaction."""
    conn.execute("BEGIN IMMEDIATE")
    (app_id,) = conn.execute("PRAGMA application_id").fetchone()
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master")}
    if not tables and app_id in (0, APPLICATION_ID):
        version = 0
    elif app_id != APPLICATION_ID or "meta" not in tables:
        raise ConfigurationError(f"{path} is an SQLite database, but not a fenced one")
    else:
        version = _schema_version(conn, path)
    if version == 0:
        sqlite_files.refuse_if_marked(path)  # its content was lost: never start again silently
        if not create:
            raise ConfigurationError(f"the coordinator database {path} was never initialised")
    checked_version(version, SCHEMA_VERSION, str(path))
    for migration in MIGRATIONS:
        if migration.version > version:
            for statement in migration.statements:
                conn.execute(statement)
    if version == 0:
        conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
        conn.executemany(
            "INSERT INTO meta (key, value) VALUES (?, ?)",
            [
                ("coordinator_id", new_id or secrets.token_hex(16)),
                ("created_wall", repr(time.time())),
            ],
        )
    if version < SCHEMA_VERSION:
        conn.execute(
            "INSERT INTO meta (key, value) VALUES ('schema_version', ?) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(SCHEMA_VERSION),),
        )
    row = conn.execute("SELECT value FROM meta WHERE key = 'coordinator_id'").fetchone()
    conn.execute("COMMIT")
    try:
        return validate_coordinator_id(row[0] if row else None)
    except ConfigurationError:
        raise ConfigurationError(f"{path}: damaged meta table: no valid coordinator_id") from None


def _schema_version(conn: sqlite3.Connection, path: Path) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    try:
        return int(row[0])
    except (TypeError, ValueError):
        raise ConfigurationError(f"{path}: damaged meta table: no valid schema_version") from None

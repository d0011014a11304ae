"""Backup and restore of the embedded coordinator's SQLite file.

* :func:`backup_database` — a consistent online copy while other processes keep granting: the
  SQLite online-backup API copies the database in one step inside one read transaction (WAL lets
  writers go on meanwhile), into a temporary file next to the destination that is checked
  (``integrity_check``, fenced's identity and schema), switched to a self-contained rollback
  journal, ``fsync``-ed and renamed into place (then the directory is synced). A crash leaves
  the previous destination file or the new one, never a partial copy. A destination that is a
  file of the live database (the database, its ``-wal``, ``-shm`` or ``-journal``, by any path,
  symlink or hard link) is refused before anything is written.
* :func:`inspect_database` — is this file a fenced coordinator database of a schema this fenced
  knows, is it intact, and what does it hold (coordinator id, epochs, minimum epoch)?
* :func:`stage_copy` / :func:`install` — the two halves of a restore: copy the backup next to
  the live file (the backup itself is only read), check it and prepare it (waiting queues and
  watchers of the past are dropped); then, after the caller advanced its epochs (see
  :mod:`fenced.coordinator._restore`), replace the live file atomically.
* :func:`users_of` — the processes that have the live file open (read from ``/proc``).

Failure behaviour: a missing, corrupt or foreign file, an unknown schema and an unwritable
location are :class:`~fenced.ConfigurationError` (one line, the driver error chained); nothing is
left behind and the destination is unchanged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from fenced._drivers.permissions import new_file_mode
from fenced.coordinator.backends.sqlite._schema import APPLICATION_ID, SCHEMA_VERSION
from fenced.core._errors import ConfigurationError
from fenced.core._token import validate_coordinator_id

__all__ = [
    "DatabaseInfo",
    "backup_database",
    "discard",
    "inspect_database",
    "install",
    "stage_copy",
    "users_of",
]

_MAGIC = b"SQLite format 3\x00"
_REQUIRED_TABLES = {"meta", "resources", "minimum_epoch"}
_SIDECARS = ("-wal", "-shm", "-journal")


@dataclass(frozen=True, slots=True)
class DatabaseInfo:
    """What a fenced coordinator database holds (as far as restores are concerned)."""

    path: Path
    coordinator_id: str
    schema_version: int
    minimum_epoch: int
    epochs: dict[str, int] = field(default_factory=dict)
    """The last epoch of every resource."""

    @property
    def largest_epoch(self) -> int:
        """The largest epoch this state could grant next minus one: max(epochs, minimum)."""
        return max([self.minimum_epoch, *self.epochs.values()])


def _fsync(path: Path, *, directory: bool = False) -> None:
    fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_header(path: Path, what: str) -> None:
    """Refuse a missing file, a directory, or a file that is not an SQLite database at all."""
    if path.is_dir():
        raise ConfigurationError(f"{what} {path} is a directory, not a fenced database file")
    try:
        with path.open("rb") as stream:
            header = stream.read(len(_MAGIC))
    except FileNotFoundError:
        raise ConfigurationError(f"{what} {path} does not exist") from None
    except OSError as error:
        raise ConfigurationError(f"cannot read {what} {path}: {error.strerror}") from error
    if header != _MAGIC:
        raise ConfigurationError(f"{what} {path} is not a fenced coordinator database")


@contextmanager
def _opened(path: Path, what: str) -> Iterator[sqlite3.Connection]:
    """A plain connection; every sqlite3 error becomes a one-line ConfigurationError."""
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(str(path), timeout=5.0, isolation_level=None)
        yield conn
    except sqlite3.Error as error:
        raise ConfigurationError(
            f"{what} {path} is not a usable fenced coordinator database ({error})"
        ) from error
    finally:
        if conn is not None:
            conn.close()


def _describe(conn: sqlite3.Connection, path: Path, what: str, *, check: bool) -> DatabaseInfo:
    """Check identity, schema and (if ``check``) integrity; read what a restore needs."""
    (app_id,) = conn.execute("PRAGMA application_id").fetchone()
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if app_id != APPLICATION_ID or not tables >= _REQUIRED_TABLES:
        raise ConfigurationError(
            f"{what} {path} is an SQLite database, but not a fenced coordinator database"
        )
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    try:
        version = int(meta.get("schema_version", ""))
    except ValueError:
        raise ConfigurationError(f"{what} {path}: damaged meta table (schema_version)") from None
    if not 1 <= version <= SCHEMA_VERSION:
        raise ConfigurationError(
            f"{what} {path} has schema version {version}; this fenced knows versions 1 to "
            f"{SCHEMA_VERSION}" + (": upgrade fenced" if version > SCHEMA_VERSION else "")
        )
    try:
        coordinator_id = validate_coordinator_id(meta.get("coordinator_id"))
    except ConfigurationError:
        raise ConfigurationError(f"{what} {path}: damaged meta table (coordinator_id)") from None
    if check:
        problems = [row[0] for row in conn.execute("PRAGMA integrity_check")]
        if problems != ["ok"]:
            raise ConfigurationError(f"{what} {path} is damaged ({_integrity(problems)})")
    row = conn.execute("SELECT epoch FROM minimum_epoch WHERE id = 1").fetchone()
    epochs = {
        str(name): int(epoch) for name, epoch in conn.execute("SELECT name, epoch FROM resources")
    }
    return DatabaseInfo(path, coordinator_id, version, int(row[0]) if row else 0, epochs)


def _integrity(problems: list[str]) -> str:
    """``integrity_check``'s answer in one line: its first problem and how many there are.

    Its rows may span lines (``*** in database main ***`` then the problem); one row per problem.
    """
    lines = [
        line.strip()
        for row in problems
        for line in str(row).splitlines()
        if line.strip() and not line.startswith("***")
    ]
    first = lines[0] if lines else "damaged"
    more = f" and {len(lines) - 1} more problem(s)" if len(lines) > 1 else ""
    return f"integrity_check: {first}{more}"


def inspect_database(path: str | os.PathLike[str], *, what: str = "database") -> DatabaseInfo:
    """Check that ``path`` is an intact fenced coordinator database of a known schema.

    Reads only and creates no file: without a ``-wal`` file beside it the database is opened as
    immutable; with one, read-only (SQLite then reads the WAL, using the ``-shm`` file). Raises
    ConfigurationError otherwise.
    """
    location = Path(path)
    _check_header(location, what)
    wal = Path(f"{location}-wal").exists()
    uri = f"file:{quote(str(location.absolute()))}?{'mode=ro' if wal else 'immutable=1'}"
    conn: sqlite3.Connection | None = None
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=5.0, isolation_level=None)
        return _describe(conn, location, what, check=True)
    except sqlite3.Error as error:
        raise ConfigurationError(
            f"{what} {location} is not a usable fenced coordinator database ({error})"
        ) from error
    finally:
        if conn is not None:
            conn.close()


def backup_database(source: Path, dest: Path) -> DatabaseInfo:
    """Copy the live database ``source`` to ``dest`` consistently, online; return the copy's info.

    ``dest`` may be an existing directory (the copy is named ``fenced-<coordinator id>.db``
    there); an existing file is replaced atomically, unless it is a file of the live database
    (ConfigurationError, nothing written). See the module docstring for the steps.
    """
    _check_header(source, "the coordinator database")
    if dest.is_dir():
        with _opened(source, "the coordinator database") as conn:
            found = _describe(conn, source, "the coordinator database", check=False)
        dest = dest / f"fenced-{found.coordinator_id}.db"
    dest = dest.absolute()
    if _is_live_file(dest, source):
        raise ConfigurationError(
            f"the backup destination {dest} is a file of the live coordinator database {source} "
            "(the database or its -wal, -shm or -journal file): choose another destination"
        )
    if not dest.parent.is_dir():
        raise ConfigurationError(f"cannot write the backup {dest}: {dest.parent} is no directory")
    temporary = dest.parent / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    try:
        # a backup holds the owner secrets and request ids of live leases: as private as the
        # database itself (0600, or 0660 in a deliberately shared directory), whatever the umask
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, new_file_mode(dest.parent))
        finally:
            os.close(fd)
        with _opened(source, "the coordinator database") as live:
            _describe(live, source, "the coordinator database", check=False)
            info = _copy_checked(live, source, temporary, dest)
        _fsync(temporary)
        os.replace(temporary, dest)
        _fsync(dest.parent, directory=True)
    except OSError as error:
        raise ConfigurationError(f"cannot write the backup {dest}: {error.strerror}") from error
    finally:
        _remove(temporary)
    return DatabaseInfo(
        dest, info.coordinator_id, info.schema_version, info.minimum_epoch, info.epochs
    )


def _copy_checked(
    live: sqlite3.Connection, source: Path, temporary: Path, dest: Path
) -> DatabaseInfo:
    """Copy ``live`` into the new file ``temporary`` and check the copy; what it holds.

    The copy has the source's pages, so damage found in it is the source's: the message names
    ``source`` (and says nothing was written to ``dest``), never the temporary file.
    """
    copy = None
    try:
        copy = sqlite3.connect(str(temporary), timeout=5.0, isolation_level=None)
        live.backup(copy)  # one step: one consistent snapshot, writers continue (WAL)
        (mode,) = copy.execute("PRAGMA journal_mode=DELETE").fetchone()
        if str(mode).lower() != "delete":
            raise ConfigurationError(f"cannot finish the backup {dest} (journal {mode})")
        try:
            return _describe(copy, source, "the coordinator database", check=True)
        except sqlite3.Error as error:
            raise ConfigurationError(
                f"the coordinator database {source} is damaged ({error}); nothing was written "
                f"to {dest}"
            ) from error
        except ConfigurationError as error:
            raise ConfigurationError(f"{error}; nothing was written to {dest}") from error
    except sqlite3.Error as error:
        raise ConfigurationError(f"cannot copy {source} to {dest}: {error}") from error
    finally:
        if copy is not None:
            copy.close()


def _is_live_file(dest: Path, source: Path) -> bool:
    """Is ``dest`` the database ``source`` or one of its sidecar files, by any path?

    Compared by resolved path (symlinks, ``..``; also for files that do not exist yet, such as a
    ``-wal`` SQLite creates later) and, for existing files, by device and inode (hard links).
    """
    bases = (source, source.resolve())
    live = {Path(f"{base}{suffix}") for base in bases for suffix in ("", *_SIDECARS)}
    target = dest.resolve()
    if any(target == path.resolve() for path in live):
        return True
    try:
        found = dest.stat()
    except FileNotFoundError:
        return False
    for path in live:
        try:
            other = path.stat()
        except FileNotFoundError:
            continue
        if (found.st_dev, found.st_ino) == (other.st_dev, other.st_ino):
            return True
    return False


def _remove(path: Path) -> None:
    for suffix in ("", *_SIDECARS):
        with contextlib.suppress(FileNotFoundError):
            Path(f"{path}{suffix}").unlink()


def stage_copy(source: Path, target: Path) -> tuple[Path, DatabaseInfo]:
    """Copy the backup ``source`` next to ``target`` as a staging file; check and prepare it.

    The backup is only read (its bytes, and those of a ``-wal`` file beside it, are copied; the
    copy is opened). The staging copy is checked (identity, known schema, integrity); waiting
    queues and watchers recorded in it are dropped (they belong to processes of the past).
    Returns the staging path (the caller installs or removes it) and what it holds.
    """
    _check_header(source, "the backup")
    if not target.parent.is_dir():
        raise ConfigurationError(f"cannot restore to {target}: {target.parent} is no directory")
    staging = target.parent / f".{target.name}.restore-{uuid.uuid4().hex}"
    try:
        shutil.copyfile(source, staging)
        wal = Path(f"{source}-wal")
        if wal.is_file() and wal.stat().st_size > 0:
            shutil.copyfile(wal, f"{staging}-wal")
        with _opened(staging, "the backup") as conn:
            info = _describe(conn, source, "the backup", check=True)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM waiters")
            conn.execute("DELETE FROM watchers")
            conn.execute("COMMIT")
            conn.execute("PRAGMA journal_mode=WAL")
    except OSError as error:
        _remove(staging)
        raise ConfigurationError(f"cannot stage the restore next to {target}: {error}") from error
    except BaseException:
        _remove(staging)
        raise
    return staging, DatabaseInfo(
        staging, info.coordinator_id, info.schema_version, info.minimum_epoch, info.epochs
    )


def discard(staging: Path) -> None:
    """Remove a staging copy (and its sidecar files); never raises for a missing one."""
    _remove(staging)


def install(staging: Path, target: Path) -> None:
    """Replace ``target`` by ``staging`` atomically (no process may have ``target`` open).

    Both files are checkpointed and closed first, so that no ``-wal`` of the old database can be
    applied to the new one: the old ``-wal``/``-shm`` files are removed, the staging file is
    ``fsync``-ed and renamed over ``target``, and the directory is synced.
    """
    with _opened(staging, "the restored database") as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    if target.exists():
        with _opened(target, "the coordinator database") as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    try:
        _fsync(staging)
        for suffix in _SIDECARS:
            with contextlib.suppress(FileNotFoundError):
                Path(f"{target}{suffix}").unlink()
        os.replace(staging, target)
        _fsync(target.parent, directory=True)
    except OSError as error:
        raise ConfigurationError(f"cannot replace {target}: {error.strerror}") from error
    for suffix in _SIDECARS:
        with contextlib.suppress(FileNotFoundError):
            Path(f"{staging}{suffix}").unlink()


def users_of(path: Path) -> list[int]:
    """The ids of the processes (this one included) that have ``path`` or its WAL files open.

    Read from ``/proc/*/fd``; processes this user may not inspect are not seen.
    """
    names = {str(path.absolute()), *(f"{path.absolute()}{s}" for s in ("-wal", "-shm"))}
    found: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        fd_dir = f"/proc/{entry}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") in names:
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return sorted(found)

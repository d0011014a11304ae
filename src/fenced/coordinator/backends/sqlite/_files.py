"""Where the embedded coordinator's database lives: its directory, the modes of its files, and
the marker that says a database lived there.

Permissions
-----------
The database holds bearer credentials: the owner secrets and request ids of live leases and of
waiters, and the addresses at which waiters listen. Whoever can read it can act as any holder
(release or renew its lease), so by default nobody else can:

- a directory fenced creates (the database's, and any missing parent) is ``0700``;
- a file fenced creates (the database, its marker) is ``0600``, whatever the umask; SQLite gives
  the ``-wal`` and ``-shm`` files the database file's mode;
- **deliberate sharing**: if the database's directory is *setgid, group-writable and not writable
  by others* (``install -d -m 2770 -g GROUP DIR``), new files are ``0660`` instead, and the
  setgid bit gives every file the directory's group: the members of that group share the
  coordinator. Nothing fenced creates is ever readable by others;
- the mode of a directory that exists is never changed (neither loosened nor tightened);
- from existing files this user owns (the database, ``-wal``, ``-shm``, marker), fenced removes
  read access of the group or of others when they lack write access: such access cannot use the
  coordinator (SQLite must write its ``-shm`` and ``-wal``), it can only read its secrets. A
  database left ``0644`` by an older fenced becomes ``0600``; a ``0660`` one stays ``0660``.

The marker
----------
``<database>.coordinator-id`` beside the database holds the database's coordinator id. It is
written (and fsynced) when a database is initialised, and when a database without one is opened
(one created by an older fenced). While it exists, fenced refuses to create a new, empty
database at that path — whose epochs would start again at 1 under a new coordinator id — when
the database is missing or empty; so does a ``-wal``, ``-shm`` or ``-journal`` file left where
the database is missing. The refusal is a one-line :class:`~fenced.ConfigurationError` that names
the ways out: restore the database (``fenced restore``), or remove the marker to start a new
coordinator deliberately.

Failure behaviour: a location that cannot be created or written is a one-line
:class:`~fenced.ConfigurationError`; nothing is created then beyond the directories made.
"""

from __future__ import annotations

import os
import stat
import uuid
from contextlib import suppress
from pathlib import Path

from fenced._drivers.local import check_database_file
from fenced._drivers.permissions import (
    PRIVATE_DIRECTORY,
    create_file,
    create_missing,
    make_directory,
    new_file_mode,
)
from fenced.core._errors import ConfigurationError

__all__ = ["MARKER_SUFFIX", "mark", "marker_of", "prepare_location", "refuse_if_marked"]

MARKER_SUFFIX = ".coordinator-id"
"""Appended to the database's path to name its marker."""
_SIDECARS = ("-wal", "-shm", "-journal")


def marker_of(path: Path) -> Path:
    """The marker of the database at ``path``."""
    return path.with_name(path.name + MARKER_SUFFIX)


def prepare_location(path: Path, *, create: bool = True) -> None:
    """Before the database at ``path`` is opened: create its missing directories (``0700``);
    refuse a missing or empty database that left a trace (see the module doc); create a missing
    database file with fenced's mode; narrow the modes of the existing files. A path that is not
    a regular file (a directory, ``/dev/null``) is refused.

    ``create=False`` (readers): refuse a missing or empty database instead, creating nothing.

    Raises ConfigurationError; changes nothing but the directories it made when it does.
    """
    check_database_file(path, "the coordinator database", create=create, parents=True)
    try:
        if create:
            _make_directories(path.parent)
        try:
            size: int | None = os.stat(path).st_size
        except FileNotFoundError:
            size = None
        if not size:
            _refuse_if_traced(path, missing=size is None)
        if not size and not create:
            raise ConfigurationError(
                f"the coordinator database {path} "
                + ("does not exist" if size is None else "is empty (never initialised)")
            )
        if size is None:
            create_missing(path, new_file_mode(path.parent))
        else:
            for each in (path, marker_of(path), *(Path(f"{path}{s}") for s in _SIDECARS)):
                _narrow(each)
    except OSError as error:
        reason = error.strerror or str(error)
        if isinstance(error, FileExistsError | NotADirectoryError):
            reason = "a part of that path is not a directory"
        raise ConfigurationError(f"cannot open the fenced database {path}: {reason}") from error


def refuse_if_marked(path: Path) -> None:
    """Raise ConfigurationError if the marker says a database lived at ``path``. Called before a
    database found with no tables is initialised (its content was lost: a replaced or deleted
    ``-wal`` whose commits were never checkpointed into the file)."""
    marked = _marked_id(marker_of(path))
    if marked is not None:
        raise ConfigurationError(_refusal(path, "holds no fenced tables", marked, marker_of(path)))


def mark(path: Path, coordinator_id: str) -> None:
    """Make sure the marker of the database at ``path`` holds ``coordinator_id`` (written
    atomically and fsynced when it does not). ConfigurationError if it cannot be written."""
    marker = marker_of(path)
    try:
        if _marked_id(marker) == coordinator_id:
            return
        temporary = marker.with_name(f".{marker.name}.tmp-{uuid.uuid4().hex}")
        text = (
            f"{coordinator_id}\n# fenced: the coordinator database {path.name} lives here. "
            "While this file exists, fenced refuses to create a new, empty database in its place "
            "(see docs/coordinator.md).\n"
        )
        try:
            _write(temporary, text.encode(), new_file_mode(path.parent))
            os.replace(temporary, marker)
        finally:
            with suppress(FileNotFoundError):
                temporary.unlink()
        _fsync_directory(path.parent)
    except OSError as error:
        raise ConfigurationError(
            f"cannot write the marker {marker} of the fenced database: {error.strerror or error}"
        ) from error


def _make_directories(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each ``0700`` whatever the umask."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    for each in reversed(missing):
        make_directory(each, PRIVATE_DIRECTORY)  # one a concurrent opener made keeps its mode


def _refuse_if_traced(path: Path, *, missing: bool) -> None:
    """Refuse to create a database where the marker (or, if the file is missing, a ``-wal``,
    ``-shm`` or ``-journal`` file) shows that one lived.

    A trace found is checked against the database file once more: another process opening
    the same new path may have created and initialised it since it was found missing or empty
    (SQLite writes the header, through a transient ``-journal``, before anything else, and the
    marker only follows a committed initialisation). The database is then open to use.
    """
    marker = marker_of(path)
    marked = _marked_id(marker)
    state = "is missing" if missing else "is empty"
    if marked is not None and not _size_now(path):  # not initialised by another opener since
        raise ConfigurationError(_refusal(path, state, marked, marker))
    if missing:
        for suffix in _SIDECARS:
            sidecar = Path(f"{path}{suffix}")
            if os.path.lexists(sidecar) and _size_now(path) is None:  # not being created
                raise ConfigurationError(
                    f"the fenced database {path} is missing, but its {sidecar.name} is there: "
                    "refusing to create a new, empty coordinator in its place (its epochs would "
                    f"start again at 1); restore it (fenced restore BACKUP) or, to start a new "
                    f"coordinator deliberately, remove {sidecar}"
                )


def _size_now(path: Path) -> int | None:
    """The database file's size now, None if it is missing."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _refusal(path: Path, state: str, marked: str, marker: Path) -> str:
    return (
        f"the fenced database {path} {state}, but {marker.name} says coordinator "
        f"{marked or '(unknown)'} lived there: refusing to create a new, empty coordinator in "
        "its place (its epochs would start again at 1 under a new id); restore it (fenced "
        f"restore BACKUP) or, to start a new coordinator deliberately, remove {marker} and any "
        f"{path.name}-wal/-shm"
    )


def _marked_id(marker: Path) -> str | None:
    """The coordinator id in ``marker`` ("" if unreadable as one), or None if there is none."""
    try:
        with open(marker, "rb") as stream:
            first = stream.readline(200)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ConfigurationError(
            f"cannot read the marker {marker} of the fenced database: {error.strerror or error}"
        ) from error
    return first.decode("ascii", "replace").strip()


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = create_file(path, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _narrow(path: Path) -> None:
    """Remove read access of the group or of others from ``path`` where they lack write access
    (see the module doc). Only a file of this user; a missing one is skipped."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):
        return
    mode = stat.S_IMODE(info.st_mode)
    narrowed = mode
    if not mode & stat.S_IWGRP:
        narrowed &= ~stat.S_IRGRP
    if not mode & stat.S_IWOTH:
        narrowed &= ~stat.S_IROTH
    if narrowed != mode:
        os.chmod(path, narrowed)

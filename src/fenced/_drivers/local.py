"""Local paths from ``sqlite:`` and ``file:`` URLs: the parser plus the checks that need the disk.

:func:`local_path` is what every command and backend opens a local coordinator or store with
(``connect``, ``open_store``, ``backup``/``restore``, the ``fenced`` commands, verify). It parses
with :func:`fenced.core._urls.parse_local` and makes the path absolute against the current
directory *now*, so a later ``chdir`` does not move the database.

The transition check: fenced once read ``sqlite:///x/y.db`` as ``/x/y.db`` (RFC 8089); it now
follows SQLAlchemy, where it is ``x/y.db`` under the current directory. When ``x/y.db`` does not
exist but ``/x/y.db`` is a fenced database (a SQLite file with fenced's ``meta`` table), the URL
almost certainly means the old one: a new, empty coordinator or store there would hand out
epochs from 1 again, or lose every floor. So :func:`local_path` refuses with a one-line
:class:`~fenced.ConfigurationError` that names both spellings, and creates nothing.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path
from urllib.parse import quote

from fenced.core._errors import ConfigurationError
from fenced.core._urls import parse_local, redacted, url_of_path

__all__ = ["check_database_file", "is_fenced_database", "local_path"]

_MAGIC = b"SQLite format 3\x00"


def local_path(url: str, scheme: str | None = None) -> Path:
    """The absolute path a ``sqlite:`` or ``file:`` URL names (``scheme``: the one expected).

    Raises :class:`~fenced.ConfigurationError` for a malformed URL (see
    :mod:`fenced.core._urls`) and for the ambiguous ``sqlite:///x`` described in the module
    docstring. Reads at most the headers of two files; creates nothing.
    """
    parsed = parse_local(url, scheme)
    path = Path(parsed.path).absolute()
    if parsed.former is not None and not path.exists() and is_fenced_database(parsed.former):
        raise ConfigurationError(
            f"{redacted(url)} now names {parsed.path} under the current directory ({path}; "
            f"SQLAlchemy's rule), which does not exist, while {parsed.former} is a fenced "
            f"database: write {url_of_path('sqlite', parsed.former)} (four slashes) to use it, or "
            f"sqlite:{quote(parsed.path)} to create a new one here"
        )
    return path


def is_fenced_database(path: str | Path) -> bool:
    """True if ``path`` is a SQLite file with a ``meta`` table (a fenced coordinator or store).

    Opens it read-only, creating no file (immutable without a ``-wal`` file beside it). A SQLite
    file that cannot be read counts as fenced's: the caller then refuses rather than guesses.
    """
    location = Path(path)
    try:
        with location.open("rb") as stream:
            if stream.read(len(_MAGIC)) != _MAGIC:
                return False
    except OSError:
        return False
    # without a -wal file, immutable: SQLite then creates no -wal or -shm file beside it
    wal = Path(f"{location}-wal").exists()
    uri = f"file:{quote(str(location.absolute()))}?{'mode=ro' if wal else 'immutable=1'}"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=1.0)
    except sqlite3.Error:
        return True
    try:
        row = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
        ).fetchone()
    except sqlite3.Error:
        return True
    finally:
        conn.close()
    return row is not None


def check_database_file(path: str | Path, what: str, *, create: bool, parents: bool) -> None:
    """Refuse, before SQLite opens ``path`` (and says something misleading, such as "disk I/O
    error" for ``/dev/null``), a database path that cannot be one: something that exists but is
    not a regular file (a directory, a device, a FIFO, a socket); with ``create`` False, a
    missing file; with ``parents`` False, a missing directory. ``what`` names the database in
    the one-line :class:`~fenced.ConfigurationError` ("the coordinator database"). Only looks.
    """
    location = Path(path)
    try:
        mode = os.stat(location).st_mode
    except FileNotFoundError:
        if not create:
            raise ConfigurationError(f"{what} {location} does not exist") from None
        if not parents and not location.parent.is_dir():
            raise ConfigurationError(
                f"cannot open or create {what} {location}: the directory {location.parent} "
                "does not exist"
            ) from None
        return
    except OSError as error:
        raise ConfigurationError(f"cannot open {what} {location}: {error.strerror}") from error
    if not stat.S_ISREG(mode):
        raise ConfigurationError(f"{what} {location} is {_kind(mode)}, not a database file")


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")

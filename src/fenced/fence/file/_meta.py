"""The metadata file of a file store (``fenced-store.json``): its format, format version and mode.

Created once, atomically (a synced temporary file hard-linked into place, so that of two
processes creating one store at once, exactly one wins and the other reads its metadata). There
is one format, ``fenced.file-store`` version :data:`FORMAT_VERSION`: a store of a newer version
is refused with a :class:`~fenced.ConfigurationError` that says to upgrade fenced; an unknown
format, an older or malformed version, or a corrupt file is refused as not a (valid) fenced
store.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from fenced.core._errors import ConfigurationError
from fenced.fence._values import Mode
from fenced.fence.file._files import fsync_dir, write_file
from fenced.fence.file._layout import META

FORMAT = "fenced.file-store"
FORMAT_VERSION = 1


def read_meta(root: Path, where: str) -> dict[str, Any] | None:
    """The metadata of the store at ``root``, None if it has none yet."""
    try:
        data = (root / META).read_bytes()
    except FileNotFoundError:
        return None
    try:
        meta = json.loads(data)
    except ValueError as error:
        raise ConfigurationError(f"{where}: corrupt {META} ({error})") from error
    if not isinstance(meta, dict):
        raise ConfigurationError(f"{where}: corrupt {META}")
    return meta


def create_meta(root: Path, where: str, mode: Mode) -> dict[str, Any]:
    """Write the metadata file of a new store; another process may win the race."""
    others = [e for e in os.listdir(root) if e != META and not e.startswith(f".{META}.")]
    if others:
        existing = read_meta(root, where)  # created by a concurrent opener meanwhile?
        if existing is not None:
            return existing
        raise ConfigurationError(
            f"{where} is not a fenced store: the directory is not empty and has no {META}"
        )
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "mode": mode}
    temporary = root / f".{META}.{uuid.uuid4().hex}"
    write_file(temporary, json.dumps(meta).encode())
    try:
        os.link(temporary, root / META)  # atomic create-if-absent
    except FileExistsError:
        pass
    finally:
        temporary.unlink()
    fsync_dir(root)
    created = read_meta(root, where)
    if created is None:
        raise ConfigurationError(f"{where}: {META} vanished while the store was created")
    return created


def check_meta(meta: dict[str, Any], where: str) -> str:
    """The mode of a store of this format and version; anything else is refused."""
    if meta.get("format") != FORMAT:
        raise ConfigurationError(f"{where} is not a fenced store ({META} has another format)")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < FORMAT_VERSION:
        raise ConfigurationError(f"{where}: corrupt {META} (version {version!r})")
    if version > FORMAT_VERSION:
        raise ConfigurationError(
            f"{where} has format version {version}, newer than this fenced understands "
            f"({FORMAT_VERSION}): upgrade fenced"
        )
    mode = meta.get("mode")
    if not isinstance(mode, str):
        raise ConfigurationError(f"{where}: corrupt {META} (mode {mode!r})")
    return mode

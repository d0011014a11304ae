"""Garbage collection of a file store: victims leave ``objects/`` for ``trash/``, their blocks
are freed after gc returns, and the state forgets the superseded publications that are gone.

See :func:`collect_garbage` for what it guarantees (it needs no free space to free space) and
how it fails (part way, in a consistent store, saying how many objects it removed).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fenced.core._errors import ConfigurationError, FencedError, Unavailable
from fenced.fence._background import later
from fenced.fence._rules import StoredObject
from fenced.fence.backend import Chooser
from fenced.fence.file._files import CONFIG_ERRNOS, ensure_dir
from fenced.fence.file._layout import JOURNAL, OBJECT_ID, OPS, RESOURCE_DIR, STATE, TRASH
from fenced.fence.file._transaction import FileTransaction

if TYPE_CHECKING:
    from fenced.fence.file._store import FileBackend

log = logging.getLogger("fenced.store")

_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
"""Errors of a full disk (or quota): gc then unlinks at once what it would move to ``trash/``."""
_DEBRIS = tuple(f"{name}.tmp-" for name in (STATE, JOURNAL, OPS))
"""Prefixes of the temporary files of an interrupted commit, checkpoint or compaction."""


def _unlink_all(paths: list[str]) -> None:
    """Unlink each of ``paths`` that still exists (another process's gc may be at it too).

    Best effort, one path at a time: a path that cannot be unlinked (not a file, no permission)
    is left for the next gc and does not stop the others.
    """
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            log.debug("gc: could not unlink %s: %s", path, error)


def _remove(path: str, trash: str | None) -> None:
    """Take a gc victim out of its ``objects/``: renamed into ``trash`` (its blocks are freed
    later), or unlinked at once if ``trash`` is None or the rename finds no space."""
    try:
        if trash is not None:
            try:
                os.rename(path, f"{trash}/{os.path.basename(path)}")
                return
            except OSError as error:
                if error.errno not in _NO_SPACE:
                    raise
        os.unlink(path)
    except FileNotFoundError:
        pass  # another gc took it meanwhile


def _listing(directory: str | None) -> list[str]:
    """The paths of the entries of ``directory`` (none if it is None or cannot be listed)."""
    if directory is None:
        return []
    try:
        return [entry.path for entry in os.scandir(directory)]
    except OSError as error:
        log.debug("gc: could not list %s: %s", directory, error)
        return []


@dataclass(slots=True)
class _Progress:
    """How far a gc got, for the error that stops it part way."""

    removed: int = 0

    def __str__(self) -> str:
        if not self.removed:
            return "gc removed nothing"
        return (
            f"gc removed {self.removed} unreferenced objects before it stopped (the store is "
            "consistent: every other object is as it was)"
        )


def collect_garbage(backend: FileBackend, choose: Chooser, cutoff: float) -> int:
    """Remove each resource's victims and forget them; free their space (step 5. of
    :mod:`fenced.fence.file._store`).

    Per resource, under its lock: the victims leave ``objects/`` for ``trash/`` (a victim that
    cannot be renamed for lack of space is unlinked at once), the debris of interrupted
    writes is unlinked, then one log line forgets the superseded publications whose objects
    are gone. The blocks in ``trash/`` are freed on the reaper thread after gc returns,
    except on a full disk: if a line cannot be written for lack of space, gc first unlinks
    everything in ``trash/`` itself, then writes the lines it could not write. A line that
    still does not fit is left to a later gc (logged): it only forgets objects that are
    gone, and the store is consistent without it. So gc needs no free space to free space.

    Not one atomic step: failing part way (an I/O error, a lock held for longer than
    ``busy_timeout``), it leaves the objects it removed removed and every other as it was, in
    a consistent store, and its error says how many it removed; a later gc finishes.
    """
    progress = _Progress()
    try:
        return _collect_all(backend, choose, cutoff, progress)
    except FencedError:  # a lock held too long (Unavailable: also an OSError) says it already
        raise
    except OSError as error:
        done = f"{progress}; run gc again to finish"
        if error.errno in CONFIG_ERRNOS:
            raise ConfigurationError(f"collecting garbage: {error}; {done}") from error
        raise Unavailable(f"collecting garbage: {error}; {done}") from error


def _collect_all(backend: FileBackend, choose: Chooser, cutoff: float, progress: _Progress) -> int:
    trash: str | None = f"{backend.root}/{TRASH}"
    try:
        ensure_dir(backend.root / TRASH)
    except OSError as error:
        if error.errno not in _NO_SPACE:
            raise
        trash = None  # no room for the directory: the victims are unlinked at once
    unrecorded: list[str] = []
    try:
        for name in sorted(os.listdir(f"{backend.root}/resources")):
            rdir = f"{backend.root}/resources/{name}"
            if RESOURCE_DIR.fullmatch(name) and os.path.isdir(rdir):
                with backend.lock(name, then=f"{progress}; run gc again to finish"):
                    if not _collect(backend, rdir, choose, cutoff, trash, progress):
                        unrecorded.append(name)
    finally:  # even if gc stops here: what is in trash/ is freed, at once on a full disk
        doomed = _listing(trash)
        if unrecorded:
            _unlink_all(doomed)
        elif doomed:
            later(functools.partial(_unlink_all, doomed))
    for name in unrecorded:  # space first, then the lines that did not fit
        rdir = f"{backend.root}/resources/{name}"
        with backend.lock(name, then=f"{progress}; run gc again to finish"):
            if not _collect(backend, rdir, choose, cutoff, None, progress):
                log.warning(
                    "gc: no space to record the objects removed from %s; the next gc records it",
                    rdir,
                )
    return progress.removed


def _collect(
    backend: FileBackend,
    rdir: str,
    choose: Chooser,
    cutoff: float,
    trash: str | None,
    progress: _Progress,
) -> bool:
    """gc of one resource directory, inside its critical section.

    Victims go to ``trash`` (unlinked at once if it is None or has no room for them).
    Returns False if the line that forgets the removed publications could not be written
    for lack of space (a torn line that every reader ignores may be left).

    Neither the renames to ``trash/`` nor the unlinks need a sync: an object that reappears
    in ``objects/`` or ``trash/`` after a power failure is unreferenced and goes at the next
    gc.
    """
    loaded = backend.load(rdir, None)
    state = loaded.current if loaded is not None else None
    current = {p.object_id: p for p in state.pointers.values()} if state else {}
    superseded = {s.object_id: s for s in state.superseded} if state else {}
    objects: list[StoredObject] = []
    for entry in os.scandir(f"{rdir}/objects"):
        if not OBJECT_ID.fullmatch(entry.name):
            continue
        if (pub := current.get(entry.name)) is not None:
            objects.append(
                StoredObject(pub.object_id, cutoff, pub.name, pub.epoch, pub.published_at)
            )
        elif (old := superseded.get(entry.name)) is not None:
            objects.append(
                StoredObject(
                    old.object_id, old.superseded_at, old.name, old.epoch, old.published_at
                )
            )
        else:
            objects.append(StoredObject(entry.name, entry.stat().st_mtime))
    victims = choose(objects, set(current))
    for object_id in victims:
        _remove(f"{rdir}/objects/{object_id}", trash)
        progress.removed += 1
    for entry in os.scandir(f"{rdir}/staging"):
        if entry.stat().st_mtime < cutoff:
            os.unlink(entry.path)
    for entry in os.scandir(rdir):
        if entry.name.startswith(_DEBRIS):
            os.unlink(entry.path)  # an interrupted commit or checkpoint: we hold the lock
    if loaded is not None and state is not None:
        present = {o.object_id for o in objects} - set(victims)
        kept = [s for s in state.superseded if s.object_id in present]
        if kept != state.superseded:
            tx = FileTransaction(rdir, loaded, state.resource)
            tx.state.superseded = kept
            try:
                backend.commit(tx, sync=False)
            except OSError as error:
                if error.errno not in _NO_SPACE:
                    raise
                return False
    return True

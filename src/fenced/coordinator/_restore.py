"""Backup, and restore that can never make an old owner look current (docs/operations.md).

A coordinator restored from a backup has forgotten every epoch granted after the backup. If it
granted those epochs again, a store could not tell the new owner of epoch 42 from the old one.
So every restore ends with an **advance**: the coordinator-wide minimum epoch is raised to ::

    max(restore_base(now),                      # the wall-clock millisecond, core/_restore_base.py
        every epoch known in the state being replaced and in the restored state,
        every floor the given stores report)

and no later grant of any resource — old or new — gets an epoch at or below it. Every lease of
the state before the restore is ended, and a RESTORED record (detail: ``reason``, ``source``,
``base``, ``known``, ``store_floor``, ``era``, ``jump``, ``minimum``) goes into each resource's
history. Why post-restore tokens cannot be confused with pre-restore ones, even when the state
being replaced is lost and nothing is known about it:

* the base grows by ``2**16`` per millisecond of wall-clock time, and a restore or advance does
  not make its new state visible before the wall clock reads a later millisecond than the one
  its base came from (it waits for that, at most :data:`CLOCK_PATIENCE`; a clock that does not
  move in that time is an error and nothing is changed). So a later restore, even of the same
  backup within the same second, reads a later millisecond and gets a base above every epoch
  the earlier restored state granted — unless it granted one resource ``2**16`` times per
  millisecond, which no coordinator can — provided the wall clock did not step back between
  the two restores;
* the known epochs and store floors cover a wall clock that was set back.

A restore that did not go through fenced (files copied back, ``pg_restore``, an etcd snapshot
restore) is made safe the same way by :func:`advance` alone (``fenced restore --advance
--floor-from STORE``).

Functions (also used by ``fenced verify``):

* :func:`backup` — a consistent online copy of the embedded (``sqlite:``) coordinator.
* :func:`restore` — put such a copy back (``sqlite:`` only), advanced before it becomes visible.
* :func:`advance` — the advance step on any coordinator, through the backend contract.
* :func:`plan_minimum` — the pure computation of the new minimum.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fenced._drivers.local import local_path
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect, resolve_url
from fenced.coordinator.backends.sqlite import _backup as sqlite_backup
from fenced.core._errors import ConfigurationError
from fenced.core._restore_base import RESTORE_SHIFT, restore_base, restore_tick
from fenced.core._token import MAX_EPOCH
from fenced.core._urls import scheme_of

__all__ = [
    "CLOCK_PATIENCE",
    "BackupInfo",
    "FloorSource",
    "RestoreReport",
    "advance",
    "backup",
    "plan_minimum",
    "restore",
    "store_floors",
]

log = logging.getLogger("fenced.coordinator")

CLOCK_PATIENCE = 1.0
"""Seconds (monotonic) a restore waits for the wall clock to read a later millisecond than the
one its base came from; a clock that does not get there (stopped, or stepped back) fails it."""


class FloorSource(Protocol):
    """What a restore needs of a store (:class:`fenced.Store` has it)."""

    @property
    def url(self) -> str: ...

    def floors(self) -> dict[str, int]: ...

    def floor(self, resource: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class BackupInfo:
    """A backup that was written: where, of which coordinator, holding which epochs."""

    path: Path
    url: str
    coordinator_id: str
    resources: int
    largest_epoch: int

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "url": self.url,
            "coordinator_id": self.coordinator_id,
            "resources": self.resources,
            "largest_epoch": self.largest_epoch,
        }


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """What a restore or an advance did.

    ``minimum``: every later grant, of every resource, gets an epoch above it. ``base``:
    :func:`~fenced.core._restore_base.restore_base` at the time; ``known``: the largest epoch
    found in the coordinator states involved; ``store_floor``: the largest floor the stores
    reported; ``floors``: the per-resource floors given to the backend; ``source``: the backup
    restored (None for an advance alone).
    """

    url: str
    coordinator_id: str
    minimum: int
    base: int
    known: int
    store_floor: int
    floors: Mapping[str, int] = field(default_factory=dict)
    source: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "url": self.url,
            "coordinator_id": self.coordinator_id,
            "source": self.source,
            "minimum": self.minimum,
            "base": self.base,
            "known": self.known,
            "store_floor": self.store_floor,
            "era": self.minimum >> RESTORE_SHIFT,
            "floors": dict(sorted(self.floors.items())),
        }


def plan_minimum(now: float, known: int, floors: Mapping[str, int]) -> tuple[int, int, int]:
    """The new coordinator-wide minimum epoch, with the base and the largest store floor.

    ``max(restore_base(now), known, max(floors))``. Pure. Raises ConfigurationError if it would
    leave no room for later epochs (a store floor near 2**63, a corrupt input).
    """
    base = restore_base(now)
    store_floor = max(floors.values(), default=0)
    minimum = max(base, known, store_floor)
    if minimum >= MAX_EPOCH - 2**32:
        raise ConfigurationError(
            f"cannot advance epochs past {minimum}: too close to the largest epoch {MAX_EPOCH}"
        )
    return minimum, base, store_floor


def store_floors(stores: Iterable[FloorSource], resources: Iterable[str] = ()) -> dict[str, int]:
    """The largest floor of every resource over ``stores``.

    A store that keeps records lists all its resources (``store.floors()``); for one that does
    not, the floors of ``resources`` are read one by one.
    """
    names = list(resources)
    found: dict[str, int] = {}
    for store in stores:
        try:
            floors = store.floors()
        except ConfigurationError:
            floors = {}
            for name in names:
                floor = store.floor(name)
                if floor is not None:
                    floors[name] = floor
        for name, floor in floors.items():
            found[name] = max(found.get(name, 0), floor)
    return found


def _merge(*maps: Mapping[str, int]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for mapping in maps:
        for name, value in mapping.items():
            merged[name] = max(merged.get(name, 0), value)
    return merged


def _detail(
    reason: str, source: str | None, minimum: int, base: int, known: int, floor: int
) -> dict[str, object]:
    return {
        "reason": reason,
        "source": source,
        "base": base,
        "known": known,
        "store_floor": floor,
        "era": minimum >> RESTORE_SHIFT,
        "jump": minimum - known,
    }


def _past_tick(tick: int, wall: Callable[[], float]) -> None:
    """Return once ``wall`` reads a later millisecond than ``tick`` (see the module docstring).

    Raises ConfigurationError after :data:`CLOCK_PATIENCE` seconds of a wall clock that does not
    get there; the caller has changed nothing visible yet.
    """
    deadline = time.monotonic() + CLOCK_PATIENCE
    while restore_tick(wall()) <= tick:
        if time.monotonic() >= deadline:
            raise ConfigurationError(
                f"the wall clock did not pass {tick} ms since the Unix epoch within "
                f"{CLOCK_PATIENCE:g} s (stopped, or stepped back): nothing was changed; a "
                "restore needs a wall clock that moves forward (see docs/operations.md)"
            )
        time.sleep(0.001)


def _sqlite_path(url: str | None, what: str) -> tuple[str, Path]:
    resolved = resolve_url(url)
    if scheme_of(resolved) != "sqlite":
        raise ConfigurationError(
            f"{what} works on the embedded coordinator (sqlite:) only, not {resolved!r}: back up "
            "and restore PostgreSQL with pg_dump/pg_restore and etcd with etcdctl snapshot, then "
            "run 'fenced restore --advance' (see docs/operations.md)"
        )
    return resolved, local_path(resolved, "sqlite")


def backup(url: str | None, dest: str | os.PathLike[str]) -> BackupInfo:
    """Take a consistent online copy of the embedded coordinator at ``url`` into ``dest``.

    Safe while other processes acquire and release: the copy is one consistent snapshot (see
    :mod:`fenced.coordinator.backends.sqlite._backup`), checked, synced and renamed into place
    (``dest`` may be a directory). Raises ConfigurationError for a non-``sqlite:`` URL, a
    missing or foreign database, or an unwritable destination; nothing is left behind then.
    """
    resolved, path = _sqlite_path(url, "fenced backup")
    info = sqlite_backup.backup_database(path, Path(dest))
    log.info("backed up %s to %s (coordinator %s)", resolved, info.path, info.coordinator_id)
    return BackupInfo(
        info.path, resolved, info.coordinator_id, len(info.epochs), info.largest_epoch
    )


def restore(
    url: str | None,
    src: str | os.PathLike[str],
    *,
    stores: Iterable[FloorSource] = (),
    floors: Mapping[str, int] | None = None,
    wall: Callable[[], float] = time.time,
    force: bool = False,
) -> RestoreReport:
    """Put the backup ``src`` back as the embedded coordinator at ``url``, restore-safe.

    Steps: refuse if any process has the database open (stop every fenced process first; only
    processes this user may inspect can be seen); copy ``src`` next to the database and check
    it (a corrupt or foreign file, or an unknown schema: ConfigurationError, nothing changed);
    refuse a backup of another coordinator than the one in place (its id would make every store
    bound to the current one reject its tokens: move the current database away to restore onto
    an empty location); advance the staged copy's epochs (see the module docstring: the known
    epochs are the backup's and the replaced database's, the floors those of ``stores`` and
    ``floors``) and record RESTORED; wait until ``wall`` reads a later millisecond than the one
    the base came from (ConfigurationError, nothing changed, if it does not within
    :data:`CLOCK_PATIENCE`); only then replace the database atomically. A crash at any point
    leaves the old database or the advanced new one, never an unadvanced copy. Run one restore
    of a database at a time.

    The coordinator id of the backup is kept. ``wall`` (Unix seconds) is for tests.
    ``force=True`` replaces the database even while processes have it open (fault-injection
    tests): their open connections keep working on the replaced file, so whatever they grant
    from then on is lost to the restored state and is refused by every store that has seen a
    post-restore epoch, exactly like a pre-restore owner's writes.
    """
    resolved, target = _sqlite_path(url, "fenced restore")
    source = Path(src).absolute()
    if source.exists() and target.exists() and source.resolve() == target.resolve():
        raise ConfigurationError(f"{source} is the coordinator database itself")
    if not force:
        _refuse_if_in_use(target)
    current = None
    if target.exists():
        try:
            current = sqlite_backup.inspect_database(target, what="the coordinator database")
        except ConfigurationError as error:
            raise ConfigurationError(
                f"{error}; restore refuses to replace it: if it is the damaged coordinator "
                "database, move it away first"
            ) from error
    staging, staged = sqlite_backup.stage_copy(source, target)
    try:
        if current is not None and current.coordinator_id != staged.coordinator_id:
            raise ConfigurationError(
                f"{source} is a backup of coordinator {staged.coordinator_id}, but {resolved} "
                f"holds coordinator {current.coordinator_id}: restoring it would make every "
                "store bound to the current one reject its tokens; move the current database "
                "away first if this is what you mean"
            )
        names = set(staged.epochs) | set(current.epochs if current else {})
        reported = _merge(store_floors(stores, names), floors or {})
        known = max(staged.largest_epoch, current.largest_epoch if current else 0)
        now = wall()
        minimum, base, floor = plan_minimum(now, known, reported)
        per_resource = _merge(current.epochs if current else {}, reported)
        detail = _detail("restore", str(source), minimum, base, known, floor)
        from fenced.coordinator.backends.sqlite._backend import SQLiteBackend  # noqa: PLC0415

        staged_backend = SQLiteBackend(staging, marker=False)  # a transient copy
        try:
            new_minimum = staged_backend.advance(minimum, per_resource, detail)
        finally:
            staged_backend.close()
        _past_tick(restore_tick(now), wall)
        if not force:
            _refuse_if_in_use(target)
        sqlite_backup.install(staging, target)
    finally:
        sqlite_backup.discard(staging)
    log.warning("restored %s from %s: every later epoch is above %d", resolved, source, new_minimum)
    return RestoreReport(
        resolved, staged.coordinator_id, new_minimum, base, known, floor, per_resource, str(source)
    )


def _refuse_if_in_use(target: Path) -> None:
    users = sqlite_backup.users_of(target)
    if users:
        mine = " (this process)" if os.getpid() in users else ""
        raise ConfigurationError(
            f"{target} is in use by process {', '.join(map(str, users))}{mine}: stop every "
            "process that uses the coordinator before restoring it"
        )


def advance(
    target: Coordinator | str | None,
    *,
    stores: Iterable[FloorSource] = (),
    floors: Mapping[str, int] | None = None,
    wall: Callable[[], float] = time.time,
    reason: str = "advance",
) -> RestoreReport:
    """Make a coordinator restore-safe in place: raise its minimum epoch, end its leases.

    ``target``: a :class:`Coordinator`, or a URL (None: ``$FENCED_URL`` or the default) that is
    connected and closed here. The new minimum is ``max(restore_base(now), the coordinator's
    last epochs, the floors of stores and floors)`` (see the module docstring); once ``wall``
    reads a later millisecond than the one the base came from (ConfigurationError, nothing
    changed, if it does not within :data:`CLOCK_PATIENCE`), the backend's
    :meth:`~fenced.coordinator.backend.CoordinatorBackend.advance` applies it in one atomic step
    and records RESTORED for every resource. Works on every backend. Run it after state was
    restored behind fenced's back, before any worker uses the coordinator again (a lease
    granted in between is ended by it, which is safe but surprising). ``wall`` is for tests.
    """
    if isinstance(target, Coordinator):
        return _advance(target, stores, floors, wall, reason)
    with connect(target) as coord:
        return _advance(coord, stores, floors, wall, reason)


def _advance(
    coord: Coordinator,
    stores: Iterable[FloorSource],
    floors: Mapping[str, int] | None,
    wall: Callable[[], float],
    reason: str,
) -> RestoreReport:
    names = coord.resources()
    known = max((coord.last_epoch(name) for name in names), default=0)
    reported = _merge(store_floors(stores, names), floors or {})
    now = wall()
    minimum, base, floor = plan_minimum(now, known, reported)
    detail = _detail(reason, None, minimum, base, known, floor)
    _past_tick(restore_tick(now), wall)
    new_minimum = coord.backend.advance(minimum, dict(reported), detail)
    log.warning("advanced the epochs of %s: every later epoch is above %d", coord.url, new_minimum)
    return RestoreReport(coord.url, coord.coordinator_id, new_minimum, base, known, floor, reported)

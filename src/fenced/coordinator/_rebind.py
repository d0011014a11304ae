"""Rebind: give a store's resources to a new coordinator after the old one was lost for good.

A store binds each resource to the coordinator id of the first token it accepted and refuses the
tokens of any other coordinator (:class:`~fenced.ForeignToken`). A coordinator whose database is
lost *without a backup* cannot be restored: a new one has a new id, and every store bound to the
old id refuses its tokens forever. The recorded way out (docs/operations.md, "Lost coordinator
without a backup") is two steps::

    fenced restore --advance --floor-from STORE --url NEW     # 1. NEW's epochs above the floors
    fenced rebind STORE --url NEW --yes                        # 2. the store's resources to NEW

:func:`rebind` (step 2) binds the resources of one store to the new coordinator's id, each in one
atomic step of that resource (:meth:`fenced.Store.rebind`), keeping its floor, and records
REBOUND in the store's history. It refuses, before changing anything, unless the coordinator's
next epoch for every such resource is above its floor (step 1 done), and when the store's
resources are bound to more than one other coordinator and ``previous`` does not say which one
was lost.

**What it trusts.** After a rebind every token of the old coordinator is refused by that store,
whatever its epoch, so an old coordinator that still runs cannot make that store accept a stale
write. What rebind cannot know, and trusts the operator for:

* that the old coordinator is gone for good, or that every worker has been moved to the new
  one: two live coordinators grant the same resource twice, and each store accepts only its own
  coordinator's owner — mutual exclusion across stores bound to different coordinators, and in
  every effect outside fenced stores, is lost while both run;
* that every store the resource's owners write to is rebound (a store left bound to the old id
  refuses every new owner; one rebound while others are not splits the owners as above);
* that no worker still holds a token of the new coordinator granted *before* step 1 (stop the
  workers for the procedure, as for a restore): such a token's epoch is at most the advanced
  minimum, so it is stale after the first post-rebind install, but one whose epoch equals a
  resource's floor would be taken, until then, for the holder that installed that floor;
* ``guard()`` fence rows in your own databases are not touched: update their
  ``coordinator_id`` with one SQL statement under the same conditions.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect
from fenced.core._errors import ConfigurationError
from fenced.core._names import validate_resource
from fenced.core._token import validate_coordinator_id

__all__ = ["RebindReport", "RebindTarget", "rebind"]

log = logging.getLogger("fenced.coordinator")


class RebindTarget(Protocol):
    """What a rebind needs of a store (:class:`fenced.Store` has it)."""

    @property
    def url(self) -> str: ...

    def floors(self) -> dict[str, int]: ...

    def floor(self, resource: str) -> int | None: ...

    def binding(self, resource: str) -> str | None: ...

    def rebind(
        self, resource: str, coordinator_id: str, *, previous: str | None = None, ceiling: int
    ) -> str | None: ...


@dataclass(frozen=True, slots=True)
class RebindReport:
    """What a rebind did: ``rebound`` maps each resource it bound to ``coordinator_id`` to the
    floor it kept, ``previous`` the coordinator ids they were bound to; ``unchanged`` lists the
    resources asked for that needed nothing (bound to it already, or unbound)."""

    store: str
    url: str
    coordinator_id: str
    rebound: Mapping[str, int] = field(default_factory=dict)
    previous: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()

    def to_json(self) -> dict[str, object]:
        return {
            "store": self.store,
            "url": self.url,
            "coordinator_id": self.coordinator_id,
            "rebound": dict(sorted(self.rebound.items())),
            "previous": list(self.previous),
            "unchanged": list(self.unchanged),
        }


def rebind(
    store: RebindTarget,
    target: Coordinator | str | None,
    *,
    resources: Iterable[str] | None = None,
    previous: str | None = None,
) -> RebindReport:
    """Bind ``store``'s resources to the coordinator ``target``, keeping every floor.

    ``target``: a :class:`Coordinator`, or a URL (None: ``$FENCED_URL`` or the default)
    connected and closed here. ``resources``: those to rebind (default: every resource of the
    store that has a floor). ``previous``: the id of the lost coordinator; only resources bound
    to it are rebound (a named resource bound to another one is refused). Without it, the
    resources must all be bound to one other coordinator.

    Refuses with :class:`ConfigurationError`, changing nothing, when a resource's floor is not
    below the coordinator's next epoch for it (advance first: ``fenced restore --advance
    --floor-from STORE``), or as said above. Then each resource is rebound in its own atomic
    step, which checks again that it is still bound as planned and below the coordinator's last
    epoch; a failure part way leaves the resources done so far rebound (run it again: done ones
    are unchanged). Read the module docstring for what a rebind trusts.
    """
    if previous is not None:
        validate_coordinator_id(previous)
    names = None if resources is None else list(dict.fromkeys(map(validate_resource, resources)))
    if isinstance(target, Coordinator):
        return _rebind(store, target, names, previous)
    with connect(target) as coord:
        return _rebind(store, coord, names, previous)


def _rebind(
    store: RebindTarget, coord: Coordinator, names: list[str] | None, previous: str | None
) -> RebindReport:
    new = coord.coordinator_id
    if previous == new:
        raise ConfigurationError(f"{coord.url} is coordinator {previous} itself: nothing to rebind")
    floors = store.floors()
    chosen = sorted(floors) if names is None else names
    bound = {name: store.binding(name) for name in chosen}
    others = {name: old for name, old in bound.items() if old is not None and old != new}
    if previous is not None:
        strays = sorted(name for name, old in others.items() if old != previous)
        if strays and names is not None:
            raise ConfigurationError(
                f"{', '.join(strays)} at {store.url} is bound to coordinator "
                f"{others[strays[0]]}, not {previous}: nothing was changed"
            )
        others = {name: old for name, old in others.items() if old == previous}
    elif len(set(others.values())) > 1:
        raise ConfigurationError(
            f"the resources of {store.url} are bound to {len(set(others.values()))} other "
            f"coordinators ({', '.join(sorted(set(others.values())))}): say which one was lost "
            "(--from ID); nothing was changed"
        )
    ceilings = {name: coord.last_epoch(name) for name in others}
    kept = {name: floors[name] if name in floors else store.floor(name) or 0 for name in others}
    behind = [name for name in others if kept[name] > ceilings[name]]
    if behind:
        name = behind[0]
        raise ConfigurationError(
            f"coordinator {new} at {coord.url} is not past the floors of {store.url} ({name}: "
            f"floor {kept[name]}, last epoch {ceilings[name]}"
            + (f", and {len(behind) - 1} more" if len(behind) > 1 else "")
            + f"): run 'fenced restore --advance --floor-from {store.url}' on it first; "
            "nothing was changed"
        )
    for name in sorted(others):
        store.rebind(name, new, previous=others[name], ceiling=ceilings[name])
    if others:
        log.warning(
            "rebound %d resource(s) of %s from coordinator %s to %s",
            len(others),
            store.url,
            ", ".join(sorted(set(others.values()))),
            new,
        )
    return RebindReport(
        store.url,
        coord.url,
        new,
        {name: kept[name] for name in sorted(others)},
        tuple(sorted(set(others.values()))),
        tuple(name for name in chosen if name not in others),
    )

"""The decisions every store makes inside its critical section. Pure: no I/O.

A store backend reads what it holds for one fencing domain, asks these functions what to do, and
applies the answer in the same atomic step (one SQLite write transaction, one locked rename of a
state file). Keeping the decisions here means every backend enforces exactly the same rules:

* **binding** — the first token a domain accepts binds it to ``token.coordinator_id``; a token of
  another coordinator is :class:`ForeignToken`, whatever its epoch. Only an operator's rebind
  (:func:`admit_rebind`: a lost coordinator replaced) moves the binding; it keeps the floor.
* **fence** — ``epoch < floor`` is :class:`StaleToken`; otherwise the floor becomes ``epoch``.
* **mutation** — ``epoch < floor`` is :class:`StaleToken`; ``epoch == floor`` passes;
  ``epoch > floor`` is :class:`NotInstalled` in ``strict`` mode (including a domain that has
  never seen a token) and installs ``epoch`` as the new floor in ``monotonic`` mode.
* **compare-and-set** — ``if_version`` must equal the key's version (0: the key must not exist).
* **pointer** — a publication pointer moves only to an epoch at or above its own.
* **garbage** — which staged objects ``gc`` may remove.

Timeline of the difference between the modes (A holds 81, B is granted 82)::

    A: put(81) ok ... pauses ..................... put(81)  → ?
    B:               granted 82 │ fence(82) │ (no write yet)

    strict:    B's fence installed 82, so A's late put(81) is StaleToken.
    monotonic: without B's fence the store has only seen 81: A's late put(81) is accepted;
               once B writes with 82, every later 81 is StaleToken.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from fenced.core._errors import (
    ConfigurationError,
    ForeignToken,
    NotInstalled,
    StaleToken,
    VersionConflict,
)
from fenced.core._token import FencingToken
from fenced.fence._values import MODES, Mode

__all__ = [
    "Head",
    "StoredObject",
    "admit_fence",
    "admit_mutation",
    "admit_rebind",
    "check_pointer",
    "gc_victims",
    "next_version",
    "resolve_mode",
]


def resolve_mode(stored: str | None, requested: str | None, where: str) -> Mode:
    """The mode of a store being opened: the stored one, or the requested one for a new store.

    A new store (``stored`` None) gets ``requested`` or ``"strict"``. Opening an existing store
    with the other mode is a :class:`ConfigurationError`: a mode is chosen once, when the store is
    created, and applies to all its resources.
    """
    for value in (stored, requested):
        if value is not None and value not in MODES:
            raise ConfigurationError(f"{where}: unknown mode {value!r}; use one of {MODES}")
    if stored is None:
        return "monotonic" if requested == "monotonic" else "strict"
    if requested is not None and requested != stored:
        raise ConfigurationError(
            f"{where} was created in {stored} mode and cannot be opened in {requested} mode "
            "(the mode is chosen when a store is created; pass mode=None to use the stored one)"
        )
    return "monotonic" if stored == "monotonic" else "strict"


@dataclass(frozen=True, slots=True)
class Head:
    """What a store holds for one domain: its bound coordinator and its floor.

    Both are None for a domain that has never accepted a token.
    """

    coordinator_id: str | None = None
    floor: int | None = None


def _check_binding(head: Head, token: FencingToken) -> None:
    if head.coordinator_id is not None and head.coordinator_id != token.coordinator_id:
        raise ForeignToken(token.resource, token.coordinator_id, head.coordinator_id, head.floor)


def admit_fence(head: Head, token: FencingToken) -> Head:
    """The head after ``fence(token)``, or raise ForeignToken / StaleToken (nothing changes)."""
    _check_binding(head, token)
    if head.floor is not None and token.epoch < head.floor:
        raise StaleToken(token.resource, token.epoch, head.floor)
    return Head(token.coordinator_id, token.epoch)


def admit_mutation(mode: Mode, head: Head, token: FencingToken) -> Head:
    """The head after a mutation with ``token`` is accepted, or raise (nothing changes).

    Raises ForeignToken, StaleToken, or (strict mode, epoch above the floor) NotInstalled.
    """
    _check_binding(head, token)
    floor = head.floor
    if floor is not None and token.epoch < floor:
        raise StaleToken(token.resource, token.epoch, floor)
    if floor == token.epoch:
        return head
    if mode == "strict":
        raise NotInstalled(token.resource, token.epoch, floor or 0)
    return Head(token.coordinator_id, token.epoch)


def admit_rebind(head: Head, coordinator_id: str, *, previous: str | None, ceiling: int) -> Head:
    """The head after an operator binds a domain to ``coordinator_id``, its floor kept.

    For a store whose coordinator was lost without a backup (see ``fenced rebind``). An unbound
    domain, or one bound to ``coordinator_id`` already, is returned unchanged (its first token
    binds it). Raises :class:`ConfigurationError`, changing nothing, if the domain is bound to
    another coordinator than ``previous`` (when given), or if its floor is above ``ceiling``
    (the new coordinator's last epoch: its next grant would not be above the floor).
    """
    bound = head.coordinator_id
    if bound is None or bound == coordinator_id:
        return head
    if previous is not None and bound != previous:
        raise ConfigurationError(f"it is bound to coordinator {bound}, not {previous}")
    floor = head.floor or 0
    if floor > ceiling:
        raise ConfigurationError(
            f"its floor {floor} is above the last epoch {ceiling} of coordinator "
            f"{coordinator_id}: advance that coordinator past the store's floors first"
        )
    return Head(coordinator_id, head.floor)


def next_version(resource: str, key: str, current: int | None, if_version: int | None) -> int:
    """The version a put creates, or raise VersionConflict if ``if_version`` does not match.

    ``current`` is None for a key that does not exist; ``if_version`` None is unconditional.
    """
    actual = current or 0
    if if_version is not None and if_version != actual:
        raise VersionConflict(resource, key, if_version, actual)
    return actual + 1


def check_pointer(token: FencingToken, pointer_epoch: int | None) -> None:
    """Raise StaleToken if moving the pointer to ``token.epoch`` would move it backwards.

    The floor check already implies this (a pointer's epoch never exceeds the floor); it is
    kept as a second, independent guard of the publication invariant.
    """
    if pointer_epoch is not None and token.epoch < pointer_epoch:
        raise StaleToken(token.resource, token.epoch, pointer_epoch)


@dataclass(frozen=True, slots=True)
class StoredObject:
    """One staged object of one resource, as ``gc`` sees it.

    ``name``/``epoch``/``published_at`` are None for an object that was never published (a
    rejected, replayed or interrupted publish). ``idle_since`` is when it stopped being needed:
    the time it was superseded, or the time it was staged if it was never published.
    """

    object_id: str
    idle_since: float
    name: str | None = None
    epoch: int | None = None
    published_at: float | None = None


def gc_victims(
    objects: Iterable[StoredObject], current: Collection[str], *, keep: int, cutoff: float
) -> list[str]:
    """The ids ``gc`` may delete among one resource's ``objects``.

    Never a current pointer target (``current``), never one of the ``keep`` newest publications
    of a name (newest by epoch, then publication time), never an object idle since ``cutoff``
    or later (the grace period protects publishes in flight and readers of a snapshot).
    """
    objects = list(objects)
    kept = set(current)
    by_name: dict[str, list[StoredObject]] = {}
    for obj in objects:
        if obj.name is not None:
            by_name.setdefault(obj.name, []).append(obj)
    for published in by_name.values():
        published.sort(key=lambda o: (o.epoch or 0, o.published_at or 0.0), reverse=True)
        kept.update(o.object_id for o in published[:keep])
    return [o.object_id for o in objects if o.object_id not in kept and o.idle_since < cutoff]

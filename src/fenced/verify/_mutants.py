"""Detection power: seeded defects the checker must catch, and the ``--mutants`` driver.

Each :class:`Mutant` is a deliberately broken variant of fenced that only verify's own worker
processes build, at a seam of the library (:mod:`fenced.verify._seeded`: the library itself has
no switch for any of them), when verify names it in a worker's configuration. The driver runs
randomized schedules with the defect active — under a fault profile designed to expose it (a
profile changes what happens, never what the checker verifies) — until the checker reports a
violation, and tells which invariants caught it after how many schedules. A defect that
survives its budget of schedules is reported as **not caught**, and the run fails.

A defect exists only where it can be seeded (its hook): some only in one coordinator backend or
one store kind (``coordinators`` / ``stores``). Against a target without that backend or store
the defect is **n/a** (shown with the reason, never run, and no failure): running it would run
the correct program and call it a miss. The store defects are n/a against stores served over
HTTP (``http:``, ``https:``): their backend runs in the ``fenced serve`` process, which verify
does not seed.

==============================  ==================================================  =============
mutant                          defect (seam where verify seeds it)                 applies to
==============================  ==================================================  =============
no-fence-check                  stores accept any epoch                             every store
                                (SeededStore: floor read as the token's epoch)
check-then-write                the file store checks and writes without its lock   file: stores
                                (SeededStore: the file store's load and commit)
deadline-from-reply             local deadline from the reply time, not the send    every
                                time (SeededCoordinator.acquire, renew)             coordinator
renewal-failure-ignored         a failed renewal counts as a success                every
                                (SeededCoordinator.renew)                           coordinator
release-without-owner           release deletes whatever lease is live              sqlite
                                (SeededSQLiteBackend: the release statement)
epoch-reuse                     a grant after an expiry (crash, pause) or a         sqlite
                                restore reuses the last epoch
                                (SeededSQLiteBackend: the grant statements)
dedup-after-fence               the op-id lookup comes after the fence check        every store
                                (SeededStore: the op-id lookup)
publish-no-token-check          publish skips the fence and pointer checks          every store
                                (SeededStore: a publish's floor and pointer)
floor-after-write               the floor (the writer's epoch) is installed after   every store
                                the write, in a separate transaction
                                (SeededStore: a mutation's install)
renew-revives-expired           the server renews a lease of that owner and epoch   sqlite,
                                to now + ttl without checking it is still live: a   postgresql
                                renewal that arrives after the expiry revives it
                                (SeededSQLiteBackend: the renew statement;
                                SeededPostgresBackend: the renew function)
etcd-grant-no-revision-compare  the grant writes the epoch it read + 1 without      etcd
                                comparing the revision of the key it read
                                (SeededEtcdBackend: the grant's compares)
pg-grant-read-committed         the grant reads the resource's row without FOR      postgresql
                                UPDATE, then writes the epoch it read + 1
                                (SeededPostgresBackend: the try_grant function)
waiter-keeps-place              a waiter that gives up keeps its place in line      every
                                (SeededCoordinator: acquire's leave)                coordinator
==============================  ==================================================  =============

The profiles (:data:`~fenced.verify._schedule.PROFILES`) of the last four: ``late-renewals``
(renewals delayed or failing and retried by holders that check rarely, grant attempts late or
failing: a renewal reaches the coordinator after its lease expired, before any waiter took the
resource), ``handovers`` (short leases, kills: grants from a stale view), ``lapses`` (renewals
and releases fail: every lease lapses, and every waiter tries to take it at its expiry, at
once), ``give-ups`` (half the grant attempts fail: their waiters give up).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fenced.core._errors import ConfigurationError
from fenced.core._urls import scheme_of
from fenced.verify import _seeded as seeded
from fenced.verify._recorder import read_history
from fenced.verify._schedule import PROFILES, Schedule, run_schedule
from fenced.verify._target import Target

__all__ = [
    "CATALOGUE",
    "DEFAULT_BUDGET",
    "Mutant",
    "MutantResult",
    "MutantStatus",
    "hunt",
    "run_mutants",
]

DEFAULT_BUDGET = 8
"""Schedules a mutant may survive before it counts as not caught."""
MUTANT_DURATION = 3.0
"""Seconds of work per mutant schedule."""
EMBEDDED_STORES = ("sqlite", "file")
"""The store kinds verify creates itself for a role given no ``--store``."""

SERVED_STORES = frozenset({"http", "https"})
"""Store kinds whose backend is the server's: no store defect can be seeded in them."""

MutantStatus = Literal["caught", "not caught", "n/a"]


def _store_kinds(target: Target, profile: str) -> set[str]:
    """The store kinds of a run against ``target`` (those verify creates for a role given no
    store: by ``profile``)."""
    chosen = PROFILES[profile].stores
    kinds: set[str] = set()
    for index, role in enumerate(("S", "M")):
        url = target.stores.get(role)
        if url is not None:
            kinds.add(_kind(url))
        else:
            kinds.update(EMBEDDED_STORES if chosen is None else (chosen[index],))
    return kinds


def _kind(url: str) -> str:
    """The backend kind of a coordinator or store URL (``postgres:`` is ``postgresql``)."""
    scheme = scheme_of(url)
    return {"postgres": "postgresql", "etcds": "etcd"}.get(scheme, scheme)


@dataclass(frozen=True)
class Mutant:
    """One seeded defect: its switch, what it breaks, where, and the profile that exposes it."""

    name: str
    defect: str
    site: str
    expected: tuple[str, ...]
    """The invariants expected to catch it (documentation; any violation counts)."""
    profile: str
    coordinators: frozenset[str] | None = None
    """The coordinator backends (URL schemes) it can be seeded in; None: every one."""
    stores: frozenset[str] | None = None
    """The store kinds (URL schemes) it can be seeded in; None: every one a worker opens itself
    (never a served one: :data:`SERVED_STORES`)."""

    def not_applicable(self, target: Target) -> str | None:
        """Why the defect cannot exist in a run against ``target`` (None: it applies)."""
        if self.coordinators is not None:
            kind = "sqlite" if target.coordinator is None else _kind(target.coordinator)
            if kind not in self.coordinators:
                return (
                    f"no hook in the {kind} coordinator "
                    f"(only in {', '.join(sorted(self.coordinators))})"
                )
        if self.stores is None and self.name not in seeded.STORE_DEFECTS:
            return None
        kinds = _store_kinds(target, self.profile)
        seedable = kinds - SERVED_STORES
        if not seedable:
            return (
                f"no hook in the served {', '.join(sorted(kinds))} stores "
                "(their backend runs in the fenced serve process, which verify does not seed)"
            )
        if self.stores is not None and not seedable & self.stores:
            return (
                f"no hook in the {', '.join(sorted(kinds))} stores "
                f"(only in {', '.join(sorted(self.stores))})"
            )
        return None


CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "no-fence-check",
        "stores accept a mutation whatever its epoch (the fence check is disabled)",
        "verify/_seeded.py SeededStore: the floor a put or publish reads",
        ("largest-seen", "chain-integrity"),
        "in-flight",
    ),
    Mutant(
        "check-then-write",
        "the file store reads, checks and writes without its lock: check and write are "
        "separate steps",
        "verify/_seeded.py SeededStore: the file store's load and commit, without its lock",
        ("chain-integrity", "largest-seen"),
        "in-commit",
        stores=frozenset({"file"}),
    ),
    Mutant(
        "deadline-from-reply",
        "the local deadline is computed from the time the reply arrived",
        "verify/_seeded.py SeededCoordinator.acquire, SeededCoordinator.renew",
        ("holder-deadline",),
        "reply-delays",
    ),
    Mutant(
        "renewal-failure-ignored",
        "a failed renewal is treated as a success (deadline extended, nothing reported)",
        "verify/_seeded.py SeededCoordinator.renew (called by the lease keeper)",
        ("holder-deadline", "diagnostics-match"),
        "renewal-failures",
    ),
    Mutant(
        "release-without-owner",
        "release deletes the live lease without comparing owner and epoch",
        "verify/_seeded.py SeededSQLiteBackend: the release statement",
        ("compare-owner", "exclusive-grant"),
        "late-releases",
        coordinators=frozenset({"sqlite"}),
    ),
    Mutant(
        "epoch-reuse",
        "a grant after an expiry (a crashed or paused holder) or a restore reuses the last "
        "epoch instead of max(last, minimum) + 1",
        "verify/_seeded.py SeededSQLiteBackend: the grant statements",
        ("token-unique", "token-monotonic"),
        "expiries",
        coordinators=frozenset({"sqlite"}),
    ),
    Mutant(
        "dedup-after-fence",
        "the op-id lookup happens after the fence check: a retry after a takeover is told "
        "StaleToken although its first attempt landed",
        "verify/_seeded.py SeededStore: the op-id lookup",
        ("outcome-honesty",),
        "lost-writes",
    ),
    Mutant(
        "publish-no-token-check",
        "publish moves the pointer without checking the token (floor and pointer epoch)",
        "verify/_seeded.py SeededStore: the floor and the pointer a publish reads",
        ("largest-seen", "pointer-monotonic"),
        "publications",
    ),
    Mutant(
        "floor-after-write",
        "the store checks and writes in one transaction and installs the writer's epoch as the "
        "floor in a second one: a newer epoch installed in between refuses that install, and "
        "the writer is told StaleToken although its write landed",
        "verify/_seeded.py SeededStore: a mutation's install, moved after its commit",
        ("outcome-honesty",),
        "in-commit",
    ),
    Mutant(
        "renew-revives-expired",
        "the server renews a lease of that owner and epoch to now + ttl without checking that it "
        "is still live: a renewal that arrives after the lease expired (nobody took the resource "
        "since) revives it",
        "verify/_seeded.py SeededSQLiteBackend: the renew statement; verify/_seeded_postgres.py: "
        "the renew function",
        ("compare-owner",),
        "late-renewals",
        coordinators=frozenset({"sqlite", "postgresql"}),
    ),
    Mutant(
        "etcd-grant-no-revision-compare",
        "the etcd grant writes the epoch it read + 1 without comparing the revision of the key "
        "it read it from: a grant from a stale view issues an epoch again",
        "verify/_seeded_etcd.py SeededEtcdBackend: the grant transaction's compares",
        ("token-unique", "token-monotonic", "diagnostics-match"),
        "handovers",
        coordinators=frozenset({"etcd"}),
    ),
    Mutant(
        "pg-grant-read-committed",
        "the PostgreSQL grant reads the resource's row without FOR UPDATE (READ COMMITTED) and "
        "writes the epoch it read + 1: two overlapping grants issue the same epoch",
        "verify/_seeded_postgres.py: the try_grant function's read of the resource",
        ("token-unique", "exclusive-grant"),
        "lapses",
        coordinators=frozenset({"postgresql"}),
    ),
    Mutant(
        "waiter-keeps-place",
        "a waiter that gives up (its wait ran out, or an error ended it) keeps its place in line: "
        "the waiters behind it wait until the backend drops that place",
        "verify/_seeded.py SeededCoordinator: acquire's leave",
        ("grant-progress",),
        "give-ups",
    ),
)
"""Every seeded defect, in table order (the names are those of fenced.verify._seeded)."""

assert {m.name for m in CATALOGUE} == seeded.DEFECTS


@dataclass
class MutantResult:
    """How one mutant fared: caught or not (or n/a), by which invariants, after how many
    schedules."""

    mutant: Mutant
    caught: bool = False
    invariants: list[str] = field(default_factory=list)
    schedules: int = 0
    seed: int | None = None
    history: Path | None = None
    messages: list[str] = field(default_factory=list)
    not_applicable: str | None = None
    """Why the defect does not exist against this target (then nothing was run)."""

    @property
    def status(self) -> MutantStatus:
        if self.not_applicable is not None:
            return "n/a"
        return "caught" if self.caught else "not caught"

    @property
    def failed(self) -> bool:
        """True if the defect applied and survived its budget (the run fails)."""
        return self.status == "not caught"

    def to_json(self) -> dict[str, Any]:
        return {
            "mutant": self.mutant.name,
            "defect": self.mutant.defect,
            "site": self.mutant.site,
            "profile": self.mutant.profile,
            "status": self.status,
            "caught": None if self.not_applicable is not None else self.caught,
            "not_applicable": self.not_applicable,
            "invariants": self.invariants,
            "schedules": self.schedules,
            "seed": self.seed,
            "history": None if self.history is None else str(self.history),
            "violations": self.messages[:10],
        }


def _by_name(names: Iterable[str] | None) -> list[Mutant]:
    if names is None:
        return list(CATALOGUE)
    known = {m.name: m for m in CATALOGUE}
    chosen = []
    for name in names:
        if name not in known:
            raise ConfigurationError(
                f"unknown mutant {name!r}; known: {', '.join(m.name for m in CATALOGUE)}"
            )
        chosen.append(known[name])
    return chosen


def hunt(
    mutant: Mutant,
    target: Target,
    *,
    seed: int,
    budget: int = DEFAULT_BUDGET,
    duration: float = MUTANT_DURATION,
    keep_history: Path | None = None,
) -> MutantResult:
    """Run schedules ``seed``, ``seed + 1``, … with ``mutant`` active until one is caught.

    A mutant that does not apply to ``target`` is not run (its result is n/a, with the reason).
    Raises :class:`RuntimeError` if the workers did not run the mutant (a switch that does not
    reach the worker processes must not look like a correct program).
    """
    result = MutantResult(mutant, not_applicable=mutant.not_applicable(target))
    if result.not_applicable is not None:
        return result
    workdir = Path(tempfile.mkdtemp(prefix="fenced-verify-mutant-"))
    try:
        for index in range(budget):
            schedule = Schedule.draw(seed + index, duration, profile=PROFILES[mutant.profile])
            outcome = run_schedule(schedule, target, workdir, mutants=[mutant.name])
            result.schedules = index + 1
            events = read_history(outcome.history)
            if not any(
                e["ev"] == "start" and mutant.name in (e.get("mutants") or []) for e in events
            ):
                raise RuntimeError(f"the workers did not switch on mutant {mutant.name}")
            if not outcome.ok:
                result.caught = True
                result.invariants = outcome.report.invariants()
                result.messages = [f"{v.invariant}: {v.message}" for v in outcome.report.violations]
                result.seed = schedule.seed
                if keep_history is not None:
                    keep_history.mkdir(parents=True, exist_ok=True)
                    kept = keep_history / f"mutant-{mutant.name}-{outcome.history.name}"
                    shutil.copyfile(outcome.history, kept)
                    result.history = kept
                break
            shutil.rmtree(outcome.history.parent, ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def run_mutants(
    target: Target,
    *,
    seed: int,
    names: Iterable[str] | None = None,
    budget: int = DEFAULT_BUDGET,
    duration: float = MUTANT_DURATION,
    keep_history: Path | None = None,
    progress: Callable[[MutantResult], None] | None = None,
) -> list[MutantResult]:
    """Hunt every mutant of the catalogue (or those named); returns the results in order
    (those that do not apply to ``target`` as n/a)."""
    results = []
    for mutant in _by_name(names):
        result = hunt(
            mutant,
            target,
            seed=seed,
            budget=budget,
            duration=duration,
            keep_history=keep_history,
        )
        results.append(result)
        if progress is not None:
            progress(result)
    return results

"""Detection power: seeded defects the checker must catch, and the ``--mutants`` driver.

Each :class:`Mutant` is a deliberately broken variant of fenced, switched on only inside verify's
own worker processes (through :data:`fenced.core.mutants.ENV_VAR`; the switches are not
reachable from the public API). The driver runs randomized schedules with the defect active —
under a fault profile that makes the faults exposing it frequent (a profile changes what
happens, never what the checker verifies) — until the checker reports a violation, and tells
which invariants caught it after how many schedules. A defect that survives its budget of
schedules is reported as **not caught**, and the run fails.

=========================  =======================================================  ===========
mutant                     defect (hook site)                                       profile
=========================  =======================================================  ===========
no-fence-check             stores accept any epoch (fence/rules.py admit_mutation)  in-flight
check-then-write           file store checks and writes without its lock            storm
                           (fence/file_store.py transaction)
deadline-from-reply        local deadline from the reply time, not the send time    reply-delays
                           (coordinator/client.py acquire, renew)
renewal-failure-ignored    a failed renewal counts as a success                     renewal-
                           (runtime/keeper.py renewer)                              failures
release-without-owner      release deletes whatever lease is live                   late-releases
                           (coordinator/backends/sqlite.py, memory.py release)
epoch-reuse                a grant after an expiry (crash, pause) or a restore      standard
                           reuses the last epoch (coordinator/backends/sqlite.py)
dedup-after-fence          the op-id lookup comes after the fence check             lost-writes
                           (fence/store.py _mutate)
publish-no-token-check     publish skips the fence and pointer checks               publications
                           (fence/store.py _mutate, fence/rules.py check_pointer)
=========================  =======================================================  ===========
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fenced.core import mutants as switches
from fenced.core.errors import ConfigurationError
from fenced.verify.recorder import read_history
from fenced.verify.schedule import PROFILES, Schedule, run_schedule
from fenced.verify.target import Target

__all__ = ["CATALOGUE", "DEFAULT_BUDGET", "Mutant", "MutantResult", "hunt", "run_mutants"]

DEFAULT_BUDGET = 8
"""Schedules a mutant may survive before it counts as not caught."""
MUTANT_DURATION = 3.0
"""Seconds of work per mutant schedule."""


@dataclass(frozen=True)
class Mutant:
    """One seeded defect: its switch, what it breaks, where, and the profile that exposes it."""

    name: str
    defect: str
    site: str
    expected: tuple[str, ...]
    """The invariants expected to catch it (documentation; any violation counts)."""
    profile: str


CATALOGUE: tuple[Mutant, ...] = (
    Mutant(
        "no-fence-check",
        "stores accept a mutation whatever its epoch (the fence check is disabled)",
        "fence/rules.py admit_mutation",
        ("largest-seen", "chain-integrity"),
        "in-flight",
    ),
    Mutant(
        "check-then-write",
        "the file store reads, checks and writes without its lock: check and write are "
        "separate steps",
        "fence/file_store.py FileBackend.transaction",
        ("chain-integrity", "largest-seen"),
        "storm",
    ),
    Mutant(
        "deadline-from-reply",
        "the local deadline is computed from the time the reply arrived",
        "coordinator/client.py Coordinator.acquire, Coordinator.renew",
        ("holder-deadline",),
        "reply-delays",
    ),
    Mutant(
        "renewal-failure-ignored",
        "a failed renewal is treated as a success (deadline extended, nothing reported)",
        "runtime/keeper.py HeldLease._renew_loop",
        ("holder-deadline", "diagnostics-match"),
        "renewal-failures",
    ),
    Mutant(
        "release-without-owner",
        "release deletes the live lease without comparing owner and epoch",
        "coordinator/backends/sqlite.py and memory.py release",
        ("compare-owner", "exclusive-grant"),
        "late-releases",
    ),
    Mutant(
        "epoch-reuse",
        "a grant after an expiry (a crashed or paused holder) or a restore reuses the last "
        "epoch instead of max(last, minimum) + 1",
        "coordinator/backends/sqlite.py SQLiteBackend._grant",
        ("token-unique", "token-monotonic"),
        "standard",
    ),
    Mutant(
        "dedup-after-fence",
        "the op-id lookup happens after the fence check: a retry after a takeover is told "
        "StaleToken although its first attempt landed",
        "fence/store.py Store._mutate",
        ("outcome-honesty",),
        "lost-writes",
    ),
    Mutant(
        "publish-no-token-check",
        "publish moves the pointer without checking the token (floor and pointer epoch)",
        "fence/store.py Store._mutate, fence/rules.py check_pointer",
        ("largest-seen", "pointer-monotonic"),
        "publications",
    ),
)
"""Every seeded defect, in table order (the names are the switches of fenced.core.mutants)."""

assert {m.name for m in CATALOGUE} == switches.KNOWN


@dataclass
class MutantResult:
    """How one mutant fared: caught or not, by which invariants, after how many schedules."""

    mutant: Mutant
    caught: bool = False
    invariants: list[str] = field(default_factory=list)
    schedules: int = 0
    seed: int | None = None
    history: Path | None = None
    messages: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "mutant": self.mutant.name,
            "defect": self.mutant.defect,
            "site": self.mutant.site,
            "profile": self.mutant.profile,
            "caught": self.caught,
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

    Raises :class:`RuntimeError` if the workers did not run the mutant (a switch that does not
    reach the worker processes must not look like a correct program).
    """
    result = MutantResult(mutant)
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
    """Hunt every mutant of the catalogue (or those named); returns the results in order."""
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

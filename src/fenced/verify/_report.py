"""What the history checker verifies and what it answers: the invariants and the report.

:data:`INVARIANTS` is the catalogue of every invariant :func:`fenced.verify._checker.check_history`
verifies, by the name that reports, tables and ``--mutants`` results show. A :class:`Report` holds
every :class:`Violation` found in one history (each names one invariant of the catalogue; a single
one fails the run), the run's figures and notes; it serialises to JSON for ``fenced verify --json``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["INVARIANTS", "Report", "Violation"]

INVARIANTS: dict[str, str] = {
    "token-unique": "each (resource, epoch) is granted at most once",
    "token-monotonic": "a grant that starts after another one ended has a larger epoch",
    "exclusive-grant": "no grant before the previous lease's TTL ran out, unless it was released",
    "holder-deadline": "the holder's local deadline is never later than the send time of an "
    "applied acquire/renew + TTL",
    "stop-at-deadline": "no protected mutation is sent after the holder's local deadline, "
    "except across an injected pause or a host suspend",
    "largest-seen": "a store never accepts an epoch below one it has acknowledged; the epochs of "
    "accepted writes never decrease",
    "install-then-equal": "a strict store accepts a mutation only with the installed epoch",
    "chain-integrity": "every accepted write extends exactly the previously accepted state "
    "(no lost update, no acknowledged write missing)",
    "compare-owner": "release and renew take effect only on the live lease of that owner and epoch",
    "grant-progress": "a free resource with a waiter in line is granted within ttl + margin, "
    "unless a fault (pause, kill, cut, delayed request) explains the delay",
    "op-exactly-once": "an operation id takes effect at most once",
    "outcome-honesty": "an operation reported as failed never took effect",
    "pointer-monotonic": "the publication pointer never moves backwards",
    "pointer-sealed": "the pointer only shows complete objects of accepted publications",
    "restore-monotonic": "after a restore every grant is above every epoch issued or seen before",
    "diagnostics-match": "recorded grants, releases, renewal failures and rejected writes match "
    "the history exactly",
}
"""Every invariant the checker verifies, by name (the names appear in reports)."""


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant, with a sentence saying where (epochs, workers, times)."""

    invariant: str
    message: str
    at: float | None = None
    """When, on the history's clock (``t`` in the report's JSON); None: the final state."""

    def to_json(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "message": self.message, "t": self.at}


@dataclass
class Report:
    """The checker's verdict on one history."""

    violations: list[Violation] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def invariants(self) -> list[str]:
        """The names of the broken invariants, in catalogue order."""
        broken = {v.invariant for v in self.violations}
        return [name for name in INVARIANTS if name in broken]

    def add(self, invariant: str, message: str, at: float | None = None) -> None:
        """Record a violation of ``invariant``, which must be one of :data:`INVARIANTS`."""
        assert invariant in INVARIANTS, invariant
        self.violations.append(Violation(invariant, message, at))

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "violations": [v.to_json() for v in self.violations],
            "stats": dict(sorted(self.stats.items())),
            "notes": self.notes,
        }

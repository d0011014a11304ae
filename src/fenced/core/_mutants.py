"""Test-only switches for seeded defects ("mutants") used by ``fenced verify --mutants``. Pure.

**Not part of the public API** and not exported by :mod:`fenced`. Every switch is off unless a
``fenced verify`` worker process turns it on at start-up with an explicit :func:`activate` call
(the names come from the worker's own configuration, which verify writes on its command line);
nothing in the library turns one on, and no environment variable does. Each defect is a hook of
one or two lines at the exact code site it breaks, guarded by :func:`active`; an inactive hook
costs one membership test in an empty frozenset.

The catalogue (what each switch breaks, where it applies, and which invariant of the history
checker must catch it) lives in :mod:`fenced.verify.mutants`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from fenced.core.lease import Lease

__all__ = ["KNOWN", "activate", "active", "assumed_renewal", "caught"]

KNOWN = frozenset(
    {
        "no-fence-check",
        "check-then-write",
        "deadline-from-reply",
        "renewal-failure-ignored",
        "release-without-owner",
        "epoch-reuse",
        "dedup-after-fence",
        "publish-no-token-check",
    }
)
"""Every switch that has a hook in the library."""

_ACTIVE: frozenset[str] = frozenset()


def active(name: str) -> bool:
    """True if the seeded defect ``name`` is switched on in this process (never by default)."""
    return name in _ACTIVE


def activate(names: Iterable[str]) -> frozenset[str]:
    """Switch on exactly ``names`` (replacing earlier ones; none switches all off); returns them.

    Called only by the verify worker at start-up (and by the unit tests of the hooks). An
    unknown name is a :class:`ValueError` and changes nothing, so a typo cannot make a mutant
    run silently as the correct program.
    """
    global _ACTIVE  # noqa: PLW0603 - one process-wide switch board, set once at start-up
    chosen = frozenset(name.strip() for name in names if name.strip())
    unknown = chosen - KNOWN
    if unknown:
        raise ValueError(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    _ACTIVE = chosen
    return chosen


def caught(name: str) -> tuple[type[Exception], ...]:
    """For an ``except`` clause: every exception while ``name`` is active, else none."""
    return (Exception,) if name in _ACTIVE else ()


def assumed_renewal(lease: Lease, sent: float) -> Lease:
    """Seeded defect ``renewal-failure-ignored``: the lease as if the failed renewal sent at
    monotonic ``sent`` had succeeded (its deadline extended from ``sent``)."""
    return dataclasses.replace(lease, deadline=sent + lease.ttl - lease.safety_margin)

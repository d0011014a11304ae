"""What ``fenced verify`` must show against a networked coordinator (PostgreSQL, etcd)."""

from __future__ import annotations

from fenced.verify.cases import CASES, run_cases
from fenced.verify.schedule import run_random
from fenced.verify.target import Target

__all__ = ["assert_verify_passes"]


def assert_verify_passes(target: Target, seed: int, schedules: int) -> None:
    """Every case of the practice table passes with no violation — except case 6 (restore),
    which verify never runs against a coordinator it did not create: *not available* — and
    ``schedules`` seeded fault schedules from ``seed`` keep every invariant."""
    assert target.proxied  # a networked coordinator on loopback: one TCP proxy per worker
    rows = run_cases(target)
    assert [row.number for row in rows] == [case.number for case in CASES]
    for row in rows:
        assert row.violations == [], (row.number, row.violations)
        expected = "unavailable" if row.number == "6" else "pass"
        assert row.status == expected, (row.number, row.observed)
        assert row.observed

    summary = run_random(schedules, seed, target, duration=3.0)
    assert summary.ok, [(r.schedule.seed, r.report.violations) for r in summary.failed]
    assert summary.totals()["grants"] >= schedules

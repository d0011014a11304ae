"""What ``fenced verify`` must show against a networked coordinator (PostgreSQL, etcd)."""

from __future__ import annotations

import json
import subprocess
import sys

from fenced.verify._cases import CASES, run_cases
from fenced.verify._mutants import CATALOGUE
from fenced.verify._schedule import run_random
from fenced.verify._target import Target

__all__ = ["ONLY_EMBEDDED", "assert_mutants_pass", "assert_verify_passes", "elsewhere"]

ONLY_EMBEDDED = frozenset({"release-without-owner", "epoch-reuse"})
"""The seeded defects whose hooks exist only in the embedded (SQLite) coordinator."""


def elsewhere(kind: str) -> frozenset[str]:
    """The seeded defects without a hook in the ``kind`` coordinator (``postgresql``,
    ``etcd``): n/a against it (the embedded stores have every store defect)."""
    return frozenset(
        m.name for m in CATALOGUE if m.coordinators is not None and kind not in m.coordinators
    )


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


def _fenced(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fenced", "verify", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def assert_mutants_pass(coordinator: str, seed: int, kind: str) -> None:
    """``fenced verify --mutants --coordinator URL`` exits 0: every defect with a hook in this
    coordinator (of ``kind``; and the embedded stores) is caught, and the defects of the other
    coordinators (the embedded one's among them) are shown as n/a, not as failures;
    ``--random`` refuses them."""
    done = _fenced(
        *("--mutants", "--coordinator", coordinator, "--seed", str(seed), "--json"), timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(done.stdout)
    assert document["ok"] is True
    statuses = {row["mutant"]: row["status"] for row in document["mutants"]}
    absent = elsewhere(kind)
    assert absent >= ONLY_EMBEDDED
    assert {name for name, status in statuses.items() if status == "n/a"} == absent
    applicable = {status for name, status in statuses.items() if name not in absent}
    assert applicable == {"caught"}, statuses
    refused = _fenced(
        *("--random", "1", "--mutant", "epoch-reuse", "--coordinator", coordinator), timeout=60
    )
    assert refused.returncode == 2
    assert "--mutant epoch-reuse does not apply here" in refused.stderr

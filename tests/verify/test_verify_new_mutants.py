"""Seeded defects added for issue 25: each one exists at its seam and is caught by the checker.

* ``floor-after-write``: a store that checks and writes in one transaction and installs the
  writer's epoch as the floor in a second one. First the seam itself, in one process and without
  timing (a successor's fence run in the window between the two transactions); then hunts with
  real processes under the defect's profile (``in-commit``: a writer stopped inside the strict
  store's critical section, so that the successor's fence queues behind it and lands in that
  window): caught, and the same schedules pass without the defect.

(``waiter-keeps-place``, a waiter that keeps its queue place after it gave up, only delays later
grants; ``grant-progress`` catches it: tests/verify/test_verify_hooks.py builds it, and it is
hunted with the other defects in test_verify.py, test_verify_postgres.py and
test_verify_etcd.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from fenced.core._errors import StaleToken
from fenced.core._token import FencingToken
from fenced.core._urls import url_of_path
from fenced.fence import open_store
from fenced.verify import _seeded as seeded
from fenced.verify._mutants import CATALOGUE, hunt
from fenced.verify._schedule import PROFILES, Schedule, run_schedule
from fenced.verify._target import Target

COORDINATOR = "c" * 32
R = "verify/new-mutants"

(FLOOR_AFTER_WRITE,) = [m for m in CATALOGUE if m.name == seeded.FLOOR_AFTER_WRITE]


def _token(epoch: int) -> FencingToken:
    return FencingToken(COORDINATOR, R, epoch)


@pytest.mark.parametrize("kind", ["file", "sqlite"])
def test_floor_after_write_installs_the_floor_in_a_second_transaction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    url = url_of_path(kind, str(tmp_path / ("store.db" if kind == "sqlite" else "store")))
    with open_store(url, mode="strict") as other:
        other.fence(_token(1))
        store = seeded.store(open_store(url), frozenset({seeded.FLOOR_AFTER_WRITE}))
        assert isinstance(store, seeded.SeededStore)
        try:
            # In the window, after the write's commit: a successor installs epoch 2.
            windows: list[str] = []

            def successor_fences() -> None:
                windows.append("put 1")
                other.fence(_token(2))

            monkeypatch.setattr(seeded, "_between_the_transactions", successor_fences)
            with pytest.raises(StaleToken):
                store.put(_token(1), "k", b"first", op_id="op-1")
            assert windows == ["put 1"]
            item = other.get(R, "k")  # told StaleToken, yet the write landed
            assert item is not None
            assert (item.value, item.epoch) == (b"first", 1)
            assert other.floor(R) == 2

            # Without a newer epoch in between, the write is accepted and its epoch installed.
            def nobody_comes() -> None:
                windows.append("put 2")

            monkeypatch.setattr(seeded, "_between_the_transactions", nobody_comes)
            assert store.put(_token(2), "k", b"second").version == 2
            assert windows == ["put 1", "put 2"]
            assert other.floor(R) == 2
        finally:
            store.close()


def test_floor_after_write_lets_a_stale_writer_slip_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = url_of_path("sqlite", str(tmp_path / "monotonic.db"))
    with open_store(url, mode="monotonic") as other:
        other.put(_token(1), "k", b"by 1")
        store = seeded.store(open_store(url), frozenset({seeded.FLOOR_AFTER_WRITE}))
        try:
            # Epoch 3's write has committed without its install: epoch 2 is still accepted.
            def stale_writer() -> None:
                other.put(_token(2), "other", b"by 2")

            monkeypatch.setattr(seeded, "_between_the_transactions", stale_writer)
            store.put(_token(3), "k", b"by 3")
            stale = other.get(R, "other")
            assert stale is not None and stale.epoch == 2
            assert other.floor(R) == 3
        finally:
            store.close()


def test_floor_after_write_is_in_the_catalogue_for_every_store() -> None:
    assert FLOOR_AFTER_WRITE.profile in PROFILES
    assert FLOOR_AFTER_WRITE.stores is None and FLOOR_AFTER_WRITE.coordinators is None
    assert FLOOR_AFTER_WRITE.not_applicable(Target()) is None
    assert FLOOR_AFTER_WRITE.not_applicable(Target("etcd://127.0.0.1:2379")) is None


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [11, 2024])
def test_floor_after_write_is_caught(seed: int) -> None:
    result = hunt(FLOOR_AFTER_WRITE, Target(), seed=seed, budget=3, duration=2.5)
    assert result.caught, f"floor-after-write survived {result.schedules} schedules"
    assert "outcome-honesty" in result.invariants, result.messages


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", [11, 2024])
def test_the_same_schedule_passes_without_the_defect(seed: int, tmp_path: Path) -> None:
    schedule = Schedule.draw(seed, 2.5, profile=PROFILES[FLOOR_AFTER_WRITE.profile])
    outcome = run_schedule(schedule, Target(), tmp_path)
    violations: list[Any] = outcome.report.violations
    assert outcome.ok, violations
    assert outcome.report.stats["grants"] >= 2
    shutil.rmtree(outcome.history.parent, ignore_errors=True)

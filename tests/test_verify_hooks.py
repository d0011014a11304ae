"""Every seeded defect of ``fenced verify --mutants`` changes what its hook site does.

A hook that no longer changes anything (a reformatted statement, a moved check) would make the
hunt run the correct program and call it a miss, or worse, a catch of something else. These unit
tests drive the real backend and store objects at each hook site with the defect off and on
(milliseconds, no processes), and pin the SQLite defects — statements of their own — to the
correct statements they break. Last, no environment variable switches a defect on: a verify
worker is told by its configuration, and a normal process cannot be.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from fenced.coordinator.backend import (
    Blocked,
    CoordinatorBackend,
    Granted,
    GrantRequest,
    Ticket,
)
from fenced.coordinator.backends.memory.backend import MemoryBackend
from fenced.coordinator.backends.sqlite import statements as sqlite_statements
from fenced.coordinator.backends.sqlite.backend import SQLiteBackend
from fenced.coordinator.client import Coordinator
from fenced.core import _mutants as switches
from fenced.core.clock import ManualClock
from fenced.core.errors import StaleToken, Unavailable
from fenced.fence import open_store
from fenced.fence.store import Store
from fenced.testing.store_conformance import R, token
from fenced.verify.recorder import read_history
from fenced.verify.worker import WorkerConfig

OWNER_A, OWNER_B, OWNER_C = "a" * 32, "b" * 32, "c" * 32
ENV_VAR = "_FENCED_VERIFY_MUTANT"  # the variable that switched defects on before (and must not)


@contextmanager
def seeded(name: str) -> Iterator[None]:
    """The defect ``name`` switched on in this process for the block."""
    switches.activate([name])
    try:
        yield
    finally:
        switches.activate(())


def granted(result: Granted | Blocked) -> Granted:
    assert isinstance(result, Granted), result
    return result


def request(owner: str, ttl: float = 10.0, request_id: str | None = None) -> GrantRequest:
    return GrantRequest(R, ttl, owner, f"holder-{owner[0]}", request_id)


def test_no_defect_is_on_by_default() -> None:
    assert not any(switches.active(name) for name in switches.KNOWN)


# -- coordinator backends ---------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "memory"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CoordinatorBackend]:
    clock = ManualClock()
    opened: CoordinatorBackend
    if request.param == "sqlite":
        opened = SQLiteBackend(tmp_path / "fenced.db", host_clock=clock)
    else:
        opened = MemoryBackend(f"hooks-{tmp_path.name}", host_clock=clock)
    yield opened
    opened.close()


def test_release_without_owner_ends_another_owners_lease(backend: CoordinatorBackend) -> None:
    lease = granted(backend.try_grant(request(OWNER_A), None))
    assert backend.release(R, lease.epoch, OWNER_B) is False
    assert backend.release(R, lease.epoch + 1, OWNER_A) is False
    assert backend.current(R) is not None
    with seeded("release-without-owner"):
        assert backend.release(R, lease.epoch + 1, OWNER_B) is True
    assert backend.current(R) is None


@pytest.mark.parametrize("path", ["known", "new-process", "request-id"])
def test_epoch_reuse_keeps_the_epoch_of_an_expired_lease(tmp_path: Path, path: str) -> None:
    """Each of the three grant statements the SQLite backend runs: the UPDATE of a resource
    this process knows, the upsert of one it does not, the upsert inside the transaction of a
    request with an id."""
    clock = ManualClock()
    shared = SQLiteBackend(tmp_path / "fenced.db", host_clock=clock)

    def grant(owner: str) -> int:
        rid = owner[:8] + str(clock.now()) if path == "request-id" else None
        if path == "new-process":
            with SQLiteBackend(tmp_path / "fenced.db", host_clock=clock) as fresh:
                return granted(fresh.try_grant(request(owner, 1.0, rid), None)).epoch
        return granted(shared.try_grant(request(owner, 1.0, rid), None)).epoch

    try:
        first = grant(OWNER_A)
        clock.advance(2.0)  # the lease expired (its holder crashed or was paused)
        second = grant(OWNER_B)
        assert second == first + 1
        clock.advance(2.0)
        with seeded("epoch-reuse"):
            assert grant(OWNER_C) == second
    finally:
        shared.close()


def _words(statement: str) -> str:
    return " ".join(statement.split())


def test_the_seeded_sqlite_statements_differ_from_the_correct_ones_in_one_clause() -> None:
    """Written out in full, a seeded statement could drift from the statement it breaks: it
    must stay that statement with exactly one clause changed (whitespace aside)."""
    sql = sqlite_statements
    correct = _words(f"epoch = max(epoch, {sql._MINIMUM}, {sql._LOST_RESERVATION}) + 1,")
    seeded_epoch = _words(
        "epoch = iif(resources.ended IS 'released', "
        f"max(epoch, {sql._MINIMUM}, {sql._LOST_RESERVATION}) + 1, epoch),"
    )
    pairs = [
        (sql._GRANT, sql._GRANT_REUSING_EPOCH, correct, seeded_epoch),
        (sql._GRANT_KNOWN, sql._GRANT_KNOWN_REUSING_EPOCH, correct, seeded_epoch),
        (sql._RELEASE, sql._RELEASE_ANY_OWNER, "epoch = :epoch AND owner = :owner AND ", ""),
    ]
    for right, wrong, clause, replaced in pairs:
        assert _words(right).count(clause) == 1, right
        assert _words(wrong) == _words(right).replace(clause, replaced)


# -- stores -----------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    opened = open_store(f"sqlite://{tmp_path / 'store.db'}", "monotonic")
    yield opened
    opened.close()


def test_no_fence_check_accepts_a_stale_epoch(store: Store) -> None:
    store.put(token(2), "k", b"two")
    with pytest.raises(StaleToken):
        store.put(token(1), "k", b"one")
    with seeded("no-fence-check"):
        assert store.put(token(1), "k", b"one").version == 2


def test_publish_no_token_check_moves_the_pointer_back_and_only_for_publish(store: Store) -> None:
    # With an op id, as verify's workers publish (without one, publish refuses a stale token
    # before staging the bytes, outside the hook).
    store.publish(token(2), b"two", op_id="w.1")
    with pytest.raises(StaleToken):
        store.publish(token(1), b"one", op_id="w.2")
    with seeded("publish-no-token-check"):
        with pytest.raises(StaleToken):
            store.put(token(1), "k", b"one")
        assert store.publish(token(1), b"one", op_id="w.3").epoch == 1
    assert store.read(R, "") == b"one"


def test_dedup_after_fence_refuses_the_retry_of_a_write_that_landed(store: Store) -> None:
    first = store.put(token(1), "k", b"one", op_id="w.1")
    store.put(token(2), "other", b"newer owner")
    assert store.put(token(1), "k", b"one", op_id="w.1") == first  # the first attempt's outcome
    with seeded("dedup-after-fence"), pytest.raises(StaleToken):
        store.put(token(1), "k", b"one", op_id="w.1")


def test_check_then_write_writes_without_the_file_stores_lock(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_store(f"file://{root}", "monotonic", busy_timeout=0.2) as files:
        files.put(token(1), "k", b"v")
        (lock_path,) = (root / "locks").iterdir()
        fd = os.open(lock_path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # another writer is inside the critical section
            with pytest.raises(Unavailable, match="lock"):
                files.put(token(1), "k", b"w")
            with seeded("check-then-write"):
                assert files.put(token(1), "k", b"w").version == 2
        finally:
            os.close(fd)


# -- the coordinator client ----------------------------------------------------------------


class _SlowReplies(MemoryBackend):
    """The memory backend whose grant and renewal replies take ``delay`` seconds of the clock
    to arrive (the request takes effect at once)."""

    def __init__(self, name: str, clock: ManualClock, delay: float) -> None:
        super().__init__(name, host_clock=clock)
        self._manual, self._delay = clock, delay

    def try_grant(self, request: GrantRequest, ticket: Ticket | None) -> Granted | Blocked:
        result = super().try_grant(request, ticket)
        self._manual.advance(self._delay)
        return result

    def renew(self, resource: str, epoch: int, owner: str, ttl: float) -> float:
        remaining = super().renew(resource, epoch, owner, ttl)
        self._manual.advance(self._delay)
        return remaining


def test_deadline_from_reply_counts_the_lease_from_the_reply(tmp_path: Path) -> None:
    clock = ManualClock()
    backend = _SlowReplies(f"hooks-{tmp_path.name}", clock, delay=0.5)
    with Coordinator(backend, clock=clock) as coord:
        sent = clock.now()
        lease = coord.acquire(R, 10.0, 0, safety_margin=1.0)
        assert lease.deadline == pytest.approx(sent + 9.0)
        sent = clock.now()
        assert coord.renew(lease).deadline == pytest.approx(sent + 9.0)
        with seeded("deadline-from-reply"):
            sent = clock.now()
            assert coord.renew(lease).deadline == pytest.approx(sent + 9.5)
            coord.release(lease)
            sent = clock.now()
            assert coord.acquire(R, 10.0, 0, safety_margin=1.0).deadline == pytest.approx(
                sent + 9.5
            )


# -- who may switch a defect on ------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, ENV_VAR: ",".join(sorted(switches.KNOWN)), **extra}


@pytest.mark.timeout(60)
def test_an_environment_variable_switches_nothing_on_in_a_verify_worker(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    config = WorkerConfig(
        name="w0",
        history=str(history),
        coordinator=f"sqlite://{tmp_path / 'fenced.db'}",
        resource=R,
        stores={},
        fence=[],
        ttl=1.0,
        margin=0.2,
    )
    done = subprocess.run(
        [sys.executable, "-m", "fenced.verify.worker", config.to_json()],
        input='{"id": "w0/1", "op": "exit"}\n',
        capture_output=True,
        text=True,
        timeout=50,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    (start,) = [e for e in read_history(history) if e["ev"] == "start"]
    assert start["mutants"] == []

    config.mutants = ["epoch-reuse"]  # what verify does: the configuration names the defects
    history.unlink()
    subprocess.run(
        [sys.executable, "-m", "fenced.verify.worker", config.to_json()],
        input='{"id": "w0/1", "op": "exit"}\n',
        text=True,
        timeout=50,
        env=_env(),
        check=True,
    )
    (start,) = [e for e in read_history(history) if e["ev"] == "start"]
    assert start["mutants"] == ["epoch-reuse"]


@pytest.mark.timeout(60)
def test_an_environment_variable_changes_nothing_in_a_normal_process(tmp_path: Path) -> None:
    program = textwrap.dedent(
        f"""
        import json, sys
        from fenced.coordinator.backend import GrantRequest
        from fenced.coordinator.backends.sqlite.backend import SQLiteBackend
        from fenced.core import _mutants as mutants

        with SQLiteBackend(sys.argv[1]) as backend:
            first = backend.try_grant(GrantRequest("r", 30.0, "{OWNER_A}", "a"), None)
            foreign = backend.release("r", first.epoch, "{OWNER_B}")
            live = backend.current("r") is not None
        on = sorted(name for name in mutants.KNOWN if mutants.active(name))
        print(json.dumps({{"foreign_release": foreign, "live": live, "on": on}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path / "fenced.db")],
        capture_output=True,
        text=True,
        timeout=50,
        env=_env(),
        check=True,
    )
    assert json.loads(done.stdout) == {"foreign_release": False, "live": True, "on": []}

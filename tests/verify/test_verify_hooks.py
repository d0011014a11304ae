"""Every seeded defect of ``fenced verify --mutants`` changes what fenced does where it is seeded.

A seeded defect that no longer changes anything (a rewritten statement, a moved check, a seam
the library stopped using) would make the hunt run the correct program and call it a miss, or
worse, a catch of something else. These unit tests build each defect as a verify worker does
(:mod:`fenced.verify._seeded`), over the real backend and store objects, and drive the correct
and the seeded variant side by side (milliseconds, no processes). Last, the library has no
switch at all: no environment variable changes anything, in a verify worker or in any other
process.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from fenced.coordinator._client import Coordinator
from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.memory._backend import MemoryBackend
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
from fenced.core._clock import ManualClock
from fenced.core._errors import Busy, LeaseLost, NotInstalled, StaleToken, Unavailable
from fenced.fence import open_store
from fenced.fence._store import Store
from fenced.testing.store_conformance import R, token
from fenced.verify import _seeded as seeded
from fenced.verify._recorder import read_history
from fenced.verify._seeded import (
    CHECK_THEN_WRITE,
    DEADLINE_FROM_REPLY,
    DEDUP_AFTER_FENCE,
    EPOCH_REUSE,
    NO_FENCE_CHECK,
    PG_GRANT_READ_COMMITTED,
    PUBLISH_NO_TOKEN_CHECK,
    RELEASE_WITHOUT_OWNER,
    RENEW_REVIVES_EXPIRED,
    RENEWAL_FAILURE_IGNORED,
    WAITER_KEEPS_PLACE,
    SeededCoordinator,
    SeededSQLiteBackend,
    SeededStore,
)
from fenced.verify._worker import WorkerConfig

OWNER_A, OWNER_B, OWNER_C = "a" * 32, "b" * 32, "c" * 32
ENV_VAR = "_FENCED_VERIFY_MUTANT"  # the variable that switched defects on once (and must not)


def granted(result: Granted | Blocked) -> Granted:
    assert isinstance(result, Granted), result
    return result


def request(owner: str, ttl: float = 10.0, request_id: str | None = None) -> GrantRequest:
    return GrantRequest(R, ttl, owner, f"holder-{owner[0]}", request_id)


def test_defects_are_chosen_by_name_only() -> None:
    assert seeded.chosen([" epoch-reuse ", ""]) == {EPOCH_REUSE}
    with pytest.raises(ValueError, match="unknown mutant"):
        seeded.chosen(["epoch-reuse", "no-such-defect"])
    assert importlib.util.find_spec("fenced.core._mutants") is None  # no switchboard


# -- the embedded coordinator -------------------------------------------------------------------


def test_release_without_owner_ends_another_owners_lease(tmp_path: Path) -> None:
    clock = ManualClock()
    database = tmp_path / "fenced.db"
    defects = frozenset({RELEASE_WITHOUT_OWNER})
    with (
        SQLiteBackend(database, host_clock=clock) as backend,
        SeededSQLiteBackend(database, defects, host_clock=clock) as broken,
    ):
        lease = granted(backend.try_grant(request(OWNER_A), None))
        assert backend.release(R, lease.epoch, OWNER_B) is False
        assert backend.release(R, lease.epoch + 1, OWNER_A) is False
        assert backend.current(R) is not None
        assert broken.release(R, lease.epoch + 1, OWNER_B) is True
        assert backend.current(R) is None


@pytest.mark.parametrize("path", ["known", "new-process", "request-id"])
def test_epoch_reuse_keeps_the_epoch_of_an_expired_lease(tmp_path: Path, path: str) -> None:
    """Each of the three grant statements the SQLite backend runs: the UPDATE of a resource
    this process knows, the upsert of one it does not, the upsert inside the transaction of a
    request with an id. The seeded backend grants first and last (the middle grant is the
    correct backend's), so that it knows the resource by then."""
    clock = ManualClock()
    database = tmp_path / "fenced.db"
    defects = frozenset({EPOCH_REUSE})

    def opened(broken: bool) -> SQLiteBackend:
        if broken:
            return SeededSQLiteBackend(database, defects, host_clock=clock)
        return SQLiteBackend(database, host_clock=clock)

    kept = {True: opened(True), False: opened(False)}

    def grant(broken: bool, owner: str) -> int:
        rid = owner[:8] + str(clock.now()) if path == "request-id" else None
        if path == "new-process":
            with opened(broken) as fresh:
                return granted(fresh.try_grant(request(owner, 1.0, rid), None)).epoch
        return granted(kept[broken].try_grant(request(owner, 1.0, rid), None)).epoch

    try:
        first = grant(True, OWNER_A)  # nothing to reuse yet: as the correct statement
        clock.advance(2.0)  # the lease expired (its holder crashed or was paused)
        second = grant(False, OWNER_B)
        assert second == first + 1
        clock.advance(2.0)
        assert grant(True, OWNER_C) == second
    finally:
        for backend in kept.values():
            backend.close()


def test_renew_revives_expired_extends_a_lease_that_expired(tmp_path: Path) -> None:
    """The correct renew refuses a lease that expired, even if nobody took the resource since;
    the seeded one sets it to expire ttl after the renewal arrived. A lease taken over by a
    newer grant is not revived (its epoch and owner are gone)."""
    clock = ManualClock()
    database = tmp_path / "fenced.db"
    defects = frozenset({RENEW_REVIVES_EXPIRED})
    with (
        SQLiteBackend(database, host_clock=clock) as backend,
        SeededSQLiteBackend(database, defects, host_clock=clock) as broken,
    ):
        lease = granted(backend.try_grant(request(OWNER_A, 1.0), None))
        clock.advance(1.5)
        with pytest.raises(LeaseLost):
            backend.renew(R, lease.epoch, OWNER_A, 1.0)
        assert backend.current(R) is None
        assert broken.renew(R, lease.epoch, OWNER_A, 1.0) == 1.0
        info = backend.current(R)
        assert info is not None and info.epoch == lease.epoch and info.expires_in == 1.0
        clock.advance(1.5)
        newer = granted(backend.try_grant(request(OWNER_B, 1.0), None))
        with pytest.raises(LeaseLost):
            broken.renew(R, lease.epoch, OWNER_A, 1.0)
        assert broken.renew(R, newer.epoch, OWNER_B, 1.0) == 1.0


def test_a_seeded_statement_is_the_correct_one_with_one_clause_changed(tmp_path: Path) -> None:
    """Built from the statement the backend runs, so that the rest of it cannot drift; a
    statement that lost the clause fails loudly instead of running as the correct one."""
    every = frozenset({EPOCH_REUSE, RELEASE_WITHOUT_OWNER, RENEW_REVIVES_EXPIRED})
    with SeededSQLiteBackend(tmp_path / "fenced.db", every) as broken:
        statements = [
            (SQLiteBackend._grant_sql, broken._grant_sql),
            (SQLiteBackend._grant_known_sql, broken._grant_known_sql),
            (SQLiteBackend._release_sql, broken._release_sql),
            (SQLiteBackend._renew_sql, broken._renew_sql),
        ]
    for correct, changed in statements:
        assert changed != correct
        kept = set(correct.splitlines()) & set(changed.splitlines())
        assert len(correct.splitlines()) - len(kept) <= 1  # one line holds the clause
    with pytest.raises(ValueError, match="exactly once"):
        seeded._one_clause_changed("UPDATE resources SET epoch = 1", "owner = :owner", "")


# -- stores -------------------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    kind = request.param
    url = f"sqlite:{tmp_path / 'store.db'}" if kind == "sqlite" else f"file://{tmp_path / 'files'}"
    opened = open_store(url, "monotonic")
    yield opened
    opened.close()


def test_no_fence_check_accepts_a_stale_epoch(store: Store) -> None:
    store.put(token(2), "k", b"two")
    with pytest.raises(StaleToken):
        store.put(token(1), "k", b"one")
    broken = SeededStore(store, frozenset({NO_FENCE_CHECK}))
    assert broken.put(token(1), "k", b"one").version == 2
    assert broken.floor(R) == 2  # the floor never moves back
    with pytest.raises(StaleToken):
        broken.fence(token(1))  # an install is still checked


def test_no_fence_check_accepts_an_uninstalled_epoch_in_strict_mode(tmp_path: Path) -> None:
    with open_store(f"sqlite:{tmp_path / 'strict.db'}", "strict") as strict:
        strict.fence(token(2))
        with pytest.raises(NotInstalled):
            strict.put(token(3), "k", b"three")
        broken = SeededStore(strict, frozenset({NO_FENCE_CHECK}))
        assert broken.put(token(1), "k", b"one").version == 1
        assert broken.put(token(3), "k", b"three").version == 2
        assert strict.floor(R) == 3  # raised to the largest epoch accepted


def test_publish_no_token_check_moves_the_pointer_back_and_only_for_publish(store: Store) -> None:
    # With an op id, as verify's workers publish (without one, publish refuses a stale token
    # before staging the bytes, outside the transaction).
    store.publish(token(2), b"two", op_id="w.1")
    with pytest.raises(StaleToken):
        store.publish(token(1), b"one", op_id="w.2")
    broken = SeededStore(store, frozenset({PUBLISH_NO_TOKEN_CHECK}))
    with pytest.raises(StaleToken):
        broken.put(token(1), "k", b"one")
    assert broken.publish(token(1), b"one", op_id="w.3").epoch == 1
    assert store.read(R, "") == b"one"
    assert store.floor(R) == 2


def test_dedup_after_fence_refuses_the_retry_of_a_write_that_landed(store: Store) -> None:
    first = store.put(token(1), "k", b"one", op_id="w.1")
    store.put(token(2), "other", b"newer owner")
    assert store.put(token(1), "k", b"one", op_id="w.1") == first  # the first attempt's outcome
    broken = SeededStore(store, frozenset({DEDUP_AFTER_FENCE}))
    with pytest.raises(StaleToken):
        broken.put(token(1), "k", b"one", op_id="w.1")
    current = broken.put(token(2), "k", b"two", op_id="w.2")
    assert broken.put(token(2), "k", b"two", op_id="w.2") == current  # not overtaken: replayed


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
            broken = seeded.store(files, frozenset({CHECK_THEN_WRITE}))
            assert broken.put(token(1), "k", b"w").version == 2
        finally:
            os.close(fd)


def test_check_then_write_is_seeded_only_in_a_file_store(tmp_path: Path) -> None:
    with open_store(f"sqlite:{tmp_path / 'store.db'}") as other:
        assert seeded.store(other, frozenset({CHECK_THEN_WRITE})) is other


# -- the coordinator client ---------------------------------------------------------------------


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
    correct = Coordinator(backend, clock=clock)
    broken = SeededCoordinator(backend, frozenset({DEADLINE_FROM_REPLY}), clock)
    try:
        sent = clock.now()
        lease = correct.acquire(R, 10.0, 0, safety_margin=1.0)
        assert lease.deadline == pytest.approx(sent + 9.0)
        sent = clock.now()
        assert correct.renew(lease).deadline == pytest.approx(sent + 9.0)
        sent = clock.now()
        assert broken.renew(lease).deadline == pytest.approx(sent + 9.5)
        correct.release(lease)
        sent = clock.now()
        with broken.hold(R, 10.0, wait=0, safety_margin=1.0) as held:  # hold() acquires too
            assert held.deadline == pytest.approx(sent + 9.5)
    finally:
        broken.close()
        correct.close()


def test_renewal_failure_ignored_extends_the_lease_from_the_failed_send(tmp_path: Path) -> None:
    clock = ManualClock()
    backend = MemoryBackend(f"hooks-{tmp_path.name}", host_clock=clock)
    correct = Coordinator(backend, clock=clock)
    broken = SeededCoordinator(backend, frozenset({RENEWAL_FAILURE_IGNORED}), clock)
    try:
        lease = correct.acquire(R, 10.0, 0, safety_margin=1.0)
        correct.release(lease)  # the coordinator no longer has it
        clock.advance(1.0)
        with pytest.raises(LeaseLost):
            correct.renew(lease)
        sent = clock.now()
        assert broken.renew(lease).deadline == pytest.approx(sent + 9.0)
    finally:
        broken.close()
        correct.close()


def test_waiter_keeps_place_leaves_no_queue_when_it_gives_up(tmp_path: Path) -> None:
    """A waits behind a live lease and gives up (Busy). The correct acquire leaves the line: once
    the lease is released, C is granted at once. The seeded one keeps its place: the release
    hands the lease to that place (or wakes it), and C is refused until the place's keep-alive
    or the lease handed to it lapses — although nobody holds the resource."""
    database = tmp_path / "fenced.db"
    for seeded_waiter in (False, True):
        with (
            SQLiteBackend(database) as holding,
            SQLiteBackend(database) as waiting,
            SQLiteBackend(database) as late,
        ):
            holder = Coordinator(holding)
            waiter: Coordinator = (
                SeededCoordinator(waiting, frozenset({WAITER_KEEPS_PLACE}))
                if seeded_waiter
                else Coordinator(waiting)
            )
            other = Coordinator(late)
            lease = holder.acquire(R, 10.0, 0)
            with pytest.raises(Busy):
                waiter.acquire(R, 10.0, 0.05)
            holder.release(lease)
            if seeded_waiter:
                with pytest.raises(Busy):
                    other.acquire(R, 10.0, 0)
            else:
                other.release(other.acquire(R, 10.0, 0))
            for coordinator in (holder, waiter, other):
                coordinator.close()


def test_the_seeded_server_variants_are_the_correct_ones_with_one_clause_changed() -> None:
    """PostgreSQL: the schema's own functions, one clause changed, created in ``pg_temp`` (never
    in the schema); etcd: the grant transaction without its compare of the state's revision.
    Built from what the backends run; a text or a transaction that lost the clause is a
    ValueError (no server needed)."""
    from fenced.coordinator.backends.etcd._keys import Keys, ResourceState
    from fenced.coordinator.backends.etcd._plans import grant_plan
    from fenced.verify import _seeded_etcd, _seeded_postgres

    renew = _seeded_postgres.function_text("vx", "renew")
    revived = _seeded_postgres._temporary("vx", "renew", "\n          AND r.expires_at > v_now", "")
    assert "r.expires_at > v_now" in renew and "r.expires_at > v_now" not in revived
    assert revived.startswith("CREATE OR REPLACE FUNCTION pg_temp.renew(")
    grant = _seeded_postgres.function_text("vx", "try_grant")
    unlocked = _seeded_postgres._temporary("vx", "try_grant", " FOR UPDATE OF r;", ";")
    assert grant.count("FOR UPDATE OF r") == 1 and "FOR UPDATE OF r" not in unlocked
    assert len(grant.splitlines()) == len(unlocked.splitlines())
    with pytest.raises(ValueError, match="exactly once"):
        _seeded_postgres._temporary("vx", "renew", "FOR UPDATE OF r", "")

    keys = Keys("/hooks")
    plan = grant_plan(keys, request(OWNER_A), (7, ResourceState(3), 2, 0), 1, None, None)
    careless = _seeded_etcd.without_revision_compare(plan, keys.res(R))
    assert len(careless.request.compare) == len(plan.request.compare) - 1
    assert careless.epoch == plan.epoch == 4
    with pytest.raises(ValueError, match="exactly once"):
        _seeded_etcd.without_revision_compare(careless, keys.res(R))
    assert {PG_GRANT_READ_COMMITTED, RENEW_REVIVES_EXPIRED} <= seeded.DEFECTS


# -- who may switch a defect on -----------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, ENV_VAR: ",".join(sorted(seeded.DEFECTS)), **extra}


@pytest.mark.timeout(60)
def test_an_environment_variable_switches_nothing_on_in_a_verify_worker(tmp_path: Path) -> None:
    history = tmp_path / "history.jsonl"
    config = WorkerConfig(
        name="w0",
        history=str(history),
        coordinator=f"sqlite:{tmp_path / 'fenced.db'}",
        resource=R,
        stores={},
        fence=[],
        ttl=1.0,
        margin=0.2,
    )
    done = subprocess.run(
        [sys.executable, "-m", "fenced.verify._worker", config.to_json()],
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
        [sys.executable, "-m", "fenced.verify._worker", config.to_json()],
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
        import importlib.util, json, sys
        from fenced.coordinator.backend import GrantRequest
        from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
        from fenced.core._errors import StaleToken
        from fenced.fence import open_store
        from fenced.testing.store_conformance import token

        with SQLiteBackend(sys.argv[1] + "/fenced.db") as backend:
            first = backend.try_grant(GrantRequest("r", 30.0, "{OWNER_A}", "a"), None)
            foreign = backend.release("r", first.epoch, "{OWNER_B}")
            live = backend.current("r") is not None
        with open_store("sqlite:" + sys.argv[1] + "/store.db") as store:
            store.fence(token(2))
            try:
                store.put(token(1), "k", b"stale")
                stale = "accepted"
            except StaleToken:
                stale = "rejected"
        switchboard = importlib.util.find_spec("fenced.core._mutants") is not None
        print(json.dumps({{
            "foreign_release": foreign, "live": live, "stale_put": stale,
            "switchboard": switchboard,
        }}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=50,
        env=_env(),
        check=True,
    )
    assert json.loads(done.stdout) == {
        "foreign_release": False,
        "live": True,
        "stale_put": "rejected",
        "switchboard": False,
    }

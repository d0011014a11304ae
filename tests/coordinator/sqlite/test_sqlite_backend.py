"""What is specific to the embedded SQLite backend (the generic contract is the conformance suite).

The database file, its schema versions and failure modes; expiry by the injected host clock
(boot id, wall-clock steps); the first-come-first-served queue with its keep-alive; wake-ups
across real processes, including a waiter killed with SIGKILL; lazy release records; fork.
Files live in ``tmp_path``; waits poll with deadlines; nothing asserts speed.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced._drivers.migrations import Migration
from fenced.coordinator._client import Coordinator
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator.backends.sqlite import _schema as sqlite_schema
from fenced.coordinator.backends.sqlite._backend import QUEUE_KEEPALIVE, SQLiteBackend, SQLiteTicket
from fenced.core._clock import ManualClock
from fenced.core._errors import ConfigurationError, LeaseLost, LossReason, Unavailable
from fenced.core._records import RecordKind
from fenced.testing.conformance import wait_for
from support.simultaneous import run_together
from support.worker_processes import read_events

R = "jobs/nightly"
OWNER_A = "a" * 32
OWNER_B = "b" * 32


def request(
    owner: str = OWNER_A, *, ttl: float = 10.0, request_id: str | None = None
) -> GrantRequest:
    return GrantRequest(R, ttl, owner, f"holder-{owner[0]}", request_id)


def granted(result: Granted | Blocked) -> Granted:
    assert isinstance(result, Granted), result
    return result


def blocked(result: Granted | Blocked) -> Blocked:
    assert isinstance(result, Blocked), result
    return result


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "fenced.db"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def backend(db_path: Path, clock: ManualClock) -> Iterator[SQLiteBackend]:
    opened = SQLiteBackend(db_path, host_clock=clock)
    yield opened
    opened.close()


# -- the database file ------------------------------------------------------------------------


def test_creates_the_directory_and_keeps_its_identity_across_reopen(db_path: Path) -> None:
    first = SQLiteBackend(db_path)
    assert db_path.exists()
    assert first.url == f"sqlite:///{db_path}"
    assert len(first.coordinator_id) == 32 and int(first.coordinator_id, 16) >= 0
    assert first.capabilities == {"wait-notify", "request-id", "records"}
    first.close()
    again = SQLiteBackend(db_path, coordinator_id_for_new="c" * 32)  # ignored: not new
    assert again.coordinator_id == first.coordinator_id
    again.close()
    with sqlite3.connect(db_path) as raw:
        meta = dict(raw.execute("SELECT key, value FROM meta").fetchall())
        (app_id,) = raw.execute("PRAGMA application_id").fetchone()
        (mode,) = raw.execute("PRAGMA journal_mode").fetchone()
        (page_size,) = raw.execute("PRAGMA page_size").fetchone()
    raw.close()
    assert page_size == sqlite_schema.PAGE_SIZE
    assert meta["schema_version"] == str(sqlite_schema.SCHEMA_VERSION)
    assert meta["coordinator_id"] == first.coordinator_id
    assert app_id == sqlite_schema.APPLICATION_ID
    assert mode == "wal"


def test_coordinator_id_for_new_names_a_new_database(db_path: Path) -> None:
    with SQLiteBackend(db_path, coordinator_id_for_new="0123456789abcdef" * 2) as backend:
        assert backend.coordinator_id == "0123456789abcdef" * 2
    with pytest.raises(ConfigurationError):
        SQLiteBackend(db_path.with_name("other.db"), coordinator_id_for_new="not-hex")


def _set_schema_version(path: Path, version: int) -> None:
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
    raw.close()


def test_a_database_of_a_newer_schema_is_refused(db_path: Path) -> None:
    SQLiteBackend(db_path).close()
    _set_schema_version(db_path, sqlite_schema.SCHEMA_VERSION + 1)
    with pytest.raises(ConfigurationError, match=r"newer fenced.*upgrade"):
        SQLiteBackend(db_path)


def test_a_later_schema_step_is_applied_once_and_keeps_the_state(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with SQLiteBackend(db_path) as old:
        epoch = granted(old.try_grant(request(), None)).epoch
        identity = old.coordinator_id
    later = Migration(
        sqlite_schema.SCHEMA_VERSION + 1,
        "a table a later release adds",
        ("CREATE TABLE later_feature (x INTEGER)", "INSERT INTO later_feature VALUES (42)"),
    )
    monkeypatch.setattr(sqlite_schema, "MIGRATIONS", (*sqlite_schema.MIGRATIONS, later))
    monkeypatch.setattr(sqlite_schema, "SCHEMA_VERSION", later.version)
    with SQLiteBackend(db_path) as upgraded:
        assert upgraded.coordinator_id == identity
        assert upgraded.last_epoch(R) == epoch
    raw = sqlite3.connect(db_path)
    assert raw.execute("SELECT x FROM later_feature").fetchall() == [(42,)]
    assert raw.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (
        str(later.version),
    )
    raw.close()


def _watched(db_path: Path) -> dict[str, int]:
    raw = sqlite3.connect(db_path)
    try:
        return dict(raw.execute("SELECT name, watched FROM resources").fetchall())
    finally:
        raw.close()


def _one_line_configuration_error(path: Path) -> ConfigurationError:
    with pytest.raises(ConfigurationError) as caught:
        SQLiteBackend(path)
    message = str(caught.value)
    assert "\n" not in message and str(path.name) in message
    return caught.value


def test_a_corrupt_file_is_a_clear_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "fenced.db"
    path.write_bytes(os.urandom(8192))
    error = _one_line_configuration_error(path)
    assert isinstance(error.__cause__, sqlite3.DatabaseError)


def test_a_foreign_sqlite_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE users (id INTEGER PRIMARY KEY)")
    raw.commit()
    raw.close()
    assert "not a fenced one" in str(_one_line_configuration_error(path))


def test_an_unusable_location_is_a_clear_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    _one_line_configuration_error(tmp_path / "a-file" / "fenced.db")  # parent is a file
    (tmp_path / "a-dir.db").mkdir()
    _one_line_configuration_error(tmp_path / "a-dir.db")  # the database path is a directory


def _wal_size(db_path: Path) -> int:
    wal = Path(f"{db_path}-wal")
    return wal.stat().st_size if wal.exists() else 0


def test_the_wal_is_kept_allocated_and_its_zero_tail_survives_a_crash(db_path: Path) -> None:
    full = 1000 * (sqlite_schema.PAGE_SIZE + 24)  # SQLite checkpoints after 1000 pages
    with SQLiteBackend(db_path) as backend:
        first = granted(backend.try_grant(request(), None))
        assert _wal_size(db_path) > full  # extended before the first durable commit
        assert backend.release(R, first.epoch, OWNER_A)
    assert _wal_size(db_path) == 0  # SQLite removes the WAL with the last connection
    # A process that dies (no close, no checkpoint) leaves frames followed by zeros; the next
    # opener recovers exactly the committed frames.
    code = textwrap.dedent(
        """
        import os, sys
        from fenced.coordinator.backend import GrantRequest
        from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
        backend = SQLiteBackend(sys.argv[1])
        for i in range(5):
            g = backend.try_grant(GrantRequest("jobs/nightly", 10.0, "c" * 32, "child"), None)
            assert backend.release("jobs/nightly", g.epoch, "c" * 32)
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", code, str(db_path)], check=True, timeout=60)
    assert _wal_size(db_path) > full
    with SQLiteBackend(db_path) as reopened:
        assert reopened.last_epoch(R) == 6
        assert granted(reopened.try_grant(request(OWNER_B), None)).epoch == 7
    raw = sqlite3.connect(db_path)
    assert raw.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    raw.close()


def test_a_grant_is_fsynced_before_it_returns_and_a_release_is_not(
    db_path: Path, tmp_path: Path
) -> None:
    """The durability contract, watched at the system-call level with strace: each grant's WAL
    frames are followed by an fdatasync of the WAL before try_grant returns; a release writes
    its frame and returns without any fsync (the next grant's fsync covers it)."""
    code = textwrap.dedent(
        """
        import os, sys
        from fenced.coordinator.backend import GrantRequest
        from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
        backend = SQLiteBackend(sys.argv[1])
        marks = os.open(os.devnull, os.O_WRONLY)
        for i in range(5):
            g = backend.try_grant(GrantRequest("jobs/nightly", 10.0, "c" * 32, "child"), None)
            os.write(marks, b"MARK granted")
            assert backend.release("jobs/nightly", g.epoch, "c" * 32)
            os.write(marks, b"MARK released")
        """
    )
    db_path.parent.mkdir(parents=True)
    SQLiteBackend(db_path).close()  # created (and its WAL allocated) before the trace
    trace = tmp_path / "trace"
    subprocess.run(
        ["strace", "-f", "-o", str(trace), "-e", "trace=openat,pwrite64,fdatasync,fsync,write",
         sys.executable, "-c", code, str(db_path)],
        check=True, timeout=120,
    )  # fmt: skip
    wal_fds: set[str] = set()
    steps: list[str] = []  # "w" WAL write, "s" WAL sync, "S" other sync, "G"/"R" marks
    for line in trace.read_text().splitlines():
        call = line.split(None, 1)[1] if " " in line else line
        if call.startswith("openat(") and f'{db_path}-wal"' in call and "= " in call:
            wal_fds.add(call.rsplit("= ", 1)[1].split()[0])
        elif call.startswith("pwrite64("):
            if call[len("pwrite64(") :].split(",", 1)[0] in wal_fds:
                steps.append("w")
        elif call.startswith(("fdatasync(", "fsync(")):
            fd = call.split("(", 1)[1].split(")", 1)[0]
            steps.append("s" if fd in wal_fds else "S")
        elif call.startswith("write(") and "MARK granted" in call:
            steps.append("G")
        elif call.startswith("write(") and "MARK released" in call:
            steps.append("R")
    history = "".join(steps)
    assert history.count("G") == 5 and history.count("R") == 5, history
    grants = [part.split("R")[-1] for part in history.split("G")[:-1]]  # what led to each mark
    for grant in grants:
        assert "w" in grant and grant.endswith("s"), history  # the WAL synced after its frames
    releases = [part.split("G")[-1] for part in history.split("R")[:-1]]
    for release in releases:
        assert "w" in release and "s" not in release and "S" not in release, history


def test_a_write_lock_held_past_the_busy_timeout_is_unavailable(
    backend: SQLiteBackend, db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_schema, "BUSY_TIMEOUT", 0.2)
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(Unavailable):
            backend.try_grant(request(), None)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert backend.last_epoch(R) == 0  # nothing happened
    assert granted(backend.try_grant(request(), None)).epoch == 1


def test_close_is_idempotent_and_final(db_path: Path) -> None:
    backend = SQLiteBackend(db_path)
    ticket = backend.enqueue(request())
    backend.close()
    backend.close()
    assert isinstance(ticket, SQLiteTicket) and ticket.ended
    with pytest.raises(ConfigurationError):
        backend.current(R)


# -- epochs and time --------------------------------------------------------------------------


def test_epochs_strictly_increase_across_release_expiry_and_reopen(
    db_path: Path, clock: ManualClock
) -> None:
    epochs = []
    with SQLiteBackend(db_path, host_clock=clock) as backend:
        first = granted(backend.try_grant(request(), None))
        assert backend.release(R, first.epoch, OWNER_A)
        epochs.append(first.epoch)
        second = granted(backend.try_grant(request(ttl=5), None))
        epochs.append(second.epoch)
        clock.advance(5.01)
        epochs.append(granted(backend.try_grant(request(OWNER_B), None)).epoch)
    with SQLiteBackend(db_path, host_clock=clock) as reopened:
        assert reopened.current(R) is not None  # the lease lives across a restart
        clock.advance(10.01)
        epochs.append(granted(reopened.try_grant(request(), None)).epoch)
        assert reopened.last_epoch(R) == epochs[-1]
        assert reopened.resources() == [R]
    assert epochs == [1, 2, 3, 4]


def test_a_lease_from_another_boot_is_expired(backend: SQLiteBackend, clock: ManualClock) -> None:
    lease = granted(backend.try_grant(request(ttl=1000), None))
    clock.reboot()
    assert backend.current(R) is None
    with pytest.raises(LeaseLost):
        backend.renew(R, lease.epoch, OWNER_A, 1000)
    assert backend.release(R, lease.epoch, OWNER_A) is False
    assert granted(backend.try_grant(request(OWNER_B), None)).epoch == lease.epoch + 1


@pytest.mark.parametrize("step", [-86400.0, 3600.0, 86400.0 * 365])
def test_a_wall_clock_step_neither_expires_nor_extends(
    backend: SQLiteBackend, clock: ManualClock, step: float
) -> None:
    granted(backend.try_grant(request(ttl=10), None))
    before = backend.current(R)
    clock.jump_wall(step)
    after = backend.current(R)
    assert before is not None and after is not None
    assert after.expires_in == pytest.approx(before.expires_in)
    clock.advance(9.9)
    assert backend.current(R) is not None
    clock.advance(0.2)
    assert backend.current(R) is None


def test_renew_after_expiry_raises_even_if_nobody_took_the_resource(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    lease = granted(backend.try_grant(request(ttl=10), None))
    clock.advance(9)
    assert backend.renew(R, lease.epoch, OWNER_A, 10) == 10
    clock.advance(10.5)
    with pytest.raises(LeaseLost) as caught:
        backend.renew(R, lease.epoch, OWNER_A, 10)
    assert caught.value.reason is LossReason.REJECTED
    assert OWNER_A not in str(caught.value)
    assert backend.current(R) is None  # not revived


def test_release_with_a_wrong_owner_or_an_old_epoch_changes_nothing(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    old = granted(backend.try_grant(request(ttl=1), None))
    clock.advance(1.5)
    new = granted(backend.try_grant(request(OWNER_B), None))
    assert backend.release(R, old.epoch, OWNER_A) is False  # a delayed release of the old lease
    assert backend.release(R, new.epoch, OWNER_A) is False  # the right epoch, a wrong owner
    info = backend.current(R)
    assert info is not None and (info.epoch, info.holder) == (new.epoch, "holder-b")
    assert backend.release(R, new.epoch, OWNER_B) is True
    assert backend.release(R, new.epoch, OWNER_B) is False


def test_request_id_retry_returns_the_original_grant_until_it_ends(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    first = granted(backend.try_grant(request(ttl=10, request_id="req-1"), None))
    clock.advance(4)
    retry = granted(backend.try_grant(request(OWNER_B, ttl=10, request_id="req-1"), None))
    assert (retry.epoch, retry.owner, retry.holder) == (first.epoch, OWNER_A, "holder-a")
    assert retry.expires_in == pytest.approx(6)
    assert backend.last_epoch(R) == first.epoch
    assert backend.release(R, first.epoch, OWNER_A)
    with pytest.raises(LeaseLost) as caught:
        backend.try_grant(request(ttl=10, request_id="req-1"), None)
    assert caught.value.reason is LossReason.REJECTED
    expiring = granted(backend.try_grant(request(ttl=1, request_id="req-2"), None))
    clock.advance(1.5)
    with pytest.raises(LeaseLost):
        backend.try_grant(request(ttl=1, request_id="req-2"), None)
    assert backend.last_epoch(R) == expiring.epoch
    with pytest.raises(ConfigurationError):
        backend.try_grant(GrantRequest("jobs/other", 1, OWNER_A, "h", "req-2"), None)
    # A retry that had queued meanwhile gets the original grant and leaves the queue.
    live = granted(backend.try_grant(request(ttl=10, request_id="req-3"), None))
    ticket = backend.enqueue(request(OWNER_B, request_id="req-3"))
    again = granted(backend.try_grant(request(OWNER_B, request_id="req-3"), ticket))
    assert (again.epoch, again.owner) == (live.epoch, OWNER_A)
    assert isinstance(ticket, SQLiteTicket) and ticket.ended


# -- the queue --------------------------------------------------------------------------------


def test_waiters_are_granted_in_the_order_they_queued(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    held = granted(backend.try_grant(request(), None))
    owners = ["1" * 32, "2" * 32, "3" * 32]
    tickets = [backend.enqueue(request(owner)) for owner in owners]
    for owner, ticket in zip(owners, tickets, strict=True):
        result = blocked(backend.try_grant(request(owner), ticket))
        assert result.retry_in is not None and result.retry_in <= QUEUE_KEEPALIVE / 3
    assert backend.release(R, held.epoch, OWNER_A)  # hands the lease to the head waiter
    for turn, (owner, ticket) in enumerate(zip(owners, tickets, strict=True)):
        holder = f"holder-{owner[0]}"
        for later_owner, later in list(zip(owners, tickets, strict=True))[turn + 1 :]:
            assert blocked(backend.try_grant(request(later_owner), later)).holder == holder
        assert blocked(backend.try_grant(request(OWNER_B), None)).holder == holder  # a newcomer
        backend.wait(ticket, 5)  # the hand-off's datagram
        lease = granted(backend.try_grant(request(owner), ticket))
        assert (lease.epoch, lease.owner) == (held.epoch + 1 + turn, owner)
        assert isinstance(ticket, SQLiteTicket) and ticket.ended
        assert backend.release(R, lease.epoch, owner)
    assert granted(backend.try_grant(request(OWNER_B), None)).epoch == held.epoch + 4


def _reservation(db_path: Path) -> tuple[int, int, str | None]:
    raw = sqlite3.connect(db_path)
    row = raw.execute(f"SELECT epoch, reserved, reserved_boot FROM resources WHERE name = '{R}'")
    epoch, reserved, boot = row.fetchone()
    raw.close()
    return int(epoch), int(reserved), boot


def test_hand_offs_use_epochs_reserved_durably_while_waiters_wait(
    backend: SQLiteBackend, clock: ManualClock, db_path: Path
) -> None:
    held = granted(backend.try_grant(request(), None))
    statements: list[str] = []
    conn = backend._db._conn
    assert conn is not None
    conn.set_trace_callback(statements.append)
    waiter = backend.enqueue(request(OWNER_B))  # reserves the queue's epochs (fsynced)
    conn.set_trace_callback(None)
    # Durable before visible: the reservation commits at synchronous=FULL (SQLite fsyncs the
    # WAL before it publishes the commit), since others hand out tokens on its strength.
    steps = [" ".join(x.split())[:40] for x in statements]
    reserve = next(i for i, x in enumerate(steps) if x.startswith("UPDATE resources SET reserved"))
    assert steps[reserve - 2 : reserve] == ["PRAGMA synchronous=FULL", "BEGIN IMMEDIATE"], steps
    assert steps[reserve + 1 : reserve + 3] == ["COMMIT", "PRAGMA synchronous=NORMAL"], steps
    epoch, reserved, boot = _reservation(db_path)
    assert (epoch, boot) == (held.epoch, clock.boot_id()) and reserved > held.epoch + 1
    blocked(backend.try_grant(request(OWNER_B), waiter))  # (this process met a waiter)
    assert backend.release(R, held.epoch, OWNER_A)  # one commit, no fsync: epoch is reserved
    backend.wait(waiter, 5)
    assert granted(backend.try_grant(request(OWNER_B), waiter)).epoch == held.epoch + 1
    assert _reservation(db_path)[1] == reserved  # the same reservation covers later hand-offs


def test_after_a_reboot_grants_start_above_the_reservation_of_the_old_boot(
    backend: SQLiteBackend, clock: ManualClock, db_path: Path
) -> None:
    held = granted(backend.try_grant(request(ttl=1000), None))
    backend.enqueue(request(OWNER_B))
    _, reserved, _ = _reservation(db_path)
    # An OS crash may lose hand-offs committed without fsync, up to the reserved epoch: the
    # next boot must never grant those epochs again.
    clock.reboot()
    lease = granted(backend.try_grant(request("3" * 32), None))
    assert lease.epoch == reserved + 1 > held.epoch + 1
    ticket = backend.enqueue(request("4" * 32))  # reserves anew, in this boot
    epoch, again, boot = _reservation(db_path)
    assert (epoch, boot) == (lease.epoch, clock.boot_id()) and again > lease.epoch + 1
    blocked(backend.try_grant(request("4" * 32), ticket))
    assert backend.release(R, lease.epoch, "3" * 32)
    backend.wait(ticket, 5)
    assert granted(backend.try_grant(request("4" * 32), ticket)).epoch == lease.epoch + 1


def test_a_lease_handed_over_is_found_without_its_datagram(backend: SQLiteBackend) -> None:
    held = granted(backend.try_grant(request(), None))
    ticket = backend.enqueue(request(OWNER_B))
    assert backend.release(R, held.epoch, OWNER_A)
    lease = granted(backend.try_grant(request(OWNER_B), ticket))  # datagram not read yet
    assert (lease.epoch, lease.owner, lease.holder) == (held.epoch + 1, OWNER_B, "holder-b")
    current = backend.current(R)
    assert current is not None and (current.epoch, current.holder) == (held.epoch + 1, "holder-b")


def test_a_waiter_that_gives_up_passes_a_lease_handed_to_it_on(backend: SQLiteBackend) -> None:
    held = granted(backend.try_grant(request(), None))
    quitter = backend.enqueue(request(OWNER_B))
    patient = backend.enqueue(request("3" * 32))
    assert backend.release(R, held.epoch, OWNER_A)  # handed to the quitter
    backend.leave(quitter)  # it timed out before it learnt of the grant: passed on
    backend.wait(patient, 5)
    lease = granted(backend.try_grant(request("3" * 32), patient))
    assert lease.epoch == held.epoch + 2
    kinds = [(r.kind.value, r.epoch) for r in Coordinator(backend).history(R)]
    assert kinds[-3:] == [
        ("granted", held.epoch + 1),
        ("released", held.epoch + 1),
        ("granted", held.epoch + 2),
    ]


def test_a_handed_lease_that_expired_while_its_waiter_slept_is_not_used(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    held = granted(backend.try_grant(request(), None))
    sleeper = backend.enqueue(request(OWNER_B))
    assert backend.release(R, held.epoch, OWNER_A)
    clock.advance(11)  # past the handed lease's ttl (10 s) before the waiter reads its datagram
    backend.wait(sleeper, 5)
    again = granted(backend.try_grant(request(OWNER_B), sleeper))  # asks again: a new epoch
    assert again.epoch == held.epoch + 2 and again.expires_in == 10


def test_a_stopped_waiter_is_skipped_once_its_keepalive_lapses(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    held = granted(backend.try_grant(request(), None))
    stopped = backend.enqueue(request("1" * 32))  # never calls try_grant again
    active = backend.enqueue(request("2" * 32))
    clock.advance(QUEUE_KEEPALIVE * 2 / 3)
    ahead = blocked(backend.try_grant(request("2" * 32), active))  # keeps its own row alive
    assert ahead.holder == "holder-a" and ahead.retry_in is not None
    clock.advance(QUEUE_KEEPALIVE / 3 + 0.1)  # the stopped waiter's keep-alive lapsed
    assert backend.release(R, held.epoch, OWNER_A)  # skips it: hands the lease to the next
    assert granted(backend.try_grant(request("2" * 32), active)).epoch == held.epoch + 1
    late = blocked(backend.try_grant(request("1" * 32), stopped))  # back, but the lease is taken
    assert late.holder == "holder-2"


def test_a_waiter_stopped_at_the_head_holds_a_handed_lease_until_its_ttl(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    held = granted(backend.try_grant(request(), None))
    stopped = backend.enqueue(request("1" * 32))  # stopped: reads nothing from now on
    active = backend.enqueue(request("2" * 32))
    assert backend.release(R, held.epoch, OWNER_A)  # handed to the stopped head, like etcd/ZK
    assert blocked(backend.try_grant(request("2" * 32), active)).holder == "holder-1"
    clock.advance(10.1)  # the handed lease's ttl
    assert granted(backend.try_grant(request("2" * 32), active)).epoch == held.epoch + 2
    backend.wait(stopped, 0)  # continued: its datagram tells of a lease that has expired
    assert blocked(backend.try_grant(request("1" * 32), stopped)).holder == "holder-2"


def test_leaving_the_head_of_the_line_wakes_the_next_waiter(backend: SQLiteBackend) -> None:
    first = backend.enqueue(request("1" * 32))
    second = backend.enqueue(request("2" * 32))
    assert isinstance(first, SQLiteTicket) and isinstance(second, SQLiteTicket)
    backend.wait(first, 0)  # consumes "free and first at enqueue"
    backend.leave(first)
    backend.leave(first)  # idempotent
    started = time.monotonic()
    backend.wait(second, 30)
    assert time.monotonic() - started < 20  # woken by the leave, not by the timeout
    assert granted(backend.try_grant(request("2" * 32), second)).epoch == 1


def test_a_ticket_from_another_backend_or_resource_is_refused(
    backend: SQLiteBackend, db_path: Path
) -> None:
    with SQLiteBackend(db_path) as other:
        foreign = other.enqueue(request())
        with pytest.raises(ConfigurationError):
            backend.try_grant(request(), foreign)
    ticket = backend.enqueue(request())
    with pytest.raises(ConfigurationError):
        backend.try_grant(GrantRequest("jobs/other", 1, OWNER_A, "h"), ticket)


# -- real processes ---------------------------------------------------------------------------

CHILD_PRELUDE = """
import json, sys, time
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator._client import Coordinator
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
path, resource, out = sys.argv[1], sys.argv[2], sys.argv[3]
backend = SQLiteBackend(path)
request = GrantRequest(resource, 10.0, "c" * 32, "child")
def say(**event):
    with open(out, "a") as f:
        f.write(json.dumps(event) + "\\n")
assert isinstance(backend.try_grant(request, None), Blocked)
ticket = backend.enqueue(request)
assert isinstance(backend.try_grant(request, ticket), Blocked)
"""


def spawn_child(body: str, db_path: Path, out: Path) -> subprocess.Popen[bytes]:
    code = CHILD_PRELUDE + textwrap.dedent(body)
    return subprocess.Popen([sys.executable, "-c", code, str(db_path), R, str(out)])


def test_a_release_in_one_process_wakes_a_waiter_in_another(db_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "child.events"
    with SQLiteBackend(db_path) as backend:
        held = granted(backend.try_grant(request(ttl=60), None))
        child = spawn_child(
            """
            say(event="queued")
            started = time.monotonic()
            backend.wait(ticket, 60.0)  # far beyond the test's patience: only a wake-up helps
            waited = time.monotonic() - started
            result = backend.try_grant(request, ticket)
            say(event="done", waited=waited, epoch=getattr(result, "epoch", None))
            """,
            db_path,
            out,
        )
        try:
            wait_for(lambda: read_events(out), 20, "the child to queue")
            assert backend.release(R, held.epoch, OWNER_A)
            wait_for(lambda: len(read_events(out)) == 2, 20, "the child to be woken")
            done = read_events(out)[1]
            assert done["epoch"] == held.epoch + 1
            assert isinstance(done["waited"], float) and done["waited"] < 30
            assert child.wait(20) == 0
        finally:
            child.kill()
            child.wait(10)


def test_a_waiter_killed_while_queued_is_skipped_at_once(db_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "child.events"
    with SQLiteBackend(db_path) as backend:
        held = granted(backend.try_grant(request(), None))
        child = spawn_child('say(event="queued")\ntime.sleep(60)\n', db_path, out)
        try:
            wait_for(lambda: read_events(out), 20, "the child to queue")
        finally:
            child.kill()
            child.wait(10)
        # Keep the dead child's row live by time: only its death can make it skippable.
        raw = sqlite3.connect(db_path)
        with raw:
            raw.execute("UPDATE waiters SET expires_at = expires_at + 3600")
        raw.close()
        mine = backend.enqueue(request(OWNER_B))
        assert blocked(backend.try_grant(request(OWNER_B), mine)).holder == "holder-a"
        assert backend.release(R, held.epoch, OWNER_A)  # wakes the dead head: refused, skipped
        assert granted(backend.try_grant(request(OWNER_B), mine)).epoch == held.epoch + 1
    raw = sqlite3.connect(db_path)
    assert raw.execute("SELECT count(*) FROM waiters").fetchone() == (0,)
    raw.close()


def test_close_wakes_a_thread_blocked_in_wait(db_path: Path) -> None:
    backend = SQLiteBackend(db_path)
    granted(backend.try_grant(request(), None))
    ticket = backend.enqueue(request(OWNER_B))
    returned = threading.Event()

    def waiter() -> None:
        backend.wait(ticket, 60)
        returned.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.05)  # let it block (if it has not yet, wait() returns at once anyway)
    backend.close()
    assert returned.wait(20)
    thread.join(20)
    with pytest.raises(ConfigurationError):
        backend.try_grant(request(OWNER_B), ticket)


def test_a_forked_child_uses_its_own_connection(backend: SQLiteBackend) -> None:
    held = granted(backend.try_grant(request(), None))
    queued = backend.enqueue(request(OWNER_B))  # the parent's place in line
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running any finaliser
        status = 1
        try:
            info = backend.current(R)
            backend.release(R, held.epoch, OWNER_A)
            backend.close()  # must not take the parent's place in line with it
            os.write(write_end, json.dumps({"epoch": info.epoch if info else None}).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    reply = os.read(read_end, 1000)
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0
    assert json.loads(reply) == {"epoch": held.epoch}
    # The child's release reached the shared database and handed the lease to the parent's
    # place in line, which the child's close() left alone.
    current = backend.current(R)
    assert current is not None and (current.epoch, current.holder) == (held.epoch + 1, "holder-b")
    assert blocked(backend.try_grant(request(OWNER_A), None)).holder == "holder-b"
    assert granted(backend.try_grant(request(OWNER_B), queued)).epoch == held.epoch + 1


# -- records ----------------------------------------------------------------------------------


def test_a_release_is_recorded_lazily_dated_when_it_happened(
    backend: SQLiteBackend, db_path: Path, clock: ManualClock
) -> None:
    lease = granted(backend.try_grant(request(), None))
    clock.advance(2)
    released_at = clock.wall()
    assert backend.release(R, lease.epoch, OWNER_A)
    clock.advance(3)
    raw = sqlite3.connect(db_path)
    assert raw.execute("SELECT kind FROM records").fetchall() == [("granted",)]  # none written yet
    raw.close()
    kinds = [(r.kind, r.epoch, r.holder) for r in backend.records(R)]
    assert kinds == [
        (RecordKind.GRANTED, lease.epoch, "holder-a"),
        (RecordKind.RELEASED, lease.epoch, "holder-a"),
    ]
    released = backend.records(R)[1]
    assert released.at == released_at
    assert granted(backend.try_grant(request(OWNER_B), None))
    assert [r.detail.get("after") for r in backend.records(R, after=released.seq)] == ["released"]


def test_every_record_is_stamped_with_the_host_clocks_wall_time(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    """A record's time is the injected clock's ``wall()``, never the machine's: under a
    ManualClock set years before today every kind of record carries the manual wall time (an
    expiry the instant it expired), and retention is measured on that clock too."""
    clock.jump_wall(-10 * 365 * 86400.0)
    start = clock.wall()
    first = granted(backend.try_grant(request(ttl=1), None))
    backend.proclaim(R, first.epoch, OWNER_A, "v1")
    clock.advance(5)  # the first lease expired 4 s ago
    second = granted(backend.try_grant(request(OWNER_B), None))
    clock.advance(1)
    backend.report(R, second.epoch, "holder-b", RecordKind.RENEWAL_FAILED, {"error": "x"})
    clock.advance(1)
    assert backend.release(R, second.epoch, OWNER_B)
    clock.advance(1)
    backend.advance(100, {}, {"era": "test"})
    stamps = [(r.kind, r.at - start) for r in backend.records(R)]
    assert stamps == [
        (RecordKind.GRANTED, 0.0),
        (RecordKind.PROCLAIMED, 0.0),
        (RecordKind.EXPIRED, 1.0),
        (RecordKind.GRANTED, 5.0),
        (RecordKind.RENEWAL_FAILED, 6.0),
        (RecordKind.RELEASED, 7.0),
        (RecordKind.RESTORED, 8.0),
    ]
    assert backend.prune_records() == 0  # none is older than the retention by this clock
    clock.jump_wall(backend._record_retention + 8.5)
    assert backend.prune_records() == len(stamps) - 1  # the newest is kept
    assert [r.kind for r in backend.records(R)] == [RecordKind.RESTORED]


def test_an_unnoticed_expiry_is_recorded_before_the_next_grant(
    backend: SQLiteBackend, clock: ManualClock
) -> None:
    first = granted(backend.try_grant(request(ttl=1), None))
    clock.advance(5)
    clock.reboot()  # a lease from another boot is expired too
    second = granted(backend.try_grant(request(OWNER_B), None))
    history = [(r.kind, r.epoch) for r in backend.records(R)]
    assert history == [
        (RecordKind.GRANTED, first.epoch),
        (RecordKind.EXPIRED, first.epoch),
        (RecordKind.GRANTED, second.epoch),
    ]
    assert backend.records(R)[-1].detail == {"after": "expired"}
    assert all(OWNER_A not in json.dumps(r.to_json()) for r in backend.records(None))


def test_watchers_are_woken_by_every_change_and_their_flag_follows_them(
    db_path: Path, backend: SQLiteBackend
) -> None:
    """A watcher is woken by the first grant of a resource (the row is created flagged), by a
    release and by a later grant (both read the flag); the last watcher to leave clears it, and
    a flag left set without watchers is cleared by the next change."""
    seen: list[int] = []

    def watching(after: int) -> threading.Thread:
        def run() -> None:
            backend.watch(R, after, timeout=10)
            seen.append(after)

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: _watchers(db_path) == 1, 5, "the watcher's row")
        return thread

    def woken_by(change: Callable[[], object], after: int) -> None:
        thread = watching(after)
        started = time.monotonic()
        change()
        thread.join(10)
        assert seen[-1] == after and time.monotonic() - started < 5  # not the 10 s timeout
        wait_for(lambda: _watchers(db_path) == 0, 5, "the watcher to leave")

    first = granted(backend.try_grant(request(), None))  # the first grant: an insert
    woken_by(lambda: backend.release(R, first.epoch, OWNER_A), backend.records(R)[-1].seq)
    other = "jobs/other"  # watched before its first grant: the new row is flagged
    thread = threading.Thread(target=lambda: backend.watch(other, 0, timeout=10))
    thread.start()
    wait_for(lambda: _watchers(db_path) == 1, 5, "the watcher's row")
    started = time.monotonic()
    granted(backend.try_grant(GrantRequest(other, 10.0, OWNER_B, "b"), None))
    thread.join(10)
    assert time.monotonic() - started < 5
    wait_for(lambda: _watchers(db_path) == 0, 5, "the watcher to leave")
    last = backend.records(R)[-1].seq
    second = granted(backend.try_grant(request(), None))  # a plain UPDATE of a known row
    woken_by(lambda: backend.release(R, second.epoch, OWNER_A), backend.records(R)[-1].seq)
    woken_by(lambda: backend.try_grant(request(), None), backend.records(R)[-1].seq)
    assert last < backend.records(R)[-1].seq
    assert _watched(db_path) == {R: 0, other: 0}  # each last watcher cleared its flag
    raw = sqlite3.connect(db_path, isolation_level=None)
    raw.execute("UPDATE resources SET watched = 1")  # as if a watcher had been purged
    raw.close()
    assert backend.current(R) is not None
    third = backend.current(R)
    assert third is not None and backend.release(R, third.epoch, OWNER_A)
    assert _watched(db_path)[R] == 0  # the release found nobody and cleared it


def _watchers(db_path: Path) -> int:
    raw = sqlite3.connect(db_path)
    try:
        return int(raw.execute("SELECT count(*) FROM watchers").fetchone()[0])
    finally:
        raw.close()


def test_close_leaves_the_queue(db_path: Path) -> None:
    backend = SQLiteBackend(db_path)
    ticket = backend.enqueue(request())
    backend.close()
    raw = sqlite3.connect(db_path)
    assert raw.execute("SELECT count(*) FROM waiters").fetchone() == (0,)
    raw.close()
    assert isinstance(ticket, SQLiteTicket) and ticket.ended


def test_records_are_bounded_by_the_limit_and_the_retention(tmp_path: Path) -> None:
    backend = SQLiteBackend(tmp_path / "fenced.db", record_limit=10, record_retention=3600)
    coord = Coordinator(backend)
    for _ in range(30):
        coord.release(coord.acquire("r", ttl=5, wait=0))
    coord.acquire("r", ttl=5, wait=0)  # writes the last release's record
    assert len(coord.history("r")) > 10
    assert backend.prune_records() > 0
    kept = coord.history("r")
    assert len(kept) == 10
    assert kept[-1].kind is RecordKind.GRANTED and kept[-1].epoch == 31  # the newest stays
    aged = SQLiteBackend(tmp_path / "fenced.db", record_retention=1e-9)
    aged.prune_records()
    assert [r.epoch for r in Coordinator(aged).history("r")] == [31]
    aged.close()
    coord.close()


@pytest.mark.parametrize("kwargs", [{"record_limit": 0}, {"record_retention": 0}])
def test_bad_record_bounds_are_configuration_errors(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        SQLiteBackend(tmp_path / "fenced.db", **kwargs)


_OPENER = """
import fenced
coord = fenced.connect("sqlite:///" + sys.argv[1])
print(coord.coordinator_id)
"""


def test_processes_that_open_a_new_database_at_once_all_get_it(tmp_path: Path) -> None:
    """Switching a new file to WAL needs its exclusive lock, and SQLite answers "database is
    locked" at once (no busy handler) while another process opens the same new file: every
    opener must wait its turn instead, and all must see the same coordinator id."""
    for attempt in range(4):
        db_path, go = tmp_path / f"new{attempt}.db", tmp_path / f"go{attempt}"
        results = run_together(_OPENER, [str(db_path)], 6, go)
        assert [code for code, _, _ in results] == [0] * 6, [err for _, _, err in results]
        assert len({out.strip() for _, out, _ in results}) == 1

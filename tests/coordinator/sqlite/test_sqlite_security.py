"""The embedded coordinator against another local user, and against losing its own database.

- A wake-up datagram is only a hint: a forged hand-off sent by another user (``nobody``) to a
  waiter's abstract socket never makes its ``acquire`` return a lease the coordinator did not
  grant; the legitimate holder keeps its lease and no epoch is issued twice.
- The coordinator's files are private (``0600`` in a ``0700`` directory) whatever the umask,
  another user can read none of them; a setgid group directory shares them deliberately.
- Request ids are bearer credentials: never in ``repr(lease)``, log messages or errors.
- A coordinator never re-creates itself silently (epochs from 1, a new id) where its database
  was: a missing, emptied or WAL-less database next to its marker or its ``-wal`` is refused.

The session runs as root; processes of the second user are started with ``user=nobody``. The
coordinator lives under a directory that every user may traverse (as a project directory
usually is), so that only fenced's own modes stand between ``nobody`` and its files.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import fenced
from fenced.coordinator import _restore as restoring
from fenced.coordinator._client import Coordinator
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend, SQLiteTicket
from fenced.coordinator.backends.sqlite._files import marker_of
from fenced.coordinator.backends.sqlite._wakeup import NETNS, Waker
from fenced.core._errors import Busy, ConfigurationError
from fenced.core._records import RecordKind
from fenced.testing.conformance import wait_for
from support.local_users import NOBODY, as_nobody, mode

R = "jobs/nightly"


_READER = """
import os, sys
for path in sys.argv[1:]:
    try:
        if path.endswith("/"):
            os.listdir(path)
        else:
            with open(path, "rb") as stream:
                stream.read(1)
        print("READ", path)
    except PermissionError:
        print("DENIED", path)
"""


def readable_by_nobody(*paths: Path, directory: Path | None = None) -> list[str]:
    """The paths (and the directory's listing) that user nobody can read."""
    targets = [str(path) for path in paths] + ([f"{directory}/"] if directory else [])
    out = as_nobody(_READER, *targets)
    assert len(out.splitlines()) == len(targets), out
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("READ ")]


def files_of(db: Path) -> list[Path]:
    return [db, Path(f"{db}-wal"), Path(f"{db}-shm"), marker_of(db)]


def grant(backend: SQLiteBackend, owner: str = "a" * 32, ttl: float = 10.0) -> Granted:
    result = backend.try_grant(GrantRequest(R, ttl, owner, f"holder-{owner[0]}"), None)
    assert isinstance(result, Granted), result
    return result


# -- a forged hand-off ---------------------------------------------------------------------------


def _waiter_row(db: Path) -> tuple[str, str] | None:
    """(address, owner secret) of the queued waiter, read as root (as an attacker with read
    access to the database would)."""
    raw = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = raw.execute(
            "SELECT addr, owner FROM waiters WHERE name = ? AND owner IS NOT NULL", (R,)
        ).fetchone()
    finally:
        raw.close()
    return None if row is None else (str(row[0]), str(row[1]))


_FORGER = """
import socket, sys, time
address, owner, epoch = sys.argv[1:4]
expires = time.clock_gettime(time.CLOCK_BOOTTIME) + 30  # the waiter's expiry clock
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for message in (f"granted {epoch} {expires!r} {owner}", f"granted {epoch}"):
    try:
        sock.sendto(message.encode(), "\\0" + address)
    except ConnectionRefusedError:  # the waiter took the first one and left
        pass
print("sent")
"""


def test_a_forged_hand_off_from_another_user_grants_nothing(
    public_dir: Path, tmp_path: Path
) -> None:
    """The attack of issue 18: ``nobody`` sends the waiter a "grant" of the next epoch (with the
    waiter's owner secret, read from the database). The waiter's acquire must not return it:
    the legitimate holder keeps its lease and its writes, and the next real grant is the only
    one of its epoch."""
    db = public_dir / ".fenced" / "fenced.db"
    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    outcome: dict[str, object] = {}
    returned_at: list[float] = []
    after: dict[str, int] = {}
    with (
        Coordinator(SQLiteBackend(db)) as holder_coord,
        Coordinator(SQLiteBackend(db)) as waiter_coord,
        fenced.open_store(store_url) as holder_store,
        fenced.open_store(store_url) as waiter_store,
    ):

        def wait_for_the_lease() -> None:
            try:
                with waiter_coord.hold(
                    R, ttl=2, wait=3, fence=[waiter_store], holder="waiter"
                ) as got:
                    outcome["epoch"] = got.epoch
                    waiter_store.put(got.token, "k", b"written under a forged grant")
            except Busy:
                outcome["busy"] = True
            except fenced.FencedError as error:
                outcome["error"] = error
            finally:
                returned_at.append(time.monotonic())

        def take_the_next_grant() -> None:
            lease = waiter_coord.acquire(R, ttl=2, wait=10)
            after["epoch"] = lease.epoch
            waiter_coord.release(lease)

        with holder_coord.hold(R, ttl=2, wait=0, fence=[holder_store], holder="legit") as held:
            waiter = threading.Thread(target=wait_for_the_lease, daemon=True)
            waiter.start()
            wait_for(lambda: _waiter_row(db), 20, "the waiter to queue")
            row = _waiter_row(db)
            assert row is not None
            address, owner = row
            assert as_nobody(_FORGER, address, owner, str(held.epoch + 1)).strip() == "sent"
            forged_at = time.monotonic()
            waiter.join(30)
            assert not waiter.is_alive()
            assert "epoch" not in outcome, f"the waiter believed a forged grant: {outcome}"
            assert returned_at[0] > forged_at, "the forgery came too late to count"
            assert outcome.get("busy") is True, outcome
            held.check()  # the legitimate holder still holds
            current = holder_coord.current(R)
            assert current is not None and (current.epoch, current.holder) == (held.epoch, "legit")
            holder_store.put(held.token, "k", b"legit")  # and its writes are accepted
            legit_epoch = held.epoch
            # The next real grant: the holder's release hands the lease to a new waiter.
            taker = threading.Thread(target=take_the_next_grant, daemon=True)
            taker.start()
            wait_for(lambda: _waiter_row(db), 20, "the next waiter to queue")
        taker.join(30)
        assert after == {"epoch": legit_epoch + 1}
        grants = [r.epoch for r in holder_coord.history(R) if r.kind is RecordKind.GRANTED]
    assert grants == [legit_epoch, legit_epoch + 1]  # each epoch granted once


def test_a_hand_off_datagram_is_a_hint_confirmed_in_the_database(tmp_path: Path) -> None:
    """The same forgery from this user, step by step: the datagram (old and new formats, with
    the right owner secret) is read, the grant is not confirmed, the waiter stays blocked; the
    real hand-off that follows is confirmed and returned once."""
    with SQLiteBackend(tmp_path / "fenced.db") as backend:
        held = grant(backend)
        request = GrantRequest(R, 10.0, "b" * 32, "holder-b")
        ticket = backend.enqueue(request)
        assert isinstance(ticket, SQLiteTicket)
        assert isinstance(backend.try_grant(request, ticket), Blocked)
        address = ticket._socket.address
        waker = Waker()
        boottime = time.clock_gettime(time.CLOCK_BOOTTIME)
        for forged in (f"granted {held.epoch + 1} {boottime + 30!r} {'b' * 32}", "granted 7"):
            waker.wake(address, NETNS, forged.encode())
            backend.wait(ticket, 5)
            answer = backend.try_grant(request, ticket)
            assert isinstance(answer, Blocked) and answer.holder == "holder-a", answer
        assert backend.release(R, held.epoch, "a" * 32)  # the real hand-off
        backend.wait(ticket, 5)
        handed = backend.try_grant(request, ticket)
        assert isinstance(handed, Granted) and handed.epoch == held.epoch + 1
        assert 0 < handed.expires_in <= 10
        waker.close()


# -- file modes ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0o022, 0o000], ids=["umask-022", "umask-000"])
def test_the_files_are_private_whatever_the_umask(
    public_dir: Path, umask: Callable[[int], None], value: int
) -> None:
    umask(value)
    db = public_dir / ".fenced" / "deeper" / "fenced.db"
    with SQLiteBackend(db) as backend:
        grant(backend)  # the -wal and -shm exist while it is open
        assert {path.name: mode(path) for path in files_of(db)} == {
            path.name: 0o600 for path in files_of(db)
        }
        assert mode(db.parent) == mode(db.parent.parent) == 0o700
        assert mode(public_dir) == 0o755  # a directory the user made is left as it was
        assert readable_by_nobody(*files_of(db), directory=db.parent) == []
        assert readable_by_nobody(directory=public_dir / ".fenced") == []


def test_another_user_can_read_nothing_of_a_coordinator_made_by_the_default_url(
    public_dir: Path, umask: Callable[[int], None]
) -> None:
    """``fenced.connect()`` in a project directory: ``.fenced`` and everything in it stay
    unreadable by another user, the owner secrets and request ids included."""
    umask(0o022)
    previous = Path.cwd()
    os.chdir(public_dir)
    try:
        with fenced.connect(None) as coord:
            lease = coord.acquire(R, ttl=2, wait=0, request_id="rid-secret")
            directory = public_dir / ".fenced"
            assert readable_by_nobody(*files_of(directory / "fenced.db"), directory=directory) == []
            refused = as_nobody(
                """
                import sys
                import fenced
                try:
                    fenced.connect(sys.argv[1])
                except fenced.ConfigurationError as error:
                    print(error)
                """,
                f"sqlite:///{directory / 'fenced.db'}",
            )
            assert refused.count("\n") == 1 and "Permission denied" in refused, refused
            coord.release(lease)
    finally:
        os.chdir(previous)


def test_existing_files_lose_read_access_that_comes_without_write_access(
    public_dir: Path, umask: Callable[[int], None]
) -> None:
    """A database an older fenced left 0644 in a 0755 directory the user made: reopening it
    makes the files 0600 and leaves the directory alone; a deliberate 0660 stays."""
    umask(0o022)
    directory = public_dir / "state"
    directory.mkdir(mode=0o755)
    db = directory / "fenced.db"
    with SQLiteBackend(db) as backend:
        grant(backend)
        for path in files_of(db):
            os.chmod(path, 0o644)
        SQLiteBackend(db).close()  # a process of this fenced opens it
        assert {path.name: mode(path) for path in files_of(db)} == {
            path.name: 0o600 for path in files_of(db)
        }
        assert mode(directory) == 0o755
        assert readable_by_nobody(*files_of(db)) == []
        os.chmod(db, 0o660)
        SQLiteBackend(db).close()
        assert mode(db) == 0o660


def test_a_setgid_group_directory_shares_the_coordinator_with_its_group(
    public_dir: Path, umask: Callable[[int], None]
) -> None:
    """``install -d -m 2770 -g GROUP DIR``: fenced creates its files 0660 (group from the
    directory), never readable by others; a member of the group (here nobody, in nogroup)
    uses the coordinator."""
    umask(0o077)  # the owner's umask does not decide for the group
    directory = public_dir / "shared"
    directory.mkdir()
    os.chown(directory, -1, NOBODY)
    os.chmod(directory, 0o2770)
    db = directory / "fenced.db"
    with SQLiteBackend(db) as backend:
        held = grant(backend)
        assert {path.name: mode(path) for path in files_of(db)} == {
            path.name: 0o660 for path in files_of(db)
        }
        assert {os.stat(path).st_gid for path in files_of(db)} == {NOBODY}
        assert backend.release(R, held.epoch, "a" * 32)
        out = as_nobody(
            """
            import sys
            from fenced.coordinator.backend import GrantRequest
            from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
            with SQLiteBackend(sys.argv[1]) as backend:
                granted = backend.try_grant(GrantRequest("jobs/nightly", 5.0, "d" * 32, "d"), None)
                print(granted.epoch)
            """,
            str(db),
        )
        assert int(out) == held.epoch + 1
    assert mode(directory) == 0o2770


# -- request ids are credentials -------------------------------------------------------------


def test_request_ids_appear_in_no_repr_log_or_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rid = "rid-0123456789-secret"
    caplog.set_level(logging.DEBUG, logger="fenced")
    with fenced.connect(f"sqlite:///{tmp_path / 'fenced.db'}") as coord:
        lease = coord.acquire(R, ttl=2, wait=0, request_id=rid)
        assert lease.request_id == rid
        assert rid not in repr(lease) and lease.owner not in repr(lease)
        with pytest.raises(ConfigurationError) as reused:
            coord.acquire("jobs/other", ttl=2, wait=0, request_id=rid)
        assert rid not in str(reused.value) and "request_id" in str(reused.value)
        coord.release(lease)
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert rid not in logged and lease.owner not in logged


# -- never re-created silently ---------------------------------------------------------------


def _one_line_refusal(db: Path, *expected: str) -> str:
    with pytest.raises(ConfigurationError) as caught:
        SQLiteBackend(db)
    message = str(caught.value)
    assert "\n" not in message and str(db) in message, message
    for text in expected:
        assert text in message, message
    return message


def test_a_deleted_database_is_refused_while_its_marker_is_there(tmp_path: Path) -> None:
    db = tmp_path / "fenced.db"
    with SQLiteBackend(db) as backend:
        coordinator_id = backend.coordinator_id
        grant(backend)
    assert marker_of(db).read_text().splitlines()[0] == coordinator_id
    db.unlink()
    _one_line_refusal(db, "missing", coordinator_id, str(marker_of(db)))
    assert not db.exists()  # nothing was created
    db.write_bytes(b"")  # an emptied file (truncated, or touched)
    _one_line_refusal(db, "empty", coordinator_id)
    assert db.stat().st_size == 0
    marker_of(db).unlink()  # the way to start a new coordinator deliberately
    db.unlink()
    with SQLiteBackend(db) as fresh:
        assert fresh.coordinator_id != coordinator_id
        assert grant(fresh).epoch == 1
    assert marker_of(db).read_text().splitlines()[0] == fresh.coordinator_id


_KILLED = """
import sys, time
from fenced.coordinator.backend import GrantRequest
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
backend = SQLiteBackend(sys.argv[1])
for owner in ("1", "2", "3"):
    granted = backend.try_grant(GrantRequest("jobs/nightly", 60.0, owner * 32, "k"), None)
    backend.release("jobs/nightly", granted.epoch, owner * 32)
print(backend.coordinator_id, granted.epoch, flush=True)
time.sleep(120)
"""


def _killed_with_its_state_in_the_wal(db: Path, *, marked: bool) -> tuple[str, int]:
    """A process grants three epochs and is killed with SIGKILL: the commits are in the
    ``-wal`` only (never checkpointed into the database file). Returns (coordinator id, last
    epoch). ``marked=False``: the marker is removed (a database of an older fenced)."""
    with subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(db)], stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout is not None
            coordinator_id, epoch = child.stdout.readline().split()
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(20)
    raw = sqlite3.connect(f"file:{db}?immutable=1", uri=True)  # the database file alone
    assert raw.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
    raw.close()
    if not marked:
        marker_of(db).unlink(missing_ok=True)
    return coordinator_id, int(epoch)


@pytest.mark.parametrize("loss", ["deleted", "replaced by a backup"])
def test_a_database_whose_wal_was_lost_is_refused_not_started_again(
    tmp_path: Path, loss: str
) -> None:
    """All the coordinator's state was in its ``-wal`` (a process killed before any
    checkpoint); the ``-wal`` is deleted, or overwritten by a backup (``fenced backup
    fenced.db-wal``). The database file alone holds no tables: it must be refused, not
    initialised as a new coordinator whose epochs start again at 1."""
    db = tmp_path / "fenced.db"
    other = tmp_path / "other" / "fenced.db"
    SQLiteBackend(other).close()
    restoring.backup(f"sqlite:///{other}", tmp_path / "backup.db")
    coordinator_id, _ = _killed_with_its_state_in_the_wal(db, marked=True)
    wal = Path(f"{db}-wal")
    if loss == "deleted":
        wal.unlink()
        Path(f"{db}-shm").unlink()
    else:
        shutil.copyfile(tmp_path / "backup.db", wal)
    _one_line_refusal(db, coordinator_id)
    raw = sqlite3.connect(f"file:{db}?immutable=1", uri=True)
    assert raw.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)  # unchanged
    raw.close()


def test_a_missing_database_beside_its_wal_is_refused_even_without_a_marker(
    tmp_path: Path,
) -> None:
    """A database of an older fenced (no marker) whose file is gone while its ``-wal`` is
    there: refused, nothing created."""
    db = tmp_path / "fenced.db"
    _killed_with_its_state_in_the_wal(db, marked=False)
    db.unlink()
    _one_line_refusal(db, "fenced.db-wal")
    assert not db.exists() and not marker_of(db).exists()


def test_a_restore_onto_a_lost_database_is_the_way_back(tmp_path: Path) -> None:
    """The refusal names the way out: ``fenced restore`` onto the empty location works with the
    marker there; afterwards the database opens, the marker holds its id, and the restore's
    staging copy left no marker behind."""
    db = tmp_path / "db" / "fenced.db"
    url = f"sqlite:///{db}"
    with SQLiteBackend(db) as backend:
        coordinator_id = backend.coordinator_id
        last = grant(backend).epoch
    restoring.backup(url, tmp_path / "backup.db")
    db.unlink()
    _one_line_refusal(db, "fenced restore")
    report = restoring.restore(url, tmp_path / "backup.db")
    with SQLiteBackend(db) as restored:
        assert restored.coordinator_id == coordinator_id
        assert grant(restored).epoch > max(last, report.minimum)
    assert sorted(path.name for path in db.parent.iterdir()) == [
        "fenced.db",
        "fenced.db.coordinator-id",
    ]

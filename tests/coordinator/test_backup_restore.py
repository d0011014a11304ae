"""Backup and restore-safe restore (DESIGN §6), with the CLI and real processes.

* grant 41, back up, grant 42 and 43 and write with 43 at a strict store, restore: the next grant
  is above 43 and its writes are accepted, a 42-holder's write is rejected;
* a backup taken while 4 processes acquire and release in a loop restores to a consistent state;
* restoring a corrupt or foreign file fails clearly and changes nothing;
* ``fenced restore --advance`` after a restore behind fenced's back, from store floors;
* the advance step works on any backend through the contract (memory here);
* restores of one backup in quick succession, the coordinator's files lost in between, never
  hand out a token twice (the base moves with every wall-clock millisecond and a restore waits
  for the next one; a coarse clock only makes it wait longer, a stuck one fails it);
* ``fenced backup`` refuses every file of the live database, by any path.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced.coordinator import _restore as restoring
from fenced.coordinator.backends.sqlite._backup import inspect_database
from fenced.core._errors import ConfigurationError
from fenced.core._records import RecordKind
from fenced.core._restore_base import restore_base, restore_tick
from fenced.core._token import MAX_EPOCH, validate_epoch

R = "exports/daily"
FENCED = [sys.executable, "-m", "fenced"]
WORKERS = Path(__file__).parents[1] / "support" / "ops_workers.py"
STARTUP = 20.0

pytestmark = pytest.mark.slow


def fenced_cmd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FENCED_URL"}
    return subprocess.run(
        [*FENCED, *args], capture_output=True, text=True, env=env, timeout=60, check=False,
        cwd=cwd,
    )  # fmt: skip


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fenced: "), result.stderr
    return lines[0]


def grant(coord: fenced.Coordinator, times: int = 1) -> fenced.Lease:
    for _ in range(times - 1):
        coord.release(coord.acquire(R, ttl=30, wait=0))
    return coord.acquire(R, ttl=30, wait=0)


@pytest.fixture
def area(tmp_path: Path) -> Path:
    (tmp_path / "db").mkdir()
    return tmp_path


def test_restore_moves_every_later_epoch_past_the_lost_ones(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    backup_file = area / "backup.db"
    with fenced.connect(url) as coord, fenced.open_store(f"sqlite:///{area}/store.db") as store:
        coordinator_id = coord.coordinator_id
        lease41 = grant(coord, 41)
        assert lease41.epoch == 41
        coord.release(lease41)
        result = fenced_cmd("backup", str(backup_file), "--url", url, "--json")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == {
            "path": str(backup_file), "url": url, "coordinator_id": coordinator_id,
            "resources": 1, "largest_epoch": 41,
        }  # fmt: skip
        lease42 = coord.acquire(R, ttl=30, wait=0)
        store.fence(lease42.token)
        store.put(lease42.token, "k", b"by 42")
        coord.release(lease42)
        with coord.hold(R, ttl=30, wait=0, fence=[store]) as held43:
            assert held43.epoch == 43
            store.put(held43.token, "k", b"by 43")
    before = time.time()
    result = fenced_cmd("restore", str(backup_file), "--url", url, "--yes")
    assert result.returncode == 0, result.stderr
    assert "every later epoch is above" in result.stdout
    with fenced.connect(url) as coord, fenced.open_store(f"sqlite:///{area}/store.db") as store:
        assert coord.coordinator_id == coordinator_id  # the same coordinator
        with coord.hold(R, ttl=30, wait=0, fence=[store]) as held:
            assert held.epoch > 43
            assert held.epoch > restore_base(before)
            store.put(held.token, "k", b"after the restore")
        with pytest.raises(fenced.StaleToken):
            store.put(lease42.token, "k", b"a 42-holder resumes")
        item = store.get(R, "k")
        assert item is not None and item.value == b"after the restore"
        kinds = [(r.kind, r.epoch) for r in coord.history(R)]
        assert kinds[:2] == [(RecordKind.GRANTED, 1), (RecordKind.RELEASED, 1)]
        restored = [r for r in coord.history(R) if r.kind is RecordKind.RESTORED]
        assert len(restored) == 1
        assert restored[0].detail["reason"] == "restore"
        assert restored[0].detail["source"] == str(backup_file)
        assert 42 not in [e for k, e in kinds if k is RecordKind.GRANTED]  # the backup's past
    timeline = fenced_cmd("timeline", R, "--url", url, "--json")
    assert timeline.returncode == 0, timeline.stderr
    assert "restored" in [e["kind"] for e in json.loads(timeline.stdout)["events"]]


def test_a_backup_under_load_restores_to_a_consistent_state(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        coordinator_id = coord.coordinator_id
    go = area / "go"
    go.touch()
    workers = []
    for index in range(4):
        ready, out, log = (area / f"w{index}.{n}" for n in ("ready", "out", "log"))
        with log.open("wb") as stream:
            proc = subprocess.Popen(
                [sys.executable, str(WORKERS), "loop", url, "--resource", R, "--holder",
                 f"w{index}", "--ready", str(ready), "--go", str(go), "--out", str(out)],
                stdout=stream, stderr=subprocess.STDOUT,
            )  # fmt: skip
        workers.append((proc, ready, out, log))

    def granted() -> list[int]:
        found = []
        for _, _, out, _ in workers:
            if out.exists():
                found += [int(line) for line in out.read_text().split("\n")[:-1]]
        return found

    try:
        deadline = time.monotonic() + STARTUP
        while not all(ready.exists() for _, ready, _, _ in workers) or len(granted()) < 20:
            assert time.monotonic() < deadline, "the workers did not start"
            for proc, _, _, log in workers:
                assert proc.poll() is None, log.read_text()
            time.sleep(0.02)
        backups = []
        for number in range(3):
            floor = max(granted())
            info = restoring.backup(url, area / f"backup-{number}.db")
            backups.append((floor, info))
    finally:
        go.unlink()
        for proc, _, _, log in workers:
            assert proc.wait(STARTUP) == 0, log.read_text()
    every = granted()
    assert sorted(every) == list(range(1, len(every) + 1))  # no epoch twice, none skipped
    for floor, info in backups:
        assert info.coordinator_id == coordinator_id
        copy = inspect_database(info.path)  # integrity_check ok, a known schema
        assert copy.epochs[R] >= floor  # it contains every grant done before it started
        assert copy.epochs[R] in every  # and only grants that were made
        conn = sqlite3.connect(info.path)
        try:
            grants = [row[0] for row in conn.execute(
                "SELECT epoch FROM records WHERE kind = 'granted' AND resource = ? ORDER BY seq",
                (R,),
            )]  # fmt: skip
        finally:
            conn.close()
        assert grants == list(range(1, copy.epochs[R] + 1))
    report = restoring.restore(url, backups[1][1].path)
    assert report.coordinator_id == coordinator_id
    assert report.known == max(every)  # the replaced state's epochs count
    restored = inspect_database(area / "db" / "fenced.db")
    assert restored.coordinator_id == coordinator_id
    with fenced.connect(url) as coord:
        assert coord.acquire(R, ttl=5, wait=0).epoch > max(every)


def snapshot(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def test_restoring_a_corrupt_or_foreign_file_fails_and_changes_nothing(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        grant(coord, 3)
    restoring.backup(url, area / "good.db")
    bad = area / "bad"
    bad.mkdir()
    (bad / "random.db").write_bytes(os.urandom(8192))
    (bad / "empty.db").write_bytes(b"")
    (bad / "text.db").write_text("SQLite format 3 is what I am not\n")
    good = (area / "good.db").read_bytes()
    (bad / "truncated.db").write_bytes(good[: len(good) // 2])
    damaged = bytearray(good)
    damaged[2048:3072] = os.urandom(1024)  # a page of garbage
    (bad / "damaged.db").write_bytes(bytes(damaged))
    fenced.open_store(f"sqlite:///{bad}/store.db").close()  # a fenced *store*, not a coordinator
    foreign = sqlite3.connect(bad / "foreign.db")
    foreign.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    foreign.commit()
    foreign.close()
    shutil.copyfile(area / "good.db", bad / "newer.db")
    newer = sqlite3.connect(bad / "newer.db")
    newer.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    newer.commit()
    newer.close()
    with fenced.connect("sqlite:///" + str(area / "other" / "fenced.db")) as other:
        grant(other)
    shutil.copyfile(area / "other" / "fenced.db", bad / "another-coordinator.db")

    cases = sorted(p for p in bad.iterdir() if not p.name.endswith(("-wal", "-shm")))
    before, sources = snapshot(area / "db"), snapshot(bad)
    messages = {}
    for path in [*cases, bad / "missing.db", bad]:
        messages[path.name] = one_line_error(
            fenced_cmd("restore", str(path), "--url", url, "--yes")
        )
    assert snapshot(area / "db") == before  # nothing changed, no staging file left
    assert snapshot(bad) == sources  # the sources were only read
    assert "schema version 99" in messages["newer.db"]
    assert "another" not in messages["newer.db"]
    assert "is a backup of coordinator" in messages["another-coordinator.db"]
    assert "not a fenced coordinator database" in messages["store.db"]
    assert "does not exist" in messages["missing.db"]
    for name in ("random.db", "text.db", "empty.db", "truncated.db", "damaged.db", "foreign.db"):
        assert "fenced" in messages[name], messages[name]
    with fenced.connect(url) as coord:
        assert coord.last_epoch(R) == 3


def test_restore_refuses_while_the_coordinator_is_in_use(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        grant(coord)
    restoring.backup(url, area / "backup.db")
    coord = fenced.connect(url)
    try:
        before = snapshot(area / "db")
        with pytest.raises(ConfigurationError, match=r"in use by process .*this process"):
            restoring.restore(url, area / "backup.db")
        assert snapshot(area / "db") == before
        report = restoring.restore(url, area / "backup.db", force=True)  # fault injection
        with fenced.connect(url) as fresh:
            assert fresh.acquire(R, ttl=5, wait=0).epoch == report.minimum + 1
    finally:
        coord.close()
    one = fenced_cmd("restore", str(area / "backup.db"), "--url", url)  # no --yes, no terminal
    assert "--yes" in one_line_error(one)
    assert "either SRC" in one_line_error(fenced_cmd("restore", "--url", url, "--yes"))
    both = fenced_cmd("restore", str(area / "backup.db"), "--advance", "--url", url, "--yes")
    assert "either SRC" in one_line_error(both)
    pg = fenced_cmd("backup", str(area / "x.db"), "--url", "postgresql://localhost/x")
    assert "pg_dump" in one_line_error(pg)


def test_advance_after_a_restore_behind_fenceds_back_uses_store_floors(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    store_url = f"file://{area}/store"
    with fenced.connect(url) as coord:
        coord.release(grant(coord, 2))
    shutil.copyfile(area / "db" / "fenced.db", area / "copy.db")  # taken while nothing runs
    future = restore_base(time.time()) + (5 << 32)  # a floor ahead of any base: a clock ahead
    with fenced.connect(url) as coord, fenced.open_store(store_url) as store:
        for _ in range(3):
            lease = coord.acquire(R, ttl=30, wait=0)
            store.fence(lease.token)
            coord.release(lease)
        store.fence(fenced.FencingToken(coord.coordinator_id, "jobs/new", future))
    shutil.copyfile(area / "copy.db", area / "db" / "fenced.db")  # the restore behind our back
    for suffix in ("-wal", "-shm"):
        (area / "db" / f"fenced.db{suffix}").unlink(missing_ok=True)
    result = fenced_cmd("restore", "--advance", "--floor-from", store_url, "--url", url, "--yes")
    assert result.returncode == 0, result.stderr
    with fenced.connect(url) as coord, fenced.open_store(store_url) as store:
        assert coord.acquire("jobs/new", ttl=5, wait=0).epoch == future + 1
        with coord.hold(R, ttl=5, wait=0, fence=[store]) as held:
            assert held.epoch == future + 1
            store.put(held.token, "k", b"accepted")
        history = coord.history(R)
        assert history[-3].kind is RecordKind.RESTORED
        assert history[-3].detail["reason"] == "advance"
        assert history[-3].detail["store_floor"] == future
    missing = fenced_cmd("restore", "--advance", "--floor-from", f"file://{area}/nope", "--yes")
    assert "no fenced store" in one_line_error(missing)


@pytest.fixture
def memory() -> Iterator[fenced.Coordinator]:
    from fenced.coordinator.backends.memory._backend import MemoryBackend

    MemoryBackend.forget("restore-test")
    with fenced.connect("memory://restore-test") as coord:
        yield coord
    MemoryBackend.forget("restore-test")


def test_advance_works_through_the_backend_contract(memory: fenced.Coordinator) -> None:
    lease = memory.acquire(R, ttl=30, wait=0)
    reads = itertools.count()  # a wall clock at 600 s that moves 1 ms at each read
    report = restoring.advance(
        memory, floors={"jobs/other": 7}, wall=lambda: 600.0 + next(reads) / 1000
    )
    assert report.minimum == max(restore_base(600.0), 7) == 10 << 32
    assert report.to_json()["era"] == 10
    assert memory.current(R) is None  # the leases of the state before are gone
    assert memory.release(lease) is False
    assert memory.acquire(R, ttl=5, wait=0).epoch == (10 << 32) + 1
    with pytest.raises(ConfigurationError, match="too close"):
        restoring.advance(memory, floors={"x": 2**63 - 10})


# -- restores in quick succession ----------------------------------------------------------------


def lose(directory: Path) -> None:
    """The coordinator's files are lost (a disk replaced, a directory wiped)."""
    for path in directory.iterdir():
        path.unlink()


def first_and_more(url: str, issued: list[int]) -> fenced.Lease:
    """The first grant after a restore (checked against every earlier one), then two more."""
    with fenced.connect(url) as coord:
        first = coord.acquire(R, ttl=5, wait=0)
        assert all(first.epoch > epoch for epoch in issued), (first.epoch, issued)
        issued.append(first.epoch)
        coord.release(first)
        issued.append(grant(coord, 2).epoch)
    return first


def test_the_restore_base_moves_with_every_millisecond_and_keeps_the_minute_as_era() -> None:
    minute = 29_000_000  # 2025
    assert restore_base(60.0 * minute) == minute << 32  # the start of a minute: its era
    bases = [restore_base(60 * minute + (tick + 0.5) / 1000) for tick in range(-2, 60_002)]
    assert [restore_tick(60 * minute + (t + 0.5) / 1000) for t in (0, 59_999)] == [
        60_000 * minute,
        60_000 * minute + 59_999,
    ]
    steps = [later - earlier for earlier, later in itertools.pairwise(bases)]
    assert min(steps) >= 2**16  # room for 2**16 grants of one resource per millisecond
    assert [base >> 32 for base in (bases[0], bases[2], bases[-3], bases[-1])] == [
        minute - 1,
        minute,
        minute,
        minute + 1,
    ]
    year_6000 = (6000 - 1970) * 365.25 * 86_400
    validate_epoch(restore_base(year_6000) + 2**32)  # still a valid token epoch, with room
    assert restore_base(year_6000) < MAX_EPOCH - 2**32


def test_restores_of_one_backup_within_a_second_never_repeat_a_token(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        coord.release(grant(coord, 3))
    restoring.backup(url, area / "backup.db")
    issued = [3]
    tokens = []
    for _ in range(3):  # three restores of the same backup, well within one minute
        lose(area / "db")  # nothing is known of the state the restore replaces
        report = restoring.restore(url, area / "backup.db")
        assert report.known == 3
        tokens.append(str(first_and_more(url, issued).token))
    assert len(set(tokens)) == 3, tokens
    assert issued == sorted(issued) and len(set(issued)) == len(issued)
    # The state the restore replaces is there this time: its epochs count too.
    report = restoring.restore(url, area / "backup.db")
    assert report.known == issued[-1] < report.minimum
    assert first_and_more(url, issued).epoch == report.minimum + 1


def test_fenced_restore_twice_within_a_minute_never_repeats_a_token(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        coord.release(grant(coord, 3))
    backup_file = area / "backup.db"
    assert fenced_cmd("backup", str(backup_file), "--url", url).returncode == 0
    issued = [3]
    minimums = []
    for restore_args in (["restore", str(backup_file)], ["restore", str(backup_file)]):
        lose(area / "db")
        result = fenced_cmd(*restore_args, "--url", url, "--yes", "--json")
        assert result.returncode == 0, result.stderr
        minimums.append(json.loads(result.stdout)["minimum"])
        first_and_more(url, issued)
    for _ in range(2):  # the same backup copied back behind fenced's back, then --advance
        lose(area / "db")
        shutil.copyfile(backup_file, area / "db" / "fenced.db")
        result = fenced_cmd("restore", "--advance", "--url", url, "--yes", "--json")
        assert result.returncode == 0, result.stderr
        minimums.append(json.loads(result.stdout)["minimum"])
        first_and_more(url, issued)
    assert minimums == sorted(set(minimums)), minimums
    assert issued == sorted(set(issued)), issued


def test_a_coarse_wall_clock_only_makes_a_restore_wait(
    area: Path, memory: fenced.Coordinator
) -> None:
    def coarse() -> float:  # a clock that moves in steps of 50 ms
        return math.floor(time.time() * 20) / 20

    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        coord.release(grant(coord, 3))
    restoring.backup(url, area / "backup.db")
    issued = [3]
    bases = []
    for _ in range(3):
        lose(area / "db")
        bases.append(restoring.restore(url, area / "backup.db", wall=coarse).base)
        first_and_more(url, issued)
    assert bases == sorted(set(bases)) and issued == sorted(set(issued)), (bases, issued)
    epochs = []
    for _ in range(3):  # the same on any backend, through advance
        restoring.advance(memory, wall=coarse)
        lease = memory.acquire(R, ttl=5, wait=0)
        memory.release(lease)
        epochs.append(lease.epoch)
    assert epochs == sorted(set(epochs)) and epochs[0] > issued[-1], epochs


def test_a_wall_clock_that_does_not_move_fails_a_restore_and_changes_nothing(
    area: Path, memory: fenced.Coordinator
) -> None:
    def stuck() -> float:
        return 1_800_000_000.0

    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        coord.release(grant(coord, 3))
    restoring.backup(url, area / "backup.db")
    before = snapshot(area / "db")
    with pytest.raises(ConfigurationError, match=r"wall clock did not pass .* nothing was changed"):
        restoring.restore(url, area / "backup.db", wall=stuck)
    assert snapshot(area / "db") == before  # no staging file left either
    lease = memory.acquire(R, ttl=30, wait=0)
    with pytest.raises(ConfigurationError, match="wall clock did not pass"):
        restoring.advance(memory, wall=stuck)
    assert memory.current(R) is not None  # the lease was not ended: nothing was advanced
    assert memory.release(lease) is True
    assert memory.acquire(R, ttl=5, wait=0).epoch == lease.epoch + 1


# -- backup refuses the live database's files ------------------------------------------------------


def test_backup_refuses_every_file_of_the_live_database(area: Path) -> None:
    url = f"sqlite:///{area}/db/fenced.db"
    db = area / "db" / "fenced.db"
    coord = fenced.connect(url)
    try:
        lease = coord.acquire(R, ttl=30, wait=0)
        assert Path(f"{db}-wal").exists() and Path(f"{db}-shm").exists()
        links = area / "links"
        links.mkdir()
        (links / "wal-symlink").symlink_to(f"{db}-wal")
        (links / "db-symlink").symlink_to(db)
        os.link(db, links / "db-hardlink")
        os.link(f"{db}-wal", links / "wal-hardlink")
        (area / "dir-symlink").symlink_to(area / "db")
        destinations = [
            db, Path(f"{db}-wal"), Path(f"{db}-shm"), Path(f"{db}-journal"),
            area / "db" / ".." / "db" / "fenced.db-wal", area / "dir-symlink" / "fenced.db-shm",
            *sorted(links.iterdir()),
        ]  # fmt: skip
        before, aside = snapshot(area / "db"), snapshot(links)
        for dest in destinations:
            message = one_line_error(fenced_cmd("backup", str(dest), "--url", url))
            assert "is a file of the live coordinator database" in message, message
        relative = fenced_cmd(
            "backup", "db/fenced.db-wal", "--url", "sqlite:db/fenced.db", cwd=area
        )
        assert "live coordinator database" in one_line_error(relative)
        assert snapshot(area / "db") == before and snapshot(links) == aside  # nothing written
        assert not Path(f"{db}-journal").exists()
        info = coord.current(R)
        assert info is not None and info.epoch == lease.epoch  # the holder's state is intact
        with fenced.connect(url) as other:
            assert other.coordinator_id == coord.coordinator_id
            assert other.last_epoch(R) == lease.epoch
        done = fenced_cmd("backup", str(area / "backup.db"), "--url", url)
        assert done.returncode == 0, done.stderr
    finally:
        coord.close()


def test_a_backup_is_as_private_as_the_database_whatever_the_umask(area: Path) -> None:
    """A backup holds the owner secrets and request ids of live leases: 0600 under any umask."""
    url = f"sqlite:///{area}/db/fenced.db"
    with fenced.connect(url) as coord:
        coord.acquire(R, ttl=30, wait=0, request_id="a-bearer-credential")
        old = os.umask(0o022)
        try:
            restoring.backup(url, area / "backup.db")
        finally:
            os.umask(old)
    assert (area / "backup.db").stat().st_mode & 0o777 == 0o600

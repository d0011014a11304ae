"""Bad input and awkward circumstances, as a user meets them (issue 20, operations).

* Readers create nothing: ``status``, ``timeline``, ``metrics``, ``backup`` and the store
  readers on a missing database exit 2 with one line naming it, and the directory is unchanged;
  ``fenced.connect(create=False)`` and ``open_store(create=False)`` are the library's way.
* ``fenced run --fence`` refuses a store that cannot be created before any coordinator exists.
* ``fenced status`` on a full disk (a real tmpfs) shows the state and exits 0.
* ``fenced run``'s command gets an absolute ``FENCED_URL``: it names the same coordinator after
  a ``cd /``.
* SIGINT while ``fenced run`` / ``fenced elect`` waits: exit 130, one line, nothing granted.
* ``put`` / ``publish`` read FIFOs and bash's ``<(cmd)``; a FILE that cannot be read says why.
* A ttl below 0.1 s is refused before any I/O, by the command and by the library.
* Accurate one-line messages: ``sqlite:/dev/null``, ``file:/proc/nope``, an oversized
  ``--if-version``, ``--url postgresql://``, a damaged coordinator given to ``backup``, a lease
  lost under ``fenced run``, and a foreign token at a store whose floor is 5.

Every command runs as ``python -m fenced`` in its own process; waits poll with a deadline.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced.core._policy import MIN_TTL, LeasePolicy, validate_ttl
from support.cli_processes import DEADLINE, FENCED, fenced_cmd, one_line_error, wait_for
from support.small_disk import fill_up, mounted_tmpfs

pytestmark = pytest.mark.slow

R = "jobs/nightly"


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'fenced.db'}"


def listing(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


def token_of(url: str) -> str:
    with fenced.connect(url) as coord:
        lease = coord.acquire(R, ttl=30, wait=0)
        return str(lease.token)


# -- readers create nothing ----------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    [["status"], ["status", R, "--json"], ["timeline", R], ["metrics"], ["backup", "BACKUP"]],
    ids=" ".join,
)
def test_a_reader_of_a_missing_coordinator_exits_2_and_creates_nothing(
    tmp_path: Path, command: list[str]
) -> None:
    missing = tmp_path / "x" / "nope" / "deep" / "x.db"
    args = [str(tmp_path / "b.db") if arg == "BACKUP" else arg for arg in command]
    before = listing(tmp_path)
    result = fenced_cmd(*args, "--url", f"sqlite:{missing}")
    assert result.returncode == 2
    assert str(missing) in one_line_error(result)
    assert "does not exist" in result.stderr
    assert result.stdout == ""
    assert listing(tmp_path) == before


def test_the_default_coordinator_is_not_created_by_status(tmp_path: Path) -> None:
    result = fenced_cmd("status", cwd=tmp_path)
    assert result.returncode == 2
    assert str(tmp_path / ".fenced" / "fenced.db") in one_line_error(result)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("kind", ["sqlite", "file"])
@pytest.mark.parametrize(
    "command",
    [["get", "STORE", R, "k"], ["latest", "STORE", R], ["read", "STORE", R], ["gc", "STORE"]],
    ids=lambda command: command[0],
)
def test_a_store_reader_of_a_missing_store_exits_2_and_creates_nothing(
    tmp_path: Path, kind: str, command: list[str]
) -> None:
    missing = tmp_path / "no" / "store" if kind == "file" else tmp_path / "store.db"
    store_url = f"{kind}:{missing}"
    result = fenced_cmd(*[store_url if arg == "STORE" else arg for arg in command])
    assert result.returncode == 2
    assert str(missing) in one_line_error(result)
    assert listing(tmp_path) == []


def test_connect_and_open_store_with_create_false_create_nothing(tmp_path: Path) -> None:
    for target in (
        lambda: fenced.connect(f"sqlite:{tmp_path / 'a' / 'c.db'}", create=False),
        lambda: fenced.open_store(f"sqlite:{tmp_path / 's.db'}", create=False),
        lambda: fenced.open_store(f"file:{tmp_path / 'a' / 'store'}", create=False),
    ):
        with pytest.raises(fenced.ConfigurationError, match="does not exist"):
            target()
    assert listing(tmp_path) == []
    (tmp_path / "empty.db").touch()  # a file, but never a fenced database: refused, unchanged
    with pytest.raises(fenced.ConfigurationError, match="empty"):
        fenced.connect(f"sqlite:{tmp_path / 'empty.db'}", create=False)
    with pytest.raises(fenced.ConfigurationError, match="not initialised"):
        fenced.open_store(f"sqlite:{tmp_path / 'empty.db'}", create=False)
    assert (tmp_path / "empty.db").stat().st_size == 0
    assert listing(tmp_path) == ["empty.db"]


def test_an_existing_coordinator_and_store_open_with_create_false(url: str, tmp_path: Path) -> None:
    store_url = f"file:{tmp_path / 'store'}"
    token = fenced.FencingToken.parse(token_of(url))
    with fenced.open_store(store_url) as store:
        store.fence(token)
    with fenced.connect(url, create=False) as coord:
        assert coord.last_epoch(R) == 1
    with fenced.open_store(store_url, create=False) as store:
        assert store.floors()[R] == 1


def test_run_refuses_a_store_that_cannot_be_created_before_the_coordinator_exists(
    tmp_path: Path,
) -> None:
    coordinator = tmp_path / "c.db"
    result = fenced_cmd(
        "run", R, "--url", f"sqlite:{coordinator}", "--fence", "sqlite:/nonexistent/x.db",
        "--", "true",
    )  # fmt: skip
    assert result.returncode == 2
    line = one_line_error(result)
    assert "/nonexistent/x.db" in line
    assert "the directory /nonexistent does not exist" in line
    assert listing(tmp_path) == []
    # a bad coordinator URL is refused before a --fence store is created
    result = fenced_cmd(
        "run", R, "--url", "nope://x", "--fence", f"sqlite:{tmp_path / 's.db'}", "--", "true"
    )
    assert result.returncode == 2
    assert "nope" in one_line_error(result)
    assert listing(tmp_path) == []


# -- a full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", "4m") as disk:
        yield disk


def test_status_shows_the_state_on_a_full_disk(small_disk: Path) -> None:
    url = f"sqlite:{small_disk / 'fenced.db'}"
    with fenced.connect(url) as coord:
        coord.release(coord.acquire("a", ttl=30, wait=0))  # its end is recorded lazily
        coord.acquire("b", ttl=600, wait=0, holder="the-holder")
    fill_up(small_disk / "filler")  # nobody has the database open: no -shm file to map
    for args in (["status"], ["timeline", "a"], ["metrics"]):
        result = fenced_cmd(*args, "--url", url)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.splitlines()) <= 1  # at most the warning that says why
    result = fenced_cmd("status", "--url", url)
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
    assert rows["a"][1:3] == ["-", "-"]
    assert rows["b"][1:3] == ["the-holder", "1"]
    assert "lease ends not recorded yet" in result.stderr


def test_status_shows_the_state_on_a_full_disk_while_a_holder_runs(small_disk: Path) -> None:
    url = f"sqlite:{small_disk / 'fenced.db'}"
    started = small_disk / "started"
    holder = subprocess.Popen(
        [*FENCED, "run", R, "--url", url, "--holder", "the-holder", "--",
         "sh", "-c", f"touch {started}; exec sleep 60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(started.exists, "the holder's command")
        with fenced.connect(url) as coord:
            coord.release(coord.acquire("other", ttl=30, wait=0))
        fill_up(small_disk / "filler")
        result = fenced_cmd("status", "--url", url)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
        assert rows[R][1:3] == ["the-holder", "1"]
        assert rows["other"][1] == "-"
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=DEADLINE)


# -- FENCED_URL, SIGINT ---------------------------------------------------------------------

CHILD = (
    'cd / && "$0" -m fenced status "$FENCED_RESOURCE" --json > "$1" && '
    "test ! -e /fenced.db && test ! -e /rel"
)


def test_the_command_gets_an_absolute_fenced_url(tmp_path: Path) -> None:
    report = tmp_path / "status.json"
    result = fenced_cmd(
        "run", R, "--url", "sqlite:rel/fenced.db", "--",
        "sh", "-c", CHILD, sys.executable, str(report),
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(report.read_text())
    assert document["url"] == f"sqlite:///{tmp_path / 'rel' / 'fenced.db'}"
    assert [row["epoch"] for row in document["resources"]] == [1]  # the parent's live lease


@pytest.mark.parametrize(
    "waiter",
    [
        ["run", R, "--url", "URL", "--", "true"],
        ["run", R, "--wait", "300", "--url", "URL", "--", "true"],
        ["elect", R, "--value", "v", "--url", "URL", "--", "true"],
    ],
    ids=lambda args: " ".join(args[:4]),
)
def test_sigint_while_waiting_exits_130_and_leaves_nothing_granted(
    url: str, tmp_path: Path, waiter: list[str]
) -> None:
    started = tmp_path / "started"
    holder = subprocess.Popen(
        [*FENCED, "run", R, "--url", url, "--", "sh", "-c", f"touch {started}; exec sleep 60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(started.exists, "the holder's command")
        proc = subprocess.Popen(
            [*FENCED, *[url if arg == "URL" else arg for arg in waiter]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        database = tmp_path / "fenced.db"
        wait_for(lambda: _queued(database, R), "the waiter to queue behind the holder")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 130
        assert stderr.strip().splitlines() == ["fenced: interrupted"]
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=DEADLINE)
    with fenced.connect(url) as coord:
        assert coord.current(R) is None
        assert coord.last_epoch(R) == 1  # the holder's; the interrupted waiter got none
    assert not _queued(tmp_path / "fenced.db", R)


def _queued(database: Path, resource: str) -> bool:
    """Whether a waiter is in the embedded coordinator's queue of ``resource``."""
    conn = sqlite3.connect(f"file:{database}?mode=ro", uri=True)
    try:
        query = "SELECT count(*) FROM waiters WHERE name = ?"
        return bool(conn.execute(query, (resource,)).fetchone()[0])
    finally:
        conn.close()


# -- put / publish from pipes ---------------------------------------------------------------


def test_put_and_publish_read_a_fifo_and_process_substitution(url: str, tmp_path: Path) -> None:
    store_url = f"sqlite:{tmp_path / 'store.db'}"
    token = token_of(url)
    assert fenced_cmd("fence", store_url, "--token", token).returncode == 0
    fifo = tmp_path / "fifo"
    for command, payload in (("put", b"value from a fifo"), ("publish", b"published " * 1000)):
        os.mkfifo(fifo)
        writer = threading.Thread(target=lambda data=payload: fifo.write_bytes(data))
        writer.start()
        args = [command, store_url, "k", str(fifo)] if command == "put" else [
            command, store_url, str(fifo)]  # fmt: skip
        result = fenced_cmd(*args, "--token", token)
        writer.join(timeout=DEADLINE)
        fifo.unlink()
        assert result.returncode == 0, result.stderr
    with fenced.open_store(store_url) as store:
        item = store.get(R, "k")
        assert item is not None and item.value == b"value from a fifo"
        assert store.read(R) == b"published " * 1000
    script = (
        f'"$0" -m fenced put {store_url} k2 <(printf substituted) --token {token} && '
        f'"$0" -m fenced publish {store_url} <(printf also) --name sub --token {token}'
    )
    result = subprocess.run(
        ["bash", "-c", script, sys.executable], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    with fenced.open_store(store_url) as store:
        item = store.get(R, "k2")
        assert item is not None and item.value == b"substituted"
        assert store.read(R, "sub") == b"also"


def test_put_and_publish_say_why_a_file_cannot_be_read(url: str, tmp_path: Path) -> None:
    store_url = f"sqlite:{tmp_path / 'store.db'}"
    token = token_of(url)
    for args, words in (
        (["put", store_url, "k", str(tmp_path)], "is a directory"),
        (["publish", store_url, str(tmp_path)], "is a directory"),
        (["put", store_url, "k", str(tmp_path / "missing")], "no such file"),
        (["publish", store_url, str(tmp_path / "missing")], "no such file"),
    ):
        result = fenced_cmd(*args, "--token", token)
        assert result.returncode == 2
        assert words in one_line_error(result)
    assert not (tmp_path / "store.db").exists()  # refused before the store was opened


# -- the shortest ttl -----------------------------------------------------------------------


@pytest.mark.parametrize("ttl", ["1e-9", "0.05", "0.099"])
def test_a_ttl_below_the_minimum_is_refused_before_any_io(url: str, ttl: str) -> None:
    result = fenced_cmd("run", R, "--url", url, "--ttl", ttl, "--", "true")
    assert result.returncode == 2
    assert f"at least {MIN_TTL:g} seconds" in one_line_error(result)
    assert not Path(url.removeprefix("sqlite:///")).exists()  # no coordinator, no epoch


def test_the_library_refuses_a_ttl_below_the_minimum(url: str) -> None:
    assert validate_ttl(MIN_TTL) == MIN_TTL
    for ttl in (1e-9, 0.05, MIN_TTL / 2):
        with pytest.raises(fenced.ConfigurationError, match="at least"):
            LeasePolicy.create(ttl)
    with fenced.connect(url) as coord:
        with pytest.raises(fenced.ConfigurationError, match="at least"):
            coord.acquire(R, ttl=0.05, wait=0)
        with pytest.raises(fenced.ConfigurationError, match="at least"):
            coord.hold(R, ttl=1e-9, wait=0).__enter__()
        assert coord.last_epoch(R) == 0


# -- accurate one-line messages ---------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--url", "sqlite:/dev/null"],
        ["run", R, "--url", "sqlite:/dev/null", "--", "true"],
        ["get", "sqlite:/dev/null", R, "k"],
        ["fence", "sqlite:/dev/null", "--token", "TOKEN"],
    ],
    ids=lambda args: args[0],
)
def test_dev_null_is_named_a_device_not_a_disk_error(url: str, args: list[str]) -> None:
    token = token_of(url)
    result = fenced_cmd(*[token if arg == "TOKEN" else arg for arg in args])
    assert result.returncode == 2
    line = one_line_error(result)
    assert "/dev/null is a character device, not a database file" in line
    assert "I/O" not in line


def test_a_file_store_that_cannot_be_created_says_why(url: str) -> None:
    result = fenced_cmd("put", "file:/proc/nope", "k", "-", "--token", token_of(url))
    assert result.returncode == 2
    line = one_line_error(result)
    assert "/proc refused a new directory" in line
    assert "parent directory does not exist" not in line


def test_an_oversized_if_version_is_bad_input(url: str, tmp_path: Path) -> None:
    store_url = f"sqlite:{tmp_path / 'store.db'}"
    token = token_of(url)
    assert fenced_cmd("fence", store_url, "--token", token).returncode == 0
    for version in (str(2**63), str(10**20)):
        result = fenced_cmd(
            "put", store_url, "k", "/dev/null", "--token", token, "--if-version", version
        )
        assert result.returncode == 2
        assert "if_version must be" in one_line_error(result)
    with fenced.open_store(store_url) as store:
        with pytest.raises(fenced.ConfigurationError):
            store.put(fenced.FencingToken.parse(token), "k", b"", if_version=2**63)
        assert store.put(fenced.FencingToken.parse(token), "k", b"", if_version=0).version == 1


@pytest.mark.parametrize("spelling", ["postgresql://", "postgresql+psycopg://", "postgres://"])
def test_an_empty_postgresql_url_is_one_accurate_line(tmp_path: Path, spelling: str) -> None:
    # libpq's defaults: a local socket, here in a directory where no server listens
    result = fenced_cmd("status", "--url", f"{spelling}?host={tmp_path}")
    assert result.returncode == 69
    line = one_line_error(result)
    assert "postgresql:?" not in line
    assert str(tmp_path) in line


def _damage_records(path: Path) -> None:
    """Overwrite the cell pointers of three leaf pages of the records table (found from its
    interior root page), as a disk that returns garbage would."""
    conn = sqlite3.connect(path)
    try:
        (root,) = conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'records'"
        ).fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
    finally:
        conn.close()
    with path.open("r+b") as stream:
        stream.seek((root - 1) * size)
        page = stream.read(size)
        assert page[0] == 0x05, "the records table has one level of interior pages"
        cells = int.from_bytes(page[3:5], "big")
        pointers = [int.from_bytes(page[12 + 2 * i : 14 + 2 * i], "big") for i in range(cells)]
        leaves = [int.from_bytes(page[p : p + 4], "big") for p in pointers]
        for leaf in leaves[1:4]:
            stream.seek((leaf - 1) * size + 8)
            stream.write(b"\xff\xf0" * 4)


def test_backup_of_a_damaged_coordinator_is_one_line(url: str, tmp_path: Path) -> None:
    with fenced.connect(url) as coord:
        for i in range(200):
            coord.release(coord.acquire(f"r/{i % 20}", ttl=5, wait=0))
        coord.history()  # every release recorded
    damaged = tmp_path / "damaged.db"
    shutil.copy(tmp_path / "fenced.db", damaged)
    _damage_records(damaged)
    dest = tmp_path / "backup.db"
    result = fenced_cmd("backup", str(dest), "--url", f"sqlite:{damaged}")
    assert result.returncode == 2
    line = one_line_error(result)
    assert f"the coordinator database {damaged} is damaged (integrity_check: " in line
    assert "more problem(s)" in line
    assert "***" not in line
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".backup")] == []


def test_a_lost_lease_under_fenced_run_is_one_line(url: str, tmp_path: Path) -> None:
    started = tmp_path / "started"
    a = subprocess.Popen(
        [*FENCED, "run", R, "--url", url, "--ttl", "1", "--grace", "5", "--",
         "sh", "-c", f"touch {started}; exec sleep 60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        wait_for(started.exists, "the command")
        os.kill(a.pid, signal.SIGSTOP)
        try:  # B takes over once A's lease expired at the coordinator
            b = fenced_cmd("run", R, "--url", url, "--wait", str(DEADLINE), "--", "true")
            assert b.returncode == 0, b.stderr
        finally:
            os.kill(a.pid, signal.SIGCONT)
        _, stderr = a.communicate(timeout=DEADLINE)
    finally:
        if a.poll() is None:
            a.kill()
            a.communicate()
    assert a.returncode == 76
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert "lost while the command ran" in stderr
    assert "SIGTERM" in stderr


def test_a_foreign_token_is_logged_and_recorded_with_the_stores_floor(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = f"sqlite:{tmp_path / 'first.db'}"
    with fenced.connect(first) as coord:
        for _ in range(4):
            coord.release(coord.acquire(R, ttl=5, wait=0))
        fifth = coord.acquire(R, ttl=5, wait=0)
        assert fifth.epoch == 5
    other = fenced.FencingToken.parse(token_of(f"sqlite:{tmp_path / 'second.db'}"))
    with fenced.open_store(f"sqlite:{tmp_path / 'store.db'}") as store:
        store.fence(fifth.token)
        caplog.set_level(logging.WARNING, logger="fenced.store")
        with pytest.raises(fenced.ForeignToken) as raised:
            store.put(other, "k", b"late")
        assert raised.value.floor == 5
        rejected = [r for r in store.history(R) if r.kind.value == "rejected"]
    messages = [record.getMessage() for record in caplog.records if record.name == "fenced.store"]
    assert messages == [f"{R}: rejected put with epoch 1: foreign (floor 5)"]
    assert len(rejected) == 1
    assert rejected[0].detail["floor"] == 5
    assert rejected[0].detail["reason"] == "foreign"

"""``fenced.guard`` on sqlite3 connections: the check is part of the caller's own transaction."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced.fence
from fenced.core._errors import ConfigurationError, ForeignToken, StaleToken
from fenced.fence import guard
from fenced.testing.store_conformance import C2, R, token

SRC = str(Path(fenced.fence.__file__).resolve().parents[2])


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE ledger(id INTEGER PRIMARY KEY, epoch INTEGER, note TEXT)")
    conn.commit()
    conn.close()
    return path


@pytest.fixture
def conn(db: Path) -> Iterator[sqlite3.Connection]:
    connection = sqlite3.connect(db, isolation_level=None, timeout=10)
    yield connection
    connection.close()


def _rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db)
    try:
        return list(conn.execute(sql).fetchall())
    finally:
        conn.close()


def _write(conn: sqlite3.Connection, epoch: int, note: str) -> None:
    conn.execute("INSERT INTO ledger(epoch, note) VALUES (?, ?)", (epoch, note))


def test_a_current_token_lets_the_callers_writes_commit(conn: sqlite3.Connection, db: Path) -> None:
    conn.execute("BEGIN IMMEDIATE")
    assert guard(conn, token(5)) == 5
    _write(conn, 5, "first")
    conn.execute("COMMIT")
    conn.execute("BEGIN IMMEDIATE")
    _write(conn, 5, "same epoch again")
    assert guard(conn, token(5)) == 5
    conn.execute("COMMIT")
    conn.execute("BEGIN IMMEDIATE")
    assert guard(conn, token(6)) == 6  # a newer epoch installs itself (monotonic rule)
    _write(conn, 6, "newer")
    conn.execute("COMMIT")
    assert _rows(db, "SELECT note FROM ledger ORDER BY id") == [
        ("first",),
        ("same epoch again",),
        ("newer",),
    ]
    assert _rows(db, "SELECT resource, coordinator_id, epoch FROM fenced_fence") == [
        (R, "c1" * 16, 6)
    ]


def test_a_stale_token_rolls_back_the_callers_own_writes(
    conn: sqlite3.Connection, db: Path
) -> None:
    conn.execute("BEGIN IMMEDIATE")
    guard(conn, token(6))
    _write(conn, 6, "by the new owner")
    conn.execute("COMMIT")
    conn.execute("BEGIN IMMEDIATE")
    _write(conn, 5, "late write of the old owner")  # written before the guard, in the same txn
    with pytest.raises(StaleToken) as caught:
        guard(conn, token(5))
    assert (caught.value.presented, caught.value.floor) == (5, 6)
    assert not conn.in_transaction
    assert _rows(db, "SELECT note FROM ledger") == [("by the new owner",)]
    assert _rows(db, "SELECT epoch FROM fenced_fence") == [(6,)]


def test_a_foreign_token_is_rejected_and_rolled_back(conn: sqlite3.Connection, db: Path) -> None:
    conn.execute("BEGIN IMMEDIATE")
    guard(conn, token(1))
    conn.execute("COMMIT")
    conn.execute("BEGIN IMMEDIATE")
    _write(conn, 99, "from another coordinator")
    with pytest.raises(ForeignToken):
        guard(conn, token(99, coordinator=C2))
    assert not conn.in_transaction
    assert _rows(db, "SELECT count(*) FROM ledger") == [(0,)]


def test_the_default_python_transaction_handling_works_too(db: Path) -> None:
    conn = sqlite3.connect(db)  # implicit BEGIN before the first INSERT
    try:
        _write(conn, 2, "implicit transaction")
        assert guard(conn, token(2)) == 2
        conn.commit()
        _write(conn, 1, "stale")
        with pytest.raises(StaleToken):
            guard(conn, token(1))
        conn.commit()  # nothing left to commit: the guard rolled back
    finally:
        conn.close()
    assert _rows(db, "SELECT note FROM ledger") == [("implicit transaction",)]


def test_outside_a_transaction_the_guard_refuses_and_writes_nothing(
    conn: sqlite3.Connection, db: Path
) -> None:
    with pytest.raises(ConfigurationError, match="BEGIN IMMEDIATE"):
        guard(conn, token(1))
    assert _rows(db, "SELECT name FROM sqlite_master WHERE name = 'fenced_fence'") == []


def test_bad_arguments(conn: sqlite3.Connection) -> None:
    with pytest.raises(ConfigurationError, match=r"no fenced guard .*sqlite3\.Connection"):
        guard(object(), token(1))
    conn.execute("BEGIN IMMEDIATE")
    with pytest.raises(ConfigurationError, match="FencingToken"):
        guard(conn, str(token(1)))  # type: ignore[arg-type]
    conn.execute("ROLLBACK")


RACER = """
import json, os, sqlite3, sys, time
from fenced.core._errors import StaleToken
from fenced.fence import guard
from fenced.testing.store_conformance import token

db, control, role = sys.argv[1], sys.argv[2], sys.argv[3]
epoch = 5 if role == "old" else 6
conn = sqlite3.connect(db, isolation_level=None, timeout=0)  # a busy database answers at once
result = {"refused": 0}

def tell(step):
    open(os.path.join(control, step), "x").close()

def after(step):
    give_up = time.monotonic() + 30
    while not os.path.exists(os.path.join(control, step)):
        if time.monotonic() > give_up:
            sys.exit(f"{role}: the other process never said {step!r}")
        time.sleep(0.001)

def begin():
    # BEGIN IMMEDIATE until it gets the write lock; the first refusal is told to the other side
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error):
                raise
            result["refused"] += 1
            if result["refused"] == 1:
                tell(role + "-refused")
            time.sleep(0.001)

def write(note):
    conn.execute("INSERT INTO ledger(epoch, note) VALUES (?, ?)", (epoch, note))
    try:
        guard(conn, token(epoch))
    except StaleToken:
        return "StaleToken"
    return "guarded"

if role == "old":
    begin()
    result["first"] = write("old/0")
    tell("old-inside")  # holds the write lock, its write guarded, not committed
    after("new-refused")  # the new one tried to begin meanwhile
    conn.execute("COMMIT")
    after("new-inside")  # now the new one holds the lock, its epoch installed, not committed
    begin()  # refused until the new one commits
    result["second"] = write("old/1")
    if conn.in_transaction:
        conn.execute("COMMIT")
else:
    after("old-inside")
    begin()  # refused until the old one commits
    result["first"] = write("new/0")
    tell("new-inside")
    after("old-refused")
    conn.execute("COMMIT")
print(json.dumps(result))
"""


def test_overlapping_transactions_of_two_processes_never_commit_an_old_write_after_a_new_one(
    db: Path, tmp_path: Path
) -> None:
    """The guard's timeline (module docstring), both ways, forced by a handshake: each process
    tries to begin while the other is inside its transaction, holding the write lock, its own
    write guarded but not committed; each says so through a file, and the other commits only
    then. The old owner's write before the new epoch commits; its write after is rolled back."""
    control = tmp_path / "control"
    control.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    old, new = (
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(db), str(control), role],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for role in ("old", "new")
    )
    old_out, old_err = old.communicate(timeout=60)
    new_out, new_err = new.communicate(timeout=60)
    assert (old.returncode, new.returncode) == (0, 0), (old_err, new_err)
    old_result, new_result = json.loads(old_out), json.loads(new_out)
    # the interleaving happened: each was refused the lock while the other held it
    assert old_result["refused"] >= 1 and new_result["refused"] >= 1
    assert sorted(path.name for path in control.iterdir()) == [
        "new-inside",
        "new-refused",
        "old-inside",
        "old-refused",
    ]
    assert (old_result["first"], new_result["first"]) == ("guarded", "guarded")
    assert old_result["second"] == "StaleToken"  # and its write in that transaction undone
    assert _rows(db, "SELECT epoch, note FROM ledger ORDER BY id") == [(5, "old/0"), (6, "new/0")]
    assert _rows(db, "SELECT epoch FROM fenced_fence") == [(6,)]

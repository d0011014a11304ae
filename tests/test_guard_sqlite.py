"""``fenced.guard`` on sqlite3 connections: the check is part of the caller's own transaction."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced.fence
from fenced.core.errors import ConfigurationError, ForeignToken, StaleToken
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
import json, sqlite3, sys, time
from fenced.core.errors import StaleToken
from fenced.fence import guard
from fenced.testing.store_conformance import token

db, epoch, start, rounds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
conn = sqlite3.connect(db, isolation_level=None, timeout=30)
while time.time() < start:
    time.sleep(0.001)
accepted = rejected = 0
for n in range(rounds):
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT INTO ledger(epoch, note) VALUES (?, ?)", (epoch, f"{epoch}/{n}"))
    try:
        guard(conn, token(epoch))
    except StaleToken:
        rejected += 1
        continue
    conn.execute("COMMIT")
    accepted += 1
print(json.dumps({"accepted": accepted, "rejected": rejected}))
"""


def test_two_processes_racing_never_interleave_an_old_write_after_a_new_one(db: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    start = time.time() + 0.6
    rounds = 40
    old, new = (
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(db), str(epoch), str(start), str(rounds)],
            stdout=subprocess.PIPE,
            env=env,
        )
        for epoch in (5, 6)
    )
    old_out, _ = old.communicate(timeout=60)
    new_out, _ = new.communicate(timeout=60)
    assert (old.returncode, new.returncode) == (0, 0)
    old_result, new_result = json.loads(old_out), json.loads(new_out)
    assert new_result == {"accepted": rounds, "rejected": 0}
    assert old_result["accepted"] + old_result["rejected"] == rounds
    epochs = [int(str(row[0])) for row in _rows(db, "SELECT epoch FROM ledger ORDER BY id")]
    assert epochs == sorted(epochs)  # no write of 5 committed after any write of 6
    assert epochs.count(5) == old_result["accepted"]
    assert epochs.count(6) == rounds

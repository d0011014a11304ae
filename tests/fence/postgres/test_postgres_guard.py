"""``guard`` for psycopg and SQLAlchemy connections on a real PostgreSQL, and the invoice example
of docs/postgres.md (run here because it needs a server; the docs test runs only ```python).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
import pytest
import sqlalchemy
from sqlalchemy import text

import fenced.fence
from fenced.core._errors import ConfigurationError, ForeignToken, StaleToken
from fenced.fence.postgres._guard import guard_postgres, guard_psycopg, guard_sqlalchemy
from fenced.testing.postgres import PostgresServer
from support.cli_processes import run_python
from support.guard_fixtures import C1, C2, dsn, status, tok

__all__ = ["dsn"]  # a fixture from support.guard_fixtures, used here

ROOT = Path(__file__).resolve().parents[3]


def test_a_stale_token_aborts_the_callers_whole_transaction(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        assert guard_psycopg(conn, tok(42)) == 42
        conn.execute("UPDATE invoices SET status = 'paid by 42' WHERE id = 1")
        conn.commit()
    with psycopg.connect(dsn) as late:
        late.execute("UPDATE invoices SET status = 'paid by 41' WHERE id = 1")  # before the guard
        with pytest.raises(StaleToken) as caught:
            guard_psycopg(late, tok(41))
        assert (caught.value.presented, caught.value.floor) == (41, 42)
        late.commit()  # the server answers COMMIT of an aborted transaction with ROLLBACK
    assert status(dsn) == "paid by 42"


def test_inside_a_transaction_block_of_an_autocommit_connection(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(ConfigurationError, match="autocommit"):
            guard_psycopg(conn, tok(1))
        with conn.transaction():
            guard_postgres(conn, tok(5))
            conn.execute("UPDATE invoices SET status = 'by 5' WHERE id = 1")
        with pytest.raises(StaleToken), conn.transaction():
            conn.execute("UPDATE invoices SET status = 'by 4' WHERE id = 1")
            guard_psycopg(conn, tok(4))
    assert status(dsn) == "by 5"


def test_a_token_of_another_coordinator_is_foreign(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():
            guard_psycopg(conn, tok(5))
        with pytest.raises(ForeignToken) as caught, conn.transaction():
            guard_psycopg(conn, tok(50, C2))
        assert (caught.value.presented, caught.value.bound) == (C2, C1)


def _waits_for_a_lock(dsn: str, pid: int) -> bool:
    """Whether the server process ``pid`` is blocked waiting for a heavyweight lock (a row's)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return row is not None and row[0] == "Lock"


def test_the_fence_row_lock_is_held_until_the_caller_commits(dsn: str) -> None:
    order: list[str] = []
    a = psycopg.connect(dsn)
    b = psycopg.connect(dsn)
    guard_psycopg(a, tok(81))  # creates the guard objects in A's transaction
    a.commit()
    guard_psycopg(a, tok(81))
    a.execute("UPDATE invoices SET status = 'A' WHERE id = 1")

    def newer() -> None:
        guard_psycopg(b, tok(82))  # waits for A's row lock
        order.append("B guarded")
        b.execute("UPDATE invoices SET status = 'B' WHERE id = 1")
        b.commit()

    thread = threading.Thread(target=newer)
    thread.start()
    deadline = time.monotonic() + 10
    while not _waits_for_a_lock(dsn, b.info.backend_pid):  # B blocked inside its guard
        assert time.monotonic() < deadline and thread.is_alive(), "B never waited for A's lock"
        time.sleep(0.01)
    order.append("A commits")
    a.commit()
    thread.join(10)
    assert order == ["A commits", "B guarded"]
    with pytest.raises(StaleToken):
        guard_psycopg(a, tok(81))
    a.rollback()
    assert status(dsn) == "B"
    a.close()
    b.close()


def test_install_then_guard_with_another_schema(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        fenced.fence.install_postgres_guard(conn, schema="fencing")  # the public name of install
        with conn.transaction():
            assert guard_psycopg(conn, tok(3), schema="fencing") == 3
        row = conn.execute("SELECT epoch FROM fencing.guard_fences").fetchone()
        assert row == (3,)
        with pytest.raises(ConfigurationError):
            guard_psycopg(conn, tok(3), schema="Bad Schema")
        with pytest.raises(ConfigurationError):
            guard_psycopg(conn, str(tok(3)))  # type: ignore[arg-type]


def test_sqlalchemy_connection(dsn: str) -> None:
    engine = sqlalchemy.create_engine(dsn.replace("postgresql://", "postgresql+psycopg://"))
    with engine.begin() as conn:
        assert guard_sqlalchemy(conn, tok(7)) == 7
        conn.execute(text("UPDATE invoices SET status = 'by 7' WHERE id = 1"))
    with pytest.raises(StaleToken), engine.begin() as conn:
        conn.execute(text("UPDATE invoices SET status = 'by 6' WHERE id = 1"))
        guard_postgres(conn, tok(6))
    assert status(dsn) == "by 7"
    with engine.connect() as conn:  # autobegin
        guard_sqlalchemy(conn, tok(8))
        conn.execute(text("UPDATE invoices SET status = 'by 8' WHERE id = 1"))
        conn.commit()
    assert status(dsn) == "by 8"
    auto = engine.execution_options(isolation_level="AUTOCOMMIT")
    with auto.connect() as conn, pytest.raises(ConfigurationError, match="autocommit"):
        guard_sqlalchemy(conn, tok(9))
    engine.dispose()
    lite = sqlalchemy.create_engine("sqlite://")
    with lite.begin() as conn, pytest.raises(ConfigurationError, match="sqlite"):
        guard_sqlalchemy(conn, tok(1))


def _doc_example(tag: str = "python-example") -> str:
    doc = (ROOT / "docs" / "postgres.md").read_text()
    blocks = re.findall(rf"^```{tag}\n(.*?)^```", doc, re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, f"docs/postgres.md should have exactly one ```{tag} block"
    return str(blocks[0])


def test_the_invoice_example_of_the_docs_runs(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    name = "inv_" + uuid.uuid4().hex[:12]
    url = postgres_server.create_database(name)
    env = {"DATABASE_URL": url, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = run_python(_doc_example(), tmp_path, env)
    postgres_server.drop_database(name)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "stale owner stopped" in result.stdout

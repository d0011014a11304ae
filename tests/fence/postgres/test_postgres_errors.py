"""Errors of the statements fenced runs through libpq (``psycopg.pq``) are psycopg's own
exception classes, built with documented psycopg API only (``psycopg.errors.lookup``), and keep
their SQLSTATE — also a code psycopg does not know, such as fenced's ``FN…``, which the store's
speculative writes and the guard decide on."""

from __future__ import annotations

import psycopg
import pytest

from fenced._drivers.postgres import checked
from fenced.testing.postgres import PostgresServer


@pytest.mark.parametrize(
    ("query", "kind", "state"),
    [
        (b"SELECT * FROM no_such_table", psycopg.errors.UndefinedTable, "42P01"),
        (b"SELECT 1 / 0", psycopg.errors.DivisionByZero, "22012"),
        (
            b"DO $$ BEGIN RAISE EXCEPTION 'fenced: the domain changed' USING ERRCODE = 'FN100'; "
            b"END $$",
            psycopg.DatabaseError,
            "FN100",
        ),
    ],
)
def test_a_failed_libpq_result_raises_psycopgs_class_with_its_sqlstate(
    postgres_server: PostgresServer, query: bytes, kind: type[psycopg.Error], state: str
) -> None:
    with psycopg.connect(postgres_server.url("postgres"), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as raised:
            checked(conn, conn.pgconn.exec_params(query, []))
        assert type(raised.value) is kind
        assert raised.value.sqlstate == state
        first = str(raised.value).splitlines()[0]
        assert first and not first.startswith("ERROR")  # as psycopg words it: no severity
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the connection is still usable

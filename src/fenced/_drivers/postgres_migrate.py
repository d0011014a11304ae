"""Versioned migrations of one component's tables in one PostgreSQL schema.

:func:`migrate` creates a component's tables or upgrades them in one transaction under a
transaction-level advisory lock (concurrent openers serialise; a crash mid-way leaves the
previous version). A meta table of another format, or written by a newer fenced, is a
:class:`~fenced.core._errors.ConfigurationError` and the schema is left untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from fenced._drivers.migrations import Migration, checked_version
from fenced.core._errors import ConfigurationError

__all__ = ["migrate"]


def migrate(
    conn: psycopg.Connection[tuple[Any, ...]],
    *,
    schema: str,
    meta_table: str,
    fmt: str,
    migrations: Sequence[Migration],
    initial: dict[str, str],
    where: str,
) -> dict[str, str]:
    """Create or upgrade one component's tables in ``schema``; return its meta key/values.

    The fast path reads ``meta_table`` (one statement). Only when it is missing or older does
    one transaction take a transaction-level advisory lock (concurrent openers serialise;
    nothing session-level), create the schema if it does not exist, re-read, apply the missing
    migrations and commit: a crash mid-way leaves the previous version. ``initial`` is written
    when the tables are created. A meta table of another format or a newer version is a
    :class:`ConfigurationError`.
    """
    newest = migrations[-1].version
    quoted = sql.Identifier(schema).as_string(conn)
    table = f"{quoted}.{meta_table}"
    meta = _read_meta(conn, schema, meta_table)
    if meta is not None and checked_version(_version(meta, where, fmt), newest, where) == newest:
        return meta
    with conn.transaction():
        conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
            (f"fenced.migrate.{schema}.{meta_table}",),
        )
        # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema exists:
        # a role that owns a schema made for it (docs/postgres.md) has no such privilege
        found = conn.execute("SELECT to_regnamespace(%s)", (quoted,)).fetchone()
        if found is None or found[0] is None:
            conn.execute(f"CREATE SCHEMA {quoted}".encode())
        meta = _read_meta(conn, schema, meta_table)
        version = 0 if meta is None else checked_version(_version(meta, where, fmt), newest, where)
        for migration in migrations:
            if migration.version > version:
                for statement in migration.statements:
                    conn.execute(statement.replace("{s}", quoted).encode())
        if meta is None:
            rows = [("format", fmt), *initial.items()]
            with conn.cursor() as cur:
                cur.executemany(f"INSERT INTO {table} (key, value) VALUES (%s, %s)".encode(), rows)
        conn.execute(
            f"INSERT INTO {table} (key, value) VALUES ('schema_version', %s) "
            "ON CONFLICT (key) DO UPDATE SET value = excluded.value".encode(),
            (str(newest),),
        )
    meta = _read_meta(conn, schema, meta_table)
    assert meta is not None
    return meta


def _read_meta(
    conn: psycopg.Connection[tuple[Any, ...]], schema: str, meta_table: str
) -> dict[str, str] | None:
    row = conn.execute(
        "SELECT to_regclass(%s)", (f"{sql.Identifier(schema).as_string(conn)}.{meta_table}",)
    ).fetchone()
    if row is None or row[0] is None:
        return None
    quoted = sql.Identifier(schema).as_string(conn)
    rows = conn.execute(f"SELECT key, value FROM {quoted}.{meta_table}".encode()).fetchall()
    return {str(key): str(value) for key, value in rows}


def _version(meta: dict[str, str], where: str, fmt: str) -> int:
    if meta.get("format") != fmt:
        raise ConfigurationError(f"{where}: the schema holds tables that are not {fmt}'s")
    try:
        version = int(meta.get("schema_version", ""))
    except ValueError:
        raise ConfigurationError(f"{where}: damaged meta table (no schema_version)") from None
    return version

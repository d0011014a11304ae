"""Published objects on PostgreSQL: ``bytea`` chunks and a row in ``store_objects``.

Objects are ``bytea`` chunks of 1 MiB in ``store_chunks`` (storage ``EXTERNAL``: no
compression of data that is usually compressed already), written with ``COPY … FROM STDIN
(FORMAT BINARY)`` in one transaction together with their ``store_objects`` row: an object is
complete or absent, a killed publisher leaves no debris, a large input is streamed chunk by
chunk and never held in memory. Why not large objects: they live outside the schema in one
shared catalog (``pg_largeobject``), are not replicated by logical replication, need
``lo_unlink``/``vacuumlo`` to avoid orphans, carry per-object privileges and dump slowly in
large numbers; their only advantage, random-access writes, is not needed for immutable
objects, and chunking removes bytea's 1 GB-per-value limit. So every size uses bytea chunks.

What is here: writing an object's chunks with ``COPY … FROM STDIN (FORMAT BINARY)``
(:func:`copy_chunks`), deleting an object (:func:`delete_object`), making a transaction's
commit durable (:func:`durable`), and reading an object back chunk by chunk
(:class:`ChunkStream`). Transactions, deadlines and error translation of the writes are the
caller's (:class:`~fenced.fence.postgres._store.PostgresBackend`); a read translates its driver
errors into :class:`~fenced.Unavailable` / :class:`~fenced.ConfigurationError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from fenced._drivers.postgres import Watchdog, guarded, translate
from fenced.fence._chunks import ChunkReader

__all__ = ["ChunkStream", "copy_chunks", "delete_object", "durable"]

Connection = psycopg.Connection[tuple[Any, ...]]


def durable(conn: Connection) -> None:
    """Raise ``synchronous_commit`` for this transaction if the server runs with it off."""
    conn.execute(
        b"SELECT CASE WHEN current_setting('synchronous_commit') = 'off'"
        b" THEN set_config('synchronous_commit', 'on', true) END"
    )


def delete_object(conn: Connection, s: str, object_id: str) -> None:
    """Delete the chunks and the row of ``object_id`` (schema ``s``) in ``conn``'s transaction."""
    conn.execute(f"DELETE FROM {s}.store_chunks WHERE object_id = %s".encode(), (object_id,))
    conn.execute(f"DELETE FROM {s}.store_objects WHERE object_id = %s".encode(), (object_id,))


def copy_chunks(
    conn: Connection,
    copy_sql: bytes,
    object_id: str,
    chunks: Iterable[bytes],
    sent: Callable[[], None],
) -> tuple[int, int]:
    """Stream ``chunks`` as rows ``(object_id, seq, data)`` with ``copy_sql`` (a binary COPY);
    call ``sent`` after each chunk. Returns the number of chunks and of bytes."""
    count = size = 0
    with conn.cursor() as cur, cur.copy(copy_sql) as copy:
        copy.set_types(["text", "int4", "bytea"])
        for chunk in chunks:
            copy.write_row((object_id, count, chunk))
            count += 1
            size += len(chunk)
            sent()
    return count, size


class ChunkStream(ChunkReader):
    """One object's chunks, read in the snapshot of ``conn``'s transaction (the stream owns
    ``conn`` and calls ``release`` once, at close, to end the transaction and give the
    connection back). Each chunk's read must end within ``timeout`` seconds."""

    def __init__(
        self,
        conn: Connection,
        release: Callable[[], None],
        select_chunk: bytes,
        object_id: str,
        chunks: int,
        *,
        timeout: float,
        where: str,
        watchdog: Watchdog | None = None,
    ) -> None:
        super().__init__(object_id, chunks)
        self._watchdog = watchdog
        self._db = conn
        self._release = release
        self._select_chunk = select_chunk
        self._timeout = timeout
        self._where = where

    def _read_chunk(self, seq: int) -> bytes | None:
        try:
            with guarded(self._db, self._timeout, self._watchdog):
                row = self._db.execute(
                    self._select_chunk, (self._object_id, seq), prepare=False
                ).fetchone()
        except psycopg.Error as error:
            raise translate(
                error, f"reading object {self._object_id}", sent=False, where=self._where
            ) from error
        return None if row is None else bytes(row[0])

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self._release()
        super().close()

"""Damaged publications on every kind of store, and the check that no read path returns them.

The damages are those a disk or an operator inflicts on stored bytes: an object cut short (1 MiB
left of its recorded 5 MiB), one flipped byte, one byte too many. Each store kind is damaged
where it keeps the bytes: the object file of a ``file:`` store, the chunk rows of a ``sqlite:``
or ``postgresql:`` store (rewritten in chunks of the store's size, with the object's chunk count
made to match, so the stream ends where the damaged bytes end).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from fenced.core._errors import CorruptData
from fenced.fence import Store
from fenced.fence._source import CHUNK_SIZE
from fenced.fence._values import Publication
from fenced.testing.store_conformance import R

DAMAGES = ("truncated", "flipped", "extended")
SIZE = 5 * 1024 * 1024


def original() -> bytes:
    """The 5 MiB that the tests publish and then damage."""
    return random.Random(SIZE).randbytes(SIZE)


def damaged(data: bytes, damage: str) -> bytes:
    if damage == "truncated":
        return data[: 1024 * 1024]
    if damage == "flipped":
        middle = len(data) // 2
        return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]
    assert damage == "extended"
    return data + b"\0"


def _chunks(data: bytes) -> list[bytes]:
    return [data[at : at + CHUNK_SIZE] for at in range(0, len(data), CHUNK_SIZE)]


def damage_file_object(root: Path, publication: Publication, damage: str) -> None:
    """Damage the object file of ``publication`` in the ``file:`` store at ``root``."""
    resource = hashlib.sha256(publication.resource.encode()).hexdigest()
    path = root / "resources" / resource / "objects" / publication.object_id
    path.write_bytes(damaged(path.read_bytes(), damage))


def damage_sqlite_object(path: Path, publication: Publication, damage: str) -> None:
    """Damage the chunks of ``publication`` in the ``sqlite:`` store at ``path``."""
    object_id = publication.object_id
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        rows = db.execute(
            "SELECT data, staged_at FROM chunks WHERE object_id = ? ORDER BY seq", (object_id,)
        ).fetchall()
        chunks = _chunks(damaged(b"".join(bytes(row[0]) for row in rows), damage))
        db.execute("DELETE FROM chunks WHERE object_id = ?", (object_id,))
        db.executemany(
            "INSERT INTO chunks(object_id, seq, data, staged_at) VALUES (?, ?, ?, ?)",
            [(object_id, seq, chunk, rows[0][1]) for seq, chunk in enumerate(chunks)],
        )
        db.execute("UPDATE objects SET chunks = ? WHERE object_id = ?", (len(chunks), object_id))


def damage_postgres_object(url: str, publication: Publication, damage: str) -> None:
    """Damage the chunks of ``publication`` in the ``postgresql:`` store at ``url``."""
    schema = url.split("schema=", 1)[1].split("&", 1)[0]
    object_id = publication.object_id
    with psycopg.connect(url.split("?", 1)[0]) as db:
        rows = db.execute(
            f'SELECT data FROM "{schema}".store_chunks WHERE object_id = %s ORDER BY seq'.encode(),
            (object_id,),
        ).fetchall()
        chunks = _chunks(damaged(b"".join(bytes(row[0]) for row in rows), damage))
        db.execute(
            f'DELETE FROM "{schema}".store_chunks WHERE object_id = %s'.encode(), (object_id,)
        )
        for seq, chunk in enumerate(chunks):
            db.execute(
                f'INSERT INTO "{schema}".store_chunks (object_id, seq, data)'
                " VALUES (%s, %s, %s)".encode(),
                (object_id, seq, chunk),
            )
        db.execute(
            f'UPDATE "{schema}".store_objects SET chunks = %s WHERE object_id = %s'.encode(),
            (len(chunks), object_id),
        )


def assert_no_read_returns_it(store: Store, publication: Publication, damage: str) -> None:
    """Every way of reading the damaged ``publication`` raises :class:`CorruptData`.

    ``read()``; a stream read whole; a stream read in pieces (never a clean end of stream); a
    stream read for exactly the recorded size (its last bytes are checked before they are
    returned: only a surplus byte, not yet seen, lets those through, and the next read raises).
    """
    named = publication.object_id

    def refused(reading: Callable[[], object]) -> None:
        with pytest.raises(CorruptData, match=f"object {named} of .* is damaged"):
            reading()

    refused(lambda: store.read(R))
    with store.open(R) as stream:
        refused(stream.read)
    with store.open(R) as stream:
        refused(lambda: [None for _ in iter(lambda: stream.read(64 * 1024), b"")])
    with store.open(R) as stream:
        if damage == "extended":
            assert stream.read(publication.size) == original()
            refused(lambda: stream.read(1))
        else:
            refused(lambda: stream.read(publication.size))

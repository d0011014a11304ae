"""Reading a stored object back as a stream of its numbered chunks (SQLite and PostgreSQL)."""

from __future__ import annotations

import abc
import io
from typing import TYPE_CHECKING

from fenced.core._errors import CorruptData

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["ChunkReader"]


class ChunkReader(io.RawIOBase):
    """A read-only stream over the chunks ``0 … chunks-1`` of one object.

    Subclasses read chunk ``seq`` in :meth:`_read_chunk` (inside the snapshot they opened, so the
    stream keeps showing the object it started with) and release their connection in ``close``.
    A missing chunk is a corrupt store: :class:`~fenced.CorruptData`.
    """

    def __init__(self, object_id: str, chunks: int) -> None:
        super().__init__()
        self._object_id = object_id
        self._chunks = chunks
        self._next = 0
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    @abc.abstractmethod
    def _read_chunk(self, seq: int) -> bytes | None:
        """The bytes of chunk ``seq``, or None if the store has no such chunk."""

    def _fetch(self) -> bytes | None:
        if self._next >= self._chunks:
            return None
        data = self._read_chunk(self._next)
        if data is None:
            raise CorruptData(f"object {self._object_id} misses a chunk: the store is corrupt")
        self._next += 1
        return data

    def readinto(self, buffer: WriteableBuffer) -> int:
        while not self._pending:
            chunk = self._fetch()
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        target = memoryview(buffer).cast("B")
        n = min(len(target), len(self._pending))
        target[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def readall(self) -> bytes:
        parts = [bytes(self._pending)]
        self._pending = memoryview(b"")
        while (chunk := self._fetch()) is not None:
            parts.append(chunk)
        return b"".join(parts)

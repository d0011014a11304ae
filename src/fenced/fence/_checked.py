"""Reading a publication safely: :class:`CheckedStream` counts and hashes the bytes as they pass.

A read that returns normally never returned damaged bytes; damage is
:class:`~fenced.CorruptData` (see :class:`CheckedStream`).
"""

from __future__ import annotations

import hashlib
import io
from typing import TYPE_CHECKING, BinaryIO

from fenced.core._errors import CorruptData
from fenced.fence._values import Publication

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["CheckedStream", "shown_publication"]


class CheckedStream(io.RawIOBase):
    """The bytes of one publication as its backend streams them, counted and hashed on the way.

    Raises :class:`CorruptData` instead of returning bytes past the recorded size, the bytes
    that reach that size with another SHA-256, or an end of stream short of it: a read that
    returns normally never returned damaged bytes, and a clean end (``b""``) means they were all
    there. Closing it closes the backend's stream.
    """

    def __init__(self, stream: BinaryIO, publication: Publication) -> None:
        super().__init__()
        self._stream = stream
        self._publication = publication
        self._hash = hashlib.sha256()
        self._seen = 0
        self._whole = False  # the recorded size was reached with the recorded SHA-256

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        target = memoryview(buffer).cast("B")
        if not target:
            return 0
        data = self._stream.read(len(target))
        self._check(data)
        target[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        data = self._stream.read()
        self._check(data)
        if data:
            self._check(b"")  # read() stops only at the end of the stream
        return data

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
        super().close()

    def _check(self, data: bytes) -> None:
        size = self._publication.size
        if data:
            self._seen += len(data)
            if self._seen > size:
                raise self._corrupt(f"it has more than its recorded {size} bytes")
            self._hash.update(data)
        elif self._seen < size:
            raise self._corrupt(f"it ends after {self._seen} of its recorded {size} bytes")
        if self._seen == size and not self._whole:
            if self._hash.hexdigest() != self._publication.sha256:
                raise self._corrupt(f"its {size} bytes do not have the recorded SHA-256")
            self._whole = True

    def _corrupt(self, what: str) -> CorruptData:
        p = self._publication
        return CorruptData(
            f"object {p.object_id} of {shown_publication(p.resource, p.name)} is damaged: {what}"
        )


def shown_publication(resource: str, name: str) -> str:
    """``resource`` and ``name`` as messages show a publication."""
    return f"{resource!r}" + (f" name {name!r}" if name else "")

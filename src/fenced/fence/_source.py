"""The data of a publish, read in chunks while its SHA-256 and size are computed.

A path or a stream is never read into memory as a whole: backends receive an iterator of chunks of
at most :data:`CHUNK_SIZE` bytes and the digest is complete once the iterator is exhausted.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections.abc import Iterator
from typing import IO

from fenced.core._errors import ConfigurationError
from fenced.fence._background import lane_queue

__all__ = ["CHUNK_SIZE", "PublishData", "Source"]

CHUNK_SIZE = 1024 * 1024

PublishData = bytes | bytearray | memoryview | os.PathLike[str] | IO[bytes]
"""What ``publish`` accepts: bytes, a path, or a binary stream opened for reading."""


class Source:
    """Chunks of the data of one publish; :attr:`sha256` and :attr:`size` once exhausted.

    Large chunks are hashed on a helper thread (see :mod:`fenced.fence._background`), in order,
    so that hashing overlaps the backend's writes and its ``fsync`` (hashlib and fsync both
    release the GIL); at most :data:`_QUEUED` chunks of a source wait for it, so memory stays
    bounded.

    Raises :class:`ConfigurationError` at construction for data of another type (a ``str`` is
    refused: pass ``pathlib.Path(name)`` for a file or ``text.encode()`` for text). Opening or
    reading a path raises :class:`OSError` as usual.
    """

    def __init__(self, data: object) -> None:
        if isinstance(data, str):
            raise ConfigurationError(
                "publish takes bytes, a path or a binary stream, not str: pass "
                "pathlib.Path(name) for a file or text.encode() for text"
            )
        if not isinstance(data, bytes | bytearray | memoryview | os.PathLike) and not callable(
            getattr(data, "read", None)
        ):
            raise ConfigurationError(
                f"publish takes bytes, a path or a binary stream, not {type(data).__name__}"
            )
        self._data = data
        self._hash = hashlib.sha256()
        self._hasher: _Hasher | None = None
        self._size = 0
        self._done = False

    @property
    def sha256(self) -> str:
        """The SHA-256 of all the data, lowercase hex (after the chunks were consumed)."""
        self._require_done()
        if self._hasher is not None:
            self._hasher.finish()
        return self._hash.hexdigest()

    @property
    def size(self) -> int:
        """The number of bytes (after the chunks were consumed)."""
        self._require_done()
        return self._size

    def _require_done(self) -> None:
        if not self._done:
            raise RuntimeError("the data was not read to its end")

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._chunks():
            if self._hasher is None and len(chunk) >= _THREADED:
                self._hasher = _Hasher(self._hash)
            if self._hasher is None:
                self._hash.update(chunk)
            else:
                self._hasher.feed(chunk)  # hashed while the backend writes it
            self._size += len(chunk)
            yield chunk
        self._done = True

    def _chunks(self) -> Iterator[bytes]:
        data = self._data
        if isinstance(data, bytes) and 0 < len(data) <= CHUNK_SIZE:
            yield data
        elif isinstance(data, bytes | bytearray | memoryview):
            view = memoryview(data).cast("B")
            for start in range(0, len(view), CHUNK_SIZE):
                yield bytes(view[start : start + CHUNK_SIZE])
        elif isinstance(data, os.PathLike):
            with open(data, "rb") as stream:
                yield from _read_stream(stream)
        else:
            yield from _read_stream(data)  # type: ignore[arg-type]


_THREADED = 64 * 1024
"""Chunks at least this large are hashed on the helper thread (smaller ones inline)."""
_QUEUED = 4


class _Hasher:
    """Feeds one source's chunks, in order, to its hash object on the process's helper thread.

    At most :data:`_QUEUED` chunks of a source wait to be hashed (``feed`` blocks meanwhile), so
    memory stays bounded.
    """

    def __init__(self, target: hashlib._Hash) -> None:
        self._target = target
        self._slots = threading.Semaphore(_QUEUED)
        self._error: BaseException | None = None
        self._jobs = lane_queue()

    def feed(self, chunk: bytes) -> None:
        self._slots.acquire()
        self._jobs.put(functools.partial(self._update, chunk))

    def _update(self, chunk: bytes) -> None:
        try:
            self._target.update(chunk)  # releases the GIL: overlaps the backend's writes
        except BaseException as error:  # reported by finish(); the helper thread lives on
            self._error = error
        finally:
            self._slots.release()

    def finish(self) -> None:
        """Wait until every chunk fed so far is hashed."""
        for _ in range(_QUEUED):
            self._slots.acquire()
        for _ in range(_QUEUED):
            self._slots.release()
        if self._error is not None:
            raise RuntimeError(f"hashing the data failed: {self._error}") from self._error


def _read_stream(stream: IO[bytes]) -> Iterator[bytes]:
    while chunk := stream.read(CHUNK_SIZE):
        if not isinstance(chunk, bytes):
            raise ConfigurationError(
                f"publish needs a stream opened in binary mode; read() returned "
                f"{type(chunk).__name__}"
            )
        yield chunk

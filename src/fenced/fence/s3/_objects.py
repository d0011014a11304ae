"""Writing and reading the immutable objects of an ``s3://`` store.

:func:`upload` writes a stream of chunks as one object: a single PUT when it is at most
:data:`PART_BYTES`, else a multipart upload of :data:`PART_BYTES` parts, at most
:data:`PARTS_IN_FLIGHT` of them sent at once (so memory stays under about
``(PARTS_IN_FLIGHT + 1) × PART_BYTES`` whatever the size). The object appears, complete, only when
``CompleteMultipartUpload`` succeeds; an upload interrupted before that (an error, a kill -9)
leaves no object, only an unfinished upload that :func:`fenced.fence.s3._gc` aborts after the
grace period. An error aborts the upload at once (best effort).

:class:`BodyReader` is a read-only stream over a GET's body; a transport error while reading is
:class:`~fenced.Unavailable`.
"""

from __future__ import annotations

import collections
import contextlib
import io
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import botocore.exceptions

from fenced._drivers import s3
from fenced.core._errors import Unavailable

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["PARTS_IN_FLIGHT", "PART_BYTES", "BodyReader", "upload"]

PART_BYTES = 8 * 1024 * 1024
"""The size of a multipart upload's parts (S3's minimum is 5 MiB but for the last)."""
PARTS_IN_FLIGHT = 5
"""Parts sent at once by one upload (benchmarks/RESULTS.md: 4 → 5 gained ~4 % against boto3's
``upload_file`` on RGW; 6 would put a 1 GiB publish's RSS growth within 2 MiB of its 64 MiB
limit)."""


def upload(
    client: Any,
    bucket: str,
    key: str,
    chunks: Iterable[bytes],
    translate: Callable[[Exception, str], Exception],
    metadata: dict[str, str],
) -> None:
    """Write the concatenated ``chunks`` as ``key`` (see the module docstring).

    ``metadata``: the object's user metadata (``x-amz-meta-*``).
    Raises what ``translate`` makes of a boto3 error (nothing is visible at ``key`` then), or
    whatever iterating ``chunks`` raises (the upload is aborted).
    """
    iterator = iter(chunks)
    first: list[bytes] = []
    size = 0
    for chunk in iterator:
        first.append(chunk)
        size += len(chunk)
        if size >= PART_BYTES:
            break
    if size < PART_BYTES:
        body = first[0] if len(first) == 1 else b"".join(first)  # the caller's bytes: no copy
        try:
            client.put_object(Bucket=bucket, Key=key, Body=body, Metadata=metadata)
        except s3.ERRORS as error:
            raise translate(error, f"writing {key}") from error
        return
    try:
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, Metadata=metadata)[
            "UploadId"
        ]
    except s3.ERRORS as error:
        raise translate(error, f"starting the upload of {key}") from error
    source = _Parts(first, iterator)
    del first  # the source holds the first chunks until they are copied into a part
    try:
        parts = _send_parts(client, bucket, key, upload_id, source)
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException as error:
        with contextlib.suppress(Exception):  # else gc aborts it later
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        if isinstance(error, s3.ERRORS):
            raise translate(error, f"uploading {key}") from error
        raise


class _Parts:
    """The data cut into parts of exactly :data:`PART_BYTES` (the last one shorter), each copied
    into a buffer that the caller reuses once the part was sent: the process allocates at most
    ``PARTS_IN_FLIGHT + 1`` buffers per upload, and no part is copied again on its way out
    (botocore sends a ``bytearray`` as it is). A fresh buffer for every part (and a ``bytes``
    copy of each) fragmented the C heap: a 1 GiB publish grew the RSS by 81-89 MiB while Python
    held at most 55 MiB (now: ``(PARTS_IN_FLIGHT + 1) × PART_BYTES`` + ~6.5 MiB)."""

    def __init__(self, first: list[bytes], iterator: Iterator[bytes]) -> None:
        self._pending = collections.deque(first)
        self._iterator = iterator
        self._rest = memoryview(b"")

    def _next(self) -> memoryview | None:
        if self._pending:
            return memoryview(self._pending.popleft()).cast("B")
        chunk = next(self._iterator, None)
        return None if chunk is None else memoryview(chunk).cast("B")

    def fill(self, buffer: bytearray) -> int:
        """Copy the next part into ``buffer`` (``PART_BYTES`` long); its size (0: no data left;
        less than the buffer: the last part, and ``buffer`` is cut to it)."""
        filled = 0
        with memoryview(buffer) as view:
            while filled < len(view):
                if not self._rest:
                    found = self._next()
                    if found is None:
                        break
                    self._rest = found
                count = min(len(view) - filled, len(self._rest))
                view[filled : filled + count] = self._rest[:count]
                self._rest = self._rest[count:]
                filled += count
        if filled < len(buffer):
            del buffer[filled:]
        return filled


def _send_parts(
    client: Any, bucket: str, key: str, upload_id: str, parts: _Parts
) -> list[dict[str, Any]]:
    room = threading.BoundedSemaphore(PARTS_IN_FLIGHT)
    free: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    sent: list[Future[dict[str, Any]]] = []

    def send(number: int, body: bytearray) -> dict[str, Any]:
        try:
            reply = client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )
            return {"PartNumber": number, "ETag": reply["ETag"]}
        finally:
            free.put(body)  # botocore holds no reference to it once the call returned
            room.release()

    with ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="fenced-s3-part") as pool:
        made = 0
        try:
            while True:
                if made <= PARTS_IN_FLIGHT:  # one buffer fills while the others are sent
                    buffer = bytearray(PART_BYTES)
                    made += 1
                else:
                    buffer = free.get()
                size = parts.fill(buffer)
                if not size:
                    break
                room.acquire()
                if any(f.done() and f.exception() for f in sent):
                    room.release()
                    break
                sent.append(pool.submit(send, len(sent) + 1, buffer))
                del buffer
                if size < PART_BYTES:
                    break
        finally:
            for future in sent:
                future.exception()  # wait for every part before completing or aborting
    return [future.result() for future in sent]


class BodyReader(io.RawIOBase):
    """A read-only stream over a GET reply's ``Body`` (see the module docstring)."""

    def __init__(self, body: Any, where: str) -> None:
        super().__init__()
        self._body = body
        self._where = where

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        try:
            data = self._body.read(len(view))
        except (botocore.exceptions.BotoCoreError, OSError) as error:
            raise Unavailable(f"{self._where}: reading failed: {error}") from error
        view[: len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        """The rest of the body in one read (not 8 KiB at a time)."""
        try:
            return bytes(self._body.read())
        except (botocore.exceptions.BotoCoreError, OSError) as error:
            raise Unavailable(f"{self._where}: reading failed: {error}") from error

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()

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

import contextlib
import io
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import botocore.exceptions

from fenced.core._errors import Unavailable

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["PARTS_IN_FLIGHT", "PART_BYTES", "BodyReader", "upload"]

PART_BYTES = 8 * 1024 * 1024
"""The size of a multipart upload's parts (S3's minimum is 5 MiB but for the last)."""
PARTS_IN_FLIGHT = 4
"""Parts sent at once by one upload."""


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
    first = _fill(iterator)
    if len(first) < PART_BYTES:
        try:
            client.put_object(Bucket=bucket, Key=key, Body=bytes(first), Metadata=metadata)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
            raise translate(error, f"writing {key}") from error
        return
    try:
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key, Metadata=metadata)[
            "UploadId"
        ]
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
        raise translate(error, f"starting the upload of {key}") from error
    try:
        parts = _send_parts(client, bucket, key, upload_id, first, iterator)
        client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
        )
    except BaseException as error:
        with contextlib.suppress(Exception):  # else gc aborts it later
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        if isinstance(error, botocore.exceptions.BotoCoreError | botocore.exceptions.ClientError):
            raise translate(error, f"uploading {key}") from error
        raise


def _fill(iterator: Iterable[bytes], part: bytes = b"") -> bytearray:
    """Up to :data:`PART_BYTES` bytes from ``iterator`` after ``part`` (a chunk may overrun:
    the excess stays in the buffer, which is sent whole)."""
    buffer = bytearray(part)
    for chunk in iterator:
        buffer += chunk
        if len(buffer) >= PART_BYTES:
            break
    return buffer


def _send_parts(
    client: Any, bucket: str, key: str, upload_id: str, first: bytearray, iterator: Any
) -> list[dict[str, Any]]:
    room = threading.BoundedSemaphore(PARTS_IN_FLIGHT)
    sent: list[Future[dict[str, Any]]] = []

    def send(number: int, body: bytes) -> dict[str, Any]:
        try:
            reply = client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )
            return {"PartNumber": number, "ETag": reply["ETag"]}
        finally:
            room.release()

    with ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="fenced-s3-part") as pool:
        buffer = first
        number = 1
        try:
            while buffer:
                room.acquire()
                if any(f.done() and f.exception() for f in sent):
                    room.release()
                    break
                sent.append(pool.submit(send, number, bytes(buffer)))
                del buffer
                number += 1
                buffer = _fill(iterator)
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

    def close(self) -> None:
        if not self.closed:
            self._body.close()
        super().close()

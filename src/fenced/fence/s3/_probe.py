"""The conditional-write probe ``open_store`` runs before it trusts an S3 server.

A server that ignored ``If-None-Match``/``If-Match`` would let two writers both "win" a state
change: a store on it cannot fence, so it must refuse to open rather than pretend
(docs/s3.md, Servers). :func:`probe` writes a throwaway key under the store's prefix and checks:

1. ``If-None-Match: *`` on a new key succeeds, and on the same key again fails with 412;
2. ``If-Match`` with an ETag the key does not have fails with 412;
3. ``If-Match`` with the key's ETag succeeds, in the quoted form S3 returns (``"…"``, AWS) or,
   failing that, unquoted (Ceph RGW compares the bare value): the form that worked is used for
   every commit.

The key is deleted whatever happens (best effort), so a refused store has nothing written.
Credentials that may not write (a reader's) make the first PUT fail with AccessDenied: then
nothing is probed, and ``open_store`` uses the form recorded when the store was created.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any

from fenced._drivers import s3
from fenced.core._errors import ConfigurationError

__all__ = ["probe"]


class _Denied(Exception):
    """The credentials may not write the probe key."""


def probe(client: Any, location: s3.S3Location) -> bool | None:
    """Check that the server honours conditional writes; True if ``If-Match`` takes the quoted
    ETag, False if it takes the bare one, None if the credentials may not write the probe key
    (a reader's: nothing is probed, and the caller decides).

    Raises :class:`ConfigurationError` naming what the server ignored, or what
    :func:`fenced._drivers.s3.translate` makes of a transport or permission error.
    """
    key = location.key("probe", uuid.uuid4().hex)
    where = location.where

    def put(body: bytes, **condition: str) -> str | None:
        """The new ETag, or None for a lost condition (412/409)."""
        try:
            reply = client.put_object(Bucket=location.bucket, Key=key, Body=body, **condition)
        except s3.ERRORS as error:
            if s3.code(error) in s3.CONFLICT_CODES:
                return None
            if s3.code(error) in s3.DENIED_CODES:
                raise _Denied from error
            raise s3.translate(error, location, "the conditional-write probe") from error
        return str(reply["ETag"])

    try:
        etag = put(b"created", IfNoneMatch="*")
        if etag is None:
            raise ConfigurationError(f"{where}: a new probe key already existed; try again")
        if put(b"again", IfNoneMatch="*") is not None:
            raise ConfigurationError(
                f"{where}: the server ignores If-None-Match on PUT, so it cannot order two "
                "writers; a fenced store refuses to run on it (docs/s3.md, Servers)"
            )
        if put(b"wrong", IfMatch='"00000000000000000000000000000000"') is not None:
            raise ConfigurationError(
                f"{where}: the server ignores If-Match on PUT, so it cannot order two "
                "writers; a fenced store refuses to run on it (docs/s3.md, Servers)"
            )
        if put(b"quoted", IfMatch=etag) is not None:
            return True
        if put(b"bare", IfMatch=etag.strip('"')) is not None:
            return False
        raise ConfigurationError(
            f"{where}: the server refuses If-Match with the key's own ETag, quoted or bare; "
            "a fenced store cannot commit on it (docs/s3.md, Servers)"
        )
    except _Denied:
        return None
    finally:
        with contextlib.suppress(*s3.ERRORS):
            client.delete_object(Bucket=location.bucket, Key=key)

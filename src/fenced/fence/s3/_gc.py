"""Garbage collection of an ``s3://`` store (``Store.gc``; docs/s3.md, Garbage collection).

Per resource, in three steps, so that a pointer never names a deleted object:

1. **Condemn** (one conditional PUT of the state): the objects the chooser picks (never a
   current target, never one of the ``keep`` newest of a name, never one idle for less than the
   grace period) and value objects no key refers to, idle past the grace period, are listed as
   condemned. A publish that commits after this cannot point at them: its ``has_object`` reads
   the condemned list in the state its own commit is conditional on. A publish that committed
   before it changed the ETag, so the condemn is re-decided on the new state.
2. **Delete** every condemned object (also those an interrupted earlier gc condemned).
3. **Forget** them (another conditional PUT): drop them from the condemned and published maps.

Then multipart uploads under ``objects/`` started before the cutoff are aborted (a publisher
killed mid-upload leaves one; S3 keeps its parts, and bills them, until then).

An error stops gc with :class:`~fenced.Unavailable` / :class:`~fenced.ConfigurationError`; what
was deleted stays deleted, what was condemned is deleted by the next gc.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from fenced._drivers import s3
from fenced.fence._rules import StoredObject
from fenced.fence.backend import Chooser
from fenced.fence.s3 import _layout

if TYPE_CHECKING:
    from fenced.fence.s3._store import S3Backend, S3Transaction

__all__ = ["collect"]

_OBJECT = "objects/"
_VALUE = "values/"


def collect(backend: S3Backend, choose: Chooser, cutoff: float) -> int:
    """Collect every resource, then abort stale uploads; the number of objects deleted."""
    resources = set(backend.resources())
    for area in ("objects", "values"):
        prefix = backend.location.key(area, "")
        for entry in backend.listing(prefix, delimiter="/"):
            resources.add(_layout.resource_of(entry["Prefix"][len(prefix) :].rstrip("/")))
    removed = sum(_collect(backend, resource, choose, cutoff) for resource in sorted(resources))
    _abort_uploads(backend, cutoff)
    return removed


def _listed(backend: S3Backend, area: str, resource: str) -> dict[str, float]:
    prefix = backend.key(area, resource, "")
    return {
        entry["Key"][len(prefix) :]: entry["LastModified"].timestamp()
        for entry in backend.listing(prefix)
    }


def _collect(backend: S3Backend, resource: str, choose: Chooser, cutoff: float) -> int:
    objects = _listed(backend, "objects", resource)
    values = _listed(backend, "values", resource)

    def condemn(tx: S3Transaction) -> list[str]:
        state = tx.state
        stored = []
        for object_id, modified in objects.items():
            entry = state.published.get(object_id)
            if entry is None:
                staged = backend.staged_at(resource, object_id, modified)
                stored.append(StoredObject(object_id, staged))
            else:
                name, epoch, published_at, superseded = entry
                idle = superseded if superseded is not None else math.inf
                stored.append(StoredObject(object_id, idle, name, epoch, published_at))
        current = {entry[1] for entry in state.pointers.values()}
        referenced = {entry[3] for entry in state.items.values() if entry[3] is not None}
        new = [_OBJECT + v for v in choose(stored, current) if _OBJECT + v not in state.condemned]
        new += [
            _VALUE + name
            for name, modified in values.items()
            if name not in referenced and modified < cutoff and _VALUE + name not in state.condemned
        ]
        tx.condemn(new, time.time())
        return list(state.condemned)

    condemned = backend.change(resource, condemn, "collect garbage")
    if condemned:
        backend.delete(
            backend.key(name.split("/")[0], resource, name.split("/", 1)[1]) for name in condemned
        )
    gone = [name[len(_OBJECT) :] for name in condemned if name.startswith(_OBJECT)]

    def forget(tx: S3Transaction) -> None:
        missing = [o for o in tx.state.published if o not in objects]
        tx.forget([*condemned, *gone, *missing])

    if condemned or any(o not in objects for o in backend.read_state(resource)[0].published):
        backend.change(resource, forget, "collect garbage")
    return len(gone)


def _abort_uploads(backend: S3Backend, cutoff: float) -> None:
    client = backend.reads
    prefix = backend.location.key("objects", "")
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(
            Bucket=backend.bucket, Prefix=prefix
        ):
            for upload in page.get("Uploads") or []:
                if upload["Initiated"].timestamp() < cutoff:
                    client.abort_multipart_upload(
                        Bucket=backend.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                    )
    except s3.ERRORS as error:
        raise backend.translate(error, "aborting stale uploads") from error

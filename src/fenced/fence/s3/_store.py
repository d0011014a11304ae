"""The ``s3://`` store backend: fenced state and publications in an S3-compatible bucket.

``s3://BUCKET[/PREFIX][?endpoint=URL&region=R&timeout=S&addressing=path|virtual|auto]``; the
credentials come from the standard AWS chain, never from the URL (:mod:`fenced._drivers.s3`).

**The critical section is optimistic** (docs/s3.md has the protocol and its failure analysis).
A transaction reads the resource's state object (:mod:`fenced.fence.s3._state`) with its ETag,
the store decides on it, and the commit is one ``PUT`` of the new state with ``If-Match`` that
ETag (``If-None-Match: *`` for a resource without state). If another writer committed first, the
server answers 412, nothing is applied, and :class:`~fenced.fence.backend.CommitConflict` makes
the store decide again on fresh state. So every decision holds at the instant its commit
applies, as with a lock, and a paused writer's commit can only fail.

* A commit whose reply is lost (a timeout, a reset) is resolved by reading the state back: its
  own fresh nonce there means committed; another version means it never will be (its
  ``If-Match`` names a version that is gone), so the mutation runs again; the same version as
  before means it may still arrive: :class:`~fenced.OutcomeUnknown`.
* Speculation (:attr:`FastPath.SPECULATION`): a mutation may be decided on the state this
  process read or wrote last, saving the read; the commit's ``If-Match`` checks it.
* Publications are staged (:mod:`fenced.fence.s3._objects`) under a fresh key before any state
  names them; ``has_object`` is "exists and not condemned by gc", and gc condemns through the
  state first (:mod:`fenced.fence.s3._gc`), so a pointer never names a deleted object.
* Op outcomes and records live in the state; the oldest are moved out to immutable objects
  (written from committed state only) so the state stays small.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, TypeVar, cast

import botocore.exceptions

from fenced._drivers import s3
from fenced.core._errors import ConfigurationError, CorruptData, OutcomeUnknown, Unavailable
from fenced.core._records import Record
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head, resolve_mode
from fenced.fence._values import Item, Mode, Publication
from fenced.fence.backend import (
    ORDINARY,
    Capability,
    Chooser,
    CommitConflict,
    FastPath,
    Intent,
    SpeculationFailed,
    StoreOptions,
)
from fenced.fence.s3 import _gc, _layout
from fenced.fence.s3._objects import BodyReader, upload
from fenced.fence.s3._probe import probe
from fenced.fence.s3._state import INLINE_BYTES, State, record_of

__all__ = ["S3Backend", "open_s3_backend"]

_ERRORS = s3.ERRORS
_AMBIGUOUS = (
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ResponseStreamingError,
)
_T = TypeVar("_T")
_OPS_KEPT = 64
"""Op outcomes kept inside a state; beyond, the oldest half is moved out."""
_RECORDS_KEPT = 128
"""Records kept inside a state; beyond, the oldest half is moved out as one segment."""
_FORMAT = 1
_SEEN_MAX = 1024
"""Resources whose last seen state a backend remembers (for speculation); cleared when full."""
STAGED = "fenced-staged"
"""The metadata field holding an object's staging time (the store's wall clock)."""


def open_s3_backend(url: str, mode: Mode | None, options: StoreOptions) -> S3Backend:
    """Open (or create, unless ``options.create`` is False) the store at ``url``; see the
    module docstring. Raises ConfigurationError (a bad URL, a missing bucket, refused
    credentials, a server that ignores conditional writes, another mode) or Unavailable."""
    if options.backend_options is not None:
        raise ConfigurationError("options= is for a pool or an engine, not s3: stores")
    location = s3.parse_url(url)
    backend = S3Backend(location, s3.clients(location), options)
    try:
        backend.initialise(mode, create=options.create)
    except BaseException:
        backend.close()
        raise
    return backend


class S3Backend:
    """See the module docstring. Created by :func:`open_s3_backend`."""

    capabilities = frozenset(Capability) - {Capability.LOCAL_FILES}
    fast_paths = frozenset({FastPath.SPECULATION, FastPath.PUBLISH_SPECULATION})

    def __init__(self, location: s3.S3Location, clients: s3.S3Clients, options: StoreOptions):
        self.url = location.url
        self.mode: Mode = "strict"
        self.location = location
        self.bucket = location.bucket
        self.reads = clients.reads
        self.commits = clients.commits
        self.options = options
        self._quoted = True
        self._seen: dict[str, tuple[State, str]] = {}
        self._staged_under: dict[str, str] = {}
        """object id → the state ETag current when its staging began (seen before it)."""
        self._seen_lock = threading.Lock()

    # -- opening ---------------------------------------------------------------------------

    def initialise(self, requested: Mode | None, *, create: bool) -> None:
        """Check the bucket, the server's conditional writes and the store's identity; create
        the identity of a new store."""
        where = self.location.where
        try:
            self.reads.head_bucket(Bucket=self.bucket)
        except _ERRORS as error:
            if s3.code(error) in s3.MISSING_CODES:
                raise ConfigurationError(
                    f"{where}: the bucket {self.bucket} does not exist"
                ) from None
            raise self.translate(error, "opening the bucket") from error
        meta = self._read_meta()
        stored = None if meta is None else str(meta.get("mode"))
        if meta is None and not create:
            raise ConfigurationError(f"no fenced store at {where}: it does not exist")
        self.mode = resolve_mode(stored, requested, f"the store {where}")
        found = probe(self.commits, self.location)
        if found is None:  # no right to write: a reader of an existing store
            if meta is None:
                raise ConfigurationError(
                    f"{where}: the credentials may not write under the prefix, so the store "
                    "cannot be created there"
                )
            found = meta.get("if_match") != "bare"
        self._quoted = found
        if meta is None:
            body = json.dumps(
                {
                    "kind": "fenced-s3-store",
                    "format": _FORMAT,
                    "mode": self.mode,
                    "if_match": "quoted" if found else "bare",
                }
            )
            try:
                self.commits.put_object(
                    Bucket=self.bucket,
                    Key=self.location.key(_layout.META),
                    Body=body.encode(),
                    IfNoneMatch="*",
                    ContentType="application/json",
                )
            except _ERRORS as error:
                if s3.code(error) not in s3.CONFLICT_CODES:
                    raise self.translate(error, "creating the store") from error
                meta = self._read_meta() or {}
                self.mode = resolve_mode(meta.get("mode"), requested, f"the store {where}")

    def _read_meta(self) -> dict[str, Any] | None:
        """The store's identity (``kind``, ``format``, ``mode``, ``if_match``: the form the probe
        found when it was created); None if the store does not exist."""
        where = self.location.where
        body = self.read_object(self.location.key(_layout.META), "reading the store's identity")
        if body is None:
            return None
        try:
            meta = json.loads(body)
            if meta.get("kind") != "fenced-s3-store":
                raise ValueError("not a fenced store")
        except (ValueError, AttributeError):
            raise ConfigurationError(
                f"{where}: {_layout.META} is not a fenced store's identity"
            ) from None
        if meta.get("format") != _FORMAT:
            raise ConfigurationError(
                f"{where} has format {meta.get('format')!r}; this fenced reads format {_FORMAT}"
            )
        return cast(dict[str, Any], meta)

    # -- plumbing --------------------------------------------------------------------------

    def translate(self, error: Exception, what: str) -> Exception:
        return s3.translate(error, self.location, what)

    def key(self, kind: str, resource: str, name: str = "") -> str:
        """The key of ``name`` of ``resource`` in the ``kind`` area (see _layout)."""
        if kind == "state":
            return self.location.key("state", _layout.segment(resource) + ".json")
        return self.location.key(kind, _layout.segment(resource), name)

    def read_object(self, key: str, what: str) -> bytes | None:
        """The bytes of ``key``, None if it does not exist."""
        try:
            return bytes(self.reads.get_object(Bucket=self.bucket, Key=key)["Body"].read())
        except _ERRORS as error:
            if s3.code(error) in s3.MISSING_CODES:
                return None
            raise self.translate(error, what) from error

    def write_object(self, key: str, body: bytes, what: str) -> None:
        """Write ``body`` at ``key`` unconditionally (fresh keys, or bodies derived from
        committed state only)."""
        try:
            self.reads.put_object(Bucket=self.bucket, Key=key, Body=body)
        except _ERRORS as error:
            raise self.translate(error, what) from error

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (absent ones are fine); Unavailable / ConfigurationError."""
        batch = [{"Key": key} for key in keys]
        for start in range(0, len(batch), 1000):
            try:
                reply = self.reads.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": batch[start : start + 1000], "Quiet": True},
                )
            except _ERRORS as error:
                raise self.translate(error, "deleting objects") from error
            errors = reply.get("Errors") or []
            if errors:
                raise Unavailable(f"{self.location.where}: deleting failed: {errors[0]}")

    def listing(self, prefix: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
        """The objects under ``prefix`` (or, with ``delimiter``, the common prefixes as
        ``{"Prefix": …}``)."""
        paginator = self.reads.get_paginator("list_objects_v2")
        arguments: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            arguments["Delimiter"] = delimiter
        try:
            for page in paginator.paginate(**arguments):
                yield from page.get("CommonPrefixes" if delimiter else "Contents") or []
        except _ERRORS as error:
            raise self.translate(error, f"listing {prefix}") from error

    # -- state -----------------------------------------------------------------------------

    def read_state(self, resource: str) -> tuple[State, str | None]:
        """The committed state of ``resource`` and its ETag (None: no state yet)."""
        key = self.key("state", resource)
        try:
            reply = self.reads.get_object(Bucket=self.bucket, Key=key)
            body = reply["Body"].read()
        except _ERRORS as error:
            if s3.code(error) in s3.MISSING_CODES:
                return State(resource), None
            raise self.translate(error, f"reading the state of {resource}") from error
        state = State.decode(resource, body, self.location.where)
        etag = str(reply["ETag"])
        self._remember(resource, state, etag)
        return state, etag

    def _remember(self, resource: str, state: State, etag: str | None) -> None:
        with self._seen_lock:
            if etag is None:
                self._seen.pop(resource, None)
                return
            if len(self._seen) >= _SEEN_MAX and resource not in self._seen:
                self._seen.clear()
            self._seen[resource] = (state, etag)

    def commit(self, resource: str, etag: str | None, state: State) -> None:
        """Write ``state`` if the committed one still has ``etag`` (None: if there is none).
        CommitConflict if not; OutcomeUnknown if that cannot be known.

        The write is sent at most twice: once more after a lost reply (the same body on the same
        condition: at most one of the two can apply). After a lost reply, the answer comes from
        the state read back (:meth:`_resolve`), never from the status of the second attempt.
        """
        key = self.key("state", resource)
        parent = state.nonce
        body = state.encode()
        if etag is None:
            condition = {"IfNoneMatch": "*"}
        else:
            condition = {"IfMatch": etag if self._quoted else etag.strip('"')}
        lost: Exception | None = None
        for _ in range(2):
            try:
                reply = self.commits.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=body,
                    ContentType="application/json",
                    **condition,
                )
            except _ERRORS as error:
                if s3.code(error) in s3.CONFLICT_CODES and lost is None:
                    self._remember(resource, state, None)
                    raise CommitConflict(resource) from None
                if s3.code(error) in s3.CONFLICT_CODES:
                    break  # after a lost reply: maybe our own first attempt
                if lost is None and not (
                    isinstance(error, _AMBIGUOUS) or (s3.status(error) or 0) >= 500
                ):
                    raise self.translate(error, f"writing the state of {resource}") from error
                lost = error
                continue
            self._remember(resource, state, str(reply["ETag"]))
            return
        assert lost is not None
        self._resolve(resource, parent, state, lost)

    def _resolve(self, resource: str, parent: str, state: State, error: Exception) -> None:
        """Whether a commit whose reply was lost applied: the write that replaced the version
        it was conditional on (nonce ``parent``) is it, or another one (CommitConflict); or
        that cannot be known (OutcomeUnknown)."""
        try:
            current = self.read_state(resource)[0]  # remembered from here on
        except (Unavailable, ConfigurationError):
            current = None
        if current is not None:
            successor = current.successor(parent)
            if successor == state.nonce:
                return
            if successor is not None:
                raise CommitConflict(resource) from None
        raise OutcomeUnknown(
            f"{self.location.where}: the reply to the write of {resource}'s state was lost "
            f"({error}); it may still apply: retry with the same op_id"
        ) from error

    # -- the Backend contract --------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, resource: str, intent: Intent = ORDINARY) -> Iterator[S3Transaction]:
        if intent.speculate:
            with self._seen_lock:
                seen = self._seen.get(resource)
            if seen is None:
                raise SpeculationFailed(resource)
            base: State = seen[0]
            etag: str | None = seen[1]
        else:
            base, etag = self.read_state(resource)
        tx = S3Transaction(self, base, etag)
        try:
            yield tx
        except BaseException:
            tx.abandon()
            raise
        tx.finish(speculative=intent.speculate)

    def head(self, resource: str) -> Head:
        return self.read_state(resource)[0].head

    def get(self, resource: str, key: str) -> Item | None:
        for _ in range(5):
            state = self.read_state(resource)[0]
            entry = state.items.get(key)
            if entry is None or entry[3] is None:
                return state.item(key)
            stored = self.read_object(self.key("values", resource, entry[3]), "reading a value")
            if stored is not None:
                return state.item(key, stored)
        raise CorruptData(f"{self.location.where}: the value of {resource}/{key} is missing")

    def pointer(self, resource: str, name: str) -> Publication | None:
        return self.read_state(resource)[0].pointer(name)

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        with self._seen_lock:
            seen = self._seen.get(resource)
            if seen is not None:
                if len(self._staged_under) >= _SEEN_MAX:
                    self._staged_under.clear()
                self._staged_under[object_id] = seen[1]
        key = self.key("objects", resource, object_id)
        upload(self.reads, self.bucket, key, chunks, self.translate, {STAGED: repr(now)})

    def staged_at(self, resource: str, object_id: str, modified: float) -> float:
        """When ``object_id`` was staged (store clock), from its metadata; ``modified`` (the
        server's time) if it has none or is gone."""
        try:
            reply = self.reads.head_object(
                Bucket=self.bucket, Key=self.key("objects", resource, object_id)
            )
            return float(reply.get("Metadata", {}).get(STAGED, modified))
        except (*_ERRORS, ValueError):
            return modified

    def discard(self, resource: str, object_id: str) -> None:
        with contextlib.suppress(Unavailable, ConfigurationError):
            self.delete([self.key("objects", resource, object_id)])

    def has_object(self, resource: str, object_id: str) -> bool:
        try:
            self.reads.head_object(Bucket=self.bucket, Key=self.key("objects", resource, object_id))
        except _ERRORS as error:
            if s3.code(error) in s3.MISSING_CODES:
                return False
            raise self.translate(error, f"checking the object {object_id}") from error
        return True

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        for _ in range(5):
            publication = self.read_state(resource)[0].pointer(name)
            if publication is None:
                return None
            key = self.key("objects", resource, publication.object_id)
            try:
                reply = self.reads.get_object(Bucket=self.bucket, Key=key)
            except _ERRORS as error:
                if s3.code(error) in s3.MISSING_CODES:
                    continue  # superseded and collected since the state was read: read again
                raise self.translate(error, f"reading {key}") from error
            return publication, BodyReader(reply["Body"], self.location.where)  # type: ignore[return-value]
        raise CorruptData(
            f"{self.location.where}: the object of {resource}/{name} is missing from the bucket"
        )

    def gc(self, choose: Chooser, cutoff: float) -> int:
        return _gc.collect(self, choose, cutoff)

    def record_rejection(self, record: Record) -> None:
        self.change(record.resource, lambda tx: tx.append_record(record), "record a rejection")

    def change(self, resource: str, change: Callable[[S3Transaction], _T], what: str) -> _T:
        """``change`` in a transaction of ``resource``, run again (on fresh state, after a short
        pause) while its commit loses a race, for at most ``busy_timeout``; then Unavailable.
        For the backend's own changes (gc, rejection records); the store's mutations are run
        again by the store, which decides them anew."""
        deadline = time.monotonic() + self.options.busy_timeout
        while True:
            try:
                with self.transaction(resource) as tx:
                    return change(tx)
            except CommitConflict:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"{resource}: too busy to {what}; retry") from None
                time.sleep(0.01)

    def history(self, resource: str, after: int, *, since: float, keep: int) -> list[Record]:
        state = self.read_state(resource)[0]
        first = max(after, state.seq - keep)
        entries = {entry[0]: entry for entry in state.records}
        prefix = self.key("records", resource, "")
        for found in self.listing(prefix):
            seqs = _layout.seqs_of(found["Key"][len(prefix) :])
            if seqs is None or seqs[1] <= first:
                continue
            body = self.read_object(found["Key"], "reading records")
            if body is None:
                continue  # pruned meanwhile
            for entry in json.loads(body):
                entries.setdefault(entry[0], entry)
        return [
            record_of(resource, entries[seq])
            for seq in sorted(entries)
            if seq > first and entries[seq][1] >= since
        ]

    def floors(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for resource in self.resources():
            floor = self.read_state(resource)[0].floor
            if floor is not None:
                found[resource] = floor
        return found

    def resources(self) -> list[str]:
        """Every resource that has a state."""
        prefix = self.location.key("state", "")
        return [
            _layout.resource_of(entry["Key"][len(prefix) :].removesuffix(".json"))
            for entry in self.listing(prefix)
            if entry["Key"].endswith(".json")
        ]

    def knows(self, resource: str, key: str | None) -> bool:
        with self._seen_lock:
            return resource in self._seen

    def remembered_head(self, resource: str) -> Head | None:
        with self._seen_lock:
            seen = self._seen.get(resource)
        return None if seen is None else seen[0].head

    def staged_under(self, object_id: str) -> str | None:
        """The state ETag this process knew when it began staging ``object_id`` (once)."""
        with self._seen_lock:
            return self._staged_under.pop(object_id, None)

    def close(self) -> None:
        for client in (self.reads, self.commits):
            with contextlib.suppress(Exception):
                client.close()


class S3Transaction:
    """One mutation's view of a resource's state, committed by one conditional PUT."""

    def __init__(self, backend: S3Backend, base: State, etag: str | None) -> None:
        self._backend = backend
        self._base = base
        self._etag = etag
        self.state = base.copy()
        self.changed = False
        self._staged: list[str] = []
        """Value keys written by this transaction (deleted if it does not commit)."""
        self._superseded: list[str] = []
        """Keys no longer needed once it commits."""
        self._expired_ops: float | None = None
        self._expired_records: tuple[float, int] | None = None
        self.resource = base.resource

    # -- reads -----------------------------------------------------------------------------

    def head(self) -> Head:
        return self.state.head

    def op(self, op_id: str) -> OpRecord | None:
        found = self.state.op(op_id)
        if found is not None or op_id in self.state.ops:
            return found
        body = self._backend.read_object(
            self._backend.key("ops", self.resource, _layout.op_name(op_id)), "reading an op id"
        )
        if body is None:
            return None
        entry = json.loads(body)
        if entry[0] != op_id:
            return None
        return OpRecord(entry[1], entry[2], entry[3])

    def version_of(self, key: str) -> int | None:
        entry = self.state.items.get(key)
        return None if entry is None else int(entry[1])

    def pointer(self, name: str) -> Publication | None:
        return self.state.pointer(name)

    def has_object(self, object_id: str) -> bool:
        """Whether ``object_id`` is staged and not condemned. Without a request when this
        transaction commits on the state version current before the staging began: gc deletes
        only what it condemned in a later version, so the commit would fail if it had."""
        if object_id in self.state.condemned:
            return False
        if self._etag is not None and self._backend.staged_under(object_id) == self._etag:
            return True
        return self._backend.has_object(self.resource, object_id)

    # -- writes ----------------------------------------------------------------------------

    def set_head(self, head: Head) -> None:
        self.state.coordinator, self.state.floor = head.coordinator_id, head.floor
        self.changed = True

    def record_op(self, op_id: str, record: OpRecord) -> None:
        self.state.ops[op_id] = [record.digest, record.outcome, record.recorded_at]
        self.changed = True

    def prune_ops(self, before: float) -> None:
        for op_id, entry in list(self.state.ops.items()):
            if entry[2] < before:
                del self.state.ops[op_id]
                self.changed = True
        self._expired_ops = before

    def put_item(self, item: Item) -> None:
        previous = self.state.items.get(item.key)
        value_name = None
        if len(item.value) > INLINE_BYTES:
            value_name = uuid.uuid4().hex
            key = self._backend.key("values", self.resource, value_name)
            self._staged.append(key)
            self._backend.write_object(key, item.value, "writing a value")
        if previous is not None and previous[3] is not None:
            self._superseded.append(self._backend.key("values", self.resource, previous[3]))
        self.state.set_item(item, value_name)
        self.changed = True

    def set_pointer(self, publication: Publication, now: float) -> None:
        self.state.set_pointer(publication, now)
        self.changed = True

    def append_record(self, record: Record) -> None:
        self.state.append(record)
        self.changed = True

    def prune_records(self, before: float, keep: int) -> None:
        oldest = self.state.seq - keep
        kept = [entry for entry in self.state.records if entry[0] > oldest and entry[1] >= before]
        if len(kept) != len(self.state.records):
            self.state.records = kept
            self.changed = True
        self._expired_records = (before, oldest)

    def condemn(self, names: Iterable[str], now: float) -> None:
        """Claim ``names`` (object ids, value key names) for deletion (gc)."""
        for name in names:
            self.state.condemned[name] = now
            self.changed = True

    def forget(self, names: Iterable[str]) -> None:
        """Drop deleted ``names`` from the condemned and published maps (gc)."""
        for name in names:
            self.state.condemned.pop(name, None)
            self.state.published.pop(name, None)
            self.changed = True

    # -- the end ---------------------------------------------------------------------------

    def abandon(self) -> None:
        """The mutation raised: delete what only this transaction wrote."""
        with contextlib.suppress(Unavailable, ConfigurationError):
            self._backend.delete(self._staged)

    def finish(self, *, speculative: bool) -> None:
        """Commit the changes, if any (see the module docstring)."""
        if not self.changed:
            if speculative:  # a decision on remembered state that changes nothing proves nothing
                raise SpeculationFailed(self.resource)
            return
        self._move_out()
        try:
            self._backend.commit(self.resource, self._etag, self.state)
        except CommitConflict:
            self.abandon()
            raise
        except (Unavailable, ConfigurationError):
            self.abandon()
            raise
        self._after()

    def _move_out(self) -> None:
        """Move the oldest committed op outcomes and records out of the state."""
        backend, base, state = self._backend, self._base, self.state
        if len(state.ops) > _OPS_KEPT:
            committed = sorted((e[2], op) for op, e in base.ops.items() if op in state.ops)
            for _, op_id in committed[: _OPS_KEPT // 2]:
                body = json.dumps([op_id, *state.ops[op_id]]).encode()
                key = backend.key("ops", self.resource, _layout.op_name(op_id))
                backend.write_object(key, body, "moving an op id out")
                del state.ops[op_id]
        if len(state.records) > _RECORDS_KEPT:
            moving = [e for e in state.records if e[0] <= base.seq][: _RECORDS_KEPT // 2]
            if moving:
                name = _layout.segment_name(moving[0][0], moving[-1][0])
                key = backend.key("records", self.resource, name)
                backend.write_object(key, json.dumps(moving).encode(), "moving records out")
                state.records = state.records[len(moving) :]

    def _after(self) -> None:
        """Best-effort clean-up once committed: superseded values, expired moved-out data."""
        backend = self._backend
        stale = list(self._superseded)
        try:
            if self._expired_ops is not None:
                cutoff = self._expired_ops
                stale += [
                    entry["Key"]
                    for entry in backend.listing(backend.key("ops", self.resource, ""))
                    if entry["LastModified"].timestamp() < cutoff
                ]
            if self._expired_records is not None:
                before, oldest = self._expired_records
                prefix = backend.key("records", self.resource, "")
                for entry in backend.listing(prefix):
                    seqs = _layout.seqs_of(entry["Key"][len(prefix) :])
                    if seqs is not None and (
                        seqs[1] <= oldest or entry["LastModified"].timestamp() < before
                    ):
                        stale.append(entry["Key"])
            if stale:
                backend.delete(stale)
        except (Unavailable, ConfigurationError):
            pass  # a later prune or gc removes them

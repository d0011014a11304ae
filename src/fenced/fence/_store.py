"""Fenced stores: :func:`open_store` and the :class:`Store` every backend is used through.

A store keeps, per resource (a *fencing domain*), a floor (the largest epoch accepted or
installed), the coordinator the domain is bound to, keys with versioned values, and publication
pointers. Every mutation is checked against the token it carries **in the same atomic step** as
the change; a rejected mutation changes nothing. Why the check must sit at the store (a worker's
own lease check is always too early)::

    worker A (81):  check lease: ok ── GC pause / SIGSTOP ─────────────── put(81)  → StaleToken
    coordinator:          A's lease expires │ grants 82 to B
    worker B (82):                          │ fence(82) ── put(82) ok
    store floor:    81 ─────────────────────────── 82 ──────────────────────────────

Backends (chosen by URL scheme in :mod:`fenced.fence._registry`) only store; this module
validates, applies op ids and asks :mod:`fenced.fence._rules` for every decision, so all backends
behave the same. A backend's fast paths (:class:`~fenced.fence.backend.FastPath`) change how
many round trips a mutation takes, never its outcome: a speculative attempt that fails, or whose
answer is a refusal, is run again the ordinary way, and only that answer is reported.

**Records** (docs/stores.md; backends with :attr:`Capability.RECORDS`): every install (``fence``, or
a monotonic store's implicit install), accepted mutation and rejected mutation (stale, not
installed, foreign) becomes a :class:`~fenced.core._records.Record` kept with the store's state and
read back with :meth:`Store.history`. Installs and accepted mutations are written inside the
mutation's own transaction: durable with it, at no extra sync. Rejections are appended after the
rejected transaction rolled back, by a cheap non-durable append (they can be lost by a power
failure, never an accepted one); recording a rejection never changes data and never masks the
rejection. Records are pruned to ``record_limit`` per resource and ``record_retention`` seconds.
The same events go to the ``fenced.store`` logger: installs at INFO, accepted mutations at
DEBUG, rejections at WARNING.
"""

from __future__ import annotations

import io
import itertools
import logging
import math
import random
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO, ClassVar, Protocol, TypeVar, cast

from fenced.core._clock import Clock, SystemClock
from fenced.core._closing import Closing
from fenced.core._errors import (
    ConfigurationError,
    ForeignToken,
    IdempotencyConflict,
    NotFound,
    NotInstalled,
    Rejected,
    StaleToken,
    Unavailable,
    VersionConflict,
)
from fenced.core._names import validate_key, validate_publication_name, validate_resource
from fenced.core._records import Record, RecordKind
from fenced.core._token import FencingToken, validate_coordinator_id
from fenced.fence import _ops as ops
from fenced.fence import _registry as registry
from fenced.fence import _rules as rules
from fenced.fence._checked import CheckedStream, shown_publication
from fenced.fence._source import PublishData, Source
from fenced.fence._values import Item, Mode, Publication, Version
from fenced.fence.backend import (
    DEFAULT_RECORD_LIMIT,
    DEFAULT_RECORD_RETENTION,
    ORDINARY,
    Backend,
    Capability,
    CommitConflict,
    CurrentPutBackend,
    FastPath,
    Intent,
    PublishSpeculatingBackend,
    RecordingBackend,
    RecordingTransaction,
    SpeculatingBackend,
    SpeculationFailed,
    StoreOptions,
    Transaction,
)

if TYPE_CHECKING:
    pass

__all__ = [
    "DEFAULT_BUSY_TIMEOUT",
    "DEFAULT_GC_GRACE",
    "DEFAULT_OP_RETENTION",
    "DEFAULT_RECORD_LIMIT",
    "DEFAULT_RECORD_RETENTION",
    "MAX_VALUE_BYTES",
    "Store",
    "open_store",
]

DEFAULT_OP_RETENTION = 7 * 24 * 3600.0
"""Seconds an op id's recorded outcome is honoured (7 days)."""
DEFAULT_GC_GRACE = 3600.0
"""Seconds an unreferenced object is kept before ``gc`` may remove it (1 hour)."""
DEFAULT_BUSY_TIMEOUT = 5.0
"""Seconds a mutation waits for another writer of the same store before :class:`Unavailable`."""
_MAX_VERSION = 2**63 - 1  # versions are 64-bit signed integers in every backend
MAX_VALUE_BYTES = 16 * 1024 * 1024
"""The largest value ``put`` accepts; publish larger data."""
_PRUNE_EVERY = 64

log = logging.getLogger("fenced.store")

_Outcome = TypeVar("_Outcome", Version, Publication)
_T = TypeVar("_T")

# What a speculative attempt may end with that the ordinary attempt decides again (nothing
# was applied): its answer came from remembered state, so only the ordinary one is reported.
_REDECIDED = (SpeculationFailed, Rejected, VersionConflict, IdempotencyConflict)


def open_store(
    url: str | object,
    mode: Mode | None = None,
    *,
    op_retention: float = DEFAULT_OP_RETENTION,
    gc_grace: float = DEFAULT_GC_GRACE,
    busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    clock: Clock | None = None,
    record_retention: float = DEFAULT_RECORD_RETENTION,
    record_limit: int = DEFAULT_RECORD_LIMIT,
    options: Mapping[str, object] | None = None,
    create: bool = True,
) -> Store:
    """Open (creating it if needed) the store at ``url``: ``sqlite:////abs/path.db``,
    ``sqlite:///rel/path.db`` (SQLAlchemy's rule: three slashes are relative), ``file:///dir``
    or ``postgresql[+psycopg]://…`` (docs/concepts.md has the table of spellings).

    Instead of a URL, ``url`` may be a ``psycopg_pool.ConnectionPool`` or a SQLAlchemy
    ``Engine`` (``postgresql+psycopg``): the store borrows its connections and never closes it
    (:mod:`fenced._drivers.postgres_borrowed` and docs/postgres.md say how). ``options`` then
    carries what a URL's query would (``schema``, ``timeout``, ``prepare``); with a URL it must
    be None.

    ``mode`` (``"strict"`` or ``"monotonic"``) is chosen when the store is created (None →
    strict) and stored; it applies to every resource of the store. None opens an existing store
    in its mode; the other mode is a :class:`ConfigurationError`.

    ``op_retention``: seconds an op id is remembered. ``gc_grace``: the default grace of
    :meth:`Store.gc`. ``busy_timeout``: seconds to wait for a concurrent writer before
    :class:`Unavailable`. ``clock``: wall time for records and gc (tests pass a ManualClock).
    ``record_retention`` (seconds) and ``record_limit`` (per resource): how long and how many
    records :meth:`Store.history` keeps (pruned now and then inside later writes).

    ``create=False`` opens an existing store only, as readers want: a ``sqlite:`` or ``file:``
    store that does not exist (or an empty database file) is a :class:`ConfigurationError`
    naming it, and nothing is created (a PostgreSQL store's tables are created on first use
    either way: the database itself exists).

    Raises :class:`ConfigurationError` for a bad URL or option, a path that is not a fenced store,
    a store of a newer format, a corrupt or unwritable store.
    """
    validated = check_open(
        url,
        mode,
        op_retention=op_retention,
        gc_grace=gc_grace,
        busy_timeout=busy_timeout,
        clock=clock,
        record_retention=record_retention,
        record_limit=record_limit,
        options=options,
        create=create,
    )
    return open_checked(url, mode, validated)


def open_checked(
    url: str | object, mode: Mode | None, options: StoreOptions, *, green: bool = False
) -> Store:
    """Open the store at ``url`` with options :func:`check_open` returned (this does the I/O);
    ``green``: on the kind's green backend, if it has one (see
    :func:`fenced.fence._registry.open_backend`)."""
    kind = registry.kind_of(url)[1]
    if kind.store:  # served elsewhere (http): the kind opens the whole Store
        return cast(Store, kind.load()(url, mode, options))
    return Store(registry.open_backend(url, mode, options, green=green), options)


class _Described(Protocol):
    """What a store face reads its identity from: a backend, or the store it runs."""

    @property
    def url(self) -> str: ...
    @property
    def mode(self) -> Mode: ...
    @property
    def capabilities(self) -> frozenset[Capability]: ...


class StoreIdentity:
    """What a store of either face (sync :class:`Store`, :class:`fenced.aio.AsyncStore`) says
    of itself: ``url``, ``mode``, ``capabilities`` and its repr, read from what it runs on
    (:meth:`_described`: a :class:`Store`'s backend, an asyncio store's sync store)."""

    _shown_as: ClassVar[str] = "fenced.Store"
    """The class's name in its repr."""

    def _described(self) -> _Described:
        raise NotImplementedError

    @property
    def url(self) -> str:
        """The URL the store was opened with."""
        return self._described().url

    @property
    def mode(self) -> Mode:
        """``"strict"`` or ``"monotonic"``, as stored when the store was created."""
        return self._described().mode

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What this store's backend can do."""
        return self._described().capabilities

    def __repr__(self) -> str:
        return f"<{self._shown_as} {self.url} mode={self.mode}>"


class Store(StoreIdentity, Closing):
    """A fenced store. Thread-safe; many processes may open the same URL at once.

    Every method that takes a token checks it atomically with its change and raises, without
    changing anything: :class:`~fenced.ForeignToken` (the resource is bound to another
    coordinator), :class:`~fenced.StaleToken` (epoch below the floor), or, in strict mode,
    :class:`~fenced.NotInstalled` (epoch above the floor that nobody installed with
    :meth:`fence`). :class:`~fenced.Unavailable` means nothing happened and a retry is safe;
    :class:`~fenced.OutcomeUnknown` means the commit may or may not have happened: retry with
    the same ``op_id`` to find out.
    """

    def __init__(self, backend: Backend, options: StoreOptions) -> None:
        self._backend = backend
        self._options = options
        self._clock = options.clock
        self._writes = itertools.count(1)
        self._closed = False

    def _described(self) -> Backend:
        return self._backend

    # -- mutations -------------------------------------------------------------------------

    def fence(self, token: FencingToken) -> int:
        """Install ``token.epoch`` as the floor of its resource; return the floor.

        Raises StaleToken if the floor is already higher (nothing changes). Installing the
        current floor again is a no-op, so a retry is safe. From the moment this returns,
        every operation with a lower epoch is rejected, even before the new owner writes.
        Binds an unbound resource to the token's coordinator.
        """
        token = check_fence(token)
        if self._speculates(token.resource, None):
            try:
                return self._fence(token, Intent(speculate=True))
            except _REDECIDED:
                pass
        return self._again(token.resource, lambda: self._fence(token, ORDINARY))

    def _fence(self, token: FencingToken, intent: Intent) -> int:
        now = self._clock.wall()
        try:
            with self._write(token.resource, intent) as tx:
                head = tx.head()
                new = rules.admit_fence(head, token)
                if new != head:
                    tx.set_head(new)
                    detail: dict[str, object] = {"op": "fence", "previous": head.floor}
                    self._append(tx, RecordKind.INSTALLED, token, detail, now)
        except Rejected as error:
            if not intent.speculate:
                self._rejected(token, _Mutation("fence", {}), error)
            raise
        if new != head:
            log.info(
                "%s: installed epoch %d (previous floor %s)",
                token.resource,
                token.epoch,
                head.floor,
            )
        return token.epoch

    def put(
        self,
        token: FencingToken,
        key: str,
        value: bytes | bytearray | memoryview,
        *,
        op_id: str | None = None,
        if_version: int | None = None,
    ) -> Version:
        """Write ``value`` under ``key`` of the token's resource; return the new version.

        ``if_version``: None writes unconditionally; 0 requires that the key does not exist; n
        requires that its version is n, else :class:`~fenced.VersionConflict` (nothing changes).
        ``op_id``: see :mod:`fenced.fence._ops` — a retry returns the first outcome.
        Values are at most :data:`MAX_VALUE_BYTES` (bad input is :class:`ConfigurationError`).
        """
        token, key, data, op_id, if_version = check_put(token, key, value, op_id, if_version)
        digest = ops.put_digest(token, key, data, if_version) if op_id is not None else ""
        if self._speculates(token.resource, key):
            try:
                intent = Intent(key=key, speculate=True)
                return self._put(token, key, data, op_id, if_version, digest, intent)
            except _REDECIDED:
                pass
        return self._again(
            token.resource,
            lambda: self._put(token, key, data, op_id, if_version, digest, Intent(key=key)),
        )

    def _put(
        self,
        token: FencingToken,
        key: str,
        data: bytes,
        op_id: str | None,
        if_version: int | None,
        digest: str,
        intent: Intent,
    ) -> Version:
        now = self._clock.wall()
        what = _Mutation("put", {"key": key})
        due = self._prune_due()
        backend = self._open_backend()
        if (
            op_id is None
            and if_version is None
            and not due
            and FastPath.CURRENT_PUT in backend.fast_paths
            and Capability.RECORDS in backend.capabilities
        ):
            # the usual put in one backend call, its accepted record included
            detail: dict[str, object] = {"op": what.op, **what.target}
            written = cast(CurrentPutBackend, backend).put_current(token, key, data, detail, now)
            if written is not None:
                what.log(token)
                return written
        try:
            with self._write(token.resource, intent, due=due) as tx:

                def change() -> Version:
                    number = rules.next_version(token.resource, key, tx.version_of(key), if_version)
                    tx.put_item(Item(token.resource, key, data, token.epoch, number))
                    return Version(token.resource, key, token.epoch, number)

                result = self._mutate(
                    tx, token, op_id, digest, now, ops.decode_version, change, what
                )
        except Rejected as error:
            if not intent.speculate:
                self._rejected(token, what, error)
            raise
        what.log(token)
        return result

    def publish(
        self,
        token: FencingToken,
        data: PublishData,
        *,
        name: str = "",
        op_id: str | None = None,
    ) -> Publication:
        """Publish ``data`` (bytes, a path or a binary stream) as ``(token.resource, name)``.

        1. The bytes are staged durably as an immutable object with a fresh id (a path or stream
           is streamed in chunks, never read whole into memory), outside the critical section.
        2. In the critical section: op id, binding and fence checks as for :meth:`put`, then the
           pointer moves to the new object only if ``token.epoch`` is at or above the pointer's.

        The pointer never moves backwards and never shows a missing or partial object, even if
        the publisher is killed at any instant. A rejected publication's object is deleted (or,
        after a crash, left for :meth:`gc`). A resource whose floor is already above the token,
        or that is bound to another coordinator, is refused before staging (without ``op_id``).
        """
        token, name, op_id = check_publish(token, name, op_id)
        source = Source(data)
        resource = token.resource
        backend = self._open_backend()
        what = _Mutation("publish", {"name": name})
        if op_id is None:  # these refusals are permanent: save the staging of doomed data
            self._refuse_doomed(backend, token, what)
        object_id = f"{token.epoch:020d}-{uuid.uuid4().hex}"
        backend.stage(resource, object_id, source, self._clock.wall())
        sha256, size = source.sha256, source.size
        digest = ops.publish_digest(token, name, sha256, size) if op_id else ""

        def attempt(intent: Intent) -> Publication:
            what.replayed = what.installed = False
            now = self._clock.wall()
            with self._write(resource, intent) as tx:

                def change() -> Publication:
                    current = tx.pointer(name)
                    rules.check_pointer(token, None if current is None else current.epoch)
                    if not tx.has_object(object_id):
                        raise Unavailable(
                            f"the staged object {object_id} was removed by gc before the "
                            "publication committed (was the publisher paused for longer than "
                            "the gc grace period?); nothing was published, retry"
                        )
                    publication = Publication(
                        resource, name, token.epoch, object_id, sha256, size, now
                    )
                    tx.set_pointer(publication, now)
                    return publication

                return self._mutate(
                    tx, token, op_id, digest, now, ops.decode_publication, change, what
                )

        try:
            result = None
            if FastPath.PUBLISH_SPECULATION in backend.fast_paths and self._speculates(
                resource, None
            ):
                with suppress(*_REDECIDED):
                    result = attempt(Intent(pointer=name, speculate=True))
            if result is None:
                result = self._again(resource, lambda: attempt(Intent(pointer=name)))
        except (Rejected, IdempotencyConflict, Unavailable) as error:  # definitely not committed
            backend.discard(resource, object_id)
            if isinstance(error, Rejected):
                self._rejected(token, what, error)
            raise
        if result.object_id != object_id:  # replayed: this attempt's object is not needed
            backend.discard(resource, object_id)
        what.log(token)
        return result

    def _refuse_doomed(self, backend: Backend, token: FencingToken, what: _Mutation) -> None:
        """Refuse a publish that no later state can admit (a floor above the token, another
        binding) before its data is staged: on committed state, or on the state a backend with
        :attr:`FastPath.PUBLISH_SPECULATION` remembers (a refusal there is confirmed on committed
        state; an admission is decided again by the commit in any case)."""
        if FastPath.PUBLISH_SPECULATION in backend.fast_paths:
            remembered = cast(PublishSpeculatingBackend, backend).remembered_head(token.resource)
            if remembered is not None:
                try:
                    rules.admit_fence(remembered, token)
                    return
                except Rejected:
                    pass
        try:
            rules.admit_fence(backend.head(token.resource), token)
        except Rejected as error:
            self._rejected(token, what, error)
            raise

    def gc(self, keep: int = 1, grace: float | None = None) -> int:
        """Delete unreferenced objects idle for longer than ``grace`` seconds; return how many.

        Never deletes a current pointer target nor one of the ``keep`` newest publications of a
        ``(resource, name)``. An object is idle from the moment it was superseded (or staged,
        if it was never published), so a reader that opened a publication can finish reading
        within the grace period. ``grace`` defaults to the store's ``gc_grace``. Also removes
        temporary files of interrupted writes older than the grace period.

        On the local stores gc is the way out of a full disk. ``file:`` removes first and records
        after. ``sqlite:`` deletes in small transactions (freeing pages without rewriting them),
        then hands the free pages back to the file system; its writes that add data keep 8 MiB
        free for gc (:class:`~fenced.Unavailable` otherwise), and on a disk something else
        filled, its error says how much to free first. gc is not one atomic step: an error part
        way (:class:`~fenced.Unavailable`, or :class:`ConfigurationError` for a permission
        error) says how many objects it removed before it stopped; the others are as they were,
        the store is consistent, and a later gc finishes the work.
        """
        keep, grace = check_gc(keep, grace)
        if grace is None:
            grace = self._options.gc_grace
        cutoff = self._clock.wall() - grace
        return self._open_backend().gc(partial(rules.gc_victims, keep=keep, cutoff=cutoff), cutoff)

    def rebind(
        self, resource: str, coordinator_id: str, *, previous: str | None = None, ceiling: int
    ) -> str | None:
        """Bind ``resource`` to the coordinator ``coordinator_id``, keeping its floor (an
        operator's step after a coordinator was lost without a backup; use
        :func:`fenced.coordinator._restore.rebind`, which checks the coordinator first).

        In one atomic step (the resource's critical section): refuses, changing nothing, with
        :class:`ConfigurationError` if the resource is bound to another coordinator than
        ``previous`` (when given) or its floor is above ``ceiling`` (the new coordinator's last
        epoch); else binds it and appends a REBOUND record (``epoch``: the floor kept; detail
        ``previous``, ``coordinator``). From then on every token of the old coordinator is
        :class:`~fenced.ForeignToken`. Returns the coordinator id it was bound to before: None
        (unbound) or ``coordinator_id`` itself change nothing, so a retry is safe.
        """
        new = check_rebind(resource, coordinator_id, previous, ceiling)
        head, changed = self._again(
            resource, lambda: self._rebind(resource, new, previous, ceiling)
        )
        if changed != head:
            log.warning(
                "%s: rebound from coordinator %s to %s (floor %s kept)",
                resource,
                head.coordinator_id,
                new,
                head.floor,
            )
        return head.coordinator_id

    def _rebind(
        self, resource: str, new: str, previous: str | None, ceiling: int
    ) -> tuple[rules.Head, rules.Head]:
        now = self._clock.wall()
        with self._write(resource, ORDINARY) as tx:
            head = tx.head()
            try:
                changed = rules.admit_rebind(head, new, previous=previous, ceiling=ceiling)
            except ConfigurationError as error:
                raise ConfigurationError(
                    f"cannot rebind {resource} at {self.url}: {error}"
                ) from None
            if changed != head:
                tx.set_head(changed)
                detail: dict[str, object] = {"previous": head.coordinator_id, "coordinator": new}
                if Capability.RECORDS in self._backend.capabilities:
                    record = Record(
                        0, now, RecordKind.REBOUND, resource, head.floor or 0, None, detail
                    )
                    cast(RecordingTransaction, tx).append_record(record)
        return head, changed

    def binding(self, resource: str) -> str | None:
        """The id of the coordinator ``resource`` is bound to; None if it is unbound."""
        validate_resource(resource)
        return self._open_backend().head(resource).coordinator_id

    # -- reads -----------------------------------------------------------------------------

    def get(self, resource: str, key: str) -> Item | None:
        """The current item of ``key`` in ``resource``, or None. Reads need no token."""
        check_get(resource, key)
        return self._open_backend().get(resource, key)

    def latest(self, resource: str, name: str = "") -> Publication | None:
        """The current publication of ``(resource, name)``, or None."""
        check_publication(resource, name)
        return self._open_backend().pointer(resource, name)

    def open(self, resource: str, name: str = "") -> BinaryIO:
        """A binary stream of the current publication's bytes (a snapshot), checked as it is read.

        The stream keeps reading the object it opened even if a newer one is published
        meanwhile, for at least the gc grace period. Raises :class:`~fenced.NotFound` (a
        :class:`LookupError`) if nothing is published under that name. Close it
        (``with store.open(...) as f``).

        The bytes are counted and hashed as they pass: a read raises
        :class:`~fenced.CorruptData` instead of returning the bytes that complete the recorded
        size with another SHA-256, any byte beyond that size, or the end of a stream short of it.
        So a clean end of stream, or the recorded number of bytes, means the publication's exact
        bytes; what an earlier read returned is not to be used once a later one raised.
        """
        publication, stream = self._current(resource, name)
        return io.BufferedReader(CheckedStream(stream, publication))

    def read(self, resource: str, name: str = "") -> bytes:
        """All bytes of the current publication, checked against its size and SHA-256.

        Raises :class:`~fenced.NotFound` (a :class:`LookupError`) if nothing is published,
        :class:`~fenced.CorruptData` (a :class:`ConfigurationError`) if the stored bytes do not
        match their publication (a damaged store).
        """
        publication, stream = self._current(resource, name)
        with CheckedStream(stream, publication) as checked:
            return checked.readall()

    def floor(self, resource: str) -> int | None:
        """The largest epoch accepted or installed for ``resource``; None if it has none."""
        validate_resource(resource)
        return self._open_backend().head(resource).floor

    def floors(self) -> dict[str, int]:
        """Every resource of the store that has a floor, with that floor.

        What ``fenced restore --floor-from`` reads. Needs :attr:`Capability.RECORDS`
        (:class:`ConfigurationError` otherwise; :meth:`floor` works on every store).
        """
        return self._recording().floors()

    def history(self, resource: str, after: int = 0) -> list[Record]:
        """The store's retained records of ``resource`` with ``seq > after``, oldest first.

        Kinds: INSTALLED (detail ``op``: ``fence``, or ``put``/``publish`` for a monotonic
        store's implicit install; ``previous`` floor), ACCEPTED (``op``, ``key`` or ``name``,
        ``version`` or ``object_id``/``size``, ``op_id`` if given) and REJECTED (``op``, ``key``
        or ``name``, ``reason``: ``stale`` / ``not-installed`` / ``foreign``, ``presented``
        epoch, ``floor``), REBOUND (:meth:`rebind`: ``previous`` and ``coordinator`` ids, the
        floor kept as ``epoch``). ``epoch`` is the token's epoch; ``holder`` is None (a store sees
        tokens only). A replayed ``op_id`` and a no-op ``fence`` leave no record. Records of
        rejections may be missing after a power failure; records of installs and accepted
        mutations are as durable as the mutations. Only retained records are returned (the
        ``record_limit`` newest, within ``record_retention``). Needs :attr:`Capability.RECORDS`
        (:class:`ConfigurationError` otherwise).
        """
        check_history(resource, after)
        since = self._clock.wall() - self._options.record_retention
        return self._recording().history(
            resource, after, since=since, keep=self._options.record_limit
        )

    # -- life cycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Close the store; later calls raise :class:`ConfigurationError`. Idempotent."""
        if not self._closed:
            self._closed = True
            self._backend.close()

    # -- the backend, the critical section, records ----------------------------------------

    def _open_backend(self) -> Backend:
        if self._closed:
            raise ConfigurationError(f"the store {self.url} is closed")
        return self._backend

    def _current(self, resource: str, name: str) -> tuple[Publication, BinaryIO]:
        check_publication(resource, name)
        found = self._open_backend().open_current(resource, name)
        if found is None:
            raise NotFound(f"nothing is published as {shown_publication(resource, name)}")
        return found

    def _recording(self) -> RecordingBackend:
        backend = self._open_backend()
        if Capability.RECORDS not in backend.capabilities:
            raise ConfigurationError(f"the store {self.url} does not keep records")
        return cast(RecordingBackend, backend)

    def _again(self, resource: str, attempt: Callable[[], _T]) -> _T:
        """``attempt()`` (one whole mutation), run again while an optimistic backend's commit
        loses a race (:class:`CommitConflict`: nothing was applied), after a random pause that
        doubles up to 0.1 s, for at most ``busy_timeout`` seconds; then Unavailable."""
        deadline = time.monotonic() + self._options.busy_timeout
        pause = 0.002
        while True:
            try:
                return attempt()
            except CommitConflict:
                if time.monotonic() >= deadline:
                    raise Unavailable(
                        f"{resource}: other writers of {self.url} kept changing it for "
                        f"{self._options.busy_timeout:g} s (busy_timeout); nothing was "
                        "changed, retry"
                    ) from None
                time.sleep(random.uniform(pause / 2, pause))
                pause = min(pause * 2, 0.1)

    def _speculates(self, resource: str, key: str | None) -> bool:
        """Whether to try a mutation of ``resource`` (reading ``key``) speculatively first."""
        backend = self._open_backend()
        return FastPath.SPECULATION in backend.fast_paths and cast(
            SpeculatingBackend, backend
        ).knows(resource, key)

    def _write(self, resource: str, intent: Intent, *, due: bool | None = None) -> _Writing:
        """The backend's critical section for a mutation with ``intent``; every
        :data:`_PRUNE_EVERY` th write also prunes expired op records and records in it.

        ``due``: whether this write prunes, if the caller already counted it
        (:meth:`_prune_due`); None counts it here.
        """
        if due is None:
            due = self._prune_due()
        return _Writing(self, self._open_backend().transaction(resource, intent), due)

    def _prune_due(self) -> bool:
        """Count one write; True for every :data:`_PRUNE_EVERY` th (it prunes)."""
        return next(self._writes) % _PRUNE_EVERY == 0

    def _prune(self, tx: Transaction) -> None:
        """Prune expired op records and records in ``tx``."""
        now = self._clock.wall()
        tx.prune_ops(now - self._options.op_retention)
        if Capability.RECORDS in self._backend.capabilities:
            cast(RecordingTransaction, tx).prune_records(
                now - self._options.record_retention, self._options.record_limit
            )

    def _append(
        self,
        tx: Transaction,
        kind: RecordKind,
        token: FencingToken,
        detail: dict[str, object],
        now: float,
    ) -> None:
        """Append a record inside ``tx`` (if the backend keeps records)."""
        if Capability.RECORDS in self._backend.capabilities:
            record = Record(0, now, kind, token.resource, token.epoch, None, detail)
            cast(RecordingTransaction, tx).append_record(record)

    def _rejected(self, token: FencingToken, what: _Mutation, error: Rejected) -> None:
        """Log and record a rejection (after its transaction rolled back). Never raises."""
        reason, floor = _why(error)
        detail: dict[str, object] = {
            "op": what.op,
            **what.target,
            "reason": reason,
            "presented": token.epoch,
            "floor": floor,
        }
        if isinstance(error, ForeignToken):
            detail["bound"] = error.bound
            detail["coordinator"] = token.coordinator_id
        log.warning(
            "%s: rejected %s with epoch %d: %s (floor %s)",
            token.resource,
            what.op,
            token.epoch,
            reason,
            floor if floor is not None else "-",
        )
        backend = self._backend
        if self._closed or Capability.RECORDS not in backend.capabilities:
            return
        record = Record(
            0, self._clock.wall(), RecordKind.REJECTED, token.resource, token.epoch, None, detail
        )
        try:
            cast(RecordingBackend, backend).record_rejection(record)
        except Exception as failure:  # diagnostics: never mask the rejection itself
            log.debug("could not record the rejection on %s: %s", token.resource, failure)

    def _mutate(
        self,
        tx: Transaction,
        token: FencingToken,
        op_id: str | None,
        digest: str,
        now: float,
        decode: Callable[[str], _Outcome],
        change: Callable[[], _Outcome],
        what: _Mutation,
    ) -> _Outcome:
        """Every mutation's steps inside the critical section, in this order.

        1. ``op_id``: a recorded outcome with the same digest is returned, nothing is applied;
           another digest is IdempotencyConflict. 2. Binding and fence (rules.admit_mutation).
        3. ``change()`` applies the operation (and may still refuse). 4. The new floor, the op
        record and the store records (an implicit install; the accepted mutation) are written.
        Any exception leaves the transaction uncommitted. ``what`` learns what happened.
        """
        if op_id is not None:
            retention = self._options.op_retention
            recorded = ops.replay(tx.op(op_id), digest, now=now, retention=retention)
            if recorded is not None:
                what.replayed = True
                return decode(recorded)
        head = tx.head()
        new = rules.admit_mutation(self.mode, head, token)
        outcome = change()
        if new != head:
            tx.set_head(new)
            installed: dict[str, object] = {"op": what.op, "previous": head.floor}
            self._append(tx, RecordKind.INSTALLED, token, installed, now)
            what.installed, what.previous = True, head.floor
        if op_id is not None:
            tx.record_op(op_id, ops.OpRecord(digest, ops.encode_outcome(outcome), now))
        detail = {"op": what.op, **what.target, **_outcome_detail(outcome)}
        if op_id is not None:
            detail["op_id"] = op_id
        self._append(tx, RecordKind.ACCEPTED, token, detail, now)
        return outcome


class _Writing:
    """``Store._write``: the backend's transaction, then (if the block did not raise and this
    write is ``due``) the prune, inside it. A prune that raises rolls the transaction back."""

    __slots__ = ("_due", "_inner", "_store", "_tx")

    def __init__(self, store: Store, inner: AbstractContextManager[Transaction], due: bool) -> None:
        self._store = store
        self._inner = inner
        self._due = due

    def __enter__(self) -> Transaction:
        self._tx = self._inner.__enter__()
        return self._tx

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if error is None and self._due:
            try:
                self._store._prune(self._tx)
            except BaseException as failure:  # the transaction ends with it: rolled back
                if not self._inner.__exit__(type(failure), failure, failure.__traceback__):
                    raise
                return None
        return self._inner.__exit__(kind, error, tb)


@dataclass(slots=True)
class _Mutation:
    """One mutation as records and logs describe it; ``_mutate`` fills in what became of it."""

    op: str
    target: dict[str, object]
    replayed: bool = False
    installed: bool = False
    previous: int | None = None

    def log(self, token: FencingToken) -> None:
        """Log the committed mutation."""
        if self.replayed:
            log.debug("%s: %s with epoch %d replayed", token.resource, self.op, token.epoch)
            return
        if self.installed:
            log.info(
                "%s: installed epoch %d by %s (previous floor %s)",
                token.resource,
                token.epoch,
                self.op,
                self.previous,
            )
        log.debug("%s: accepted %s with epoch %d", token.resource, self.op, token.epoch)


def _why(error: Rejected) -> tuple[str, int | None]:
    """The record's ``reason`` and the floor the rejection was measured against."""
    if isinstance(error, StaleToken):
        return "stale", error.floor
    if isinstance(error, NotInstalled):
        return "not-installed", error.floor
    if isinstance(error, ForeignToken):
        return "foreign", error.floor
    return type(error).__name__, None


def _outcome_detail(outcome: Version | Publication) -> dict[str, object]:
    if isinstance(outcome, Version):
        return {"version": outcome.version}
    return {"object_id": outcome.object_id, "size": outcome.size}


# -- argument checks -----------------------------------------------------------------------
# Each public operation's checks of its arguments, pure (no I/O). Shared with the asyncio face
# (fenced.aio._store), which runs them on the event loop before it hands a call to its worker
# thread: bad input raises the same exception, with the same message, on both faces.


def check_open(
    url: str | object,
    mode: Mode | None,
    *,
    op_retention: float,
    gc_grace: float,
    busy_timeout: float,
    clock: Clock | None,
    record_retention: float,
    record_limit: int,
    options: Mapping[str, object] | None,
    create: bool,
) -> StoreOptions:
    """The checks of :func:`open_store`: its validated options, or ConfigurationError."""
    registry.kind_of(url)  # an unknown scheme is refused before the options are checked
    if options is not None and not isinstance(options, Mapping):
        raise ConfigurationError(f"options must be a mapping, got {type(options).__name__}")
    validated = StoreOptions(
        op_retention=_positive("op_retention", op_retention, allow_zero=False),
        gc_grace=_positive("gc_grace", gc_grace),
        busy_timeout=_positive("busy_timeout", busy_timeout),
        clock=clock if clock is not None else SystemClock(),
        record_retention=_positive("record_retention", record_retention, allow_zero=False),
        record_limit=_count("record_limit", record_limit),
        backend_options=None if options is None else dict(options),
        create=bool(create),
    )
    rules.resolve_mode(None, mode, "open_store")  # reject an unknown mode before any I/O
    return validated


def check_fence(token: object) -> FencingToken:
    """The checks of :meth:`Store.fence`."""
    return _check_token(token)


def check_put(
    token: object, key: object, value: object, op_id: object, if_version: object
) -> tuple[FencingToken, str, bytes, str | None, int | None]:
    """The checks of :meth:`Store.put`: ``(token, key, value as bytes, op_id, if_version)``."""
    checked = _check_token(token)
    key = validate_key(key)
    data = _check_value(value)
    version = _check_if_version(if_version)
    return checked, key, data, None if op_id is None else ops.validate_op_id(op_id), version


def check_publish(
    token: object, name: object, op_id: object
) -> tuple[FencingToken, str, str | None]:
    """The checks of :meth:`Store.publish` but its data's (:class:`Source` checks that)."""
    checked = _check_token(token)
    name = validate_publication_name(name)
    return checked, name, None if op_id is None else ops.validate_op_id(op_id)


def check_get(resource: object, key: object) -> None:
    """The checks of :meth:`Store.get`."""
    validate_resource(resource)
    validate_key(key)


def check_publication(resource: object, name: object) -> None:
    """The checks of :meth:`Store.latest`, :meth:`Store.read` and :meth:`Store.open`."""
    validate_resource(resource)
    validate_publication_name(name)


def check_gc(keep: object, grace: object) -> tuple[int, float | None]:
    """The checks of :meth:`Store.gc`: ``(keep, grace)``, grace None for the store's default."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigurationError(f"keep must be an integer >= 0, got {keep!r}")
    return keep, None if grace is None else _positive("grace", grace)


def check_history(resource: object, after: object) -> None:
    """The checks of :meth:`Store.history`."""
    validate_resource(resource)
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        raise ConfigurationError(f"after must be an integer >= 0, got {after!r}")


def check_rebind(
    resource: object, coordinator_id: object, previous: object, ceiling: object
) -> str:
    """The checks of :meth:`Store.rebind`: the new coordinator id."""
    validate_resource(resource)
    new = validate_coordinator_id(coordinator_id)
    if previous is not None:
        validate_coordinator_id(previous)
    if isinstance(ceiling, bool) or not isinstance(ceiling, int) or ceiling < 0:
        raise ConfigurationError(f"ceiling must be an integer >= 0, got {ceiling!r}")
    return new


def _check_token(token: object) -> FencingToken:
    if not isinstance(token, FencingToken):
        raise ConfigurationError(
            f"expected a fenced.FencingToken, got {type(token).__name__} "
            "(parse text with FencingToken.parse)"
        )
    return token


def _check_value(value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        raise ConfigurationError(f"a value must be bytes, not {type(value).__name__}")
    data = bytes(value)
    if len(data) > MAX_VALUE_BYTES:
        raise ConfigurationError(
            f"a value is at most {MAX_VALUE_BYTES} bytes, got {len(data)}: publish large data"
        )
    return data


def _check_if_version(if_version: object) -> int | None:
    if if_version is None:
        return None
    if (
        isinstance(if_version, bool)
        or not isinstance(if_version, int)
        or not 0 <= if_version <= _MAX_VERSION
    ):
        raise ConfigurationError(
            f"if_version must be None or an integer from 0 to {_MAX_VERSION}, got {if_version!r}"
        )
    return if_version


def _count(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{what} must be an integer >= 1, got {value!r}")
    return value


def _positive(what: str, value: object, *, allow_zero: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{what} must be a finite number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigurationError(f"{what} must be {'>=' if allow_zero else '>'} 0, got {value}")
    return float(value)

"""The narrow contract a store backend implements; :class:`fenced.Store` does the rest.

A backend only stores and retrieves. It makes no decision: validation, op ids, the fencing rules
and the pointer rule live once, above the backends, in :class:`~fenced.fence._store.Store` and
:mod:`fenced.fence._rules`. What a backend must guarantee:

* :meth:`Backend.transaction` is the critical section of one fencing domain (one resource):
  everything read through the :class:`Transaction` is current and stays so until the block ends,
  across threads and processes; the writes made through it become visible and durable together
  when the block ends normally, and not at all when it raises. If the commit itself fails in a
  way that leaves the outcome unknown, it raises :class:`~fenced.OutcomeUnknown`.
* :meth:`Backend.stage` stores an object's bytes under a fresh id *before* any pointer can
  reference it; the object is durable at the latest when the transaction that first points at
  it commits (and before that commit's own change is). An interrupted stage leaves nothing
  that :meth:`Transaction.has_object` sees.
* Reads (:meth:`Backend.head`, :meth:`Backend.get`, :meth:`Backend.pointer`,
  :meth:`Backend.open_current`) see committed state only.
* Driver errors are translated at this boundary (``raise Unavailable(...) from error`` and so on).

**Intent and fast paths.** :meth:`Backend.transaction` receives the mutation's
:class:`Intent`: the key or pointer it will read (a backend may read them together with the
head) and whether to *speculate*. A backend declares the optional paths it offers in
:attr:`Backend.fast_paths` (:class:`FastPath`), and implements the matching protocol:

* :attr:`FastPath.SPECULATION` (:class:`SpeculatingBackend`): a transaction opened with
  ``Intent(speculate=True)`` may answer reads from the domain state this process saw last and
  check that state under the lock at commit; if it changed, the transaction applies nothing
  and raises :class:`SpeculationFailed`. The store then runs the mutation again the ordinary
  way, and only that answer (a rejection, a conflict, a result) is reported and recorded.
* :attr:`FastPath.PUBLISH_SPECULATION` (:class:`PublishSpeculatingBackend`): ``publish`` too
  (its early refusal and its commit) on remembered state.
* :attr:`FastPath.CURRENT_PUT` (:class:`CurrentPutBackend`): the usual put in one call.

**Optimistic backends.** A backend may implement the critical section without a lock: the
transaction reads a version of the domain, and its commit is one conditional write against that
version. If the version changed, the commit applies nothing and raises :class:`CommitConflict`;
the store then decides the whole mutation again on fresh state (so every decision is still made
on state that was current when it committed).

A backend with :attr:`Capability.RECORDS` also implements :class:`RecordingBackend` (and its
transactions :class:`RecordingTransaction`): the store's diagnostic records (docs/stores.md,
Records). Installs and accepted mutations are appended inside the mutation's own transaction
(durable with it, no extra sync); a rejection is appended afterwards by a cheap, non-durable append
(:meth:`RecordingBackend.record_rejection`). Records are diagnostics: they are never read by a
decision, and a rejected mutation changes no data even though it leaves a record.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from fenced.core._clock import Clock
from fenced.core._records import Record
from fenced.core._token import FencingToken
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head, StoredObject
from fenced.fence._values import Item, Mode, Publication, Version

__all__ = [
    "DEFAULT_RECORD_LIMIT",
    "DEFAULT_RECORD_RETENTION",
    "ORDINARY",
    "Backend",
    "Capability",
    "Chooser",
    "CommitConflict",
    "CurrentPutBackend",
    "FastPath",
    "Intent",
    "PublishSpeculatingBackend",
    "RecordingBackend",
    "RecordingTransaction",
    "SpeculatingBackend",
    "SpeculationFailed",
    "StoreOptions",
    "Transaction",
]

DEFAULT_RECORD_RETENTION = 30 * 24 * 3600.0
"""Seconds a store keeps its records (30 days)."""
DEFAULT_RECORD_LIMIT = 10_000
"""Records a store keeps per resource (the newest)."""


@dataclass(frozen=True, slots=True)
class StoreOptions:
    """The validated options of ``open_store`` (see its docstring)."""

    op_retention: float
    gc_grace: float
    busy_timeout: float
    clock: Clock
    record_retention: float = DEFAULT_RECORD_RETENTION
    """Seconds records are kept (pruned now and then, inside later write transactions)."""
    record_limit: int = DEFAULT_RECORD_LIMIT
    """Records kept per resource: older ones are pruned now and then."""
    backend_options: Mapping[str, object] | None = None
    """A store given as a pool or an engine instead of a URL: the parameters a URL would carry
    in its query (``schema``, ``timeout``, …); None for a URL."""
    create: bool = True
    """False: open an existing local store only (``sqlite:``, ``file:``): a missing one is a
    :class:`~fenced.ConfigurationError` naming it, and nothing is created."""


class Capability(enum.StrEnum):
    """What a store can do; the conformance suite has one test class per capability."""

    KEYS = "keys"
    """put / get with ``if_version``."""
    PUBLICATION = "publication"
    """publish / latest / read / open / gc."""
    OP_IDS = "op_ids"
    """Operation ids with recorded outcomes."""
    MULTI_PROCESS = "multi_process"
    """Many processes may open the same store at once."""
    LOCAL_FILES = "local_files"
    """The store lives under one local path and writes nothing outside it."""
    RECORDS = "records"
    """Records of installs, accepted and rejected mutations (``history``); ``floors``.

    The backend implements :class:`RecordingBackend`."""


class FastPath(enum.StrEnum):
    """An optional way a backend can run a mutation faster, with the same outcome.

    Internal to the store (not a :class:`Capability`: a user sees no difference)."""

    SPECULATION = "speculation"
    """Mutations decided on remembered state, checked under the lock.

    The backend implements :class:`SpeculatingBackend`."""
    PUBLISH_SPECULATION = "publish_speculation"
    """Also ``publish`` decided on remembered state (its pointer, op id and object checks
    included), and its early refusal too (:class:`PublishSpeculatingBackend`)."""
    CURRENT_PUT = "current_put"
    """An unconditional put by the installed holder in one call (:class:`CurrentPutBackend`)."""


@dataclass(frozen=True, slots=True)
class Intent:
    """What one mutation will do inside :meth:`Backend.transaction`, announced when it opens.

    A backend may use it to read ahead; it never changes what the transaction's reads return.
    """

    key: str | None = None
    """The key whose version the mutation reads (``put``)."""
    pointer: str | None = None
    """The publication name whose pointer the mutation reads (``publish``)."""
    speculate: bool = False
    """Run speculatively (only on a backend with :attr:`FastPath.SPECULATION`)."""


ORDINARY = Intent()
"""The intent of a mutation that announces nothing and does not speculate."""


class SpeculationFailed(Exception):
    """The state a speculative transaction was decided on has changed: nothing was applied.

    Raised only by a transaction opened with ``Intent(speculate=True)``; the store runs the
    mutation again the ordinary way.
    """


class CommitConflict(SpeculationFailed):
    """An optimistic backend's transaction lost the race to commit: nothing was applied.

    A backend without a lock (``s3://``: each commit is one conditional write against the
    version it read) raises it when that version changed before its commit, from any
    transaction, speculative or not. The store runs the whole mutation again on fresh state,
    with a short random pause, until ``busy_timeout``; then :class:`~fenced.Unavailable`.
    """


Chooser = Callable[[list[StoredObject], set[str]], list[str]]
"""Given one resource's objects and current pointer targets, the ids gc may delete."""


class Transaction(Protocol):
    """The critical section of one resource (see the module docstring)."""

    def head(self) -> Head:
        """The domain's binding and floor."""
        ...

    def set_head(self, head: Head) -> None:
        """Replace the domain's binding and floor."""
        ...

    def op(self, op_id: str) -> OpRecord | None:
        """The record of ``op_id`` in this resource, if any."""
        ...

    def record_op(self, op_id: str, record: OpRecord) -> None:
        """Record (or replace) the outcome of ``op_id``."""
        ...

    def prune_ops(self, before: float) -> None:
        """Delete this resource's op records recorded before ``before`` (wall time)."""
        ...

    def version_of(self, key: str) -> int | None:
        """The current version of ``key``, None if it does not exist."""
        ...

    def put_item(self, item: Item) -> None:
        """Write ``item`` (insert or replace)."""
        ...

    def pointer(self, name: str) -> Publication | None:
        """The current publication of ``name``."""
        ...

    def has_object(self, object_id: str) -> bool:
        """Whether ``object_id`` was staged completely for this resource and still exists."""
        ...

    def set_pointer(self, publication: Publication, now: float) -> None:
        """Point ``publication.name`` at ``publication``; the previous target is superseded now."""
        ...


class Backend(Protocol):
    """Storage for many fencing domains; chosen by URL scheme (see ``open_store``)."""

    url: str
    mode: Mode
    capabilities: frozenset[Capability]
    fast_paths: frozenset[FastPath]

    def transaction(
        self, resource: str, intent: Intent = ORDINARY
    ) -> AbstractContextManager[Transaction]:
        """The critical section of ``resource`` for a mutation with ``intent``.

        See the module docstring; :class:`SpeculationFailed` only if ``intent.speculate``.
        """
        ...

    def head(self, resource: str) -> Head:
        """The committed binding and floor of ``resource``."""
        ...

    def get(self, resource: str, key: str) -> Item | None:
        """The committed item, or None."""
        ...

    def pointer(self, resource: str, name: str) -> Publication | None:
        """The committed publication of ``(resource, name)``, or None."""
        ...

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        """Store the concatenated ``chunks`` as object ``object_id`` of ``resource``."""
        ...

    def discard(self, resource: str, object_id: str) -> None:
        """Delete an object that no pointer references (best effort)."""
        ...

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        """The current publication and a stream of its bytes, from one consistent snapshot.

        The stream keeps reading that object even if a newer one is published meanwhile, at
        least until the gc grace period after it was superseded has passed.
        """
        ...

    def gc(self, choose: Chooser, cutoff: float) -> int:
        """Delete, per resource and inside its critical section, the objects ``choose`` picks.

        Also removes the backend's own debris (temporary files of interrupted writes) last
        touched before ``cutoff`` (wall time). Returns the number of objects deleted.
        """
        ...

    def close(self) -> None:
        """Release connections and file handles. Idempotent."""
        ...


class RecordingTransaction(Transaction, Protocol):
    """The transaction of a backend with :attr:`Capability.RECORDS`."""

    def append_record(self, record: Record) -> None:
        """Append ``record`` (its ``seq`` is ignored: the backend numbers it) to this resource.

        Written, and durable, together with the transaction's other writes, or not at all.
        """
        ...

    def prune_records(self, before: float, keep: int) -> None:
        """Drop this resource's records dated before ``before`` and all but the ``keep`` newest.

        May be deferred (done at a cheaper moment of a later transaction); never drops records
        newer than both limits.
        """
        ...


class RecordingBackend(Backend, Protocol):
    """A store backend with :attr:`Capability.RECORDS` (see the module docstring)."""

    def transaction(
        self, resource: str, intent: Intent = ORDINARY
    ) -> AbstractContextManager[RecordingTransaction]:
        """The critical section of ``resource``; its transaction can append records."""
        ...

    def record_rejection(self, record: Record) -> None:
        """Append a record of a rejected mutation, outside any mutation's transaction.

        Cheap and not durable by itself (no fsync of its own): it may be lost by a power
        failure, never by a process crash once this returned. Changes nothing but the records.
        Raises :class:`~fenced.Unavailable` / :class:`~fenced.ConfigurationError` on failure;
        the caller treats that as "not recorded".
        """
        ...

    def history(self, resource: str, after: int, *, since: float, keep: int) -> list[Record]:
        """The retained records of ``resource`` with ``seq > after``, in ``seq`` order.

        Retained: dated ``since`` or later and among the ``keep`` newest of the resource
        (whether or not older ones were pruned yet). ``seq`` increases with every record of the
        resource (it is per store for some backends, per resource for others: compare seqs of
        one resource only).
        """
        ...

    def floors(self) -> dict[str, int]:
        """Every resource that has a floor, with its floor (committed state)."""
        ...


class SpeculatingBackend(Backend, Protocol):
    """A store backend with :attr:`FastPath.SPECULATION` (see the module docstring)."""

    def knows(self, resource: str, key: str | None) -> bool:
        """Whether a speculative mutation of ``resource`` (reading ``key``) is worth trying.

        A hint: a speculative transaction still checks what it assumed.
        """
        ...


class PublishSpeculatingBackend(SpeculatingBackend, Protocol):
    """A store backend with :attr:`FastPath.PUBLISH_SPECULATION` (and SPECULATION)."""

    def remembered_head(self, resource: str) -> Head | None:
        """The head of ``resource`` as this process saw it last; None if it remembers none.

        A hint: the store only uses it to refuse a doomed publish before staging, and confirms
        a refusal on committed state.
        """
        ...


class CurrentPutBackend(Backend, Protocol):
    """A store backend with :attr:`FastPath.CURRENT_PUT`."""

    def put_current(
        self, token: FencingToken, key: str, value: bytes, detail: dict[str, object], now: float
    ) -> Version | None:
        """An unconditional ``put`` whose token changes nothing but the item; else None.

        The store calls it for a put without ``op_id`` or ``if_version`` (and not due to
        prune) on a backend with :attr:`Capability.RECORDS`. It applies the same rule
        (:func:`~fenced.fence._rules.admit_mutation`), writes the item and its ``accepted``
        record (``detail`` plus the new ``version``) in one durable transaction. When the token
        would change the head (an implicit install) or is refused, it writes nothing and
        returns None: the store takes the general path, which installs or rejects and records
        it.
        """
        ...

"""The seeded defects of ``fenced verify --mutants``, each built by verify at a seam of fenced.

The library has no switch for any of them, and nothing in it can build one: a verify worker
builds its coordinator and its stores through :func:`coordinator_backend`, :func:`coordinator`
and :func:`store`, which put the defects its configuration names (:func:`chosen`, from the
``mutants`` verify writes into a worker's configuration) where each one lives, as a variant
that only this module defines. What each defect breaks, the fault profile that exposes it and
the invariants expected to catch it are in the catalogue, :mod:`fenced.verify._mutants`.

* **The coordinator client** (every coordinator): :class:`SeededCoordinator` is a
  :class:`~fenced.Coordinator` whose ``acquire`` and ``renew`` — what ``hold()`` and its lease
  keeper call — count the local deadline from the reply instead of the send
  (``deadline-from-reply``), or whose ``renew`` answers any failure with the lease extended
  from the send, as if the renewal had succeeded (``renewal-failure-ignored``), or whose
  ``acquire`` never leaves the queue: a waiter that gives up (its wait ran out, or an error
  ended it) keeps its place until the backend drops it (``waiter-keeps-place``).
* **The embedded coordinator**: :class:`SeededSQLiteBackend` runs variants of the grant,
  release and renew statements that
  :class:`~fenced.coordinator.backends.sqlite._backend.SQLiteBackend` names as class
  attributes, each the correct statement with one clause changed (``epoch-reuse``,
  ``release-without-owner``, ``renew-revives-expired``). A statement that no longer has that
  clause exactly once is a :class:`ValueError` when the backend is built, never the correct
  program run under the defect's name.
* **PostgreSQL** (:mod:`fenced.verify._seeded_postgres`, loaded only for a ``postgresql:``
  coordinator): the ``renew`` and ``try_grant`` functions of the coordinator's schema, each
  with one clause changed, created as session-local functions (``pg_temp``: the schema, which
  other clients use, is never altered) and called instead of the schema's
  (``renew-revives-expired``, ``pg-grant-read-committed``).
* **etcd** (:mod:`fenced.verify._seeded_etcd`, loaded only for an ``etcd:`` coordinator): the
  grant transaction without its compare of the resource state's revision
  (``etcd-grant-no-revision-compare``).
* **Stores** (every store kind): :class:`SeededStore` is a :class:`~fenced.Store` over a backend
  whose transactions lie to the put or publish in flight, whose token it knows: the floor reads
  as the token's own epoch, so any epoch passes, and the floor is raised as the accepted
  mutation would raise it (``no-fence-check``); a publish reads the floor as its own epoch and
  no current pointer (``publish-no-token-check``); the op-id lookup runs the fence check first
  (``dedup-after-fence``). It declines the backend's fast paths, so that every mutation meets
  its transaction (a fast path never changes an outcome). With ``floor-after-write`` a mutation's
  transaction writes without installing anything, and the writer's epoch is installed
  :data:`FLOOR_WINDOW` after its commit, in a transaction of its own, as ``fence`` installs one
  (refused, StaleToken, below a newer floor: the write has landed all the same).
* **The file store** (``check-then-write``): the same backend runs the file store's critical
  section — load, decide, commit: the pieces the file store's gc also composes — without the
  resource's lock, so that check and write are separate steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, cast

from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import open_backend
from fenced.coordinator.backend import CoordinatorBackend, Granted, Ticket
from fenced.coordinator.backends.sqlite._backend import SQLiteBackend
from fenced.coordinator.backends.sqlite._statements import _LIVE, _LOST_RESERVATION, _MINIMUM
from fenced.core._clock import Clock, HostClock, SystemClock
from fenced.core._lease import Lease
from fenced.core._token import FencingToken
from fenced.core._urls import scheme_of
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head, admit_fence, admit_mutation
from fenced.fence._source import PublishData
from fenced.fence._store import Store
from fenced.fence._values import Item, Mode, Publication, Version
from fenced.fence.backend import ORDINARY, Backend, FastPath, Intent, Transaction
from fenced.fence.file._files import translated
from fenced.fence.file._layout import resource_digest
from fenced.fence.file._store import FileBackend
from fenced.fence.file._transaction import FileTransaction

__all__ = [
    "CHECK_THEN_WRITE",
    "DEADLINE_FROM_REPLY",
    "DEDUP_AFTER_FENCE",
    "DEFECTS",
    "EPOCH_REUSE",
    "ETCD_GRANT_NO_REVISION_COMPARE",
    "FLOOR_AFTER_WRITE",
    "FLOOR_WINDOW",
    "NO_FENCE_CHECK",
    "PG_GRANT_READ_COMMITTED",
    "PUBLISH_NO_TOKEN_CHECK",
    "RELEASE_WITHOUT_OWNER",
    "RENEWAL_FAILURE_IGNORED",
    "RENEW_REVIVES_EXPIRED",
    "STORE_DEFECTS",
    "WAITER_KEEPS_PLACE",
    "SeededCoordinator",
    "SeededSQLiteBackend",
    "SeededStore",
    "chosen",
    "coordinator",
    "coordinator_backend",
    "store",
]

NO_FENCE_CHECK = "no-fence-check"
CHECK_THEN_WRITE = "check-then-write"
DEADLINE_FROM_REPLY = "deadline-from-reply"
RENEWAL_FAILURE_IGNORED = "renewal-failure-ignored"
RELEASE_WITHOUT_OWNER = "release-without-owner"
EPOCH_REUSE = "epoch-reuse"
DEDUP_AFTER_FENCE = "dedup-after-fence"
PUBLISH_NO_TOKEN_CHECK = "publish-no-token-check"  # noqa: S105 - a name, not a secret
FLOOR_AFTER_WRITE = "floor-after-write"
RENEW_REVIVES_EXPIRED = "renew-revives-expired"
ETCD_GRANT_NO_REVISION_COMPARE = "etcd-grant-no-revision-compare"
PG_GRANT_READ_COMMITTED = "pg-grant-read-committed"
WAITER_KEEPS_PLACE = "waiter-keeps-place"

_CLIENT = frozenset({DEADLINE_FROM_REPLY, RENEWAL_FAILURE_IGNORED, WAITER_KEEPS_PLACE})
_SQLITE = frozenset({RELEASE_WITHOUT_OWNER, EPOCH_REUSE, RENEW_REVIVES_EXPIRED})
_POSTGRES = frozenset({RENEW_REVIVES_EXPIRED, PG_GRANT_READ_COMMITTED})
_ETCD = frozenset({ETCD_GRANT_NO_REVISION_COMPARE})
_STORE = frozenset(
    {NO_FENCE_CHECK, CHECK_THEN_WRITE, DEDUP_AFTER_FENCE, PUBLISH_NO_TOKEN_CHECK, FLOOR_AFTER_WRITE}
)
STORE_DEFECTS = _STORE
"""The defects seeded in a worker's store (never in a store served over HTTP: its backend runs
in the ``fenced serve`` process)."""
DEFECTS = _CLIENT | _SQLITE | _POSTGRES | _ETCD | _STORE
"""Every seeded defect this module can build."""


def chosen(names: Iterable[str]) -> frozenset[str]:
    """The defects ``names`` (blank names ignored); an unknown one is a :class:`ValueError`, so
    that a typo cannot make a mutant run silently as the correct program."""
    picked = frozenset(name.strip() for name in names if name.strip())
    unknown = picked - DEFECTS
    if unknown:
        raise ValueError(f"unknown mutant(s): {', '.join(sorted(unknown))}")
    return picked


# -- the coordinator ----------------------------------------------------------------------------


def coordinator_backend(url: str, defects: frozenset[str]) -> CoordinatorBackend:
    """The backend of ``url`` (as :func:`fenced.connect` opens it), with the chosen defects of
    that coordinator backend (the embedded one, PostgreSQL, etcd), if any."""
    scheme = scheme_of(url)
    if scheme in ("postgresql", "postgres") and defects & _POSTGRES:
        from fenced.verify._seeded_postgres import SeededPostgresBackend  # noqa: PLC0415

        return SeededPostgresBackend(url, defects & _POSTGRES)
    if scheme in ("etcd", "etcds") and defects & _ETCD:
        from fenced.verify._seeded_etcd import SeededEtcdBackend  # noqa: PLC0415

        return SeededEtcdBackend(url, defects & _ETCD)
    opened = open_backend(url)
    seeded = defects & _SQLITE
    if not seeded or not isinstance(opened, SQLiteBackend):
        return opened
    opened.close()
    return SeededSQLiteBackend(opened.path, seeded)


def coordinator(backend: CoordinatorBackend, defects: frozenset[str]) -> Coordinator:
    """A :class:`~fenced.Coordinator` over ``backend``, with the chosen client defects."""
    seeded = defects & _CLIENT
    return SeededCoordinator(backend, seeded) if seeded else Coordinator(backend)


class SeededCoordinator(Coordinator):
    """A Coordinator with ``deadline-from-reply``, ``renewal-failure-ignored`` and/or
    ``waiter-keeps-place``.

    ``hold()`` acquires through :meth:`acquire` and its lease keeper renews through
    :meth:`renew`, so these defects reach the holder as the correct code would have. With
    ``waiter-keeps-place`` the backend is seen through :class:`_StaysInLine`: ``acquire``'s
    leave (when its wait ran out, or an error ended it) does nothing.
    """

    def __init__(
        self, backend: CoordinatorBackend, defects: frozenset[str], clock: Clock | None = None
    ) -> None:
        self._time: Clock = clock or SystemClock()
        if WAITER_KEEPS_PLACE in defects:
            backend = cast(CoordinatorBackend, _StaysInLine(backend))
        super().__init__(backend, clock=self._time)
        self._defects = defects

    def acquire(self, *args: Any, **kwargs: Any) -> Lease:
        lease = super().acquire(*args, **kwargs)
        return self._from_reply(lease)

    def renew(self, lease: Lease) -> Lease:
        sent = self._time.now()
        try:
            renewed = super().renew(lease)
        except Exception:
            if RENEWAL_FAILURE_IGNORED not in self._defects:
                raise
            # the lease as if this renewal had succeeded: extended from its send
            return dataclasses.replace(lease, deadline=sent + lease.ttl - lease.safety_margin)
        return self._from_reply(renewed)

    def _from_reply(self, lease: Lease) -> Lease:
        """With ``deadline-from-reply``: ``lease`` with its deadline counted from now, the time
        its reply arrived, instead of from the send of its request."""
        if DEADLINE_FROM_REPLY not in self._defects:
            return lease
        lifetime = min(lease.ttl, lease.expires_in)
        return dataclasses.replace(
            lease, deadline=self._time.now() + lifetime - lease.safety_margin
        )


class _StaysInLine:
    """``waiter-keeps-place``: ``inner`` as the Coordinator sees it, whose ``leave`` does
    nothing. An acquire that gives up keeps its place in line: the waiters behind it wait until
    the backend drops it (its keep-alive lapses; etcd keeps it while the process lives), and a
    lease a release handed to it is neither taken nor passed on."""

    def __init__(self, inner: CoordinatorBackend) -> None:
        self._inner = inner

    def leave(self, ticket: Ticket, take: bool = False) -> Granted | None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _one_clause_changed(statement: str, clause: str, replacement: str) -> str:
    """``statement`` with its one ``clause`` replaced by ``replacement``.

    A statement without exactly one such clause (it was rewritten) is a ValueError: the defect
    has to be written again, it must not run as the correct statement.
    """
    if statement.count(clause) != 1:
        raise ValueError(f"a seeded defect expects {clause!r} exactly once in: {statement}")
    return statement.replace(clause, replacement)


_NEXT_EPOCH = f"max(epoch, {_MINIMUM}, {_LOST_RESERVATION}) + 1"


class SeededSQLiteBackend(SQLiteBackend):
    """The embedded coordinator with ``epoch-reuse``, ``release-without-owner`` and/or
    ``renew-revives-expired``.

    ``epoch-reuse``: a grant after a lease that was not released (it expired: a crashed or
    paused holder; or a restore ended it) keeps the last epoch instead of max(last, minimum) + 1,
    in both grant statements. ``release-without-owner``: the release statement without its
    compare of epoch and owner, so that a release ends whatever lease is live.
    ``renew-revives-expired``: the renew statement without its "still live" condition: a
    renewal that arrives after the lease expired (nobody took the resource since) sets it to
    expire ttl after that arrival, as if it had never lapsed.
    """

    def __init__(
        self, path: str | Path, defects: frozenset[str], *, host_clock: HostClock | None = None
    ) -> None:
        super().__init__(path, host_clock=host_clock)
        if EPOCH_REUSE in defects:
            keeps = f"epoch = iif(resources.ended IS 'released', {_NEXT_EPOCH}, epoch),"
            sets = f"epoch = {_NEXT_EPOCH},"
            self._grant_known_sql = _one_clause_changed(self._grant_known_sql, sets, keeps)
            self._grant_sql = _one_clause_changed(self._grant_sql, sets, keeps)
        if RELEASE_WITHOUT_OWNER in defects:
            compare = "epoch = :epoch AND owner = :owner AND "
            self._release_sql = _one_clause_changed(self._release_sql, compare, "")
        if RENEW_REVIVES_EXPIRED in defects:
            self._renew_sql = _one_clause_changed(self._renew_sql, f" AND {_LIVE}", "")


# -- stores -------------------------------------------------------------------------------------


def store(opened: Store, defects: frozenset[str]) -> Store:
    """``opened``, or a :class:`SeededStore` over its backend if a chosen defect applies to it
    (``check-then-write`` only to a file store)."""
    seeded = defects & _STORE
    if not hasattr(opened, "_backend"):  # served over HTTP: the backend is the server's
        return opened
    if not isinstance(opened._backend, FileBackend):
        seeded -= {CHECK_THEN_WRITE}
    return SeededStore(opened, seeded) if seeded else opened


class SeededStore(Store):
    """A Store whose backend lies to each put and publish (see the module docstring).

    Built from an opened store (its backend and options; the original is not used again).
    Serves one thread at a time, as a verify worker uses its stores: the token of the mutation
    in flight is held by the backend for the duration of each :meth:`put` and :meth:`publish`.
    """

    def __init__(self, opened: Store, defects: frozenset[str]) -> None:
        self._lies = _LyingBackend(opened._backend, defects)
        super().__init__(cast(Backend, self._lies), opened._options)

    def in_window(self, call: Callable[[], None]) -> bool:
        """With ``floor-after-write``: run ``call`` in the window between a mutation's commit
        and its install, after the window's own round trip; returns whether that defect is
        seeded here (``False``: ``call`` is never run)."""
        return self._lies.in_window(call)

    def put(
        self,
        token: FencingToken,
        key: str,
        value: bytes | bytearray | memoryview,
        *,
        op_id: str | None = None,
        if_version: int | None = None,
    ) -> Version:
        with self._lies.presenting(token):
            return super().put(token, key, value, op_id=op_id, if_version=if_version)

    def publish(
        self, token: FencingToken, data: PublishData, *, name: str = "", op_id: str | None = None
    ) -> Publication:
        with self._lies.presenting(token):
            return super().publish(token, data, name=name, op_id=op_id)


FLOOR_WINDOW = 0.02
"""``floor-after-write``: seconds from the write's commit to the transaction that installs the
writer's epoch (the second transaction's round trip)."""


def _between_the_transactions() -> None:
    """``floor-after-write``: the window between the write's commit and the install."""
    time.sleep(FLOOR_WINDOW)


class _LyingBackend:
    """The store backend contract over ``inner``: transactions as the seeded defects see them."""

    fast_paths: frozenset[FastPath] = frozenset()

    def __init__(self, inner: Backend, defects: frozenset[str]) -> None:
        self._inner = inner
        self._defects = defects
        self._presented: FencingToken | None = None
        self._window_call: Callable[[], None] | None = None

    def in_window(self, call: Callable[[], None]) -> bool:
        """See :meth:`SeededStore.in_window`."""
        if FLOOR_AFTER_WRITE not in self._defects:
            return False
        self._window_call = call
        return True

    @contextlib.contextmanager
    def presenting(self, token: FencingToken) -> Iterator[None]:
        """``token`` is the token of the mutation run inside the block."""
        self._presented = token
        try:
            yield
        finally:
            self._presented = None

    @contextlib.contextmanager
    def transaction(self, resource: str, intent: Intent = ORDINARY) -> Iterator[Transaction]:
        opened = (
            _unlocked(self._inner, resource)
            if CHECK_THEN_WRITE in self._defects and isinstance(self._inner, FileBackend)
            else self._inner.transaction(resource, intent)
        )
        lying = None
        with opened as tx:
            token = self._presented
            if token is None or (intent.key is None and intent.pointer is None):
                yield tx  # a fence (or no mutation of a SeededStore): the truth
            else:
                mode = self._inner.mode
                lying = _LyingTransaction(
                    tx, token, intent.pointer is not None, mode, self._defects
                )
                yield cast(Transaction, lying)
        if lying is not None and lying.wrote and FLOOR_AFTER_WRITE in self._defects:
            # The write has committed; now the writer's epoch is installed, as fence() installs
            # one, in a transaction of its own: a newer epoch installed in between (a successor's
            # fence queued behind the write) refuses it, and the put or publish raises StaleToken
            # although its write landed; a stale writer may have slipped in too.
            _between_the_transactions()
            if self._window_call is not None:
                self._window_call()
            with self._inner.transaction(resource) as floor_tx:
                head = floor_tx.head()
                installed = admit_fence(head, lying.token)
                if installed != head:
                    floor_tx.set_head(installed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _unlocked(files: FileBackend, resource: str) -> Iterator[FileTransaction]:
    """``check-then-write``: the file store's critical section without the resource's lock."""
    rdir = f"{files.root}/resources/{resource_digest(resource)}"
    with translated(f"writing {resource!r}"):
        tx = FileTransaction(rdir, files.load(rdir, resource), resource)
        yield tx
        if tx.dirty:
            files.commit(tx)


class _LyingTransaction:
    """The transaction of one put or publish with ``token``, falsified by the seeded defects;
    every other call goes to the backend's transaction."""

    def __init__(
        self,
        inner: Transaction,
        token: FencingToken,
        publishing: bool,
        mode: Mode,
        defects: frozenset[str],
    ) -> None:
        self._inner = inner
        self.token = token
        self._publishing = publishing
        self._mode = mode
        self._defects = defects
        self.wrote = False
        """The mutation was applied (not refused, not replayed from its op id)."""

    def head(self) -> Head:
        real = self._inner.head()
        token = self.token
        if NO_FENCE_CHECK in self._defects:
            # Any epoch passes; the floor still rises to the largest epoch accepted.
            raised = Head(token.coordinator_id, max(real.floor or 0, token.epoch))
            if raised != real:
                self._inner.set_head(raised)
            return Head(token.coordinator_id, token.epoch)
        if PUBLISH_NO_TOKEN_CHECK in self._defects and self._publishing:
            return Head(real.coordinator_id, token.epoch)  # passes and changes nothing
        return real

    def pointer(self, name: str) -> Publication | None:
        if PUBLISH_NO_TOKEN_CHECK in self._defects and self._publishing:
            return None  # no pointer epoch to check the token against
        return self._inner.pointer(name)

    def set_head(self, head: Head) -> None:
        if FLOOR_AFTER_WRITE not in self._defects:  # else installed after the commit
            self._inner.set_head(head)

    def put_item(self, item: Item) -> None:
        self.wrote = True
        self._inner.put_item(item)

    def set_pointer(self, publication: Publication, now: float) -> None:
        self.wrote = True
        self._inner.set_pointer(publication, now)

    def op(self, op_id: str) -> OpRecord | None:
        if DEDUP_AFTER_FENCE in self._defects:
            admit_mutation(self._mode, self.head(), self.token)  # the fence check comes first
        return self._inner.op(op_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

"""Records (``P/log/NAME:N``), the listing of resources, and restore (:meth:`advance`).

:func:`records_ops` builds the puts of a transaction's records, numbered by each resource's own
counter in ``P/res/NAME`` (compared in the same transaction, so two changes never write one
record key), pruning each resource's records beyond :data:`RECORDS_KEPT`. Reading records first
records the expiries nobody recorded yet (:func:`settle_txn`); reads are paged
(:class:`RecordPages`) and never split one transaction's records. These builders and readers
are the decisions both faces send (the sync :class:`_Records` here, the asyncio backend in
:mod:`._aio`): only the sending differs. :meth:`advance` raises epochs to their floors, then
in one transaction raises the minimum epoch and deletes every live lease key, and records the
restore of every resource. Contention beyond a bounded number of attempts raises
:class:`~fenced.Unavailable`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from fenced.coordinator.backends.etcd import _rpc as rpc
from fenced.coordinator.backends.etcd._base import _MAX_ATTEMPTS
from fenced.coordinator.backends.etcd._client import KV, Event
from fenced.coordinator.backends.etcd._keys import (
    SEQ_PER_REVISION,
    Keys,
    ResourceState,
    prefix_end,
    records_from,
    records_value,
)
from fenced.coordinator.backends.etcd._leasepool import _LeasePool
from fenced.coordinator.backends.etcd._ops import (
    _cmp,
    _delete,
    _first,
    _get,
    _int_value,
    _kvs,
    _Op,
    _put,
)
from fenced.coordinator.backends.etcd._watch import WatchStream
from fenced.core._errors import Unavailable
from fenced.core._names import validate_resource
from fenced.core._records import Record, RecordKind

RECORDS_KEPT = 10_000
"""Record keys (recorded changes) kept per resource; the oldest are pruned every
:data:`_PRUNE_EVERY` of them."""
_PRUNE_EVERY = 1000
_RESTORE_CHUNK = 50  # resources per advance transaction (etcd's --max-txn-ops is 128)
_SETTLE_CHUNK = 40  # expiries recorded per transaction
_PAGE = 500  # keys per read of records or resources

_Item = tuple[RecordKind, str, int, str | None, dict[str, object]]
"""A record to write: kind, resource, epoch, holder, detail."""


def _restored(
    states: list[tuple[str, ResourceState]], minimum: int, detail: dict[str, object]
) -> list[_Item]:
    """The ``restored`` records of these resources after ``advance`` raised the minimum."""
    return [
        (RecordKind.RESTORED, name, max(state.epoch, minimum), None, detail)
        for name, state in states
    ]


def records_ops(
    keys: Keys, items: list[_Item], numbers: dict[str, int], at: float | None = None
) -> tuple[list[_Op], dict[str, int]]:
    """Puts of the records ``items`` of one transaction: one key per resource, numbered after
    the resource's last record key in ``numbers``; the raised numbers (to be written in the
    same transaction, with each resource's ``P/res/NAME`` compared). A resource whose number
    crosses a multiple of :data:`_PRUNE_EVERY` also loses its record keys older than the newest
    :data:`RECORDS_KEPT`. The records' time is ``at`` (default: now; :data:`STAMP_LATER`: see
    :func:`stamped`)."""
    if len(items) > SEQ_PER_REVISION:
        raise ValueError(f"{len(items)} records in one transaction")
    at = time.time() if at is None else at
    grouped: dict[str, list[tuple[int, Record]]] = {}
    for index, (kind, resource, epoch, holder, detail) in enumerate(items):
        record = Record(0, at, kind, resource, epoch, holder, detail)
        grouped.setdefault(resource, []).append((index, record))
    raised = dict(numbers)
    ops: list[_Op] = []
    for resource, records in grouped.items():
        raised[resource] += 1
        ops.append(_put(keys.record(resource, raised[resource]), records_value(records)))
    for resource, new in raised.items():
        if new // _PRUNE_EVERY > numbers[resource] // _PRUNE_EVERY and new > RECORDS_KEPT:
            ops.append(
                _delete(keys.record(resource, 0), keys.record(resource, new - RECORDS_KEPT + 1))
            )
    return ops, raised


def resource_records(
    keys: Keys, resource: str, number: int, items: list[_Item], at: float | None = None
) -> tuple[list[_Op], int]:
    """:func:`records_ops` for records of one resource whose last number is ``number``."""
    ops, raised = records_ops(keys, items, {resource: number}, at)
    return ops, raised[resource]


def settle_reads(keys: Keys, resource: str | None) -> list[_Op]:
    """What :func:`settle_txn` reads: the states and the live lease keys (of one resource,
    or of all)."""
    if resource is None:
        return [
            _get(keys.res_prefix, prefix_end(keys.res_prefix)),
            _get(keys.lease_prefix, prefix_end(keys.lease_prefix), keys_only=True),
        ]
    return [_get(keys.res(resource)), _get(keys.lease(resource), keys_only=True)]


@dataclass(frozen=True, slots=True)
class _Settle:
    """The transaction that records expiries nobody recorded yet (:func:`settle_txn`)."""

    request: rpc.TxnRequest
    expired: dict[str, ResourceState]  # the states it writes
    more: bool  # more expiries than one transaction records: settle again after it


def settle_txn(keys: Keys, responses: list[rpc.ResponseOp]) -> _Settle | None:
    """What :func:`settle_reads` found: the transaction that records the expiries of leases
    whose state is still ``held`` but whose lease key is gone (at most :data:`_SETTLE_CHUNK`),
    each compared unchanged; None if there are none."""
    live = {kv.key for kv in _kvs(responses[1])}
    ended: list[tuple[str, KV, ResourceState]] = []
    for kv in _kvs(responses[0]):
        name = keys.name_of(kv.key, keys.res_prefix)
        state = ResourceState.decode(kv.value)
        if state.state == "held" and keys.lease(name) not in live:
            ended.append((name, kv, state))
    if not ended:
        return None
    chunk = ended[:_SETTLE_CHUNK]
    record_ops, numbers = records_ops(
        keys,
        [(RecordKind.EXPIRED, name, state.epoch, state.holder, {}) for name, _, state in chunk],
        {name: state.last_record for name, _, state in chunk},
    )
    compare: list[rpc.Compare] = []
    success = list(record_ops)
    expired: dict[str, ResourceState] = {}
    for name, kv, state in chunk:
        expired[name] = ResourceState(state.epoch, "expired", state.holder, numbers[name])
        compare += [
            _cmp(kv.key, "MOD", kv.mod_revision),
            _cmp(keys.lease(name), "CREATE", 0),
        ]
        success.append(_put(kv.key, expired[name].encode()))
    request = rpc.TxnRequest(compare=compare, success=success, failure=[])
    return _Settle(request, expired, len(ended) > _SETTLE_CHUNK)


class RecordPages:
    """The reads of ``records(resource, after, limit)`` (no I/O: the caller sends
    :meth:`next_read` and gives its answer to :meth:`feed` until it returns None).

    Read in pages sorted by create revision from ``after``'s revision on (etcd filters and
    sorts). A full page may end inside one transaction's records: its last revision is left
    for the next page, which starts at that revision (and a page filled by one transaction's
    records is followed by a read of all of them). :attr:`found` then holds the records with
    ``seq > after``, oldest first, at most ``limit``; :attr:`revision` the revision of the
    first read.
    """

    def __init__(self, keys: Keys, resource: str | None, after: int, limit: int) -> None:
        self._start = keys.log_prefix if resource is None else keys.log(resource)
        self._end = prefix_end(self._start)
        self._after = max(after, 0)
        self._first = self._after // SEQ_PER_REVISION
        self._limit = limit
        self._whole: int | None = None  # a revision whose records filled a page
        self._done = False
        self._found: list[Record] = []
        self.revision = 0

    @property
    def found(self) -> list[Record]:
        return self._found[: self._limit]

    def next_read(self) -> list[_Op] | None:
        """The next read, or None: done."""
        if self._whole is not None:
            last = self._whole
            return [
                _get(self._start, self._end, min_create_revision=last, max_create_revision=last)
            ]
        if self._done or len(self._found) >= self._limit:
            return None
        return [
            _get(
                self._start,
                self._end,
                min_create_revision=self._first,
                sort_order="ASCEND",
                sort_target="CREATE",
                limit=_PAGE,
            )
        ]

    def feed(self, responses: list[rpc.ResponseOp], revision: int) -> None:
        """The answer to :meth:`next_read`."""
        page = _kvs(responses[0])
        if self._whole is not None:  # every record of one transaction
            self._first, self._whole = self._whole + 1, None
            self._take(page)
            return
        self.revision = self.revision or revision
        full = len(page) >= _PAGE
        if full:
            last = page[-1].create_revision
            page = [kv for kv in page if kv.create_revision < last]
            if not page:  # one transaction's records fill the page: read them all
                self._whole = last
                return
            self._first = last
        else:
            self._done = True
        self._take(page)

    def _take(self, page: list[KV]) -> None:
        records = sorted(
            (r for kv in page for r in records_from(kv.value, kv.create_revision)),
            key=lambda r: r.seq,
        )
        self._found += [record for record in records if record.seq > self._after]


def resources_read(keys: Keys, start: bytes | None) -> list[_Op]:
    """A page of resource names from ``start`` (None: the first page)."""
    prefix = keys.res_prefix
    return [_get(start or prefix, prefix_end(prefix), keys_only=True, limit=_PAGE)]


def resources_page(keys: Keys, responses: list[rpc.ResponseOp]) -> tuple[list[str], bytes | None]:
    """The names a page of :func:`resources_read` holds, and where the next page starts (None:
    this was the last)."""
    found = _kvs(responses[0])
    names = [keys.name_of(kv.key, keys.res_prefix) for kv in found]
    return names, (found[-1].key + b"\x00" if len(found) >= _PAGE else None)


def report_txn(
    keys: Keys, resource: str, res_rev: int, state: ResourceState, item: _Item
) -> tuple[rpc.TxnRequest, ResourceState]:
    """The transaction that appends a holder's report ``item`` to ``resource``'s records (its
    state as cached: ``res_rev``, ``state``), and the state it writes."""
    res_key = keys.res(resource)
    record_ops, number = resource_records(keys, resource, state.last_record, [item])
    new_state = replace(state, last_record=number)
    request = rpc.TxnRequest(
        compare=[_cmp(res_key, "MOD", res_rev)],
        success=[_put(res_key, new_state.encode()), *record_ops],
        failure=[_get(res_key)],
    )
    return request, new_state


class _Records(_LeasePool):
    """Records, resources and restore of an etcd backend."""

    def _records_ops(
        self, items: list[_Item], numbers: dict[str, int], at: float | None = None
    ) -> tuple[list[_Op], dict[str, int]]:
        """:func:`records_ops` under this backend's prefix."""
        return records_ops(self._keys, items, numbers, at)

    def _resource_records(
        self, resource: str, number: int, items: list[_Item], at: float | None = None
    ) -> tuple[list[_Op], int]:
        """:func:`resource_records` under this backend's prefix."""
        return resource_records(self._keys, resource, number, items, at)

    def _settle(self, resource: str | None) -> None:
        """Record the expiries of leases whose end was not recorded yet (and cache states)."""
        reads = settle_reads(self._keys, resource)
        for _ in range(_MAX_ATTEMPTS):
            responses, _ = self._read(reads, "reading records")
            settle = settle_txn(self._keys, responses)
            if settle is None:
                return
            ok, _, revision = self._send(settle.request, "recording expiries")
            if ok:
                with self._lock:
                    for name, state in settle.expired.items():
                        self._res[name] = (revision, state)
                if not settle.more:
                    return

    def _read_records(
        self, resource: str | None, after: int, limit: int
    ) -> tuple[list[Record], int]:
        """Records with ``seq > after`` (of ``resource``, or all), oldest first; and the revision
        of the first read (:class:`RecordPages`)."""
        pages = RecordPages(self._keys, resource, after, limit)
        while (ops := pages.next_read()) is not None:
            responses, revision = self._read(ops, "reading records")
            pages.feed(responses, revision)
        return pages.found, pages.revision

    def records(self, resource: str | None, after: int = 0, limit: int = 1000) -> list[Record]:
        self._settle(resource)
        return self._read_records(resource, after, limit)[0]

    def report(
        self,
        resource: str,
        epoch: int,
        holder: str,
        kind: RecordKind,
        detail: dict[str, object],
    ) -> None:
        for _ in range(_MAX_ATTEMPTS):
            res_rev, state, _, _ = self._cached(resource)
            request, new_state = report_txn(
                self._keys, resource, res_rev, state, (kind, resource, epoch, holder, detail)
            )
            if self._reported(resource, new_state, self._send(request, "report")):
                return
        raise Unavailable(f"etcd: {resource} changed too often to report (contention)")

    def watch(self, resource: str, after: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        keys = self._keys
        woken = threading.Event()

        def on_events(events: list[Event], revision: int) -> None:
            woken.set()

        def on_trouble(reason: str) -> None:
            woken.set()

        while True:
            self._settle(resource)
            found, revision = self._read_records(resource, after, 1)
            if found or time.monotonic() >= deadline:
                return
            woken.clear()
            streams = [
                WatchStream(
                    self._transport,
                    keys.log(resource),
                    prefix_end(keys.log(resource)),
                    revision + 1,
                    on_events,
                    on_trouble,
                    name="records",
                ),
                WatchStream(
                    self._transport,
                    keys.lease(resource),
                    None,
                    revision + 1,
                    on_events,
                    on_trouble,
                    name="records",
                ),
            ]
            try:
                woken.wait(max(deadline - time.monotonic(), 0.0))
            finally:
                for stream in streams:
                    stream.stop()

    def resources(self) -> list[str]:
        names: list[str] = []
        start: bytes | None = None
        while True:
            responses, _ = self._read(resources_read(self._keys, start), "listing resources")
            found, start = resources_page(self._keys, responses)
            names += found
            if start is None:
                return sorted(names)

    def advance(self, minimum: int, floors: dict[str, int], detail: dict[str, object]) -> int:
        """Restore safety (see the backend contract); for an etcd snapshot restore.

        Steps: (0) record the expiries that are due, as a reader does (:meth:`_settle`: with the
        lease's own epoch, before a floor raises it), so that a lease that expired before the
        restore ends ``expired`` then ``restored`` whether or not anyone looked; (1) raise each
        resource's last epoch to its floor, in transactions of at most
        :data:`_RESTORE_CHUNK` resources (raising early is always safe); (2) in one transaction,
        compared against every resource state read before: raise ``P/meta/minimum``, delete every
        live lease key, mark and record the first resources as restored; (3) record the
        remaining resources in further transactions (records only: the epochs are safe after
        step 2). Returns the new minimum.
        """
        keys = self._keys
        for name in floors:
            validate_resource(name)
        self._settle(None)
        pending = sorted(floors.items())
        while pending:
            chunk, pending = pending[:_RESTORE_CHUNK], pending[_RESTORE_CHUNK:]
            self._raise_floors(dict(chunk))
        new_minimum = 0
        for _ in range(_MAX_ATTEMPTS):
            responses, read_rev = self._read(
                [_get(keys.res_prefix, prefix_end(keys.res_prefix)), _get(keys.minimum)],
                "reading state to advance",
            )
            states = [
                (keys.name_of(kv.key, keys.res_prefix), ResourceState.decode(kv.value))
                for kv in _kvs(responses[0])
            ]
            min_rev, old_minimum = _int_value(_first(responses[1]))
            new_minimum = max(old_minimum, minimum)
            recorded = {**detail, "minimum": new_minimum}
            first, rest = states[:_RESTORE_CHUNK], states[_RESTORE_CHUNK:]
            record_ops, numbers = self._records_ops(
                _restored(first, new_minimum, recorded),
                {name: state.last_record for name, state in first},
            )
            ok, _, revision = self._txn(
                [
                    _cmp(keys.res_prefix, "MOD", read_rev + 1, "LESS", prefix_end(keys.res_prefix)),
                    _cmp(keys.minimum, "MOD", min_rev),
                ],
                [
                    _put(keys.minimum, str(new_minimum).encode()),
                    _delete(keys.lease_prefix, prefix_end(keys.lease_prefix)),
                    *[
                        _put(
                            keys.res(name),
                            ResourceState(state.epoch, "restored", None, numbers[name]).encode(),
                        )
                        for name, state in first
                    ],
                    *record_ops,
                ],
                [],
                what="advancing epochs",
            )
            if ok:
                with self._lock:
                    self._minimum = (revision, new_minimum)
                    self._res.clear()
                self._record_restored([name for name, _ in rest], recorded, revision)
                return new_minimum
        raise Unavailable("etcd: the state changed too often to advance (contention)")

    def _read_states(self, names: list[str]) -> list[tuple[str, int, ResourceState]]:
        """``(name, mod revision, state)`` of each resource, in one read (a resource never
        granted: revision 0 and a blank state)."""
        responses, _ = self._read([_get(self._keys.res(name)) for name in names], "reading epochs")
        found = []
        for name, response in zip(names, responses, strict=True):
            kv = _first(response)
            if kv is None:
                found.append((name, 0, ResourceState()))
            else:
                found.append((name, kv.mod_revision, ResourceState.decode(kv.value)))
        return found

    def _raise_floors(self, floors: dict[str, int]) -> None:
        keys = self._keys
        for _ in range(_MAX_ATTEMPTS):
            compare: list[rpc.Compare] = []
            success: list[_Op] = []
            for name, revision, state in self._read_states(list(floors)):
                compare.append(_cmp(keys.res(name), "MOD", revision))
                if floors[name] > state.epoch:
                    raised = replace(state, epoch=floors[name])
                    success.append(_put(keys.res(name), raised.encode()))
            if not success:
                return
            ok, _, _ = self._txn(compare, success, [], what="raising epochs")
            if ok:
                return
        raise Unavailable("etcd: the state changed too often to advance (contention)")

    def _record_restored(self, names: list[str], recorded: dict[str, object], since: int) -> None:
        """Record the restore for the resources that the advance transaction (at revision
        ``since``) left out, :data:`_RESTORE_CHUNK` per transaction, each compared by mod
        revision. One granted since then keeps its state (its grant came after the restore);
        the others are marked restored."""
        keys = self._keys
        with self._lock:
            new_minimum = self._minimum[1]
        attempts = 0
        while names:
            attempts += 1
            if attempts > _MAX_ATTEMPTS:
                raise Unavailable("etcd: the state changed too often to record a restore")
            chunk = names[:_RESTORE_CHUNK]
            found = [item for item in self._read_states(chunk) if item[1]]
            states = [(name, state) for name, _, state in found]
            record_ops, numbers = self._records_ops(
                _restored(states, new_minimum, recorded),
                {name: state.last_record for name, state in states},
            )
            compare: list[rpc.Compare] = []
            success: list[_Op] = []
            for name, revision, state in found:
                marked = (
                    ResourceState(state.epoch, "restored", None, numbers[name])
                    if revision <= since
                    else replace(state, last_record=numbers[name])
                )
                compare.append(_cmp(keys.res(name), "MOD", revision))
                success.append(_put(keys.res(name), marked.encode()))
            ok, _, _ = self._txn(compare, [*success, *record_ops], [], what="recording a restore")
            if ok:
                names, attempts = names[_RESTORE_CHUNK:], 0

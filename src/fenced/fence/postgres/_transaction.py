"""The critical section of one fencing domain on PostgreSQL: :class:`PostgresTransaction`.

A transaction is *ordinary* or *speculative* (:attr:`~fenced.fence.backend.Intent.speculate`):

* ordinary: the first read sends ``BEGIN``, the domain's advisory lock, its head and the
  announced reads (the :class:`~fenced.fence.backend.Intent`'s key version or pointer, an op id)
  as one multi-statement query; writes are buffered and sent with ``COMMIT``;
* speculative: reads are answered from :class:`Remembered` (the domain state this process saw
  last) and kept as expectations; the commit is one ``store_apply_all`` statement that takes the
  lock, checks the expectations and applies the writes and records. A changed state applies
  nothing and raises :class:`~fenced.fence.backend.SpeculationFailed`.

Also the SQL statements the backend shares with its transactions. Driver errors are left to
:meth:`~fenced.fence.postgres._store.PostgresBackend.transaction`, which translates them.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps's, for str
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import pq

from fenced.core._records import Record, detail_json
from fenced.fence._ops import OpRecord
from fenced.fence._rules import Head, StoredObject
from fenced.fence._values import Item, Publication
from fenced.fence.backend import Chooser, SpeculationFailed

if TYPE_CHECKING:
    from fenced.fence.postgres._store import PostgresBackend

__all__ = [
    "APPLY",
    "APPLY_N",
    "HEAD",
    "INSERT_RECORD",
    "LOCK",
    "POINTER",
    "REMEMBERED_KEYS",
    "PostgresTransaction",
    "Remembered",
    "publication_of",
    "record_params",
]


@dataclass(frozen=True, slots=True)
class Remembered:
    """The committed state of one domain as this process saw it last (a hint, never trusted)."""

    head: Head
    versions: tuple[tuple[str, int | None], ...] = ()

    def version(self, key: str) -> tuple[bool, int | None]:
        for name, version in self.versions:
            if name == key:
                return True, version
        return False, None


REMEMBERED_KEYS = 16


POINTER = (
    "SELECT epoch, object_id, sha256, size, published_at FROM {s}.store_pointers"
    " WHERE resource = %s AND name = %s"
)
APPLY = "SELECT {s}.store_apply_all(" + ", ".join(["%s"] * 22) + ")"
APPLY_N = "SELECT {s}.store_apply_all(" + ", ".join(f"${n}" for n in range(1, 23)) + ")"
HEAD = "SELECT coordinator_id, floor FROM {s}.store_domains WHERE resource = %s"
VERSION = "SELECT version FROM {s}.store_items WHERE resource = %s AND key = %s"
LOCK = (
    b"SELECT set_config('lock_timeout', %s, true),"
    b" set_config('synchronous_commit', CASE current_setting('synchronous_commit')"
    b" WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, true),"
    b" pg_advisory_xact_lock(hashtextextended(%s, 0))"
)
OP = "SELECT 1 FROM {s}.store_ops WHERE resource = %s AND op_id = %s"
INSERT_RECORD = (
    "INSERT INTO {s}.store_records (resource, at, kind, epoch, detail) VALUES (%s, %s, %s, %s, %s)"
)
OP_ROW = "SELECT digest, outcome, recorded_at FROM {s}.store_ops WHERE resource = %s AND op_id = %s"


def publication_of(resource: str, name: str, row: tuple[Any, ...]) -> Publication:
    epoch, object_id, sha256, size, published_at = row
    return Publication(
        resource, name, int(epoch), str(object_id), str(sha256), int(size), float(published_at)
    )


# compact JSON, as json.dumps(…, separators=(",", ":")) writes it
_JSON = json.JSONEncoder(separators=(",", ":"))


def records_json(records: Sequence[tuple[object, ...]]) -> str:
    """The records of :func:`record_params` as store_apply_all's JSON array of [at, kind,
    epoch, detail] (what _JSON.encode writes, built by hand)."""
    parts = []
    for _, at, kind, epoch, detail in records:
        if (
            type(at) is not float
            or not math.isfinite(at)
            or type(kind) is not str
            or type(epoch) is not int
            or type(detail) is not str
        ):
            return _JSON.encode([params[1:] for params in records])
        parts.append(
            f"[{float.__repr__(at)},{_json_str(kind)},{int.__repr__(epoch)},{_json_str(detail)}]"
        )
    return "[" + ",".join(parts) + "]"


def record_params(record: Record) -> tuple[object, ...]:
    detail = detail_json(record.detail)
    return (record.resource, record.at, record.kind.value, record.epoch, detail)


_BIG = 256 * 1024  # larger values are sent with the extended protocol (binary), not inlined


class PostgresTransaction:
    """One store transaction. Not thread-safe (one per mutation).

    Ordinary mode: the first read sends ``BEGIN``, the lock, the head, the announced reads and
    itself as one multi-statement query; writes are buffered and sent with ``COMMIT``.
    Speculative mode (``known`` given): reads are answered from ``known`` and remembered as
    expectations; at commit, one ``store_apply_all`` statement (see :meth:`_apply`) checks them
    under the lock and applies the writes and records (writes it does not carry would go out as
    BEGIN, the lock, a check statement, the writes and COMMIT). A read that ``known`` cannot
    answer switches to ordinary mode, checking the answers already given.
    """

    def __init__(
        self,
        backend: PostgresBackend,
        conn: psycopg.Connection[tuple[Any, ...]],
        resource: str,
        key_hint: str | None,
        pointer_hint: str | None,
        known: Remembered | None,
    ) -> None:
        self._backend = backend
        self._conn = conn
        self._cursor: psycopg.ClientCursor[tuple[Any, ...]] | None = None  # when first needed
        self._resource = resource
        self._key_hint = key_hint
        self._pointer_hint = pointer_hint
        self._known = known
        self._begun = False
        self._head: Head | None = None
        self._versions: dict[str, int | None] = {}
        self._pointers: dict[str, Publication | None] = {}
        self._writes: list[tuple[bytes, tuple[object, ...]]] = []
        self._typed: dict[str, tuple[object, ...]] = {}  # the same writes, by kind
        self._records: list[tuple[object, ...]] = []  # the records among them, in order
        # speculative expectations
        self._expect_head = False
        self._expect_key: tuple[str, int | None] | None = None
        self._expect_op: str | None = None

    # -- plumbing -----------------------------------------------------------------------------

    def _enter(self) -> list[tuple[bytes, tuple[object, ...]]]:
        """BEGIN; the domain lock (``busy_timeout`` as lock_timeout) and a durable commit."""
        backend = self._backend
        return [
            (b"BEGIN", ()),
            (
                LOCK,
                (
                    f"{backend._lock_timeout_ms}ms",
                    f"fenced.store.{backend.schema}:{self._resource}",
                ),
            ),
        ]

    def _check(self) -> tuple[bytes, tuple[object, ...]]:
        """A statement that fails (division by zero, 22012) unless the expectations hold."""
        backend = self._backend
        r = self._resource
        head = self._known.head if self._known is not None else Head()  # not a set_head
        conditions: list[str] = []
        params: list[object] = []
        if head.floor is None:
            conditions.append("NOT EXISTS (SELECT 1 FROM {s}.store_domains WHERE resource = %s)")
            params.append(r)
        else:
            conditions.append(
                "EXISTS (SELECT 1 FROM {s}.store_domains WHERE resource = %s"
                " AND coordinator_id = %s AND floor = %s)"
            )
            params += [r, head.coordinator_id, head.floor]
        if self._expect_key is not None:
            key, version = self._expect_key
            found = "NOT EXISTS" if version is None else "EXISTS"
            conditions.append(
                f"{found} (SELECT 1 FROM {{s}}.store_items WHERE resource = %s AND key = %s"
                + ("" if version is None else " AND version = %s")
                + ")"
            )
            params += [r, key] if version is None else [r, key, version]
        if self._expect_op is not None:
            conditions.append(
                "NOT EXISTS (SELECT 1 FROM {s}.store_ops WHERE resource = %s AND op_id = %s)"
            )
            params += [r, self._expect_op]
        query = "SELECT 1 / (CASE WHEN " + " AND ".join(conditions) + " THEN 1 ELSE 0 END)"
        return backend._sql(query), tuple(params)

    def _run(self, statements: list[tuple[bytes, tuple[object, ...]]]) -> list[list[Any]]:
        """Run ``statements`` in one round trip when they are small; return their rows."""
        if any(isinstance(p, bytes) and len(p) > _BIG for _, ps in statements for p in ps):
            out: list[list[Any]] = []
            for query, params in statements:
                one = self._conn.execute(query, params, prepare=False)
                out.append(one.fetchall() if one.pgresult and one.pgresult.ntuples else [])
            return out
        cur = self._cursor
        if cur is None:
            cur = self._cursor = psycopg.ClientCursor(self._conn)
        cur.execute(b"; ".join(q for q, _ in statements), [p for _, ps in statements for p in ps])
        results: list[list[Any]] = []
        while True:
            results.append(cur.fetchall() if cur.description is not None else [])
            if not cur.nextset():
                break
        return results

    def _begin(self, extra: tuple[bytes, tuple[object, ...]] | None = None) -> list[Any] | None:
        """Switch to ordinary mode: BEGIN, the lock, the head, the prefetches and ``extra``."""
        backend = self._backend
        r = self._resource
        key = self._expect_key[0] if self._expect_key is not None else self._key_hint
        statements = self._enter()
        statements.append((backend._sql(HEAD), (r,)))
        if key is not None:
            statements.append((backend._sql(VERSION), (r, key)))
        if self._pointer_hint is not None:
            statements.append((backend._sql(POINTER), (r, self._pointer_hint)))
        if self._expect_op is not None:
            statements.append((backend._sql(OP), (r, self._expect_op)))
        if extra is not None:
            statements.append(extra)
        results = self._run(statements)[2:]
        self._begun = True
        row = results.pop(0)
        head = Head() if not row else Head(str(row[0][0]), int(row[0][1]))
        if key is not None:
            found = results.pop(0)
            self._versions[key] = None if not found else int(found[0][0])
        if self._pointer_hint is not None:
            found = results.pop(0)
            self._pointers[self._pointer_hint] = (
                None if not found else publication_of(r, self._pointer_hint, found[0])
            )
        op_found = results.pop(0) if self._expect_op is not None else []
        # answers already given speculatively must still hold
        if (
            (self._expect_head and self._head != head)
            or (
                self._expect_key is not None
                and self._versions.get(self._expect_key[0]) != self._expect_key[1]
            )
            or op_found
        ):
            raise SpeculationFailed(r)
        self._head = head
        self._known = None
        return results.pop(0) if extra is not None else None

    def _query(self, query: str, params: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """A read inside the transaction (after flushing buffered writes)."""
        statement = (self._backend._sql(query), params)
        if not self._begun:
            rows = self._begin(statement)
            assert rows is not None
            return rows
        results = self._run([*self._writes, statement])
        self._writes.clear()
        return list(results[-1])

    def _write(self, query: str, params: tuple[object, ...], kind: str = "") -> None:
        if not self._begun and self._known is None:
            self._begin()
        self._writes.append((self._backend._sql(query), params))
        if kind == "record":
            self._records.append(params)
            return
        self._typed[kind if kind and kind not in self._typed else f"other{len(self._typed)}"] = (
            params
        )

    def commit(self) -> None:
        if not self._begun and self._known is None:
            return  # nothing was read or written
        statements: list[tuple[bytes, tuple[object, ...]]] = []
        if not self._begun:  # speculative: even a no-op must confirm what it was told
            if set(self._typed) <= {"head", "item", "op", "prune", "prune_records"}:
                self._apply()
                return
            statements = [*self._enter(), self._check()]
        statements.extend(self._writes)
        statements.append((b"COMMIT", ()))
        self._run(statements)
        self._clear()
        self._begun = False

    def _clear(self) -> None:
        self._writes.clear()
        self._typed.clear()
        self._records.clear()

    def _apply(self) -> None:
        """A speculative commit as one statement: ``store_apply_all`` (the lock, the check, then
        the writes, the records and their pruning)."""
        backend = self._backend
        head = self._known.head if self._known is not None else Head()  # what was decided on
        key, version = self._expect_key or (None, None)
        new_head = self._typed.get("head", (None, None, None))[1:]
        item = self._typed.get("item", (None, None, None, None, None))[1:]
        op = self._typed.get("op", (None, None, None, None, None))[1:]
        prune = self._typed.get("prune", (None, None))[1:]
        _, records_before, records_keep = self._typed.get("prune_records", (None,) * 3)
        # record_params: (resource, at, kind, epoch, detail), always of this resource; JSON
        # because psycopg dumps arrays slowly (more than the rest of the statement together)
        records = records_json(self._records)
        backend._apply.run(
            backend._pool,
            self._conn,
            (
                self._resource, f"fenced.store.{backend.schema}:{self._resource}",
                backend._lock_timeout, head.coordinator_id, head.floor, key, version,
                self._expect_op, *new_head, *item, *op, *prune,
                records if self._records else None, records_before, records_keep,
            ),
        )  # fmt: skip
        self._clear()

    def abort(self) -> None:
        self._clear()
        conn = self._conn
        if (
            not conn.closed
            and not conn.broken
            and conn.info.transaction_status != pq.TransactionStatus.IDLE
        ):
            with contextlib.suppress(psycopg.Error):
                conn.execute(b"ROLLBACK")

    @property
    def speculative(self) -> bool:
        """Still deciding on remembered state (nothing read from the server yet)."""
        return not self._begun and self._known is not None

    def seen(self) -> Remembered | None:
        """The domain state this transaction read or left (for the next speculative write)."""
        if self._head is None:
            return None
        versions = tuple(list(self._versions.items())[-REMEMBERED_KEYS:])
        return Remembered(self._head, versions)

    # -- the Transaction protocol -------------------------------------------------------------

    def head(self) -> Head:
        if self._head is None:
            if self._known is not None:
                self._head = self._known.head
                self._expect_head = True
            else:
                self._begin()
        assert self._head is not None
        return self._head

    def set_head(self, head: Head) -> None:
        self._write(
            "INSERT INTO {s}.store_domains (resource, coordinator_id, floor) VALUES (%s, %s, %s)"
            " ON CONFLICT (resource) DO UPDATE SET coordinator_id = excluded.coordinator_id,"
            " floor = excluded.floor",
            (self._resource, head.coordinator_id, head.floor),
            "head",
        )
        self._head = head

    def op(self, op_id: str) -> OpRecord | None:
        if not self._begun and self._known is not None:
            self._expect_op = op_id  # expected unknown; the check statement checks it
            return None
        rows = self._query(OP_ROW, (self._resource, op_id))
        if not rows:
            return None
        digest, outcome, recorded_at = rows[0]
        return OpRecord(str(digest), str(outcome), float(recorded_at))

    def record_op(self, op_id: str, record: OpRecord) -> None:
        self._write(
            "INSERT INTO {s}.store_ops (resource, op_id, digest, outcome, recorded_at)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (resource, op_id) DO UPDATE SET"
            " digest = excluded.digest, outcome = excluded.outcome,"
            " recorded_at = excluded.recorded_at",
            (self._resource, op_id, record.digest, record.outcome, record.recorded_at),
            "op",
        )

    def prune_ops(self, before: float) -> None:
        self._write(
            "DELETE FROM {s}.store_ops WHERE resource = %s AND recorded_at < %s",
            (self._resource, before),
            "prune",
        )

    def append_record(self, record: Record) -> None:
        # a speculative commit sends the records to store_apply_all (see _apply)
        self._write(INSERT_RECORD, record_params(record), "record")

    def prune_records(self, before: float, keep: int) -> None:
        # store_apply_records without records: it deletes only what is due
        self._write(
            "SELECT {s}.store_apply_records(%s, NULL, %s, %s)",
            (self._resource, before, keep),
            "prune_records",
        )

    def version_of(self, key: str) -> int | None:
        if key in self._versions:
            return self._versions[key]
        if not self._begun and self._known is not None and self._expect_key is None:
            cached, version = self._known.version(key)
            if cached:
                self._expect_key = (key, version)
                self._versions[key] = version
                return version
        if not self._begun:
            self._key_hint = key
            self._begin()
            if key in self._versions:
                return self._versions[key]
        rows = self._query(VERSION, (self._resource, key))
        self._versions[key] = None if not rows else int(rows[0][0])
        return self._versions[key]

    def put_item(self, item: Item) -> None:
        self._write(
            "INSERT INTO {s}.store_items (resource, key, value, epoch, version)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (resource, key) DO UPDATE SET"
            " value = excluded.value, epoch = excluded.epoch, version = excluded.version",
            (item.resource, item.key, item.value, item.epoch, item.version),
            "item",
        )
        self._versions[item.key] = item.version

    def pointer(self, name: str) -> Publication | None:
        if name in self._pointers:
            return self._pointers[name]
        if not self._begun:
            self._pointer_hint = name
            self._begin()
            if name in self._pointers:
                return self._pointers[name]
        rows = self._query(POINTER, (self._resource, name))
        self._pointers[name] = None if not rows else publication_of(self._resource, name, rows[0])
        return self._pointers[name]

    def has_object(self, object_id: str) -> bool:
        rows = self._query(
            "SELECT 1 FROM {s}.store_objects WHERE object_id = %s AND resource = %s",
            (object_id, self._resource),
        )
        return bool(rows)

    def set_pointer(self, publication: Publication, now: float) -> None:
        p = publication
        self._write(
            "UPDATE {s}.store_objects SET superseded_at = %s WHERE object_id ="
            " (SELECT object_id FROM {s}.store_pointers WHERE resource = %s AND name = %s)",
            (now, p.resource, p.name),
        )
        self._write(
            "INSERT INTO {s}.store_pointers"
            " (resource, name, object_id, epoch, sha256, size, published_at)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (resource, name) DO UPDATE SET"
            " object_id = excluded.object_id, epoch = excluded.epoch,"
            " sha256 = excluded.sha256, size = excluded.size,"
            " published_at = excluded.published_at",
            (p.resource, p.name, p.object_id, p.epoch, p.sha256, p.size, p.published_at),
        )
        self._write(
            "UPDATE {s}.store_objects SET name = %s, epoch = %s, published_at = %s"
            " WHERE object_id = %s",
            (p.name, p.epoch, p.published_at, p.object_id),
        )
        self._pointers[p.name] = p

    # -- gc -----------------------------------------------------------------------------------

    def collect(self, choose: Chooser) -> int:
        """Delete the objects ``choose`` picks among this resource's (inside the lock)."""
        rows = self._query(
            "SELECT object_id, staged_at, name, epoch, published_at, superseded_at"
            " FROM {s}.store_objects WHERE resource = %s",
            (self._resource,),
        )
        objects = [
            StoredObject(
                str(object_id),
                idle_since=float(superseded_at or published_at or staged_at),
                name=None if name is None else str(name),
                epoch=None if epoch is None else int(epoch),
                published_at=None if published_at is None else float(published_at),
            )
            for object_id, staged_at, name, epoch, published_at, superseded_at in rows
        ]
        current = {
            str(row[0])
            for row in self._query(
                "SELECT object_id FROM {s}.store_pointers WHERE resource = %s", (self._resource,)
            )
        }
        victims = choose(objects, current)
        for object_id in victims:
            self._write("DELETE FROM {s}.store_chunks WHERE object_id = %s", (object_id,))
            self._write("DELETE FROM {s}.store_objects WHERE object_id = %s", (object_id,))
        return len(victims)

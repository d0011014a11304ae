"""The ``postgresql://`` store: fencing domains, keys and publications in PostgreSQL.

:class:`PostgresStore` is a :class:`~fenced.fence.store.Store` over :class:`PostgresBackend`; the
store does validation, op ids and asks :mod:`fenced.fence.rules` for every decision, exactly as
for the other stores. What this backend guarantees:

* **Critical section**: one transaction per mutation that first takes a *transaction-level*
  advisory lock on the domain (``pg_advisory_xact_lock``, released by COMMIT or ROLLBACK; it
  works through a transaction-pooling PgBouncer). Every read inside runs after the lock is held
  (READ COMMITTED, one snapshot per statement), so it sees every earlier commit of the domain. A
  lock wait longer than ``busy_timeout`` is :class:`~fenced.Unavailable` (``lock_timeout``).
* **Two round trips per mutation**: the lock, the domain's head and the first read (an op id,
  and the key's version or the pointer, announced by :class:`PostgresStore`) go out together in
  one pipeline; the writes are buffered and sent together with ``COMMIT``. A break while that
  pipeline is in flight is :class:`~fenced.OutcomeUnknown` (retry with the same op id); a failure
  before it is :class:`~fenced.Unavailable` (nothing was changed).
* **Durability**: commits are synchronous (``synchronous_commit`` raised for the transaction
  when the server has it off): a mutation is on disk when it returns.
* **Objects** are ``bytea`` chunks of 1 MiB in ``store_chunks`` (storage ``EXTERNAL``: no
  compression of data that is usually compressed already), written with ``COPY … FROM STDIN
  (FORMAT BINARY)`` in one transaction together with their ``store_objects`` row: an object is
  complete or absent, a killed publisher leaves no debris, a large input is streamed chunk by
  chunk and never held in memory. Why not large objects: they live outside the schema in one
  shared catalog (``pg_largeobject``), are not replicated by logical replication, need
  ``lo_unlink``/``vacuumlo`` to avoid orphans, carry per-object privileges and dump slowly in
  large numbers; their only advantage, random-access writes, is not needed for immutable
  objects, and chunking removes bytea's 1 GB-per-value limit. So every size uses bytea chunks.
* **Snapshot reads**: :meth:`PostgresBackend.open_current` reads the pointer and the chunks in
  one ``REPEATABLE READ READ ONLY`` transaction of a connection of its own: the stream is
  unaffected by later publications and even by gc (MVCC) until it is closed.
* **Schema**: tables ``store_*`` in the URL's schema (default ``fenced``, ``?schema=``), versioned
  in ``store_meta`` (``format``, ``schema_version``, ``mode``) and migrated automatically.

URL query parameters: ``schema``, ``pool_size``, ``timeout`` (seconds an operation may wait for a
reply, default 10), ``prepare`` — see :mod:`fenced.coordinator.backends.postgres`.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import psycopg
from psycopg import sql

from fenced.core.errors import ConfigurationError, FencedError, OutcomeUnknown, Unavailable
from fenced.core.token import FencingToken
from fenced.fence.backend import Capability, Chooser, StoreOptions
from fenced.fence.ops import OpRecord
from fenced.fence.postgres_conn import (
    DEFAULT_OP_TIMEOUT,
    DEFAULT_POOL_SIZE,
    Migration,
    Pool,
    deadlines,
    guarded,
    migrate,
    parse_url,
    translate,
)
from fenced.fence.rules import Head, StoredObject, resolve_mode
from fenced.fence.source import PublishData
from fenced.fence.store import Store
from fenced.fence.values import Item, Mode, Publication, Version

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "FORMAT",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "PostgresBackend",
    "PostgresStore",
    "open_postgres_store",
]

FORMAT = "fenced.store"
_URL_KEYS = ("pool_size", "timeout", "prepare")

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "domains, items, pointers, objects as bytea chunks, op ids",
        (
            "CREATE TABLE {s}.store_meta (key text PRIMARY KEY, value text NOT NULL)",
            "CREATE TABLE {s}.store_domains (resource text PRIMARY KEY,"
            " coordinator_id text NOT NULL, floor bigint NOT NULL)",
            "CREATE TABLE {s}.store_items (resource text NOT NULL, key text NOT NULL,"
            " value bytea NOT NULL, epoch bigint NOT NULL, version bigint NOT NULL,"
            " PRIMARY KEY (resource, key))",
            "CREATE TABLE {s}.store_pointers (resource text NOT NULL, name text NOT NULL,"
            " object_id text NOT NULL, epoch bigint NOT NULL, sha256 text NOT NULL,"
            " size bigint NOT NULL, published_at double precision NOT NULL,"
            " PRIMARY KEY (resource, name))",
            "CREATE TABLE {s}.store_objects (object_id text PRIMARY KEY, resource text NOT NULL,"
            " chunks integer NOT NULL, size bigint NOT NULL,"
            " staged_at double precision NOT NULL, name text, epoch bigint,"
            " published_at double precision, superseded_at double precision)",
            "CREATE INDEX store_objects_by_resource ON {s}.store_objects (resource)",
            "CREATE TABLE {s}.store_chunks (object_id text NOT NULL, seq integer NOT NULL,"
            " data bytea NOT NULL, PRIMARY KEY (object_id, seq))",
            "ALTER TABLE {s}.store_chunks ALTER COLUMN data SET STORAGE EXTERNAL",
            "CREATE TABLE {s}.store_ops (resource text NOT NULL, op_id text NOT NULL,"
            " digest text NOT NULL, outcome text NOT NULL,"
            " recorded_at double precision NOT NULL, PRIMARY KEY (resource, op_id))",
            "CREATE INDEX store_ops_by_age ON {s}.store_ops (resource, recorded_at)",
        ),
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1].version


def open_postgres_store(url: str, mode: Mode | None, options: StoreOptions) -> PostgresStore:
    """Open (creating its tables if needed) the store at ``url`` with validated ``options``.

    This is what ``fenced.open_store("postgresql://…")`` calls after validating its options.
    """
    backend = PostgresBackend(url, mode, options)
    return PostgresStore(backend, options)


class PostgresStore(Store):
    """A :class:`~fenced.fence.store.Store` on PostgreSQL (see the module docstring).

    Behaves exactly like every other store (the same :class:`Store` code makes the decisions);
    it only tells the backend which key or pointer a mutation will read, so that the read goes
    out in the same round trip as the domain lock.
    """

    _backend: PostgresBackend

    def put(
        self,
        token: FencingToken,
        key: str,
        value: bytes,
        *,
        op_id: str | None = None,
        if_version: int | None = None,
    ) -> Version:
        with self._backend.prefetching(key=key):
            return super().put(token, key, value, op_id=op_id, if_version=if_version)

    def publish(
        self,
        token: FencingToken,
        data: PublishData,
        *,
        name: str = "",
        op_id: str | None = None,
    ) -> Publication:
        with self._backend.prefetching(pointer=name):
            return super().publish(token, data, name=name, op_id=op_id)


class _Hint(threading.local):
    key: str | None = None
    pointer: str | None = None


class PostgresBackend:
    """The store backend on PostgreSQL; see the module docstring. Thread-safe."""

    capabilities = frozenset(
        {Capability.KEYS, Capability.PUBLICATION, Capability.OP_IDS, Capability.MULTI_PROCESS}
    )

    def __init__(self, url: str, mode: Mode | None, options: StoreOptions) -> None:
        parsed = parse_url(url, _URL_KEYS)
        self.url = parsed.display
        self.schema = parsed.schema
        self._where = f"postgres store {parsed.display}"
        self._timeout = parsed.option_float("timeout", DEFAULT_OP_TIMEOUT, minimum=0.01)
        self._connect_budget = min(parsed.connect_timeout, self._timeout)
        self._lock_timeout_ms = max(int(options.busy_timeout * 1000), 1)
        self._pool = Pool(
            parsed.conninfo,
            display=parsed.display,
            size=parsed.option_int("pool_size", DEFAULT_POOL_SIZE),
            connect_timeout=parsed.connect_timeout,
            prepare=parsed.option_flag("prepare", False),
        )
        self._hint = _Hint()
        s = sql.Identifier(self.schema).as_string(None)
        self._s = s
        try:
            self.mode: Mode = self._initialise(mode)
        except BaseException:
            self._pool.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresStoreBackend({self.url!r})"

    def _sql(self, text: str) -> bytes:
        return text.replace("{s}", self._s).encode()

    def _initialise(self, requested: Mode | None) -> Mode:
        try:
            with self._pool.connection(self._connect_budget) as conn:
                meta = migrate(
                    conn,
                    schema=self.schema,
                    meta_table="store_meta",
                    fmt=FORMAT,
                    migrations=MIGRATIONS,
                    initial={},
                    where=self._where,
                )
                mode = resolve_mode(meta.get("mode"), requested, self._where)
                if "mode" not in meta:
                    conn.execute(
                        self._sql(
                            "INSERT INTO {s}.store_meta (key, value) VALUES ('mode', %s) "
                            "ON CONFLICT (key) DO NOTHING"
                        ),
                        (mode,),
                    )
                    row = conn.execute(
                        self._sql("SELECT value FROM {s}.store_meta WHERE key = 'mode'")
                    ).fetchone()
                    mode = resolve_mode(None if row is None else str(row[0]), requested, self._where)
                return mode
        except psycopg.Error as error:
            raise translate(error, "opening the store", sent=False, where=self._where) from error

    # -- helpers ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def prefetching(self, *, key: str | None = None, pointer: str | None = None) -> Iterator[None]:
        """Announce the key or pointer the next mutation of this thread will read."""
        hint = self._hint
        hint.key, hint.pointer = key, pointer
        try:
            yield
        finally:
            hint.key = hint.pointer = None

    def _read(self, doing: str, query: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        with self._pool.connection(self._connect_budget) as conn, guarded(conn, self._timeout):
            try:
                return conn.execute(self._sql(query), params).fetchall()
            except psycopg.Error as error:
                if conn.broken:
                    self._pool.discard_idle()
                raise translate(error, doing, sent=False, where=self._where) from error

    # -- the critical section -----------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, resource: str) -> Iterator[_PgTransaction]:
        with self._pool.connection(self._connect_budget) as conn:
            with guarded(conn, self._timeout) as fired:
                tx = _PgTransaction(self, conn, resource, self._hint.key, self._hint.pointer)
                try:
                    yield tx
                except FencedError:
                    tx.abort()
                    raise
                except psycopg.Error as error:
                    tx.abort()
                    raise self._failed(error, conn, f"writing {resource!r}", fired()) from error
                except BaseException:
                    tx.abort()
                    raise
                try:
                    tx.commit()
                except psycopg.Error as error:
                    tx.abort()
                    raise self._failed(
                        error, conn, f"committing a write to {resource!r}", fired(), sent=True
                    ) from error

    def _failed(
        self,
        error: psycopg.Error,
        conn: psycopg.Connection[tuple[object, ...]],
        doing: str,
        fired: bool,
        *,
        sent: bool = False,
    ) -> FencedError:
        if conn.broken:
            self._pool.discard_idle()
        if fired:
            if sent:
                return OutcomeUnknown(
                    f"{doing} ({self._where}): no reply within {self._timeout:g}s, the "
                    "connection was cut; the write may or may not have been applied: retry "
                    "with the same op_id to find out"
                )
            return Unavailable(f"{doing} ({self._where}): no reply within {self._timeout:g}s")
        if getattr(error, "sqlstate", None) == "55P03":
            return Unavailable(
                f"{doing}: another writer held the domain for longer than the busy timeout; "
                "nothing changed, retry"
            )
        return translate(error, doing, sent=sent, where=self._where)

    # -- reads --------------------------------------------------------------------------------

    def head(self, resource: str) -> Head:
        rows = self._read(
            f"reading {resource!r}",
            "SELECT coordinator_id, floor FROM {s}.store_domains WHERE resource = %s",
            (resource,),
        )
        return Head() if not rows else Head(str(rows[0][0]), int(rows[0][1]))

    def get(self, resource: str, key: str) -> Item | None:
        rows = self._read(
            f"reading {resource!r}",
            "SELECT value, epoch, version FROM {s}.store_items WHERE resource = %s AND key = %s",
            (resource, key),
        )
        if not rows:
            return None
        value, epoch, version = rows[0]
        return Item(resource, key, bytes(value), int(epoch), int(version))

    def pointer(self, resource: str, name: str) -> Publication | None:
        rows = self._read(f"reading {resource!r}", _POINTER, (resource, name))
        return None if not rows else _publication(resource, name, rows[0])

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        conn = self._pool.open_connection(self._connect_budget)
        try:
            with guarded(conn, self._timeout):
                conn.execute(b"BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                rows = conn.execute(self._sql(_POINTER), (resource, name)).fetchall()
                if not rows:
                    conn.close()
                    return None
                publication = _publication(resource, name, rows[0])
                found = conn.execute(
                    self._sql("SELECT chunks FROM {s}.store_objects WHERE object_id = %s"),
                    (publication.object_id,),
                ).fetchone()
            if found is None:
                raise ConfigurationError(
                    f"the pointer of {resource!r} names a missing object: the store is corrupt"
                )
        except psycopg.Error as error:
            conn.close()
            raise translate(error, f"reading {resource!r}", sent=False, where=self._where) from error
        except BaseException:
            conn.close()
            raise
        reader = _ChunkReader(self, conn, publication.object_id, int(found[0]))
        return publication, cast(BinaryIO, reader)

    # -- objects ------------------------------------------------------------------------------

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        """Write the object's chunks and its row in one transaction (streamed with COPY).

        Each chunk must reach the server within the operation timeout (a rolling deadline).
        Any failure rolls the whole object back: nothing was published, retry
        (:class:`~fenced.Unavailable`, even if the commit's reply was lost: an object that no
        pointer references is only garbage for gc).
        """
        doing = f"staging an object of {resource!r}"
        copy_sql = self._sql(
            "COPY {s}.store_chunks (object_id, seq, data) FROM STDIN (FORMAT BINARY)"
        )
        with self._pool.connection(self._connect_budget) as conn:
            watchdog = deadlines()
            key, armed = watchdog.arm(conn.fileno(), self._timeout)
            try:
                count = size = 0
                with conn.transaction(), conn.cursor() as cur:
                    with cur.copy(copy_sql) as copy:
                        copy.set_types(["text", "int4", "bytea"])
                        for chunk in chunks:
                            copy.write_row((object_id, count, chunk))
                            count += 1
                            size += len(chunk)
                            watchdog.disarm(key, armed)
                            key, armed = watchdog.arm(conn.fileno(), self._timeout)
                    conn.execute(
                        self._sql(
                            "INSERT INTO {s}.store_objects"
                            " (object_id, resource, chunks, size, staged_at)"
                            " VALUES (%s, %s, %s, %s, %s)"
                        ),
                        (object_id, resource, count, size, now),
                    )
                    _durable(conn)
            except psycopg.Error as error:
                if conn.broken:
                    self._pool.discard_idle()
                if armed.fired:
                    raise Unavailable(
                        f"{doing} ({self._where}): no reply within {self._timeout:g}s; nothing "
                        "was published, retry"
                    ) from error
                raise translate(error, doing, sent=False, where=self._where) from error
            finally:
                watchdog.disarm(key, armed)

    def discard(self, resource: str, object_id: str) -> None:
        try:
            with self._pool.connection(self._connect_budget) as conn, guarded(conn, self._timeout):
                with conn.transaction():
                    _delete_object(conn, self._s, object_id)
        except (psycopg.Error, FencedError):
            pass  # best effort: gc removes it later

    def gc(self, choose: Chooser, cutoff: float) -> int:
        removed = 0
        resources = [
            str(row[0])
            for row in self._read(
                "collecting garbage", "SELECT DISTINCT resource FROM {s}.store_objects", ()
            )
        ]
        for resource in resources:
            with self.transaction(resource) as tx:
                removed += tx.collect(choose)
        return removed

    def close(self) -> None:
        self._pool.close()


_POINTER = (
    "SELECT epoch, object_id, sha256, size, published_at FROM {s}.store_pointers"
    " WHERE resource = %s AND name = %s"
)


def _publication(resource: str, name: str, row: tuple[Any, ...]) -> Publication:
    epoch, object_id, sha256, size, published_at = row
    return Publication(
        resource, name, int(epoch), str(object_id), str(sha256), int(size), float(published_at)
    )


def _durable(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Raise ``synchronous_commit`` for this transaction if the server runs with it off."""
    conn.execute(
        b"SELECT CASE WHEN current_setting('synchronous_commit') = 'off'"
        b" THEN set_config('synchronous_commit', 'on', true) END"
    )


def _delete_object(conn: psycopg.Connection[tuple[object, ...]], s: str, object_id: str) -> None:
    conn.execute(f"DELETE FROM {s}.store_chunks WHERE object_id = %s".encode(), (object_id,))
    conn.execute(f"DELETE FROM {s}.store_objects WHERE object_id = %s".encode(), (object_id,))


class _PgTransaction:
    """One store transaction: reads go out with the lock, writes go out with COMMIT.

    Not thread-safe (one per mutation). ``begin`` is lazy: the first read sends ``BEGIN``, the
    lock, the head, the prefetched key/pointer and itself in one pipeline.
    """

    def __init__(
        self,
        backend: PostgresBackend,
        conn: psycopg.Connection[tuple[object, ...]],
        resource: str,
        key_hint: str | None,
        pointer_hint: str | None,
    ) -> None:
        self._b = backend
        self._conn = conn
        self._resource = resource
        self._key_hint = key_hint
        self._pointer_hint = pointer_hint
        self._begun = False
        self._head: Head | None = None
        self._versions: dict[str, int | None] = {}
        self._pointers: dict[str, Publication | None] = {}
        self._writes: list[tuple[bytes, tuple[object, ...]]] = []

    # -- plumbing -----------------------------------------------------------------------------

    def _begin(self, extra: tuple[bytes, tuple[object, ...]] | None = None) -> Any:
        """Start: BEGIN, lock timeout, the domain lock, the head and prefetches; run ``extra``."""
        b = self._b
        conn = self._conn
        r = self._resource
        with conn.pipeline():
            conn.execute(b"BEGIN")
            conn.execute(
                b"SELECT set_config('lock_timeout', %s, true)", (f"{b._lock_timeout_ms}ms",)
            )
            conn.execute(
                b"SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                (f"fenced.store.{b.schema}:{r}",),
            )
            head = conn.execute(
                b._sql("SELECT coordinator_id, floor FROM {s}.store_domains WHERE resource = %s"),
                (r,),
            )
            version = None
            if self._key_hint is not None:
                version = conn.execute(
                    b._sql("SELECT version FROM {s}.store_items WHERE resource = %s AND key = %s"),
                    (r, self._key_hint),
                )
            pointer = None
            if self._pointer_hint is not None:
                pointer = conn.execute(b._sql(_POINTER), (r, self._pointer_hint))
            result = None if extra is None else conn.execute(*extra)
        self._begun = True
        row = head.fetchone()
        self._head = Head() if row is None else Head(str(row[0]), int(row[1]))
        if version is not None and self._key_hint is not None:
            found = version.fetchone()
            self._versions[self._key_hint] = None if found is None else int(found[0])
        if pointer is not None and self._pointer_hint is not None:
            found = pointer.fetchone()
            self._pointers[self._pointer_hint] = (
                None if found is None else _publication(r, self._pointer_hint, found)
            )
        return None if result is None else result.fetchall()

    def _query(self, query: str, params: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """A read inside the transaction (after flushing buffered writes)."""
        statement = (self._b._sql(query), params)
        if not self._begun:
            rows: list[tuple[Any, ...]] = self._begin(statement)
            return rows
        if self._writes:
            with self._conn.pipeline():
                for write in self._writes:
                    self._conn.execute(*write)
                cur = self._conn.execute(*statement)
            self._writes.clear()
            return cur.fetchall()
        return self._conn.execute(*statement).fetchall()

    def _write(self, query: str, params: tuple[object, ...]) -> None:
        if not self._begun:
            self._begin()
        self._writes.append((self._b._sql(query), params))

    def commit(self) -> None:
        if not self._begun:
            return
        with self._conn.pipeline():
            for write in self._writes:
                self._conn.execute(*write)
            if self._writes:
                self._conn.execute(
                    b"SELECT CASE WHEN current_setting('synchronous_commit') = 'off'"
                    b" THEN set_config('synchronous_commit', 'on', true) END"
                )
            self._conn.execute(b"COMMIT")
        self._writes.clear()

    def abort(self) -> None:
        self._writes.clear()
        conn = self._conn
        if self._begun and not conn.closed and not conn.broken:
            with contextlib.suppress(psycopg.Error):
                conn.execute(b"ROLLBACK")

    # -- the Transaction protocol -------------------------------------------------------------

    def head(self) -> Head:
        if self._head is None:
            self._begin()
        assert self._head is not None
        return self._head

    def set_head(self, head: Head) -> None:
        self._write(
            "INSERT INTO {s}.store_domains (resource, coordinator_id, floor) VALUES (%s, %s, %s)"
            " ON CONFLICT (resource) DO UPDATE SET coordinator_id = excluded.coordinator_id,"
            " floor = excluded.floor",
            (self._resource, head.coordinator_id, head.floor),
        )
        self._head = head

    def op(self, op_id: str) -> OpRecord | None:
        rows = self._query(
            "SELECT digest, outcome, recorded_at FROM {s}.store_ops"
            " WHERE resource = %s AND op_id = %s",
            (self._resource, op_id),
        )
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
        )

    def prune_ops(self, before: float) -> None:
        self._write(
            "DELETE FROM {s}.store_ops WHERE resource = %s AND recorded_at < %s",
            (self._resource, before),
        )

    def version_of(self, key: str) -> int | None:
        if not self._begun:
            self._begin()
        if key in self._versions:
            return self._versions[key]
        rows = self._query(
            "SELECT version FROM {s}.store_items WHERE resource = %s AND key = %s",
            (self._resource, key),
        )
        self._versions[key] = None if not rows else int(rows[0][0])
        return self._versions[key]

    def put_item(self, item: Item) -> None:
        self._write(
            "INSERT INTO {s}.store_items (resource, key, value, epoch, version)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (resource, key) DO UPDATE SET"
            " value = excluded.value, epoch = excluded.epoch, version = excluded.version",
            (item.resource, item.key, item.value, item.epoch, item.version),
        )
        self._versions[item.key] = item.version

    def pointer(self, name: str) -> Publication | None:
        if not self._begun:
            self._begin()
        if name in self._pointers:
            return self._pointers[name]
        rows = self._query(_POINTER, (self._resource, name))
        self._pointers[name] = None if not rows else _publication(self._resource, name, rows[0])
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


class _ChunkReader(io.RawIOBase):
    """One object's chunks, read in the snapshot of its own connection's transaction."""

    def __init__(
        self,
        backend: PostgresBackend,
        conn: psycopg.Connection[tuple[object, ...]],
        object_id: str,
        chunks: int,
    ) -> None:
        super().__init__()
        self._backend = backend
        self._db = conn
        self._object_id = object_id
        self._chunks = chunks
        self._next = 0
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _fetch(self) -> bytes | None:
        if self._next >= self._chunks:
            return None
        b = self._backend
        try:
            with guarded(self._db, b._timeout):
                row = self._db.execute(
                    b._sql("SELECT data FROM {s}.store_chunks WHERE object_id = %s AND seq = %s"),
                    (self._object_id, self._next),
                ).fetchone()
        except psycopg.Error as error:
            raise translate(
                error, f"reading object {self._object_id}", sent=False, where=b._where
            ) from error
        if row is None:
            raise ConfigurationError(f"object {self._object_id} misses a chunk: corrupt store")
        self._next += 1
        return bytes(row[0])

    def readinto(self, buffer: WriteableBuffer) -> int:
        while not self._pending:
            chunk = self._fetch()
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        target = memoryview(buffer).cast("B")
        n = min(len(target), len(self._pending))
        target[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def readall(self) -> bytes:
        parts = [bytes(self._pending)]
        self._pending = memoryview(b"")
        while (chunk := self._fetch()) is not None:
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self._db.close()
        super().close()

"""The ``postgresql://`` store: fencing domains, keys and publications in PostgreSQL.

:class:`PostgresBackend` is the store backend (registered for ``postgresql://`` and
``postgres://`` in :mod:`fenced.fence._registry`); :class:`~fenced.fence._store.Store` does
validation, op ids and asks :mod:`fenced.fence._rules` for every decision, exactly as for the
other stores. Its transactions are in :mod:`fenced.fence.postgres._transaction`. What this backend
guarantees:

* **Critical section**: one transaction per mutation that first takes a *transaction-level*
  advisory lock on the domain (``pg_advisory_xact_lock``, released by COMMIT or ROLLBACK; it
  works through a transaction-pooling PgBouncer). Every read inside runs after the lock is held
  (READ COMMITTED, one snapshot per statement), so it sees every earlier commit of the domain. A
  lock wait longer than ``busy_timeout`` is :class:`~fenced.Unavailable` (``lock_timeout``).
* **Round trips**: ordinarily two per mutation — the lock, the domain's head and the announced
  reads (the :class:`~fenced.fence.backend.Intent`'s key version or pointer, an op id) go out as
  one multi-statement query; the writes are buffered and sent with ``COMMIT``. Once this
  process has seen a domain, ``put`` and ``fence`` are *speculative*
  (:attr:`~fenced.fence.backend.FastPath.SPECULATION`): decided by
  :class:`~fenced.fence._store.Store` on the state seen last, then sent as one statement
  (``store_apply_all``) that takes the lock, raises unless that state is still current, and
  applies the writes and the records; a changed state is
  :class:`~fenced.fence.backend.SpeculationFailed` and the store runs the mutation again the
  ordinary way, whose answer alone is reported. A break while the commit is in flight is
  :class:`~fenced.OutcomeUnknown` (retry with the same op id); a failure before it is
  :class:`~fenced.Unavailable` (nothing was changed).
* **Durability**: commits are synchronous (``synchronous_commit`` raised for the transaction
  when the server has it off): a mutation is on disk when it returns.
* **Objects** are ``bytea`` chunks written with their row in one transaction: complete or
  absent, streamed, never held in memory whole (see :mod:`fenced.fence.postgres._objects`).
* **Snapshot reads**: :meth:`PostgresBackend.open_current` reads the pointer and the chunks in
  one ``REPEATABLE READ READ ONLY`` transaction of a connection of its own: the stream is
  unaffected by later publications and even by gc (MVCC) until it is closed.
* **Records** (:attr:`~fenced.fence.backend.Capability.RECORDS`): rows of ``store_records``.
  Installs and accepted mutations are inserted in the mutation's own transaction (by the one
  statement of a speculative mutation, ``store_apply_all``); a rejection is inserted by a
  transaction of its own, under the domain lock, committed with ``synchronous_commit = off``
  (no wait for the WAL flush). ``seq`` is one sequence for the whole store. Pruning (inside
  one write in 64) first looks at the oldest and newest record of the resource and deletes
  only when some are due.
* **Schema**: tables ``store_*`` and the functions ``store_apply_all`` and
  ``store_apply_records`` in the URL's schema (default ``fenced``, ``?schema=``), versioned in
  ``store_meta`` (``format``, ``schema_version``, ``mode``). :data:`MIGRATIONS` lists the
  versions (today one: the initial format), created or applied automatically by
  :func:`fenced._drivers.postgres.migrate`; a later change appends a
  :class:`~fenced._drivers.migrations.Migration`, a released one is never edited. A store of a
  newer version, or tables of another format, are refused with
  :class:`~fenced.ConfigurationError` and left untouched.

URL query parameters: ``schema``, ``pool_size``, ``timeout`` (seconds an operation may take, its
wait for a connection included: its statements get only the time left once it is connected;
default 10), ``prepare`` (``off``: no server-side prepared statements) — see docs/postgres.md.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, BinaryIO, cast

import psycopg
from psycopg import pq, sql

from fenced._drivers.migrations import Migration
from fenced._drivers.postgres import (
    DEFAULT_OP_TIMEOUT,
    Lender,
    Statement,
    dedicated,
    execute,
    guarded,
    migrate,
    translate,
)
from fenced._drivers.postgres_borrowed import lender
from fenced._drivers.postgres_url import ParsedURL
from fenced.core._errors import (
    ConfigurationError,
    CorruptData,
    FencedError,
    OutcomeUnknown,
    Rejected,
    Unavailable,
)
from fenced.core._records import Record, RecordKind
from fenced.fence._rules import Head, resolve_mode
from fenced.fence._values import Item, Mode, Publication
from fenced.fence.backend import (
    ORDINARY,
    Capability,
    Chooser,
    FastPath,
    Intent,
    SpeculationFailed,
    StoreOptions,
)
from fenced.fence.postgres._objects import ChunkStream, copy_chunks, delete_object, durable
from fenced.fence.postgres._transaction import (
    APPLY,
    APPLY_N,
    INSERT_RECORD,
    LOCK,
    POINTER,
    PostgresTransaction,
    Remembered,
    publication_of,
    record_params,
)

__all__ = [
    "FORMAT",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "PostgresBackend",
    "open_postgres_backend",
]

FORMAT = "fenced.store"
_URL_KEYS = ("pool_size", "timeout", "prepare")

_TABLES = (
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
    "CREATE TABLE {s}.store_records (seq bigserial PRIMARY KEY, resource text NOT NULL,"
    " at double precision NOT NULL, kind text NOT NULL, epoch bigint NOT NULL,"
    " detail text NOT NULL)",
    "CREATE INDEX store_records_by_resource ON {s}.store_records (resource, seq)",
)

# The records of one call, a JSON array of [at, kind, epoch, detail], inserted in order (the
# body of both functions below).
_INSERT_RECORDS = """\
            INSERT INTO {s}.store_records (resource, at, kind, epoch, detail)
            SELECT p_resource, (e.value->>0)::double precision, e.value->>1,
                (e.value->>2)::bigint, e.value->>3
            FROM json_array_elements(p_records::json) WITH ORDINALITY AS e (value, n)
            ORDER BY e.n;
"""

_FUNCTIONS = (
    # A speculative write and its records in one statement (see PostgresTransaction._apply):
    # take the domain lock, raise FN100 unless the state the write was decided on (the head,
    # the key's version, the op id's absence) still holds, then apply the writes, insert the
    # records (a JSON array of [at, kind, epoch, detail], in order) and now and then prune. No
    # decision is taken here: the rules ran in Python. The op id check is a statement of its
    # own so that its plan is made once per session; an existing item is UPDATEd (no
    # speculative insertion).
    """CREATE FUNCTION {s}.store_apply_all(
        p_resource text, p_lock_key text, p_lock_timeout text,
        p_coordinator text, p_floor bigint,
        p_key text, p_version bigint, p_op text,
        p_head_coordinator text, p_head_floor bigint,
        p_item_key text, p_item_value bytea, p_item_epoch bigint, p_item_version bigint,
        p_op_id text, p_op_digest text, p_op_outcome text,
        p_op_recorded_at double precision, p_prune_before double precision,
        p_records text, p_records_before double precision, p_records_keep bigint)
    RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        v_coordinator text;
        v_floor bigint;
        v_version bigint;
        v_ignored text;
    BEGIN
        v_ignored := set_config('lock_timeout', p_lock_timeout, true);
        IF current_setting('synchronous_commit') = 'off' THEN
            v_ignored := set_config('synchronous_commit', 'on', true);
        END IF;
        PERFORM pg_advisory_xact_lock(hashtextextended(p_lock_key, 0));
        SELECT d.coordinator_id, d.floor INTO v_coordinator, v_floor
        FROM {s}.store_domains d WHERE d.resource = p_resource;
        IF p_key IS NOT NULL THEN
            SELECT i.version INTO v_version FROM {s}.store_items i
            WHERE i.resource = p_resource AND i.key = p_key;
        END IF;
        IF v_coordinator IS DISTINCT FROM p_coordinator
                OR v_floor IS DISTINCT FROM p_floor
                OR v_version IS DISTINCT FROM p_version THEN
            RAISE EXCEPTION 'fenced: the domain changed' USING ERRCODE = 'FN100';
        END IF;
        IF p_op IS NOT NULL THEN
            IF EXISTS (SELECT 1 FROM {s}.store_ops o
                    WHERE o.resource = p_resource AND o.op_id = p_op) THEN
                RAISE EXCEPTION 'fenced: the domain changed' USING ERRCODE = 'FN100';
            END IF;
        END IF;
        IF p_head_floor IS NOT NULL THEN
            INSERT INTO {s}.store_domains (resource, coordinator_id, floor)
            VALUES (p_resource, p_head_coordinator, p_head_floor)
            ON CONFLICT (resource) DO UPDATE SET
                coordinator_id = excluded.coordinator_id, floor = excluded.floor;
        END IF;
        IF p_item_key IS NOT NULL THEN
            UPDATE {s}.store_items i SET value = p_item_value, epoch = p_item_epoch,
                version = p_item_version
            WHERE i.resource = p_resource AND i.key = p_item_key;
            IF NOT FOUND THEN
                INSERT INTO {s}.store_items (resource, key, value, epoch, version)
                VALUES (p_resource, p_item_key, p_item_value, p_item_epoch,
                    p_item_version)
                ON CONFLICT (resource, key) DO UPDATE SET value = excluded.value,
                    epoch = excluded.epoch, version = excluded.version;
            END IF;
        END IF;
        IF p_op_id IS NOT NULL THEN
            INSERT INTO {s}.store_ops (resource, op_id, digest, outcome, recorded_at)
            VALUES (p_resource, p_op_id, p_op_digest, p_op_outcome, p_op_recorded_at)
            ON CONFLICT (resource, op_id) DO UPDATE SET digest = excluded.digest,
                outcome = excluded.outcome, recorded_at = excluded.recorded_at;
        END IF;
        IF p_prune_before IS NOT NULL THEN
            DELETE FROM {s}.store_ops o
            WHERE o.resource = p_resource AND o.recorded_at < p_prune_before;
        END IF;
        IF p_records IS NOT NULL THEN
"""
    + _INSERT_RECORDS
    + """        END IF;
        IF p_records_before IS NOT NULL THEN
            PERFORM {s}.store_apply_records(p_resource, NULL, p_records_before,
                p_records_keep);
        END IF;
    END $$""",
    # Insert records (as store_apply_all does) and, if p_prune_before is given, delete what is
    # due: the records older than p_prune_before, and those beyond the newest p_prune_keep. It
    # first looks at the oldest and the newest record of the resource (two index probes) and
    # deletes only when some are due: past the retention when the oldest is, beyond the limit
    # only when the records span more than p_prune_keep sequence numbers (seq is unique: fewer
    # records cannot exceed the limit then). A record older than the retention behind a newer
    # oldest one (the clock stepped back) waits for a later prune; history() never returns it.
    """CREATE FUNCTION {s}.store_apply_records(p_resource text,
        p_records text, p_prune_before double precision, p_prune_keep bigint)
    RETURNS void
    LANGUAGE plpgsql AS $$
    DECLARE
        v_oldest bigint;
        v_oldest_at double precision;
        v_cut bigint;
    BEGIN
        IF p_records IS NOT NULL THEN
"""
    + _INSERT_RECORDS
    + """        END IF;
        IF p_prune_before IS NOT NULL THEN
            SELECT r.seq, r.at INTO v_oldest, v_oldest_at FROM {s}.store_records r
            WHERE r.resource = p_resource ORDER BY r.resource, r.seq LIMIT 1;
            IF v_oldest_at < p_prune_before THEN
                DELETE FROM {s}.store_records r
                WHERE r.resource = p_resource AND r.at < p_prune_before;
            END IF;
            IF (SELECT r.seq FROM {s}.store_records r WHERE r.resource = p_resource
                    ORDER BY r.resource DESC, r.seq DESC LIMIT 1) - v_oldest
                    >= p_prune_keep THEN
                v_cut := (SELECT k.seq FROM {s}.store_records k
                    WHERE k.resource = p_resource
                    ORDER BY k.resource DESC, k.seq DESC LIMIT 1 OFFSET p_prune_keep);
                IF v_cut IS NOT NULL THEN
                    DELETE FROM {s}.store_records r
                    WHERE r.resource = p_resource AND r.seq <= v_cut;
                END IF;
            END IF;
        END IF;
    END $$""",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "domains, items, pointers, objects as bytea chunks, op ids, records; a speculative "
        "write and its records in one statement",
        _TABLES + _FUNCTIONS,
    ),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
"""The newest schema this code knows; a store of a newer version is refused."""


def open_postgres_backend(url: object, mode: Mode | None, options: StoreOptions) -> PostgresBackend:
    """Open (creating its tables if needed) the store backend at ``url`` — a URL, or a user's
    ``psycopg_pool.ConnectionPool`` or SQLAlchemy ``Engine`` (see
    :mod:`fenced._drivers.postgres_borrowed`) — with validated ``options``: what
    ``fenced.open_store("postgresql://…")`` or ``fenced.open_store(pool)`` opens (see the
    registry)."""
    return PostgresBackend(url, mode, options)


def open_green_postgres_backend(
    url: object, mode: Mode | None, options: StoreOptions
) -> PostgresBackend:
    """:func:`open_postgres_backend` for the asyncio face, called inside
    :func:`~fenced._drivers.green.greenlet_spawn`: the same backend on
    :class:`~fenced._drivers.postgres_green.GreenLender` connections (psycopg's
    ``AsyncConnection`` s on the running loop, no thread). A URL only."""
    from fenced._drivers.postgres_green import green_lender  # noqa: PLC0415 - asyncio only

    return PostgresBackend(url, mode, options, lend=green_lender)


_REMEMBERED_DOMAINS = 4096  # domains whose state a backend remembers for speculation


class PostgresBackend:
    """The store backend on PostgreSQL; see the module docstring. Thread-safe."""

    capabilities = frozenset(
        {
            Capability.KEYS,
            Capability.PUBLICATION,
            Capability.OP_IDS,
            Capability.MULTI_PROCESS,
            Capability.RECORDS,
        }
    )
    fast_paths = frozenset({FastPath.SPECULATION})

    def __init__(
        self,
        url: object,
        mode: Mode | None,
        options: StoreOptions,
        *,
        lend: Callable[
            [object, Sequence[str], Mapping[str, object] | None], tuple[ParsedURL, Lender]
        ] = lender,
    ) -> None:
        parsed, self._pool = lend(url, _URL_KEYS, options.backend_options)
        self._watch = self._pool.watchdog()
        self.url = parsed.display
        self.schema = parsed.schema
        self._where = f"postgres store {parsed.display}"
        try:
            self._timeout = parsed.option_float("timeout", DEFAULT_OP_TIMEOUT, minimum=0.01)
        except BaseException:
            self._pool.close()
            raise
        self._connect_budget = min(parsed.connect_timeout, self._timeout)
        self._lock_timeout_ms = max(int(options.busy_timeout * 1000), 1)
        self._lock_timeout = f"{self._lock_timeout_ms}ms"  # the lock_timeout setting
        self._remembered: dict[str, Remembered] = {}  # by resource, the oldest first
        self._remembered_lock = threading.Lock()
        self._quoted_schema = sql.Identifier(self.schema).as_string(None)  # for {s} in queries
        self._queries: dict[str, bytes] = {}  # _sql's, built once
        # the speculative write, sent through libpq directly (see Statement)
        self._apply = Statement(self._sql(APPLY_N), self._sql(APPLY))
        try:
            self.mode: Mode = self._initialise(mode)
        except BaseException:
            self._pool.close()
            raise

    def __repr__(self) -> str:
        return f"PostgresStoreBackend({self.url!r})"

    def _sql(self, text: str) -> bytes:
        query = self._queries.get(text)
        if query is None:
            query = text.replace("{s}", self._quoted_schema).encode()
            if len(self._queries) < 256:  # a few dozen texts (see PostgresTransaction._check)
                self._queries[text] = query
        return query

    def _initialise(self, requested: Mode | None) -> Mode:
        try:
            # a connection of its own: a failure here (wrong password, missing database, newer
            # schema) is reported at once and starts no pool threads
            with dedicated(self._pool, self._connect_budget) as conn:
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
                    mode = resolve_mode(
                        None if row is None else str(row[0]), requested, self._where
                    )
                return mode
        except psycopg.Error as error:
            raise translate(error, "opening the store", sent=False, where=self._where) from error

    # -- remembered domains, deadlines, one-statement reads -----------------------------------

    def knows(self, resource: str, key: str | None) -> bool:
        """Whether a speculative mutation of ``resource`` (reading ``key``) is worth trying:
        this process remembers the domain's state (and ``key``'s version)."""
        with self._remembered_lock:
            known = self._remembered.get(resource)
        return known is not None and (key is None or known.version(key)[0])

    def _remember(self, resource: str, known: Remembered | None) -> None:
        with self._remembered_lock:
            self._remembered.pop(resource, None)
            if known is not None:
                if len(self._remembered) >= _REMEMBERED_DOMAINS:
                    del self._remembered[next(iter(self._remembered))]
                self._remembered[resource] = known

    def _deadline(self) -> float:
        """When an operation that starts now must end (``time.monotonic()``): ``?timeout=``
        counts from the start of the call, waiting for a connection included."""
        return time.monotonic() + self._timeout

    def _left(self, doing: str, deadline: float) -> float:
        """Seconds left before ``deadline`` for the statements, once connected: connecting
        never makes a call outlast its timeout. :class:`Unavailable` (nothing was sent) if
        getting the connection took them all."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise Unavailable(
                f"{doing} ({self._where}): no connection within {self._timeout:g}s; nothing "
                "was changed, retry"
            )
        return left

    def _read(self, doing: str, query: str, params: Sequence[object]) -> list[tuple[Any, ...]]:
        deadline = self._deadline()
        with (
            self._pool.connection(self._connect_budget) as conn,
            guarded(conn, self._left(doing, deadline), self._watch),
        ):
            try:
                return execute(self._pool, conn, self._sql(query), params)
            except psycopg.Error as error:
                if conn.broken:
                    self._pool.discard_idle()
                raise translate(error, doing, sent=False, where=self._where) from error

    # -- the critical section -----------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(
        self, resource: str, intent: Intent = ORDINARY
    ) -> Iterator[PostgresTransaction]:
        """The critical section of ``resource`` (see the module docstring).

        Ordinary: the first read sends BEGIN, the lock, the head and the reads ``intent``
        announces in one round trip; the writes go with COMMIT. Speculative (``intent.speculate``):
        reads are answered from the state this process saw last, and one ``store_apply_all``
        statement takes the lock, checks that this state is still current and applies the
        writes and records; a changed state aborts it (``SpeculationFailed``).
        """
        with self._remembered_lock:
            known = self._remembered.get(resource) if intent.speculate else None
        if intent.speculate and known is None:
            raise SpeculationFailed(resource)
        deadline = self._deadline()
        with self._pool.connection(self._connect_budget) as conn:
            left = self._left(f"writing {resource!r}", deadline)
            watchdog = self._watch  # as guarded(): the statements below end at the deadline
            armed_key, armed = watchdog.arm(conn.fileno(), left)
            tx = PostgresTransaction(self, conn, resource, intent.key, intent.pointer, known)
            try:
                try:
                    yield tx
                except psycopg.Error as error:
                    tx.abort()
                    self._remember(resource, None)
                    if tx.speculative and getattr(error, "sqlstate", None) in ("22012", "FN100"):
                        raise SpeculationFailed(resource) from error
                    raise self._failed(error, conn, f"writing {resource!r}", armed.fired) from error
                except Rejected:
                    tx.abort()  # nothing was written; what was read under the lock stays true
                    self._remember(resource, tx.seen())
                    raise
                except BaseException:  # a conflict, or the caller's own error
                    tx.abort()
                    raise
                try:
                    tx.commit()
                except psycopg.Error as error:
                    tx.abort()
                    self._remember(resource, None)
                    if tx.speculative and getattr(error, "sqlstate", None) in ("22012", "FN100"):
                        raise SpeculationFailed(resource) from error
                    raise self._failed(
                        error, conn, f"committing a write to {resource!r}", armed.fired, sent=True
                    ) from error
            finally:
                watchdog.disarm(armed_key, armed)
            self._remember(resource, tx.seen())

    def _failed(
        self,
        error: psycopg.Error,
        conn: psycopg.Connection[tuple[Any, ...]],
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

    # -- records ------------------------------------------------------------------------------

    def record_rejection(self, record: Record) -> None:
        """Insert ``record`` in a transaction of its own, committed without waiting for the WAL
        flush (``synchronous_commit = off``): a crash of the server may lose it, never a crash
        of this process once it returned. It takes the domain lock (so that one resource's
        records become visible in ``seq`` order) and changes nothing but the records.
        """
        doing = f"recording a rejection on {record.resource!r}"
        deadline = self._deadline()
        with (
            self._pool.connection(self._connect_budget) as conn,
            guarded(conn, self._left(doing, deadline), self._watch) as fired,
        ):
            cur: psycopg.ClientCursor[tuple[Any, ...]] = psycopg.ClientCursor(conn)
            try:
                cur.execute(
                    b"BEGIN; "
                    + LOCK
                    + b"; SET LOCAL synchronous_commit = off; "
                    + self._sql(INSERT_RECORD)
                    + b"; COMMIT",
                    (
                        f"{self._lock_timeout_ms}ms",
                        f"fenced.store.{self.schema}:{record.resource}",
                        *record_params(record),
                    ),
                )
            except psycopg.Error as error:
                if not conn.closed and not conn.broken:
                    with contextlib.suppress(psycopg.Error):
                        conn.execute(b"ROLLBACK")
                raise self._failed(error, conn, doing, fired()) from error

    def history(self, resource: str, after: int, *, since: float, keep: int) -> list[Record]:
        rows = self._read(
            f"reading the records of {resource!r}",
            "SELECT seq, at, kind, epoch, detail FROM {s}.store_records WHERE resource = %s"
            " AND seq > %s AND at >= %s AND seq > coalesce((SELECT seq FROM {s}.store_records"
            " WHERE resource = %s ORDER BY seq DESC LIMIT 1 OFFSET %s), 0) ORDER BY seq",
            (resource, after, since, resource, keep),
        )
        try:
            return [
                Record(
                    int(seq),
                    float(at),
                    RecordKind(kind),
                    resource,
                    int(epoch),
                    None,
                    json.loads(detail),
                )
                for seq, at, kind, epoch, detail in rows
            ]
        except ValueError as error:
            raise ConfigurationError(f"corrupt records of {resource!r} in {self._where}") from error

    def floors(self) -> dict[str, int]:
        rows = self._read("reading floors", "SELECT resource, floor FROM {s}.store_domains", ())
        return {str(resource): int(floor) for resource, floor in rows}

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
        rows = self._read(f"reading {resource!r}", POINTER, (resource, name))
        return None if not rows else publication_of(resource, name, rows[0])

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        deadline = self._deadline()
        conn, give_back = self._pool.lend_dedicated(self._connect_budget)
        release = partial(self._end_snapshot, conn, give_back)
        try:
            with guarded(conn, self._left(f"reading {resource!r}", deadline), self._watch):
                conn.execute(b"BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                rows = conn.execute(self._sql(POINTER), (resource, name), prepare=False).fetchall()
                if not rows:
                    release()
                    return None
                publication = publication_of(resource, name, rows[0])
                found = conn.execute(
                    self._sql("SELECT chunks FROM {s}.store_objects WHERE object_id = %s"),
                    (publication.object_id,),
                    prepare=False,
                ).fetchone()
            if found is None:
                raise CorruptData(
                    f"the pointer of {resource!r} names a missing object: the store is corrupt"
                )
        except psycopg.Error as error:
            release()
            raise translate(
                error, f"reading {resource!r}", sent=False, where=self._where
            ) from error
        except BaseException:
            release()
            raise
        reader = ChunkStream(
            conn,
            release,
            self._sql("SELECT data FROM {s}.store_chunks WHERE object_id = %s AND seq = %s"),
            publication.object_id,
            int(found[0]),
            timeout=self._timeout,
            where=self._where,
            watchdog=self._watch,
        )
        return publication, cast(BinaryIO, reader)

    def _end_snapshot(
        self, conn: psycopg.Connection[tuple[Any, ...]], give_back: Callable[[], None]
    ) -> None:
        """End a snapshot read's transaction (a borrowed connection then goes back to its pool
        reusable; a broken one is discarded) and give the connection back. Never raises."""
        with contextlib.suppress(Exception):
            if not conn.broken and conn.info.transaction_status != pq.TransactionStatus.IDLE:
                with guarded(conn, self._timeout, self._watch):
                    conn.execute(b"ROLLBACK")
        with contextlib.suppress(Exception):
            give_back()

    # -- objects ------------------------------------------------------------------------------

    def stage(self, resource: str, object_id: str, chunks: Iterable[bytes], now: float) -> None:
        """Write the object's chunks and its row in one transaction (streamed with COPY).

        Each chunk must reach the server within the operation timeout (a rolling deadline;
        the first one's counts from the start of the call, waiting for a connection included).
        Any failure rolls the whole object back: nothing was published, retry
        (:class:`~fenced.Unavailable`, even if the commit's reply was lost: an object that no
        pointer references is only garbage for gc).
        """
        doing = f"staging an object of {resource!r}"
        copy_sql = self._sql(
            "COPY {s}.store_chunks (object_id, seq, data) FROM STDIN (FORMAT BINARY)"
        )
        deadline = self._deadline()
        with self._pool.connection(self._connect_budget) as conn:
            watchdog = self._watch
            key, armed = watchdog.arm(conn.fileno(), self._left(doing, deadline))

            def sent() -> None:  # each chunk gets the whole timeout
                nonlocal key, armed
                watchdog.disarm(key, armed)
                key, armed = watchdog.arm(conn.fileno(), self._timeout)

            try:
                with conn.transaction():
                    count, size = copy_chunks(conn, copy_sql, object_id, chunks, sent)
                    conn.execute(
                        self._sql(
                            "INSERT INTO {s}.store_objects"
                            " (object_id, resource, chunks, size, staged_at)"
                            " VALUES (%s, %s, %s, %s, %s)"
                        ),
                        (object_id, resource, count, size, now),
                    )
                    durable(conn)
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
        deadline = self._deadline()
        try:
            with (
                self._pool.connection(self._connect_budget) as conn,
                guarded(conn, self._left(f"discarding object {object_id}", deadline), self._watch),
                conn.transaction(),
            ):
                delete_object(conn, self._quoted_schema, object_id)
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

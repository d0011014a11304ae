"""The ``postgresql://`` store: fencing domains, keys and publications in PostgreSQL.

:class:`PostgresStore` is a :class:`~fenced.fence.store.Store` over :class:`PostgresBackend`; the
store does validation, op ids and asks :mod:`fenced.fence.rules` for every decision, exactly as
for the other stores. What this backend guarantees:

* **Critical section**: one transaction per mutation that first takes a *transaction-level*
  advisory lock on the domain (``pg_advisory_xact_lock``, released by COMMIT or ROLLBACK; it
  works through a transaction-pooling PgBouncer). Every read inside runs after the lock is held
  (READ COMMITTED, one snapshot per statement), so it sees every earlier commit of the domain. A
  lock wait longer than ``busy_timeout`` is :class:`~fenced.Unavailable` (``lock_timeout``).
* **Round trips**: ordinarily two per mutation — the lock, the domain's head and the announced
  reads (the key's version or the pointer, an op id) go out as one multi-statement query; the
  writes are buffered and sent with ``COMMIT``. Once this process has seen a domain, ``put`` and
  ``fence`` are *speculative*: decided by :class:`~fenced.fence.store.Store` on the state seen
  last, then sent as one statement (``store_apply_all``, schema version 4) that takes the
  lock, raises unless that state is still current, and applies the writes and the records
  (see :class:`PostgresStore`). A break while the commit is in flight is
  :class:`~fenced.OutcomeUnknown` (retry with the same op id); a failure before it is
  :class:`~fenced.Unavailable` (nothing was changed).
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
* **Records** (:attr:`~fenced.fence.backend.Capability.RECORDS`): rows of ``store_records``.
  Installs and accepted mutations are inserted in the mutation's own transaction (by the one
  statement of a speculative mutation, ``store_apply_all``); a rejection is inserted by a
  transaction of its own, under the domain lock, committed with ``synchronous_commit = off``
  (no wait for the WAL flush). ``seq`` is one sequence for the whole store. Pruning (inside
  one write in 64) first looks at the oldest and newest record of the resource and deletes
  only when some are due (schema version 4).
* **Schema**: tables ``store_*`` in the URL's schema (default ``fenced``, ``?schema=``), versioned
  in ``store_meta`` (``format``, ``schema_version``, ``mode``) and migrated automatically.

URL query parameters: ``schema``, ``pool_size``, ``timeout`` (seconds an operation may take, its
wait for a connection included: its statements get only the time left once it is connected;
default 10), ``prepare`` (``off``: no server-side prepared statements) — see docs/postgres.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps's, for str
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import psycopg
from psycopg import pq, sql

from fenced._drivers.postgres import (
    DEFAULT_OP_TIMEOUT,
    DEFAULT_POOL_SIZE,
    Migration,
    Pool,
    Statement,
    deadlines,
    execute,
    guarded,
    migrate,
    parse_url,
    translate,
)
from fenced.core.errors import (
    ConfigurationError,
    CorruptData,
    FencedError,
    IdempotencyConflict,
    OutcomeUnknown,
    Rejected,
    Unavailable,
    VersionConflict,
)
from fenced.core.records import Record, RecordKind, detail_json
from fenced.core.token import FencingToken
from fenced.fence.backend import Capability, Chooser, StoreOptions
from fenced.fence.chunks import ChunkReader
from fenced.fence.ops import OpRecord
from fenced.fence.rules import Head, StoredObject, resolve_mode
from fenced.fence.source import PublishData
from fenced.fence.store import Store
from fenced.fence.values import Item, Mode, Publication, Version

if TYPE_CHECKING:
    from fenced.fence.store import _Mutation

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
            # A speculative write in one statement (see _PgTransaction): take the domain lock,
            # raise FN100 unless the state the write was decided on is still the state, then
            # apply the given writes. No decision is taken here; the rules ran in Python.
            """CREATE FUNCTION {s}.store_apply(
                p_resource text, p_lock_key text, p_lock_timeout text,
                p_coordinator text, p_floor bigint,
                p_key text, p_version bigint, p_op text,
                p_head_coordinator text, p_head_floor bigint,
                p_item_key text, p_item_value bytea, p_item_epoch bigint, p_item_version bigint,
                p_op_id text, p_op_digest text, p_op_outcome text,
                p_op_recorded_at double precision, p_prune_before double precision)
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
                        OR v_version IS DISTINCT FROM p_version
                        OR (p_op IS NOT NULL AND EXISTS (
                            SELECT 1 FROM {s}.store_ops o
                            WHERE o.resource = p_resource AND o.op_id = p_op)) THEN
                    RAISE EXCEPTION 'fenced: the domain changed' USING ERRCODE = 'FN100';
                END IF;
                IF p_head_floor IS NOT NULL THEN
                    INSERT INTO {s}.store_domains (resource, coordinator_id, floor)
                    VALUES (p_resource, p_head_coordinator, p_head_floor)
                    ON CONFLICT (resource) DO UPDATE SET
                        coordinator_id = excluded.coordinator_id, floor = excluded.floor;
                END IF;
                IF p_item_key IS NOT NULL THEN
                    INSERT INTO {s}.store_items (resource, key, value, epoch, version)
                    VALUES (p_resource, p_item_key, p_item_value, p_item_epoch, p_item_version)
                    ON CONFLICT (resource, key) DO UPDATE SET value = excluded.value,
                        epoch = excluded.epoch, version = excluded.version;
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
            END $$""",
        ),
    ),
    Migration(
        2,
        "records of installs, accepted and rejected mutations",
        (
            "CREATE TABLE {s}.store_records (seq bigserial PRIMARY KEY, resource text NOT NULL,"
            " at double precision NOT NULL, kind text NOT NULL, epoch bigint NOT NULL,"
            " detail text NOT NULL)",
            "CREATE INDEX store_records_by_resource ON {s}.store_records (resource, seq)",
        ),
    ),
    Migration(
        3,
        "a speculative write and its records in one statement",
        (
            # The records of a speculative write (see _PgTransaction._apply): a JSON array of
            # [at, kind, epoch, detail], inserted in order, and now and then the pruning of old
            # ones. Called as ``SELECT store_apply_records(…) FROM store_apply(…)``: store_apply
            # has taken the domain lock and checked the state first, all in one transaction.
            """CREATE FUNCTION {s}.store_apply_records(p_resource text, p_records text,
                p_prune_before double precision, p_prune_keep bigint)
            RETURNS void
            LANGUAGE plpgsql AS $$
            DECLARE
                v_record json;
            BEGIN
                FOR v_record IN SELECT e.value FROM json_array_elements(p_records::json)
                        WITH ORDINALITY AS e (value, n) ORDER BY e.n LOOP
                    INSERT INTO {s}.store_records (resource, at, kind, epoch, detail)
                    VALUES (p_resource, (v_record->>0)::double precision, v_record->>1,
                        (v_record->>2)::bigint, v_record->>3);
                END LOOP;
                IF p_prune_before IS NOT NULL THEN
                    DELETE FROM {s}.store_records r WHERE r.resource = p_resource
                        AND (r.at < p_prune_before OR r.seq <= coalesce((
                            SELECT k.seq FROM {s}.store_records k WHERE k.resource = p_resource
                            ORDER BY k.seq DESC LIMIT 1 OFFSET p_prune_keep), 0));
                END IF;
            END $$""",
        ),
    ),
    Migration(
        4,
        "cheaper speculative writes: nothing planned per call, pruning only when due",
        (
            # A speculative write and its records in one function (store_apply and
            # store_apply_records of versions 1 and 3, which stay for processes still running
            # older code): the lock, the check of the state the write was decided on (FN100
            # unless it still holds), then the writes, the records and now and then the
            # pruning. Cheaper than the pair by one PL/pgSQL call, an op id check planned once
            # per session (in one condition with ``p_op IS NOT NULL`` its custom plan always
            # won, so it was planned again on every call, about 20 µs), an UPDATE of an
            # existing item (no speculative insertion) and one INSERT for all the records.
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
                    INSERT INTO {s}.store_records (resource, at, kind, epoch, detail)
                    SELECT p_resource, (e.value->>0)::double precision, e.value->>1,
                        (e.value->>2)::bigint, e.value->>3
                    FROM json_array_elements(p_records::json) WITH ORDINALITY AS e (value, n)
                    ORDER BY e.n;
                END IF;
                IF p_records_before IS NOT NULL THEN
                    PERFORM {s}.store_apply_records(p_resource, NULL, p_records_before,
                        p_records_keep);
                END IF;
            END $$""",
            # As version 3's (and still called so by older processes, and by store_apply_all
            # and ordinary writes to prune), but the records go in with one INSERT (not one per
            # record from a loop over a cursor), and the pruning first looks at the oldest and
            # the newest record (two index probes) and deletes only what is due: past the
            # retention when the oldest is, beyond the limit only when the resource's records
            # span more than ``p_prune_keep`` sequence numbers (seq is unique: fewer records
            # cannot exceed the limit then).
            # Version 3's prune read every record of the resource each time (about 1.2 ms on
            # 10,000 records, on 1 write in 64). A record older than the retention behind a
            # newer oldest one (the clock stepped back) waits for a later prune; history()
            # never returns it anyway.
            """CREATE OR REPLACE FUNCTION {s}.store_apply_records(p_resource text,
                p_records text, p_prune_before double precision, p_prune_keep bigint)
            RETURNS void
            LANGUAGE plpgsql AS $$
            DECLARE
                v_oldest bigint;
                v_oldest_at double precision;
                v_cut bigint;
            BEGIN
                IF p_records IS NOT NULL THEN
                    INSERT INTO {s}.store_records (resource, at, kind, epoch, detail)
                    SELECT p_resource, (e.value->>0)::double precision, e.value->>1,
                        (e.value->>2)::bigint, e.value->>3
                    FROM json_array_elements(p_records::json) WITH ORDINALITY AS e (value, n)
                    ORDER BY e.n;
                END IF;
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

    Behaves exactly like every other store: the same :class:`Store` code makes every decision.
    It only helps the backend save round trips: it announces the key or pointer a mutation will
    read, and lets ``put``/``fence`` run *speculatively* on the domain state this process saw
    last (one round trip that re-checks that state under the lock). Whatever a speculative
    attempt decided without the server — a rejection, a conflict — or a state that changed
    meanwhile, the call is simply run again the ordinary way, whose answer is authoritative.
    """

    _backend: PostgresBackend

    def fence(self, token: FencingToken) -> int:
        if isinstance(token, FencingToken) and self._backend.known(token.resource, None):
            try:
                with self._backend.hinting(speculate=True):
                    return super().fence(token)
            except _RETRY_ORDINARY:
                pass
        return super().fence(token)

    def put(
        self,
        token: FencingToken,
        key: str,
        value: bytes | bytearray | memoryview,
        *,
        op_id: str | None = None,
        if_version: int | None = None,
    ) -> Version:
        if isinstance(token, FencingToken) and self._backend.known(token.resource, key):
            try:
                with self._backend.hinting(key=key, speculate=True):
                    return super().put(token, key, value, op_id=op_id, if_version=if_version)
            except _RETRY_ORDINARY:
                pass
        with self._backend.hinting(key=key):
            return super().put(token, key, value, op_id=op_id, if_version=if_version)

    def publish(
        self,
        token: FencingToken,
        data: PublishData,
        *,
        name: str = "",
        op_id: str | None = None,
    ) -> Publication:
        with self._backend.hinting(pointer=name):
            return super().publish(token, data, name=name, op_id=op_id)

    def _rejected(self, token: FencingToken, what: _Mutation, error: Rejected) -> None:
        # A speculative attempt's rejection is re-decided the ordinary way, which logs and
        # records it: once, like on every other store.
        if not self._backend.speculating():
            super()._rejected(token, what, error)


class _SpeculationFailed(Exception):
    """The state a speculative write was decided on has changed: nothing was applied."""


# Outcomes of a speculative attempt that are re-decided the ordinary way (nothing was applied).
_RETRY_ORDINARY = (_SpeculationFailed, Rejected, VersionConflict, IdempotencyConflict)


class _Hint(threading.local):
    key: str | None = None
    pointer: str | None = None
    speculate: bool = False


class _Hinting:
    """``with``: set this thread's :class:`_Hint`, cleared on exit (cheaper than a generator)."""

    __slots__ = ("_hint", "_key", "_pointer", "_speculate")

    def __init__(self, hint: _Hint, key: str | None, pointer: str | None, speculate: bool) -> None:
        self._hint, self._key, self._pointer, self._speculate = hint, key, pointer, speculate

    def __enter__(self) -> None:
        hint = self._hint
        hint.key, hint.pointer, hint.speculate = self._key, self._pointer, self._speculate

    def __exit__(self, *exc: object) -> None:
        hint = self._hint
        hint.key = hint.pointer = None
        hint.speculate = False


@dataclass(frozen=True, slots=True)
class _Known:
    """The committed state of one domain as this process saw it last (a hint, never trusted)."""

    head: Head
    versions: tuple[tuple[str, int | None], ...] = ()

    def version(self, key: str) -> tuple[bool, int | None]:
        for name, version in self.versions:
            if name == key:
                return True, version
        return False, None


_KNOWN_DOMAINS = 4096
_KNOWN_KEYS = 16


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

    def __init__(self, url: str, mode: Mode | None, options: StoreOptions) -> None:
        parsed = parse_url(url, _URL_KEYS)
        self.url = parsed.display
        self.schema = parsed.schema
        self._where = f"postgres store {parsed.display}"
        self._timeout = parsed.option_float("timeout", DEFAULT_OP_TIMEOUT, minimum=0.01)
        self._connect_budget = min(parsed.connect_timeout, self._timeout)
        self._lock_timeout_ms = max(int(options.busy_timeout * 1000), 1)
        self._lock_timeout = f"{self._lock_timeout_ms}ms"  # the lock_timeout setting
        self._pool = Pool(
            parsed.conninfo,
            display=parsed.display,
            size=parsed.option_int("pool_size", DEFAULT_POOL_SIZE),
            connect_timeout=parsed.connect_timeout,
            prepare=parsed.option_flag("prepare", True),
        )
        self._hint = _Hint()
        self._known: dict[str, _Known] = {}
        self._known_lock = threading.Lock()
        s = sql.Identifier(self.schema).as_string(None)
        self._s = s
        self._queries: dict[str, bytes] = {}  # _sql's, built once
        # the speculative write, sent through libpq directly (see Statement)
        self._apply = Statement(self._sql(_APPLY_N), self._sql(_APPLY))
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
            query = text.replace("{s}", self._s).encode()
            if len(self._queries) < 256:  # a few dozen texts (see _PgTransaction._check)
                self._queries[text] = query
        return query

    def _initialise(self, requested: Mode | None) -> Mode:
        try:
            # a connection of its own: a failure here (wrong password, missing database, newer
            # schema) is reported at once and starts no pool threads
            with self._pool.open_connection(self._connect_budget) as conn:
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

    # -- helpers ------------------------------------------------------------------------------

    def hinting(
        self, *, key: str | None = None, pointer: str | None = None, speculate: bool = False
    ) -> _Hinting:
        """Announce what the next mutation of this thread reads, and whether to speculate."""
        return _Hinting(self._hint, key, pointer, speculate)

    def speculating(self) -> bool:
        """Whether this thread's current mutation is a speculative attempt."""
        return self._hint.speculate

    def known(self, resource: str, key: str | None) -> bool:
        """Whether a speculative mutation of ``resource`` (reading ``key``) is worth trying."""
        with self._known_lock:
            known = self._known.get(resource)
        return known is not None and (key is None or known.version(key)[0])

    def _remember(self, resource: str, known: _Known | None) -> None:
        with self._known_lock:
            self._known.pop(resource, None)
            if known is not None:
                if len(self._known) >= _KNOWN_DOMAINS:
                    del self._known[next(iter(self._known))]
                self._known[resource] = known

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
            guarded(conn, self._left(doing, deadline)),
        ):
            try:
                return execute(self._pool, conn, self._sql(query), params)
            except psycopg.Error as error:
                if conn.broken:
                    self._pool.discard_idle()
                raise translate(error, doing, sent=False, where=self._where) from error

    # -- the critical section -----------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, resource: str) -> Iterator[_PgTransaction]:
        """The critical section of ``resource`` (see the module docstring).

        Ordinary: the first read sends BEGIN, the lock, the head and the announced reads in
        one round trip; the writes go with COMMIT. Speculative (``hinting(speculate=True)``):
        reads are answered from the state this process saw last, and one ``store_apply_all``
        statement takes the lock, checks that this state is still current and applies the
        writes and records; a changed state aborts it (``_SpeculationFailed``).
        """
        hint = self._hint
        with self._known_lock:
            known = self._known.get(resource) if hint.speculate else None
        if hint.speculate and known is None:
            raise _SpeculationFailed(resource)
        deadline = self._deadline()
        with self._pool.connection(self._connect_budget) as conn:
            left = self._left(f"writing {resource!r}", deadline)
            watchdog = deadlines()  # as guarded(), without one more generator per call
            armed_key, armed = watchdog.arm(conn.fileno(), left)
            tx = _PgTransaction(self, conn, resource, hint.key, hint.pointer, known)
            try:
                try:
                    yield tx
                except psycopg.Error as error:
                    tx.abort()
                    self._remember(resource, None)
                    if tx.speculative and getattr(error, "sqlstate", None) in ("22012", "FN100"):
                        raise _SpeculationFailed(resource) from error
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
                        raise _SpeculationFailed(resource) from error
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
            guarded(conn, self._left(doing, deadline)) as fired,
        ):
            cur: psycopg.ClientCursor[tuple[Any, ...]] = psycopg.ClientCursor(conn)
            try:
                cur.execute(
                    b"BEGIN; "
                    + _LOCK
                    + b"; SET LOCAL synchronous_commit = off; "
                    + self._sql(_INSERT_RECORD)
                    + b"; COMMIT",
                    (
                        f"{self._lock_timeout_ms}ms",
                        f"fenced.store.{self.schema}:{record.resource}",
                        *_record_params(record),
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
        rows = self._read(f"reading {resource!r}", _POINTER, (resource, name))
        return None if not rows else _publication(resource, name, rows[0])

    def open_current(self, resource: str, name: str) -> tuple[Publication, BinaryIO] | None:
        deadline = self._deadline()
        conn = self._pool.open_connection(self._connect_budget)
        try:
            with guarded(conn, self._left(f"reading {resource!r}", deadline)):
                conn.execute(b"BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                rows = conn.execute(self._sql(_POINTER), (resource, name), prepare=False).fetchall()
                if not rows:
                    conn.close()
                    return None
                publication = _publication(resource, name, rows[0])
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
            conn.close()
            raise translate(
                error, f"reading {resource!r}", sent=False, where=self._where
            ) from error
        except BaseException:
            conn.close()
            raise
        reader = _ChunkReader(self, conn, publication.object_id, int(found[0]))
        return publication, cast(BinaryIO, reader)

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
            watchdog = deadlines()
            key, armed = watchdog.arm(conn.fileno(), self._left(doing, deadline))
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
        deadline = self._deadline()
        try:
            with (
                self._pool.connection(self._connect_budget) as conn,
                guarded(conn, self._left(f"discarding object {object_id}", deadline)),
                conn.transaction(),
            ):
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
_APPLY = "SELECT {s}.store_apply_all(" + ", ".join(["%s"] * 22) + ")"
_APPLY_N = "SELECT {s}.store_apply_all(" + ", ".join(f"${n}" for n in range(1, 23)) + ")"
_HEAD = "SELECT coordinator_id, floor FROM {s}.store_domains WHERE resource = %s"
_VERSION = "SELECT version FROM {s}.store_items WHERE resource = %s AND key = %s"
_LOCK = (
    b"SELECT set_config('lock_timeout', %s, true),"
    b" set_config('synchronous_commit', CASE current_setting('synchronous_commit')"
    b" WHEN 'off' THEN 'on' ELSE current_setting('synchronous_commit') END, true),"
    b" pg_advisory_xact_lock(hashtextextended(%s, 0))"
)
_OP = "SELECT 1 FROM {s}.store_ops WHERE resource = %s AND op_id = %s"
_INSERT_RECORD = (
    "INSERT INTO {s}.store_records (resource, at, kind, epoch, detail) VALUES (%s, %s, %s, %s, %s)"
)
_OP_ROW = (
    "SELECT digest, outcome, recorded_at FROM {s}.store_ops WHERE resource = %s AND op_id = %s"
)


def _publication(resource: str, name: str, row: tuple[Any, ...]) -> Publication:
    epoch, object_id, sha256, size, published_at = row
    return Publication(
        resource, name, int(epoch), str(object_id), str(sha256), int(size), float(published_at)
    )


# json.dumps(…, separators=(",", ":")[, default=str]) without building an encoder per call
_JSON = json.JSONEncoder(separators=(",", ":"))


def _records_json(records: Sequence[tuple[object, ...]]) -> str:
    """The records of :func:`_record_params` as store_apply_all's JSON array of [at, kind,
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


def _record_params(record: Record) -> tuple[object, ...]:
    detail = detail_json(record.detail)
    return (record.resource, record.at, record.kind.value, record.epoch, detail)


def _durable(conn: psycopg.Connection[tuple[Any, ...]]) -> None:
    """Raise ``synchronous_commit`` for this transaction if the server runs with it off."""
    conn.execute(
        b"SELECT CASE WHEN current_setting('synchronous_commit') = 'off'"
        b" THEN set_config('synchronous_commit', 'on', true) END"
    )


def _delete_object(conn: psycopg.Connection[tuple[Any, ...]], s: str, object_id: str) -> None:
    conn.execute(f"DELETE FROM {s}.store_chunks WHERE object_id = %s".encode(), (object_id,))
    conn.execute(f"DELETE FROM {s}.store_objects WHERE object_id = %s".encode(), (object_id,))


_BIG = 256 * 1024  # larger values are sent with the extended protocol (binary), not inlined


class _PgTransaction:
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
        known: _Known | None,
    ) -> None:
        self._b = backend
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
        b = self._b
        return [
            (b"BEGIN", ()),
            (_LOCK, (f"{b._lock_timeout_ms}ms", f"fenced.store.{b.schema}:{self._resource}")),
        ]

    def _check(self) -> tuple[bytes, tuple[object, ...]]:
        """A statement that fails (division by zero, 22012) unless the expectations hold."""
        b = self._b
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
        return b._sql(query), tuple(params)

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
        b = self._b
        r = self._resource
        key = self._expect_key[0] if self._expect_key is not None else self._key_hint
        statements = self._enter()
        statements.append((b._sql(_HEAD), (r,)))
        if key is not None:
            statements.append((b._sql(_VERSION), (r, key)))
        if self._pointer_hint is not None:
            statements.append((b._sql(_POINTER), (r, self._pointer_hint)))
        if self._expect_op is not None:
            statements.append((b._sql(_OP), (r, self._expect_op)))
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
                None if not found else _publication(r, self._pointer_hint, found[0])
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
            raise _SpeculationFailed(r)
        self._head = head
        self._known = None
        return results.pop(0) if extra is not None else None

    def _query(self, query: str, params: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """A read inside the transaction (after flushing buffered writes)."""
        statement = (self._b._sql(query), params)
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
        self._writes.append((self._b._sql(query), params))
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
        b = self._b
        head = self._known.head if self._known is not None else Head()  # what was decided on
        key, version = self._expect_key or (None, None)
        new_head = self._typed.get("head", (None, None, None))[1:]
        item = self._typed.get("item", (None, None, None, None, None))[1:]
        op = self._typed.get("op", (None, None, None, None, None))[1:]
        prune = self._typed.get("prune", (None, None))[1:]
        _, records_before, records_keep = self._typed.get("prune_records", (None,) * 3)
        # _record_params: (resource, at, kind, epoch, detail), always of this resource; JSON
        # because psycopg dumps arrays slowly (more than the rest of the statement together)
        records = _records_json(self._records)
        b._apply.run(
            b._pool,
            self._conn,
            (
                self._resource, f"fenced.store.{b.schema}:{self._resource}",
                b._lock_timeout, head.coordinator_id, head.floor, key, version,
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

    def seen(self) -> _Known | None:
        """The domain state this transaction read or left (for the next speculative write)."""
        if self._head is None:
            return None
        versions = tuple(list(self._versions.items())[-_KNOWN_KEYS:])
        return _Known(self._head, versions)

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
        rows = self._query(_OP_ROW, (self._resource, op_id))
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
        self._write(_INSERT_RECORD, _record_params(record), "record")

    def prune_records(self, before: float, keep: int) -> None:
        # store_apply_records without records: it deletes only what is due (schema version 4)
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
        rows = self._query(_VERSION, (self._resource, key))
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


class _ChunkReader(ChunkReader):
    """One object's chunks, read in the snapshot of its own connection's transaction."""

    def __init__(
        self,
        backend: PostgresBackend,
        conn: psycopg.Connection[tuple[Any, ...]],
        object_id: str,
        chunks: int,
    ) -> None:
        super().__init__(object_id, chunks)
        self._backend = backend
        self._db = conn

    def _read_chunk(self, seq: int) -> bytes | None:
        b = self._backend
        try:
            with guarded(self._db, b._timeout):
                row = self._db.execute(
                    b._sql("SELECT data FROM {s}.store_chunks WHERE object_id = %s AND seq = %s"),
                    (self._object_id, seq),
                    prepare=False,
                ).fetchone()
        except psycopg.Error as error:
            raise translate(
                error, f"reading object {self._object_id}", sent=False, where=b._where
            ) from error
        return None if row is None else bytes(row[0])

    def close(self) -> None:
        if not self.closed:
            with contextlib.suppress(Exception):
                self._db.close()
        super().close()

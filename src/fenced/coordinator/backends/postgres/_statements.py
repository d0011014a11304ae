"""The PostgreSQL coordinator's statements and how each reaches the server.

:func:`named_statements` are the statements calling the schema's functions; the hot ones (the
uncontended grant and release, :data:`_FAST_GRANT` and :data:`_FAST_RELEASE`, and the queued
grant) are :class:`DirectStatement` s run through libpq as prepared statements whose names are
derived from their text. :class:`StatementRunner` sends one statement per call within the
caller's budget: ``Unavailable`` if nothing was sent, ``OutcomeUnknown`` if a mutation was sent
and its reply lost or late (the connection is then cut), ``ConfigurationError`` for
authentication, missing objects or privileges. What it shares with the asyncio runner (the
statements, budgets, re-sending, error translation, prepared statements) is :class:`Statements`.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import re
import select
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

import psycopg
from psycopg import pq, sql

from fenced._drivers.postgres import (
    Lender,
    checked,
    execute,
    guarded,
    statement_name,
    translate,
)
from fenced.coordinator.backends.postgres import _schema as postgres_schema
from fenced.core._errors import FencedError, OutcomeUnknown, Unavailable

if TYPE_CHECKING:
    from fenced.coordinator.backends.postgres._plans import Settings

__all__ = [
    "Call",
    "DirectStatement",
    "Rows",
    "StatementRunner",
    "Statements",
    "direct_statements",
    "named_statements",
    "never_ran",
    "text_params",
]

log = logging.getLogger("fenced.coordinator.postgres")

_RESEND_CONNECT = 3.0  # seconds spent reconnecting before an idempotent request is re-sent

_NAMED = re.compile(r"%\((\w+)\)s")

Rows = list[tuple[Any, ...]]
"""The rows of a statement's answer."""


Call = tuple[str, str, Sequence[object], bool, float | None, bool]
"""One statement to send, as both backends send it: ``(doing, name, params, mutation,
timeout, idempotent)``, the arguments of :meth:`StatementRunner.call`. ``doing`` says what it
does (for messages: ``renewing r``); ``name`` is its name in :func:`named_statements` or
:func:`direct_statements`; ``mutation``: it may change something (lost after it was sent:
OutcomeUnknown); ``timeout``: the seconds it may take at most, if less than ``?timeout=``
(None: ``?timeout=``); ``idempotent``: it may be sent once more on a new connection if its
connection broke under it. A plain tuple: one is built for every statement, on the hot path
too."""


class DirectStatement:
    """A hot statement, run as libpq's own prepared statement (:attr:`StatementRunner.direct`).

    ``query`` has one ``$n`` per distinct ``%(key)s`` of the source text (``keys``, in order of
    first appearance). ``name`` is derived from the text: the same name always means the same
    statement, even on a server session that a pooler shares between clients.
    """

    __slots__ = ("_get", "keys", "name", "query")

    def __init__(self, text: str) -> None:
        keys: list[str] = []

        def number(match: re.Match[str]) -> str:
            if match.group(1) not in keys:
                keys.append(match.group(1))
            return f"${keys.index(match.group(1)) + 1}"

        self.query = _NAMED.sub(number, text).encode()
        self.keys = tuple(keys)
        self._get = operator.itemgetter(*keys)
        self.name = statement_name(self.query)

    def bind(self, **values: object) -> tuple[object, ...]:
        """The parameters, in ``$n`` order (other keys are ignored)."""
        params = self._get(values)
        return cast(tuple[object, ...], params) if len(self.keys) > 1 else (params,)


_DUMPERS: dict[type, Callable[[Any, str], bytes | None]] = {
    str: lambda value, encoding: value.encode(encoding),
    float: lambda value, _: repr(value).encode(),
    int: lambda value, _: str(value).encode(),
    bool: lambda value, _: b"t" if value else b"f",
    type(None): lambda value, _: None,
}
"""Parameters in PostgreSQL's text format, by type (None is NULL)."""


_LOADERS: dict[int, Callable[[bytes], object]] = {
    16: lambda data: data == b"t",  # bool
    20: int,  # int8
    23: int,  # int4
    701: float,  # float8
}


_Kept = tuple[
    contextlib.AbstractContextManager[psycopg.Connection[Any]], psycopg.Connection[Any], int
]
"""A connection the runner keeps lent: how it was lent, the connection, the process's pid."""


def _reusable(conn: psycopg.Connection[Any]) -> bool:
    """True if ``conn`` is open, idle and has nothing to read (EOF: the server closed it)."""
    if conn.closed or conn.info.transaction_status != pq.TransactionStatus.IDLE:
        return False
    readable, _, _ = select.select([conn.fileno()], [], [], 0)
    return not readable


def _rows(result: pq.abc.PGresult, encoding: str) -> list[tuple[Any, ...]]:
    """The rows of a text-format ``result`` (bool, integers and float8 as such, else str)."""
    columns = range(result.nfields)
    loaders = [_LOADERS.get(result.ftype(i)) for i in columns]
    rows: list[tuple[Any, ...]] = []
    for row in range(result.ntuples):
        values: list[object] = []
        for i in columns:
            data = result.get_value(row, i)
            load = loaders[i]
            values.append(None if data is None else load(data) if load else data.decode(encoding))
        rows.append(tuple(values))
    return rows


_FAST_GRANT = """
WITH granted AS (
    UPDATE {s}.resources r SET epoch = r.epoch + 1, owner = %(owner)s, holder = %(holder)s,
        ttl = %(ttl)s, expires_at = clock_timestamp() + %(ttl)s * interval '1 second',
        value = %(value)s
    WHERE r.name = %(name)s AND r.owner IS NULL AND r.epoch > 0
      AND NOT EXISTS (SELECT 1 FROM {s}.waiters w
                      WHERE w.name = %(name)s AND w.expires_at > clock_timestamp())
      AND NOT EXISTS (SELECT 1 FROM {s}.watchers x
                      WHERE x.name = %(name)s AND x.expires_at > clock_timestamp())
    RETURNING r.name, r.epoch, r.holder, r.ttl, r.value, r.ended,
        r.expires_at - r.ttl * interval '1 second' AS at,
        CASE WHEN current_setting('synchronous_commit') = 'off'
             THEN set_config('synchronous_commit', 'on', true) END AS durable),
rec AS (
    INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
    SELECT g.at, 'granted', g.name, g.epoch, g.holder,
           jsonb_build_object('after', g.ended) || CASE WHEN g.value IS NULL THEN '{}'::jsonb
                                                   ELSE jsonb_build_object('value', g.value) END
    FROM granted g)
SELECT 'granted', g.epoch, %(owner)s, g.holder, g.ttl, g.ttl, NULL::float8, NULL::bigint
FROM granted g
UNION ALL
SELECT * FROM {s}.try_grant(%(name)s, %(owner)s, %(holder)s, %(ttl)s, NULL, NULL, %(value)s,
                            %(keepalive)s, %(retry_cap)s, NULL, false)
WHERE NOT EXISTS (SELECT 1 FROM granted)
"""
"""The uncontended grant in one statement, else (nothing granted) the ``try_grant`` function in
the same statement. It grants a known resource (epoch > 0: ``advance`` raised it to the minimum
epoch, so the row lock alone orders this grant after any restore) that is free, with no live
waiter or watcher; ``ended`` keeps how the previous lease ended (for the record) until the next
ending sets it. The new epoch, the lease and the record are written together; the commit is
synchronous (raised here if the server runs with it off: ``durable`` in RETURNING is evaluated
for the granted row)."""

_TRY_GRANT = """
SELECT * FROM {s}.try_grant(%(name)s, %(owner)s, %(holder)s, %(ttl)s, %(request_id)s, %(ticket)s,
                            %(value)s, %(keepalive)s, %(retry_cap)s, %(listen_key)s, %(prune)s)
"""
"""An acquire attempt of a queued caller or with a request_id: the ``try_grant`` function."""

_FAST_RELEASE = """
WITH rel AS (
    SELECT r.name, r.epoch, r.holder, clock_timestamp() AS now FROM {s}.resources r
    WHERE r.name = %(name)s AND r.epoch = %(epoch)s AND r.owner = %(owner)s
      AND r.expires_at > clock_timestamp()
    FOR UPDATE),
head AS MATERIALIZED (
    SELECT w.id FROM {s}.waiters w
    WHERE w.name = %(name)s AND w.expires_at > clock_timestamp() ORDER BY w.id LIMIT 1),
gone AS (
    DELETE FROM {s}.waiters w USING rel, head h
    WHERE w.id = h.id AND w.expires_at > clock_timestamp() AND w.owner IS NOT NULL
      AND NOT pg_try_advisory_xact_lock({k}, w.listen_key)
    RETURNING w.id, w.owner, w.holder, w.ttl, w.value, w.refreshed_at),
done AS (
    UPDATE {s}.resources r SET epoch = r.epoch + CASE WHEN g.id IS NULL THEN 0 ELSE 1 END,
        owner = g.owner, holder = coalesce(g.holder, r.holder), ttl = coalesce(g.ttl, r.ttl),
        expires_at = CASE WHEN g.id IS NULL THEN r.expires_at
                          ELSE rel.now + g.ttl * interval '1 second' END,
        value = g.value, ended = 'released'
    FROM rel LEFT JOIN gone g ON true
    WHERE r.name = rel.name AND (g.id IS NOT NULL OR NOT EXISTS (SELECT 1 FROM head))
    RETURNING rel.now, rel.epoch AS old_epoch, rel.holder AS old_holder, r.epoch, r.holder,
        r.value, g.id AS waiter,
        CASE WHEN g.id IS NOT NULL THEN pg_notify('{c}', g.id::text || ':' || r.name || ':'
            || r.epoch::text || ':'
            || coalesce(extract(epoch FROM rel.now - g.refreshed_at)::float8, 0)::text)
        END AS handed,
        CASE WHEN EXISTS (SELECT 1 FROM {s}.watchers x
                          WHERE x.name = r.name AND x.expires_at > rel.now)
             THEN pg_notify('{c}', '0:' || r.name) END AS watched,
        set_config('synchronous_commit', CASE WHEN g.id IS NULL THEN 'off'
            WHEN current_setting('synchronous_commit') = 'off' THEN 'on'
            ELSE current_setting('synchronous_commit') END, true) AS durability),
rec AS (
    INSERT INTO {s}.records (at, kind, resource, epoch, holder, detail)
    SELECT d.now, 'released', %(name)s, d.old_epoch, d.old_holder, '{}'::jsonb FROM done d
    UNION ALL
    SELECT d.now, 'granted', %(name)s, d.epoch, d.holder,
           jsonb_build_object('after', 'released') || CASE WHEN d.value IS NULL THEN '{}'::jsonb
                                                      ELSE jsonb_build_object('value', d.value) END
    FROM done d WHERE d.waiter IS NOT NULL)
SELECT true FROM done
UNION ALL
SELECT {s}.release(%(name)s, %(epoch)s, %(owner)s) WHERE NOT EXISTS (SELECT 1 FROM done)
"""
"""The release in one statement, and the handoff with it: it locks this owner's live lease
(``rel``), then takes the first live waiter's row (``gone``) if that waiter left what a grant
needs and its listen lock is held (its process lives) — a row a concurrent ``leave`` deleted
first is not taken — and ends the lease or grants it to that waiter (epoch + 1, durable commit,
NOTIFY ``<id>:<resource>:<epoch>:<seconds since its last keep-alive>``), with the records of
both. Committed without waiting for the disk when it grants nothing. Anything else (not this
owner's live lease, a first waiter that is gone or cannot be granted here) is the ``release``
function's, in the same statement."""


def direct_statements(s: str, channel: str) -> dict[str, DirectStatement]:
    """The hot statements, by name (``{s}``: the quoted schema; ``channel``: its NOTIFY
    channel): the uncontended grant, the queued grant and the release."""
    return {
        name: DirectStatement(
            text.replace("{s}", s)
            .replace("{c}", channel)
            .replace("{k}", str(postgres_schema.LISTEN_LOCK_CLASS))
        )
        for name, text in (
            ("grant", _FAST_GRANT),
            ("grant_queued", _TRY_GRANT),
            ("release", _FAST_RELEASE),
        )
    }


def named_statements(s: str) -> dict[str, bytes]:
    """The statements other than the hot ones, by name (``{s}``: the quoted schema)."""

    def q(text: str) -> bytes:
        return text.replace("{s}", s).encode()

    return {
        "renew": q("SELECT {s}.renew(%s, %s, %s, %s)"),
        "current": q("SELECT * FROM {s}.current_lease(%s)"),
        "last_epoch": q(
            "SELECT greatest(coalesce((SELECT r.epoch FROM {s}.resources r "
            "WHERE r.name = %s), 0), (SELECT m.value::bigint FROM {s}.meta m "
            "WHERE m.key = 'minimum_epoch'))"
        ),
        "resources": q(
            'SELECT r.name FROM {s}.resources r WHERE r.epoch > 0 ORDER BY r.name COLLATE "C"'
        ),
        "proclaim": q("SELECT {s}.proclaim(%s, %s, %s, %s)"),
        "report": q("SELECT {s}.report(%s, %s, %s, %s, %s)"),
        "records": q("SELECT * FROM {s}.records_after(%s, %s, %s)"),
        "enqueue": q("SELECT {s}.enqueue(%s, %s, %s, %s, %s, %s, %s)"),
        "leave": q("SELECT {s}.leave(%s, %s, %s)"),
        "leave_taking": q("SELECT * FROM {s}.leave_taking(%s, %s, %s)"),
        "watch_start": q("SELECT {s}.watch_start(%s, %s)"),
        "watch_poll": q("SELECT * FROM {s}.watch_poll(%s, %s, %s, %s)"),
        "unwatch": q("DELETE FROM {s}.watchers WHERE id = %s"),
        "advance": q("SELECT {s}.advance(%s, %s, %s)"),
        "probe": q("SELECT pg_notify(%s, %s)"),
    }


class _Switch(Protocol):
    """What a runner asks of its pool about prepared statements (:class:`~fenced._drivers.
    postgres.PreparedSwitch`)."""

    @property
    def prepare(self) -> bool: ...

    def lost_prepared_statement(
        self, error: psycopg.Error, conn: psycopg.Connection[tuple[Any, ...]]
    ) -> bool: ...


_P = TypeVar("_P", bound=_Switch)


class Statements(Generic[_P]):
    """What the sync and the asyncio statement runners share: the statements, the budget of a
    call, whether to send one again, the translation of its errors and the bookkeeping of
    prepared statements. No I/O: :class:`StatementRunner` (threads) and the asyncio runner of
    :mod:`~fenced.coordinator.backends.postgres._aio` send and wait.
    """

    def __init__(self, pool: _P, url: str, schema: str, found: Settings) -> None:
        self.pool = pool
        self.url = url
        self.schema = schema
        self.op_timeout = found.op_timeout
        self.connect_budget = found.connect_budget
        self.channel = postgres_schema.channel(schema)
        quoted = sql.Identifier(schema).as_string(None)
        self.queries = named_statements(quoted)
        self.direct = direct_statements(quoted, self.channel)
        self._prepared: weakref.WeakKeyDictionary[pq.abc.PGconn, set[bytes]] = (
            weakref.WeakKeyDictionary()
        )
        self._prepared_lock = threading.Lock()

    def budget(self, timeout: float | None) -> float:
        """Seconds a call may take: ``?timeout=``, or ``timeout`` if shorter."""
        return self.op_timeout if timeout is None else min(timeout, self.op_timeout)

    @staticmethod
    def resend(doing: str, unknown: OutcomeUnknown, idempotent: bool) -> bool:
        """Whether a statement whose outcome is ``unknown`` is sent once more, on a new
        connection (:data:`_RESEND_CONNECT`): an ``idempotent`` one whose connection broke
        under it (a server restart terminates the session), never one that timed out."""
        if not idempotent or getattr(unknown, "timed_out", False):
            return False
        log.debug("%s: %s; sending it again", doing, unknown)
        return True

    def failure(
        self, error: psycopg.Error, doing: str, budget: float, *, mutation: bool, fired: bool
    ) -> FencedError:
        """fenced's error for psycopg's ``error`` of a statement (``fired``: cut at the end of
        its ``budget``): a ``mutation`` sent is OutcomeUnknown, nothing sent Unavailable."""
        sent = mutation and not isinstance(error, psycopg.InterfaceError)
        if fired:
            return _timed_out(doing, self.url, budget, sent=sent)
        return translate(error, doing, sent=sent, where=self.url)

    def session(self, conn: Any) -> tuple[pq.abc.PGconn, str, set[bytes]]:
        """What a hot statement needs of ``conn``: its libpq connection, its encoding and the
        names of the hot statements prepared on its server session."""
        pgconn = conn.pgconn
        with self._prepared_lock:
            names = self._prepared.setdefault(pgconn, set())
        return pgconn, conn.info.encoding, names

    def lost(
        self, error: psycopg.Error, conn: Any, names: set[bytes], direct: DirectStatement
    ) -> bool:
        """True if ``error`` says a pooler lost ``direct``'s prepared statement (it had not
        run; prepared statements are off from now on): then it is sent again unprepared."""
        if not self.pool.lost_prepared_statement(error, conn):
            return False
        names.discard(direct.name)
        return True


def never_ran(error: psycopg.OperationalError) -> psycopg.InterfaceError:
    """The error of a failed Parse of a hot statement: nothing was sent."""
    return psycopg.InterfaceError(f"preparing a statement: {error}")


def text_params(params: Sequence[object], encoding: str) -> list[bytes]:
    """``params`` in PostgreSQL's text format (:data:`_DUMPERS`; None is NULL)."""
    return cast(list[bytes], [_DUMPERS[type(value)](value, encoding) for value in params])


class StatementRunner(Statements[Lender]):
    """Runs the coordinator's statements, one transaction and one round trip each, within a
    budget. Thread-safe.

    One thread at a time uses a connection kept lent between statements; the others borrow from
    the pool. A call is cut at its deadline (the :class:`~fenced._drivers.postgres.Deadlines`
    watchdog); errors are translated (:func:`~fenced._drivers.postgres.translate`): nothing sent
    is :class:`~fenced.Unavailable`, a mutation whose reply was lost is
    :class:`~fenced.OutcomeUnknown`.
    """

    def __init__(self, pool: Lender, url: str, schema: str, found: Settings) -> None:
        super().__init__(pool, url, schema, found)
        self._kept: _Kept | None = None
        self._kept_lock = threading.Lock()

    def close(self) -> None:
        """Give back the kept connection (after a call in flight ends) and close the pool."""
        if self._kept_lock.acquire(timeout=self.op_timeout):
            try:
                self._drop_kept()
            finally:
                self._kept_lock.release()
        self.pool.close()

    def call(self, call: Call) -> Rows:
        """Run one statement of :func:`named_statements` or :attr:`direct` (one transaction, one
        round trip).

        An ``idempotent`` one may be sent again. When the connection breaks under it (a server
        restart terminates the session) it is re-sent once on a new connection instead of
        reporting :class:`OutcomeUnknown` — never after a timeout (:meth:`~Statements.resend`).
        """
        doing, _name, _params, _mutation, timeout, idempotent = call
        budget = self.budget(timeout)
        try:
            return self._send(call, budget, self.connect_budget)
        except OutcomeUnknown as unknown:
            if not self.resend(doing, unknown, idempotent):
                raise
            try:
                return self._send(call, budget, _RESEND_CONNECT)
            except Unavailable:
                raise unknown from None  # the first attempt's outcome is still unknown

    def _send(self, call: Call, budget: float, connect_budget: float) -> Rows:
        """One attempt within ``budget`` seconds: a connection (waiting at most
        ``connect_budget`` for it), then the statement with the time left, so that connecting
        never makes the call outlast its budget."""
        deadline = time.monotonic() + budget
        wait = min(connect_budget, budget)
        if self.pool.may_keep and self._kept_lock.acquire(blocking=False):
            try:
                conn = self._kept_connection(wait)
                try:
                    return self._run(conn, call, budget, deadline)
                except BaseException:
                    self._drop_kept()  # closed unless it is idle, else back to the pool
                    raise
            finally:
                self._kept_lock.release()
        with self.pool.connection(wait) as conn:
            return self._run(conn, call, budget, deadline)

    def _run(
        self, conn: psycopg.Connection[Any], call: Call, budget: float, deadline: float
    ) -> Rows:
        """The statement on ``conn``, cut at ``deadline`` (the end of the call's ``budget``)."""
        doing, name, params, mutation, _timeout, _idempotent = call
        with guarded(conn, _left(doing, self.url, deadline, budget)) as fired:
            try:
                direct = self.direct.get(name)
                if direct is not None:
                    return self._run_direct(conn, direct, params)
                return execute(self.pool, conn, self.queries[name], params)
            except psycopg.Error as error:
                if conn.broken:
                    self.pool.discard_idle()  # they probably share the same fate
                raise self.failure(
                    error, doing, budget, mutation=mutation, fired=fired()
                ) from error

    def _kept_connection(self, wait: float) -> psycopg.Connection[Any]:
        """The pooled connection this runner keeps lent between its statements (under
        ``_kept_lock``), so that a call neither borrows nor returns one.

        One thread at a time uses it (the others borrow from the pool as usual, so a single
        thread uses one connection for everything); it is checked
        without a round trip before each use, like the pool's, and given back when a call on it
        failed, when the runner closes, and never used by a forked child.
        """
        kept = self._kept
        if kept is not None:
            _, conn, pid = kept
            if pid != os.getpid():
                self._kept = None  # the parent's: the child's pool never touches it either
            elif _reusable(conn):
                return conn
            else:
                self._drop_kept()
        lending = self.pool.connection(wait)
        conn = lending.__enter__()
        self._kept = (lending, conn, os.getpid())
        return conn

    def _drop_kept(self) -> None:
        """Give the kept connection back to the pool (which closes it unless it is idle)."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[2] == os.getpid():
            with contextlib.suppress(Exception):
                kept[0].__exit__(None, None, None)

    def _run_direct(
        self, conn: psycopg.Connection[Any], direct: DirectStatement, params: Sequence[object]
    ) -> list[tuple[Any, ...]]:
        """Run a hot statement through libpq: Bind/Execute of a statement prepared once per
        server session, text parameters and results, without psycopg's cursors.

        With prepared statements off (``?prepare=off``, or a pooler lost one: then the
        statement had not run and is sent again), the same text goes through psycopg,
        unprepared. Errors are psycopg's (translated by the caller).
        """
        if not self.pool.prepare:
            return psycopg.RawCursor(conn).execute(direct.query, params, prepare=False).fetchall()
        pgconn, encoding, names = self.session(conn)
        try:
            if direct.name not in names:
                try:
                    checked(conn, pgconn.prepare(direct.name, direct.query))
                except psycopg.OperationalError as error:
                    raise never_ran(error) from error
                names.add(direct.name)
            values = text_params(params, encoding)
            result = checked(conn, pgconn.exec_prepared(direct.name, values))
        except psycopg.Error as error:
            if not self.lost(error, conn, names, direct):
                raise
            return psycopg.RawCursor(conn).execute(direct.query, params, prepare=False).fetchall()
        return _rows(result, encoding)


def _left(doing: str, url: str, deadline: float, budget: float) -> float:
    """Seconds left before ``deadline`` (``time.monotonic()``) for the statement, once
    connected; :class:`Unavailable` (nothing was sent) if connecting took them all."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise Unavailable(f"{doing} ({url}): no connection within {budget:g}s; nothing was changed")
    return left


def _timed_out(doing: str, url: str, budget: float, *, sent: bool) -> FencedError:
    if sent:
        unknown = OutcomeUnknown(
            f"{doing} ({url}): no reply within {budget:g}s, the connection was cut; the request "
            "may or may not have taken effect"
        )
        unknown.timed_out = True  # type: ignore[attr-defined]
        return unknown
    return Unavailable(f"{doing} ({url}): no reply within {budget:g}s; nothing was changed")

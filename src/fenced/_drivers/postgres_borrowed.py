"""Connections borrowed from a user's pool: a ``psycopg_pool.ConnectionPool`` or a SQLAlchemy
``Engine`` (psycopg 3 driver), handed to ``fenced.connect`` or ``fenced.open_store`` instead of
a URL.

:func:`lender` is the one place that turns what a backend was given — a URL or a pool — into
its :class:`~fenced._drivers.postgres.Lender` and parsed options. Semantics of a borrowed pool
(:class:`Borrowed`):

* **Borrowed, never owned.** Each operation takes a connection from the user's pool and gives
  it back when done; ``close()`` of the coordinator or store gives back what it holds and never
  closes the user's pool or engine. No connection is kept lent between operations.
* **Lent as fenced needs, given back as found.** While fenced uses a connection it is in
  autocommit mode, prepares nothing automatically (``prepare_threshold=None``) and returns
  tuples; the connection's own ``autocommit``, ``prepare_threshold`` and ``row_factory`` are put
  back before it returns to the pool. A connection that is broken, or left in a transaction (an
  operation cut at its deadline), is closed (psycopg_pool) or invalidated (SQLAlchemy) instead:
  the pool replaces it. Statements are schema-qualified, so the pool's ``search_path`` does not
  matter. fenced's hot statements are server-side prepared statements named ``fenced_…`` on the
  pool's sessions (``prepare=off`` in the options turns them off, e.g. for a pool whose reset
  runs ``DISCARD ALL``).
* **Waiting for a connection.** psycopg_pool: up to ``min(5 s, timeout)``
  (``getconn(timeout=…)``), then :class:`~fenced.Unavailable`. SQLAlchemy: the engine's own
  ``pool_timeout`` (an ``Engine`` has no per-checkout timeout), then Unavailable.
* **LISTEN/NOTIFY** (the coordinator's waiting) needs a session of its own for as long as the
  process waits. psycopg_pool: one connection is taken from the pool when the coordinator first
  waits and held until ``close()`` (so the pool needs ``max_size`` ≥ 2; size it one larger);
  it goes back after ``UNLISTEN *`` and ``pg_advisory_unlock_all()``, its ``autocommit`` as it
  was (closed instead if it broke).
  SQLAlchemy: one connection is checked out and ``detach()``-ed from the engine's pool (it then
  counts against no limit), closed at ``close()``. A broken listening connection is given back
  and another one taken. ``listen_url`` in the options gives the listener a direct connection
  instead; ``listen=off`` never listens.
* Not fork-aware: a forked child must use a pool of its own (psycopg_pool and SQLAlchemy say
  the same of theirs).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from fenced._drivers.postgres import (
    DEFAULT_POOL_SIZE,
    Lender,
    ParsedURL,
    Pool,
    PreparedSwitch,
    _close_quietly,
    _dead,
    _idle,
    guarded,
    parse_url,
    translate,
)
from fenced._drivers.postgres_url import parse_options
from fenced.core._errors import ConfigurationError, Unavailable

__all__ = ["LISTEN_TAKE_TIMEOUT", "Borrowed", "lender"]

Connection = psycopg.Connection[tuple[Any, ...]]

LISTEN_TAKE_TIMEOUT = 5.0
"""Seconds the listener waits for a connection from a user's psycopg pool (then tries again)."""

_ACCEPTED = (
    "a postgresql:// URL, a psycopg_pool.ConnectionPool or a SQLAlchemy Engine (postgresql+psycopg)"
)


def lender(
    target: object, fenced_keys: Sequence[str], options: Mapping[str, object] | None
) -> tuple[ParsedURL, Lender]:
    """The parsed fenced options and the connections of ``target``: a URL (a :class:`Pool` of
    fenced's own; ``options`` must then be None: they belong in the URL's query) or a user's
    pool or engine (:class:`Borrowed`; ``options`` as :func:`parse_options` reads them).

    Raises :class:`ConfigurationError` for anything else, an async pool or engine, an Engine of
    another database or driver.
    """
    if isinstance(target, str):
        if options is not None:
            raise ConfigurationError(
                "options= is for a pool or an engine; with a URL put them in its query string"
            )
        parsed = parse_url(target, fenced_keys)
        pool = Pool(
            parsed.conninfo,
            display=parsed.display,
            size=parsed.option_int("pool_size", DEFAULT_POOL_SIZE),
            connect_timeout=parsed.connect_timeout,
            prepare=parsed.option_flag("prepare", True),
        )
        return parsed, pool
    source = _source(target)
    keys = [key for key in fenced_keys if key != "pool_size"]
    parsed = parse_options(options, keys, source.display)
    return parsed, Borrowed(source, prepare=parsed.option_flag("prepare", True))


def _source(target: object) -> _PsycopgPool | _Engine:
    if isinstance(target, ConnectionPool):
        return _PsycopgPool(target)
    kind = type(target)
    if kind.__module__.startswith("sqlalchemy"):
        if hasattr(target, "sync_engine"):
            raise ConfigurationError(
                "an AsyncEngine cannot be used: pass its sync_engine, or a psycopg_pool."
                "ConnectionPool, or a postgresql:// URL"
            )
        dialect = getattr(target, "dialect", None)
        if dialect is not None and hasattr(target, "raw_connection"):
            return _Engine(target, dialect)
    if "AsyncConnectionPool" in kind.__name__:
        raise ConfigurationError(
            f"a {kind.__name__} cannot be used (fenced's API is synchronous): pass a "
            "psycopg_pool.ConnectionPool or a postgresql:// URL"
        )
    raise ConfigurationError(f"expected {_ACCEPTED}, got {kind.__module__}.{kind.__qualname__}")


class _PsycopgPool:
    """A user's ``psycopg_pool.ConnectionPool``."""

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self.pool = pool
        self.display = f"psycopg_pool {pool.name!r}"
        self.size = pool.max_size

    def take(self, budget: float) -> tuple[Connection, object]:
        try:
            conn: Connection = self.pool.getconn(timeout=max(budget, 0.001))
        except PoolTimeout as error:
            raise Unavailable(
                f"{self.display}: no connection within {budget:g}s (all busy, or the server "
                "cannot be reached); nothing was sent"
            ) from error
        except PoolClosed as error:
            raise ConfigurationError(f"{self.display} is closed") from error
        return conn, conn

    def give(self, handle: object, conn: Connection, reusable: bool) -> None:
        if not reusable:
            _close_quietly(conn)  # the pool replaces a closed connection
        self.pool.putconn(conn)

    def listen(self) -> tuple[Connection, Callable[[], None]]:
        conn, handle = self.take(LISTEN_TAKE_TIMEOUT)
        autocommit = conn.autocommit
        try:
            conn.autocommit = True
        except BaseException:
            self.give(handle, conn, False)
            raise

        def give_back() -> None:
            """Back to the pool without the session's LISTEN and listen lock (or closed)."""
            reusable = _idle(conn)
            if reusable:
                try:
                    with guarded(conn, LISTEN_TAKE_TIMEOUT):
                        conn.execute(b"UNLISTEN *", prepare=False)
                        conn.execute(b"SELECT pg_advisory_unlock_all()", prepare=False)
                    conn.autocommit = autocommit
                except psycopg.Error:
                    reusable = False
            self.give(handle, conn, reusable and _idle(conn))

        return conn, give_back


class _Engine:
    """A user's SQLAlchemy ``Engine`` with the psycopg (3) driver."""

    def __init__(self, engine: Any, dialect: Any) -> None:
        if dialect.name != "postgresql" or dialect.driver != "psycopg":
            raise ConfigurationError(
                f"a SQLAlchemy Engine of {dialect.name}+{dialect.driver} cannot be used: fenced "
                "needs postgresql+psycopg (psycopg 3)"
            )
        self.engine = engine
        self.display = str(engine.url.render_as_string(hide_password=True))
        self.size: int | None = None

    def take(self, budget: float) -> tuple[Connection, object]:
        from sqlalchemy import exc  # noqa: PLC0415 - installed by whoever passes an Engine

        try:
            proxied = self.engine.raw_connection()
        except exc.TimeoutError as error:
            raise Unavailable(
                f"{self.display}: no connection from the engine's pool within its "
                "pool_timeout; nothing was sent"
            ) from error
        except exc.DBAPIError as error:
            if isinstance(error.orig, psycopg.Error):
                raise translate(error.orig, "connecting", sent=False, where=self.display) from error
            raise
        conn: Connection = proxied.driver_connection
        return conn, proxied

    def give(self, handle: Any, conn: Connection, reusable: bool) -> None:
        if not reusable:
            handle.invalidate()  # closed; the engine's pool replaces it
        handle.close()

    def listen(self) -> tuple[Connection, Callable[[], None]]:
        conn, proxied = self.take(LISTEN_TAKE_TIMEOUT)
        detach: Any = proxied
        detach.detach()  # out of the engine's pool: closing it really closes it
        conn.autocommit = True
        return conn, detach.close


class Borrowed(PreparedSwitch):
    """A :class:`~fenced._drivers.postgres.Lender` over a user's pool or engine (see the module
    docstring). Thread-safe as the user's pool is."""

    def __init__(self, source: _PsycopgPool | _Engine, *, prepare: bool) -> None:
        super().__init__(prepare)
        self._source = source
        self.display = source.display
        self._closed = False

    @property
    def may_keep(self) -> bool:
        return False

    def check_listen(self) -> None:
        """Refuse a psycopg pool too small to lend a connection while the listener holds one."""
        size = self._source.size
        if size is not None and size < 2:
            raise ConfigurationError(
                f"{self.display} has max_size {size}: the coordinator's listener holds one "
                "connection while it waits, so the pool needs max_size >= 2 (or pass "
                "options={'listen': 'off'} or a direct listen_url)"
            )

    def _take(self, budget: float) -> tuple[Connection, Callable[[], None]]:
        """A live connection set up for fenced, and the function that gives it back."""
        if self._closed:
            raise ConfigurationError(f"{self.display}: fenced's use of this pool is closed")
        deadline = time.monotonic() + budget
        while True:
            conn, handle = self._source.take(deadline - time.monotonic())
            if not _dead(conn):
                break
            self._source.give(handle, conn, False)
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"{self.display}: no live connection within {budget:g}s; nothing was sent"
                )
        saved = (conn.autocommit, conn.prepare_threshold, conn.row_factory)
        try:
            conn.autocommit = True
            conn.prepare_threshold = None
            conn.row_factory = tuple_row
        except BaseException:
            self._source.give(handle, conn, False)
            raise

        def give_back() -> None:
            reusable = _idle(conn)
            if reusable:
                try:
                    conn.autocommit, conn.prepare_threshold, conn.row_factory = saved
                except psycopg.Error:
                    reusable = False
            self._source.give(handle, conn, reusable)

        return conn, give_back

    @contextlib.contextmanager
    def connection(self, budget: float) -> Iterator[Connection]:
        """Lend a connection of the user's pool for one operation (see the module docstring)."""
        conn, give_back = self._take(budget)
        try:
            yield conn
        finally:
            give_back()

    def lend_dedicated(self, budget: float) -> tuple[Connection, Callable[[], None]]:
        return self._take(budget)

    def listen_connection(self) -> tuple[Connection, Callable[[], None]]:
        return self._source.listen()

    def discard_idle(self) -> None:
        """Nothing: the user's pool checks its own idle connections (and fenced checks each
        one it borrows, without a round trip, before use)."""

    def close(self) -> None:
        """Stop borrowing; the user's pool or engine stays open. Idempotent."""
        self._closed = True

"""The coordinator on ``postgresql://`` (a fresh schema per test), against a real PostgreSQL 15
that the test session starts itself.

It runs :class:`CoordinatorConformance` and :class:`HistoryConformance`. It does **not** run
:class:`ManualClockConformance`: expiry is decided by the PostgreSQL server's clock
(``clock_timestamp()``), which cannot be injected (``connect(url, host_clock=...)`` is refused
loudly). Instead, expiry by the server's clock is tested directly, and so is what only a real
server can show: restarts (``pg_ctl restart -m fast`` and ``-m immediate``) in the middle of held
leases, a connection blackholed by a TCP proxy while holding, a lost NOTIFY, PgBouncer in
transaction mode, and the documented restore procedure (pg_dump, pg_restore, ``advance``). And
what this backend does on its own: a release that hands the resource to the first waiter in its
own transaction (and what happens when that waiter is gone or gave up), and the one-statement
grant and release.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest

from fenced._drivers.postgres import Pool, connect_listening, execute, parse_url
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect, open_backend
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator.backends.postgres import _schema as postgres_schema
from fenced.coordinator.backends.postgres._backend import PostgresBackend, PostgresTicket
from fenced.coordinator.backends.postgres._listener import Listener, Subscription
from fenced.core._clock import ManualClock, SystemClock
from fenced.core._errors import (
    Busy,
    ConfigurationError,
    LeaseLost,
    OutcomeUnknown,
    StaleToken,
    Unavailable,
)
from fenced.core._lease import Lease, LeaseState
from fenced.core._records import RecordKind
from fenced.core._restore_base import restore_base
from fenced.fence._store import Store
from fenced.fence.backend import StoreOptions
from fenced.fence.postgres._store import open_postgres_backend
from fenced.runtime._keeper import HeldLease
from fenced.testing._threads import ResultThread
from fenced.testing.aio_conformance import AsyncCoordinatorConformance, AsyncHistoryConformance
from fenced.testing.conformance import CoordinatorConformance, HistoryConformance, wait_for
from fenced.testing.postgres import PgBouncer, PostgresServer
from fenced.testing.proxy import TcpProxy
from support.coordinators import DEADLINE_CLOCK, restore_again_and_again

R = "exports/daily"


def _schema() -> str:
    return "t_" + uuid.uuid4().hex[:12]


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> str:
    return postgres_server.url("postgres", schema=_schema())


class TestPostgresCoordinator(CoordinatorConformance):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url


class TestPostgresHistory(HistoryConformance):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url


class TestPostgresCoordinatorAsync(AsyncCoordinatorConformance):
    """The same cases on the asyncio face (psycopg async connections, async LISTEN)."""

    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url


class TestPostgresHistoryAsync(AsyncHistoryConformance):
    @pytest.fixture
    def url(self, pg_url: str) -> str:
        return pg_url


def _options() -> StoreOptions:
    return StoreOptions(7 * 24 * 3600.0, 3600.0, 5.0, SystemClock())


# -- the server's clock ---------------------------------------------------------------------------


def test_expiry_is_decided_by_the_server_clock(
    open_coord: Callable[[str], Coordinator], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigurationError, match="server's clock"):
        open_backend(pg_url, host_clock=ManualClock())
    coord = open_coord(pg_url)
    lease = coord.acquire(R, ttl=1.0, wait=0, safety_margin=0.1)
    # The client's wall clock is a year off: nothing changes (the client never sends a time).
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 365 * 86400)
    info = coord.current(R)
    assert info is not None and 0.5 < info.expires_in <= 1.0
    monkeypatch.setattr(time, "time", real)
    schema = pg_url.split("schema=")[1]
    with psycopg.connect(pg_url.split("?", maxsplit=1)[0]) as conn:
        row = conn.execute(
            f"SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 "
            f"FROM {schema}.resources WHERE name = %s".encode(),
            (R,),
        ).fetchone()
    assert row is not None and 0.4 < row[0] <= 1.0  # stored as a server timestamp
    wait_for(lambda: coord.current(R) is None, timeout=3, what="expiry at the server")
    assert coord.acquire(R, ttl=5, wait=0).epoch == lease.epoch + 1


# -- restarts -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_a_server_restart_in_the_middle_of_held_leases(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer, mode: str
) -> None:
    url = postgres_server.url("postgres", schema=_schema())
    holder = open_coord(url)
    waiter = open_coord(url)
    observer = open_coord(url)
    held_states: list[LeaseState] = []
    released_at: list[float] = []
    ready = threading.Event()
    finish = threading.Event()

    def hold() -> int:
        with holder.hold(R, ttl=3, wait=0) as held:
            ready.set()
            while not finish.is_set():
                held_states.append(held.state)
                time.sleep(0.02)
            epoch = held.epoch
            released_at.append(time.monotonic())
        return epoch

    a = ResultThread(hold)
    a.start()
    assert ready.wait(5)
    before = observer.last_epoch(R)
    b = ResultThread(lambda: waiter.acquire(R, ttl=5, wait=30))
    b.start()
    wait_for(lambda: waiter.backend.listener_state == "listening", what="the waiter listening")  # type: ignore[attr-defined]
    wait_for(lambda: _queued(url) == 1, what="the waiter to queue")
    postgres_server.restart(mode)  # type: ignore[arg-type]
    # The lease survives (it is durable, its expiry is a server timestamp) ...
    wait_for(lambda: held_states and held_states[-1] is LeaseState.HELD, timeout=5)
    info = observer.current(R)
    assert info is not None and info.epoch == before
    assert b.is_alive(), b.error  # ... and the waiter still waits, no second lease
    time.sleep(0.3)
    finish.set()
    a.join(10)
    assert a.error is None, a.error
    b.join(10)
    assert b.error is None, b.error
    assert b.result.epoch == before + 1
    assert b.finished_at >= released_at[0]  # never two holders
    assert b.finished_at - released_at[0] < 3  # woken by the release, not by the expiry
    assert LeaseState.LOST not in held_states
    kinds = [r.kind for r in observer.history(R)]
    assert kinds[-3:] == [RecordKind.GRANTED, RecordKind.RELEASED, RecordKind.GRANTED]


@pytest.mark.slow
def test_a_grant_survives_an_immediate_restart(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer
) -> None:
    url = postgres_server.url("postgres", schema=_schema())
    coord = open_coord(url)
    epochs = []
    for i in range(5):
        coord.release(coord.acquire(f"r/{i}", ttl=30, wait=0))  # the first grant: the function
        epochs.append(coord.acquire(f"r/{i}", ttl=30, wait=0).epoch)  # the one-statement grant
    # The test server runs with synchronous_commit off: a grant that did not raise it for its
    # own commit would still be in the WAL buffers, lost by the crash.
    postgres_server.restart("immediate")
    after = open_coord(url)
    assert [after.last_epoch(f"r/{i}") for i in range(5)] == epochs
    with pytest.raises(Busy):
        after.acquire("r/0", ttl=5, wait=0)


# -- a proxy between the holder and the server ----------------------------------------------------


@pytest.mark.slow
def test_a_blackholed_holder_goes_uncertain_then_lost_and_the_next_owner_wins(
    open_coord: Callable[[str], Coordinator],
    postgres_server: PostgresServer,
) -> None:
    schema = _schema()
    direct = postgres_server.url("postgres", schema=schema)
    store = Store(open_postgres_backend(direct, "strict", _options()), _options())
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        via_proxy = f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?schema={schema}&timeout=1&connect_timeout=2"
        holder = open_coord(via_proxy)
        successor = open_coord(direct)
        states: list[tuple[float, LeaseState]] = []
        losses: list[LeaseLost] = []
        with (
            pytest.raises(LeaseLost),
            holder.hold(R, ttl=1.5, wait=0, fence=[store], on_lost=losses.append) as held,
        ):
            store.put(held.token, "k", b"from the first owner")
            proxy.blackhole()
            cut_at = DEADLINE_CLOCK.now()
            while not held.lost.is_set() and DEADLINE_CLOCK.now() - cut_at < 5:
                states.append((DEADLINE_CLOCK.now(), held.state))
                time.sleep(0.01)
            lost_at = DEADLINE_CLOCK.now()
            assert held.lost.is_set()
            deadline = held.deadline
            stale = held.token
            new = successor.acquire(R, ttl=5, wait=5)
            granted_at = DEADLINE_CLOCK.now()
            store.fence(new.token)
            store.put(new.token, "k", b"from the next owner")
            with pytest.raises(StaleToken):
                store.put(stale, "k", b"late write of the first owner")
        seen = [state for _, state in states]
        assert LeaseState.UNCERTAIN in seen
        assert seen.index(LeaseState.UNCERTAIN) < len(seen)
        assert lost_at >= deadline - 0.05  # lost at its deadline, not before
        assert granted_at >= lost_at  # the next owner came after the loss
        assert new.epoch == stale.epoch + 1
        item = store.get(R, "k")
        assert item is not None and item.value == b"from the next owner"
        assert losses and losses[0].reason.value in ("expired", "rejected")
        proxy.forward()
        successor.release(new)
    store.close()


@pytest.mark.slow
@pytest.mark.slow
def test_behind_a_blackhole_connecting_never_holds_a_renewal_past_its_budget(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer
) -> None:
    """A renewal's budget is a third of its ttl. Behind a proxy that stops forwarding, the first
    renewal times out on its connection (sent: OutcomeUnknown); the next has none and must
    connect, which libpq would let take its ``connect_timeout`` (whole seconds, 5 here): it
    gives up within its budget instead, with nothing sent (Unavailable)."""
    schema = _schema()
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        coord = open_coord(f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?schema={schema}")
        lease = coord.acquire(R, ttl=2.0, wait=0)
        budget = lease.ttl / 3
        proxy.blackhole()
        took: list[float] = []
        errors: list[type[BaseException]] = []
        for _ in range(2):
            began = time.monotonic()
            with pytest.raises((OutcomeUnknown, Unavailable)) as caught:
                coord.renew(lease)
            took.append(time.monotonic() - began)
            errors.append(caught.type)
        proxy.forward()
    assert errors == [OutcomeUnknown, Unavailable]
    assert all(seconds < budget + 0.5 for seconds in took), (budget, took)


@pytest.mark.slow
def test_waiting_for_a_busy_connection_comes_out_of_the_call_budget(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer
) -> None:
    """The only pooled connection is busy for most of a renewal's budget (a third of its ttl),
    then handed to it just as the network starts blackholing: the renewal ends when its budget,
    counted from its start, ends — not a whole budget after it got the connection."""
    schema = _schema()
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        coord = open_coord(
            f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?schema={schema}&pool_size=1"
        )
        backend = coord.backend
        assert isinstance(backend, PostgresBackend)
        lease = coord.acquire(R, ttl=2.0, wait=0)
        budget = lease.ttl / 3
        taken = threading.Event()
        pool = backend._pool
        assert isinstance(pool, Pool)

        def busy() -> None:
            with pool.connection(5):
                taken.set()
                wait_for(lambda: pool._waiting > 0, what="the renewal to wait")
                time.sleep(budget * 0.9)  # the fault: the connection stays busy this long
                proxy.blackhole()

        other = ResultThread(busy)
        other.start()
        assert taken.wait(10)
        began = time.monotonic()
        with pytest.raises((OutcomeUnknown, Unavailable)):
            coord.renew(lease)
        took = time.monotonic() - began
        other.join(10)
        proxy.forward()
    assert other.error is None, other.error
    assert took < budget + 0.3, (budget, took)


class _TimedRenewals:
    """The coordinator as a keeper's LeaseOps, with when each renewal began and ended (on the
    deadline clock)."""

    def __init__(self, coord: Coordinator, clock: SystemClock) -> None:
        self.coord = coord
        self.clock = clock
        self.began: list[float] = []
        self.ended: list[float] = []

    def renew(self, lease: Lease) -> Lease:
        self.began.append(self.clock.now())
        try:
            return self.coord.renew(lease)
        finally:
            self.ended.append(self.clock.now())

    def release(self, lease: Lease) -> bool:
        return self.coord.release(lease)

    def report_trouble(self, lease: Lease, error: BaseException) -> None:
        self.coord.report_trouble(lease, error)


@pytest.mark.slow
def test_behind_a_blackhole_the_keeper_retries_on_schedule_and_no_renewal_outlasts_its_budget(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer
) -> None:
    """The keeper of a ttl 2 lease behind a blackhole: its first renewal times out, the next
    begins a retry interval later and must connect; each ends within its budget (a third of the
    ttl), not after libpq's 5 s ``connect_timeout``, and the lease is lost at its deadline."""
    schema = _schema()
    clock = DEADLINE_CLOCK
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        coord = open_coord(f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?schema={schema}")
        ops = _TimedRenewals(coord, clock)
        lease = coord.acquire(R, ttl=2.0, wait=0)
        budget = lease.ttl / 3
        held = HeldLease(ops, lease, clock=clock)
        proxy.blackhole()
        held.start()
        try:
            assert held.lost.wait(10)
            wait_for(lambda: len(ops.ended) >= 2, timeout=10, what="two renewals to end")
        finally:
            proxy.forward()
            held.stop(release=False)
    took = [end - begin for begin, end in zip(ops.began, ops.ended, strict=False)]
    assert all(seconds < budget + 0.5 for seconds in took), (budget, took)
    assert ops.began[1] - ops.ended[0] < lease.ttl / 10 * 1.1 + 0.3  # a retry interval


def test_a_lost_reply_to_an_acquire_is_recovered_by_its_request_id(
    open_coord: Callable[[str], Coordinator],
    postgres_server: PostgresServer,
) -> None:
    schema = _schema()
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        coord = open_coord(f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres?schema={schema}")
        coord.resources()  # a pooled connection exists
        proxy.lose_replies()
        with pytest.raises(Unavailable):  # only the statement's preparation was sent
            coord.acquire(R, ttl=10, wait=0, request_id="req-lost")
        proxy.forward()
        # the statement is prepared on the pooled connection now: the next lost reply is the grant's
        coord.release(coord.acquire("warm/up", ttl=10, wait=0, request_id="req-warm"))
        proxy.lose_replies()
        with pytest.raises(Exception) as caught:
            coord.acquire(R, ttl=10, wait=0, request_id="req-lost")
        assert type(caught.value).__name__ == "OutcomeUnknown"
        proxy.forward()
        lease = coord.acquire(R, ttl=10, wait=0, request_id="req-lost")
        assert lease.epoch == 1 and coord.last_epoch(R) == 1


# -- notifications --------------------------------------------------------------------------------


def _terminate_listeners(url: str) -> int:
    with psycopg.connect(url.split("?", maxsplit=1)[0], autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'fenced-listen'"
        ).fetchall()
    return len(rows)


def _holder_and_waiter(
    open_coord: Callable[[str], Coordinator], url: str
) -> tuple[Coordinator, Coordinator, PostgresBackend, Lease]:
    """Two coordinator objects (two processes' worth); the first holds R for 30 s."""
    holder = open_coord(url)
    waiter = open_coord(url)
    backend = waiter.backend
    assert isinstance(backend, PostgresBackend)
    return holder, waiter, backend, holder.acquire(R, ttl=30, wait=0, holder="a")


@pytest.mark.slow
def test_a_lost_notification_is_recovered(
    open_coord: Callable[[str], Coordinator], pg_url: str
) -> None:
    holder, waiter, backend, lease = _holder_and_waiter(open_coord, pg_url)
    b = ResultThread(lambda: waiter.acquire(R, ttl=5, wait=20))
    b.start()
    wait_for(lambda: backend.listener_state == "listening", what="listening")
    # The listening connection dies and the release's NOTIFY goes nowhere ...
    assert _terminate_listeners(pg_url) >= 1
    released = time.monotonic()
    assert holder.release(lease)
    b.join(10)
    # ... the listener reconnects, re-LISTENs and wakes the waiter, who tries again at once.
    assert b.error is None, b.error
    assert b.result.epoch == lease.epoch + 1
    assert b.finished_at - released < 3  # not the 30 s ttl, not forever
    wait_for(lambda: backend.listener_state == "listening", what="listening again")


def test_without_listen_waiting_falls_back_to_short_rechecks(
    open_coord: Callable[[str], Coordinator], pg_url: str
) -> None:
    holder = open_coord(pg_url)
    waiter = open_coord(pg_url + "&listen=off")
    lease = holder.acquire(R, ttl=30, wait=0)
    b = ResultThread(lambda: waiter.acquire(R, ttl=5, wait=10))
    b.start()
    wait_for(lambda: _queued(pg_url) == 1, what="the waiter to queue")  # it waits, then
    released = time.monotonic()
    assert holder.release(lease)
    b.join(10)
    assert b.error is None, b.error
    assert b.result.epoch == lease.epoch + 1
    assert b.finished_at - released < 2  # a re-check found it, not the end of its 10 s wait
    assert waiter.backend.listener_state == "off"  # type: ignore[attr-defined]


# -- PgBouncer ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pgbouncer(postgres_server: PostgresServer) -> Iterator[PgBouncer]:
    with PgBouncer(postgres_server, pool_mode="transaction", pool_size=3) as bouncer:
        yield bouncer


@pytest.mark.slow
def test_through_a_transaction_pooling_pgbouncer(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer, pgbouncer: PgBouncer
) -> None:
    schema = _schema()
    direct = postgres_server.url("postgres", schema=schema)
    pooled = pgbouncer.url("postgres", schema=schema)
    with_listen = f"{pooled}&listen_url={quote(direct, safe='')}"
    coords = [open_coord(with_listen) for _ in range(3)]
    first, second, third = coords
    squatter = psycopg.connect(pooled.split("?")[0])
    for cycle in range(20):  # many transactions over few server connections, no session state
        if cycle == 8:  # psycopg has prepared statements by now: take their server session
            squatter.execute("SELECT 1")
        lease = first.acquire(R, ttl=5, wait=0, request_id=f"r-{uuid.uuid4().hex}")
        assert second.current(R) is not None
        assert first.release(lease)
    squatter.rollback()
    squatter.close()
    # psycopg prepared the statements that ran 5 times; the pooler lost them: detected, sent
    # again unprepared, and prepared statements are off for good
    assert first.backend._pool.prepare is False  # type: ignore[attr-defined]
    lease = first.acquire(R, ttl=30, wait=0)
    b = ResultThread(lambda: second.acquire(R, ttl=5, wait=10))
    b.start()
    wait_for(lambda: second.backend.listener_state == "listening", what="listening")  # type: ignore[attr-defined]
    wait_for(lambda: _queued(direct) == 1, what="b to queue")
    released = time.monotonic()
    first.release(lease)
    b.join(10)
    assert b.error is None, b.error
    assert b.finished_at - released < 1.0  # woken by NOTIFY through the direct listen connection
    # Without listen_url, LISTEN through the pooler cannot work: detected, and waiting degrades
    # to short re-checks instead of hanging.
    degraded = open_coord(pooled)
    c = ResultThread(lambda: degraded.acquire(R, ttl=5, wait=10))
    c.start()
    wait_for(lambda: degraded.backend.listener_state == "unreliable", timeout=8)  # type: ignore[attr-defined]
    released = time.monotonic()
    second.release(b.result)
    c.join(10)
    assert c.error is None, c.error
    assert c.finished_at - released < 2.0
    degraded.release(c.result)
    assert third.url.startswith("postgresql://")


def test_a_statement_prepared_by_another_client_of_the_pooler_is_never_run(
    postgres_server: PostgresServer,
) -> None:
    """Behind a transaction pooler with one server session, fenced's pool runs a query often;
    then another client deallocates every prepared statement there and prepares its own as
    psycopg names them (``_pg3_0``, …). Had the pool let psycopg prepare the query, it would now
    run that client's ``SELECT k`` under its own ``_pg3_0`` and read another query's rows,
    without an error: fenced's pool never lets psycopg prepare (its own hot statements are
    named after their text), so every answer stays right."""
    query = b"SELECT count(*) FROM pg_class WHERE relname = %s"
    with PgBouncer(postgres_server, pool_mode="transaction", pool_size=1) as bouncer:
        dsn = bouncer.url("postgres")
        pool = Pool(dsn, display="pooled", size=1)
        try:
            with pool.connection(5) as conn:
                for _ in range(8):  # more runs than psycopg's default threshold (5)
                    assert execute(pool, conn, query, ("pg_class",)) == [(1,)]
            with psycopg.connect(dsn, autocommit=True) as other:
                other.execute("DEALLOCATE ALL")
                for k in range(8):  # one parameter too, as the pool's query
                    other.execute(
                        f"SELECT {k + 100}::bigint WHERE %s::text IS NOT NULL".encode(),
                        ("x",),
                        prepare=True,
                    )
            with pool.connection(5) as conn:
                for _ in range(3):
                    assert execute(pool, conn, query, ("pg_class",)) == [(1,)]
        finally:
            pool.close()


# -- schema, URLs and errors ----------------------------------------------------------------------


def test_the_schema_is_versioned_and_a_newer_one_refused(pg_url: str) -> None:
    backend = PostgresBackend(pg_url)
    coordinator_id = backend.coordinator_id
    backend.close()
    again = PostgresBackend(pg_url)
    assert again.coordinator_id == coordinator_id  # kept forever
    again.close()
    assert _sql(pg_url, "SELECT value FROM {s}.meta WHERE key = 'schema_version'") == [
        (str(postgres_schema.SCHEMA_VERSION),)
    ]
    schema = pg_url.split("schema=")[1]
    with psycopg.connect(pg_url.split("?", maxsplit=1)[0], autocommit=True) as conn:
        conn.execute(f"UPDATE {schema}.meta SET value = '99' WHERE key = 'schema_version'".encode())
    with pytest.raises(ConfigurationError, match="newer fenced"):
        PostgresBackend(pg_url)


def test_a_schema_holding_other_tables_is_refused(postgres_server: PostgresServer) -> None:
    schema = _schema()
    with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}".encode())
        conn.execute(f"CREATE TABLE {schema}.meta (key text, value text)".encode())
        conn.execute(f"INSERT INTO {schema}.meta VALUES ('format', 'something else')".encode())
    with pytest.raises(ConfigurationError, match=r"not fenced\.coordinator"):
        PostgresBackend(postgres_server.url("postgres", schema=schema))


def test_url_errors_and_password_masking(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer
) -> None:
    for bad in (
        "postgresql://h/db?schema=Upper",
        "postgresql://h/db?pool_size=0",
        "postgresql://h/db?timeout=-1",
        "postgresql://h/db?listen=maybe",
        "postgresql://h/db?bogus_libpq_option=1",
    ):
        with pytest.raises(ConfigurationError):
            connect(bad)
    with pytest.raises(Unavailable) as caught:
        connect("postgres://user:s3cret@127.0.0.1:1/db?connect_timeout=2")
    assert "s3cret" not in str(caught.value) and "user:***@" in str(caught.value)
    with pytest.raises(ConfigurationError, match="does not exist"):
        connect(postgres_server.dsn("no_such_database"))
    coord = open_coord(postgres_server.url("postgres", schema=_schema()))
    assert coord.url.startswith("postgresql://postgres@127.0.0.1:")


def test_libpq_options_with_spaces_reach_the_server(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer
) -> None:
    """``options=-c name=value`` (a space inside) is passed to libpq as written: a "+" for the
    space would reach the server as part of the setting's name."""
    parsed = parse_url(
        postgres_server.url("postgres", options="-c%20statement_timeout%3D4321"), ["schema"]
    )
    assert psycopg.conninfo.conninfo_to_dict(parsed.conninfo)["options"] == (
        "-c statement_timeout=4321"
    )
    read_only = postgres_server.url(
        "postgres", schema=_schema(), options="-c default_transaction_read_only=on"
    )
    with pytest.raises(Unavailable, match="read-only transaction"):  # the server applied it
        connect(read_only)
    coord = open_coord(
        postgres_server.url("postgres", schema=_schema(), options="-c statement_timeout=4321")
    )
    lease = coord.acquire(R, ttl=5, wait=0)
    assert coord.release(lease)


def test_many_leases_in_one_process_share_a_small_pool(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer
) -> None:
    coord = open_coord(postgres_server.url("postgres", schema=_schema(), pool_size="3"))
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            for _ in range(10):
                lease = coord.acquire(f"jobs/{index}", ttl=10, wait=5)
                coord.renew(lease)
                assert coord.release(lease)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    assert [coord.last_epoch(f"jobs/{i}") for i in range(12)] == [10] * 12
    everything = coord.history()
    assert len(everything) == 12 * 20
    assert [r.seq for r in everything] == sorted(r.seq for r in everything)


def test_a_request_id_is_bound_to_its_resource(pg_url: str) -> None:
    backend = PostgresBackend(pg_url)
    backend.try_grant(GrantRequest(R, 10.0, "1" * 32, "h", "req"), None)
    with pytest.raises(ConfigurationError, match="already used"):
        backend.try_grant(GrantRequest("other", 10.0, "2" * 32, "h", "req"), None)
    backend.close()


# -- restore ------------------------------------------------------------------------------------


def _pg_dump(server: PostgresServer, schema: str, dump: Path) -> None:
    """``pg_dump -Fc`` of ``schema`` (database postgres) into ``dump``."""
    _pg_program(server, "pg_dump", "-Fc", "-n", schema, "-f", str(dump), "postgres")


def _pg_restore(server: PostgresServer, dump: Path) -> None:
    """``pg_restore --clean`` of ``dump`` into the database postgres."""
    _pg_program(server, "pg_restore", "--clean", "-d", "postgres", str(dump))


def _pg_program(server: PostgresServer, program: str, *args: str) -> None:
    env = {**os.environ, "PGHOST": "127.0.0.1", "PGPORT": str(server.port), "PGUSER": "postgres"}
    subprocess.run([str(server.bin_dir / program), *args], env=env, check=True)


@pytest.mark.slow
def test_restore_with_pg_dump_and_pg_restore_then_advance(
    open_coord: Callable[[str], Coordinator], postgres_server: PostgresServer, tmp_path: Path
) -> None:
    schema = _schema()
    url = postgres_server.url("postgres", schema=schema)
    store_url = postgres_server.url("postgres", schema=schema + "_s")
    store = Store(open_postgres_backend(store_url, "strict", _options()), _options())
    coord = open_coord(url)
    for _ in range(40):
        coord.release(coord.acquire(R, ttl=5, wait=0))
    lease41 = coord.acquire(R, ttl=5, wait=0)
    assert lease41.epoch == 41
    coord.release(lease41)
    dump = tmp_path / "coordinator.dump"
    _pg_dump(postgres_server, schema, dump)
    for _ in range(2):
        lease = coord.acquire(R, ttl=5, wait=0)
        store.fence(lease.token)
        store.put(lease.token, "k", f"written with {lease.epoch}".encode())
        coord.release(lease)
    assert lease.epoch == 43
    # Restore the older state (41) ...
    _pg_restore(postgres_server, dump)
    restored = open_coord(url)
    assert restored.last_epoch(R) == 41
    # ... then the documented procedure: advance past anything the lost state could have issued.
    minimum = max(restore_base(time.time()), store.floor(R) or 0)
    assert restored.backend.advance(minimum, {}, {"reason": "pg_restore"}) == minimum
    new = restored.acquire(R, ttl=5, wait=0)
    assert new.epoch > 43
    store.fence(new.token)
    store.put(new.token, "k", b"after the restore")
    item = store.get(R, "k")
    assert item is not None and item.value == b"after the restore"
    assert restored.history(R)[-2].kind is RecordKind.RESTORED
    store.close()


@pytest.mark.slow
def test_restoring_one_dump_again_and_again_never_repeats_a_token(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """pg_restore of the same dump three times in a few seconds, each followed by the advance
    step (``fenced restore --advance``) and grants: every first grant is above every earlier one."""
    schema = _schema()
    dump = tmp_path / "coordinator.dump"
    restore_again_and_again(
        postgres_server.url("postgres", schema=schema),
        R,
        lambda: _pg_dump(postgres_server, schema, dump),
        lambda: _pg_restore(postgres_server, dump),
    )


# -- a release hands the resource to the first waiter ---------------------------------------------


def _queued(url: str) -> int:
    """How many waiters are queued (committed) in the schema of ``url``."""
    return int(_sql(url, "SELECT count(*) FROM {s}.waiters")[0][0])


def _sql(url: str, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Run one statement on a connection of its own (``{s}``: the URL's schema)."""
    schema = url.split("schema=")[1].split("&", maxsplit=1)[0]
    with psycopg.connect(url.split("?", maxsplit=1)[0], autocommit=True) as conn:
        cursor = conn.execute(statement.replace("{s}", schema).encode(), params)
        return cursor.fetchall() if cursor.description else []


def test_a_release_hands_the_resource_to_the_first_waiter(
    open_coord: Callable[[str], Coordinator], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder, waiter, backend, lease = _holder_and_waiter(open_coord, pg_url)
    sent: list[tuple[float, str]] = []
    answered: list[float] = []
    call = backend._call

    def counted(doing: str, name: str, params: Any, **options: Any) -> Any:
        sent.append((time.monotonic(), name))
        try:
            return call(doing, name, params, **options)
        finally:
            answered.append(time.monotonic())

    monkeypatch.setattr(backend, "_call", counted)
    b = ResultThread(lambda: waiter.acquire(R, ttl=20, wait=20, holder="b"))
    b.start()
    wait_for(lambda: _queued(pg_url) == 1, what="b's place in line to be committed")
    # release just after one of b's keep-alives came back, so that its next one (a third of
    # QUEUE_KEEPALIVE later) cannot fall between the release and the notification
    seen = len(answered)
    wait_for(lambda: len(answered) > seen, what="a keep-alive of b's place in line")
    released = DEADLINE_CLOCK.now()
    assert holder.release(lease)
    returned = DEADLINE_CLOCK.now()
    b.join(10)
    assert b.error is None, b.error
    assert b.result.epoch == lease.epoch + 1
    # granted by the releaser's transaction: b returned without another request of its own
    assert [name for at, name in sent if at >= released] == []
    # its local deadline (ttl 20 s, margin 2 s) counts from no later than the grant, and loses
    # only about the time the notification took
    assert released + 18 - 0.5 < b.result.deadline < returned + 18
    info = holder.current(R)
    assert info is not None and info.holder == "b" and info.epoch == b.result.epoch
    last = holder.history(R)[-3:]
    assert [(r.kind, r.holder) for r in last] == [
        (RecordKind.GRANTED, "a"),
        (RecordKind.RELEASED, "a"),
        (RecordKind.GRANTED, "b"),
    ]
    assert last[2].detail == {"after": "released"}
    assert _sql(pg_url, "SELECT count(*) FROM {s}.waiters") == [(0,)]
    assert waiter.release(b.result)


def test_a_waiter_whose_process_is_gone_is_skipped(
    open_coord: Callable[[str], Coordinator], pg_url: str
) -> None:
    coord = open_coord(pg_url)
    lease = coord.acquire(R, ttl=30, wait=0)
    # A waiter that was killed: its row still lives (keep-alive), its listen lock is free (no
    # listener ever takes key 0).
    _sql(
        pg_url,
        "INSERT INTO {s}.waiters (name, holder, expires_at, owner, ttl, listen_key, refreshed_at)"
        " VALUES (%s, 'ghost', clock_timestamp() + interval '2 s', %s, 30, 0, clock_timestamp())",
        (R, "9" * 32),
    )
    assert coord.release(lease)
    assert coord.current(R) is None  # not handed to the ghost: free at once, not after 2 s
    assert _sql(pg_url, "SELECT count(*) FROM {s}.waiters") == [(0,)]
    assert coord.acquire(R, ttl=5, wait=0).epoch == lease.epoch + 1


def test_a_live_waiter_is_handed_the_resource_and_leave_passes_it_on(
    open_coord: Callable[[str], Coordinator], pg_url: str
) -> None:
    coord = open_coord(pg_url)
    lease = coord.acquire(R, ttl=30, wait=0)
    owner = "8" * 32
    with psycopg.connect(pg_url.split("?", maxsplit=1)[0], autocommit=True) as alive:
        # a waiter in another process: it holds its listen lock (key 77) while it lives
        alive.execute(f"SELECT pg_advisory_lock({postgres_schema.LISTEN_LOCK_CLASS}, 77)")
        waiter_id = _sql(
            pg_url,
            "INSERT INTO {s}.waiters (name, holder, expires_at, owner, ttl, listen_key, "
            "refreshed_at) VALUES (%s, 'remote', clock_timestamp() + interval '2 s', %s, 30, 77, "
            "clock_timestamp()) RETURNING id",
            (R, owner),
        )[0][0]
        assert coord.release(lease)
        info = coord.current(R)
        assert info is not None and info.holder == "remote" and info.epoch == lease.epoch + 1
        # it gave up before it learnt of the grant: its leave ends that lease
        _sql(pg_url, "SELECT {s}.leave(%s, %s, %s)", (R, waiter_id, owner))
    assert coord.current(R) is None
    assert [(r.kind, r.holder) for r in coord.history(R)[-2:]] == [
        (RecordKind.GRANTED, "remote"),
        (RecordKind.RELEASED, "remote"),
    ]


def test_leave_after_a_handoff_releases_the_lease_it_never_saw(
    open_coord: Callable[[str], Coordinator], pg_url: str
) -> None:
    holder, _, backend, lease = _holder_and_waiter(open_coord, pg_url)
    request = GrantRequest(R, 10.0, "7" * 32, "w")
    ticket = backend.enqueue(request)
    assert backend.listener_state == "listening"
    assert isinstance(backend.try_grant(request, ticket), Blocked)
    assert holder.release(lease)
    info = holder.current(R)
    assert info is not None and info.holder == "w"
    backend.leave(ticket)  # the caller gave up (a timeout, an interrupt) without looking
    assert holder.current(R) is None
    assert holder.acquire(R, ttl=5, wait=0).epoch == lease.epoch + 2


def test_many_processes_competing_for_one_resource(
    open_coord: Callable[[str], Coordinator], pg_url: str
) -> None:
    coords = [open_coord(pg_url) for _ in range(4)]
    inside = threading.Lock()
    errors: list[BaseException] = []

    def work(coord: Coordinator) -> None:
        try:
            for _ in range(15):
                lease = coord.acquire(R, ttl=10, wait=20)
                assert inside.acquire(blocking=False), "two holders at once"
                inside.release()
                assert coord.release(lease)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(c,)) for c in coords]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    grants = [r for r in coords[0].history(R) if r.kind is RecordKind.GRANTED]
    assert [r.epoch for r in grants] == list(range(1, 61))
    assert _sql(pg_url, "SELECT count(*) FROM {s}.waiters WHERE expires_at > now()") == [(0,)]


def test_a_stale_or_late_handoff_is_asked_again(pg_url: str) -> None:
    backend = PostgresBackend(pg_url)
    try:
        request = GrantRequest(R, 10.0, "6" * 32, "w")
        ticket = PostgresTicket(backend, R, 7, request.owner, DEADLINE_CLOCK.now() - 1.0)
        ticket._sub = sub = Subscription(R, 7)
        ticket.seen_epoch = 5
        sub.handoff = (5, 0.5)  # a server answer after the grant already knew epoch 5
        assert backend._handed_over(ticket, request) is None and sub.handoff is None
        sub.handoff = (6, 3.0)  # since_keep can never exceed the time since the send
        granted = backend._handed_over(ticket, request)
        assert isinstance(granted, Granted) and granted.epoch == 6 and ticket.ended
        assert 9.9 < granted.expires_in <= 10.0
        late = PostgresTicket(backend, R, 8, request.owner, DEADLINE_CLOCK.now() - 8.0)
        late._sub = Subscription(R, 8)
        late._sub.handoff = (9, 0.1)  # less than half the ttl left: ask the server
        assert backend._handed_over(late, request) is None and not late.ended
    finally:
        backend.close()


def test_a_handoff_counts_the_time_a_suspended_host_slept_since_the_send(pg_url: str) -> None:
    """The server's clock kept counting while the host slept: a lease handed over 8 s of
    suspend after the waiter's last send has at most 2 s of its 10 s left, so the waiter asks
    the server instead of believing 10 s (``time.monotonic()`` would not have seen the 8 s)."""
    backend = PostgresBackend(pg_url)
    clock = ManualClock(now=time.monotonic())
    backend._clock = clock
    try:
        request = GrantRequest(R, 10.0, "6" * 32, "w")
        ticket = PostgresTicket(backend, R, 7, request.owner, clock.now())
        ticket._sub = Subscription(R, 7)
        clock.suspend(8.0)
        ticket._sub.handoff = (8, 0.1)
        assert backend._handed_over(ticket, request) is None and not ticket.ended
    finally:
        backend.close()


def test_notification_payloads_reach_the_right_subscriptions() -> None:
    listener = Listener(lambda: connect_listening(""), "x", "fenced_x", print, enabled=False)
    mine = listener.subscribe(R, 7)
    other = listener.subscribe(R, 8)
    watcher = listener.subscribe(R, None)
    listener._dispatch(f"7:{R}:12:0.25")
    assert mine.handoff == (12, 0.25) and mine.event.is_set()
    assert other.handoff is None and not other.event.is_set()
    assert watcher.handoff is None and watcher.event.is_set()
    listener._dispatch(f"8:{R}")  # woken to try itself (no grant)
    assert other.event.is_set() and other.handoff is None
    listener._dispatch(f"8:{R}:x:y")  # not ours to parse: ignored
    listener.close()


# -- the one-statement grant and release ----------------------------------------------------------


def test_the_one_statement_grant_raises_synchronous_commit(pg_url: str) -> None:
    backend = PostgresBackend(pg_url)
    try:
        backend.release(R, 1, "x")  # nothing to release: creates nothing
        request = GrantRequest(R, 5.0, "5" * 32, "h")
        first = backend.try_grant(request, None)
        assert isinstance(first, Granted)
        assert backend.release(R, first.epoch, request.owner)
        grant = backend._direct["grant"]
        params = grant.bind(
            name=R, owner="4" * 32, holder="h", ttl=5.0, value=None, keepalive=2.0, retry_cap=0.6
        )
        with psycopg.connect(pg_url.split("?", maxsplit=1)[0]) as conn:
            conn.execute("SET synchronous_commit = off")
            conn.commit()
            row = psycopg.RawCursor(conn).execute(grant.query, params).fetchone()
            assert row is not None and row[:2] == ("granted", first.epoch + 1)
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)  # this commit
            conn.commit()
    finally:
        backend.close()


def test_without_prepared_statements(open_coord: Callable[[str], Coordinator], pg_url: str) -> None:
    coord = open_coord(pg_url + "&prepare=off")
    for _ in range(8):
        assert coord.release(coord.acquire(R, ttl=5, wait=0))
    assert coord.last_epoch(R) == 8
    assert coord.backend._pool.prepare is False  # type: ignore[attr-defined]

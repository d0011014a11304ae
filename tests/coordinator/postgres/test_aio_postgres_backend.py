"""The asyncio PostgreSQL backend (``_aio.py``) against the session's real PostgreSQL server.

At the backend level, no mocks: the same steps on the async backend and the sync
:class:`PostgresBackend` (two schemas of one server) give the same answers; waiting tasks are
woken by NOTIFY, also by a release of the sync face from another thread; a killed LISTEN
connection is reopened; cancellation and ``aclose`` leave no task, thread or open transaction.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.postgres._aio import (
    AsyncPostgresBackend,
    open_async_postgres,
)
from fenced.coordinator.backends.postgres._backend import PostgresBackend
from fenced.core._errors import ConfigurationError, LeaseLost, OutcomeUnknown
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.testing._threads import ResultThread
from fenced.testing.postgres import PostgresServer

R = "exports/daily"
APP = "fenced-aio-test"


def _tasks() -> set[asyncio.Task[object]]:
    """The loop's tasks but psycopg's own short waits: before 3.3, psycopg's ``notifies``
    waits through ``asyncio.wait_for(event.wait(), …)``, a task of its own that the
    listener's reading renews every few seconds (they are the listener's, not a caller's)."""
    return {
        t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__qualname__", "") != "Event.wait"
    }


def _schema() -> str:
    return "t_" + uuid.uuid4().hex[:12]


def _url(server: PostgresServer, schema: str, **query: str) -> str:
    return server.url("postgres", schema=schema, application_name=APP, **query)


def _request(owner: str, resource: str = R, ttl: float = 2.0, **kw: Any) -> GrantRequest:
    return GrantRequest(resource, ttl, owner, owner.upper(), **kw)


@pytest.fixture
def schema() -> str:
    return _schema()


@pytest.fixture
async def aio(postgres_server: PostgresServer, schema: str) -> AsyncIterator[AsyncPostgresBackend]:
    backend = await open_async_postgres(_url(postgres_server, schema))
    try:
        yield backend
    finally:
        await backend.aclose()


@pytest.fixture
def sync(postgres_server: PostgresServer, schema: str) -> Iterator[PostgresBackend]:
    """A sync backend on the same schema as ``aio`` (two faces of one coordinator)."""
    with PostgresBackend(postgres_server.url("postgres", schema=schema)) as backend:
        yield backend


async def _until(
    condition: Callable[[], Awaitable[object] | object], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def _joined(thread: threading.Thread, timeout: float = 10.0) -> None:
    """Wait for ``thread`` without blocking the event loop."""
    await _until(lambda: not thread.is_alive(), timeout, f"{thread.name} to end")


# -- lockstep: the same answers as the sync backend -------------------------------------------


def _shape(value: object) -> object:
    """An answer without what legitimately differs between two coordinators (remaining times,
    seq, at, the coordinator id)."""
    if isinstance(value, Granted):
        return ("granted", value.epoch, value.owner, value.holder, value.ttl)
    if isinstance(value, Blocked):
        return ("blocked", value.holder, value.epoch)
    if isinstance(value, LeaseInfo):
        return ("lease", value.resource, value.epoch, value.holder, value.ttl, value.value)
    if isinstance(value, Record):
        return ("record", value.kind, value.resource, value.epoch, value.holder, value.detail)
    if isinstance(value, list):
        return [_shape(item) for item in value]
    if isinstance(value, float):
        return "seconds"
    return value


class Lockstep:
    """Runs each step on both backends and compares answers (or exception classes)."""

    def __init__(self, sync: PostgresBackend, aio: AsyncPostgresBackend) -> None:
        self.sync = sync
        self.aio = aio
        self.steps = 0

    async def __call__(self, method: str, *args: Any) -> tuple[Any, Any]:
        return await self.each(method, args, args)

    async def each(
        self, method: str, sync_args: tuple[Any, ...], aio_args: tuple[Any, ...]
    ) -> tuple[Any, Any]:
        self.steps += 1
        try:
            expected: object = getattr(self.sync, method)(*sync_args)
        except Exception as error:
            expected = type(error)
        try:
            got: object = await getattr(self.aio, method)(*aio_args)
        except Exception as error:
            got = type(error)
        assert _shape(got) == _shape(expected), f"step {self.steps}: {method}{sync_args}"
        return expected, got


@pytest.mark.parametrize("prepare", ["on", "off"])
async def test_lockstep_with_the_sync_backend(
    postgres_server: PostgresServer, prepare: str
) -> None:
    sync = PostgresBackend(postgres_server.url("postgres", schema=_schema(), prepare=prepare))
    aio = await open_async_postgres(_url(postgres_server, _schema(), prepare=prepare))
    try:
        step = Lockstep(sync, aio)
        r2, r3 = "jobs/x", "jobs/y"
        assert (await step("last_epoch", R))[0] == 0
        assert (await step("resources"))[0] == []
        assert (await step("current", R))[0] is None
        # grants, the one-statement path and the function's
        assert (await step("try_grant", _request("a"), None))[0].epoch == 1
        assert isinstance((await step("try_grant", _request("b"), None))[0], Blocked)
        await step("try_grant", _request("a"), None)  # held by this very owner: its lease
        await step("try_grant", _request("c", r2, request_id="rid-1"), None)
        await step("try_grant", _request("c", r2, request_id="rid-1"), None)  # the same grant
        foreign = await step("try_grant", _request("d", R, request_id="rid-1"), None)
        assert foreign[0] is ConfigurationError  # a request_id used for another resource
        # renew: by owner, wrong owner, stale epoch
        await step("renew", R, 1, "a", 2.0)
        assert (await step("renew", R, 1, "b", 2.0))[0] is LeaseLost
        assert (await step("renew", R, 2, "a", 2.0))[0] is LeaseLost
        # proclaim, report, current
        await step("proclaim", R, 1, "a", "leader-1")
        assert (await step("proclaim", R, 1, "b", "nope"))[0] is LeaseLost
        await step("current", R)
        await step("report", R, 1, "A", RecordKind.RENEWAL_FAILED, {"error": "slow", "n": 1})
        # release: wrong owner, stale epoch, owner, again
        assert (await step("release", R, 1, "b"))[0] is False
        assert (await step("release", R, 0, "a"))[0] is False
        assert (await step("release", R, 1, "a"))[0] is True
        assert (await step("release", R, 1, "a"))[0] is False
        await step("current", R)
        await step("try_grant", _request("b", value="v"), None)  # epoch 2, with a value
        await step("current", R)
        await step("release", R, 2, "b")
        # a request_id whose grant has ended: LeaseLost, never a second epoch
        await step("release", r2, 1, "c")
        assert (await step("try_grant", _request("c", r2, request_id="rid-1"), None))[
            0
        ] is LeaseLost
        # expiry by the server's clock, detected and recorded
        await step("try_grant", _request("e", r3, ttl=0.3), None)
        await asyncio.sleep(0.4)
        await step("current", r3)
        await step("renew", r3, 1, "e", 2.0)
        await step("try_grant", _request("f", r3), None)
        await step("last_epoch", R)
        await step("last_epoch", "never/granted")
        await step("resources")
        # records: all, per resource, with after and limit (each side's own seq numbers)
        expected, got = await step("records", None)
        assert len(expected) >= 10
        await step("records", R)
        await step("records", R, 0, 2)
        await step("records", r3)
        for index in (1, 4):
            await step.each("records", (None, expected[index].seq, 3), (None, got[index].seq, 3))
        kinds = [record.kind for record in got]
        assert RecordKind.EXPIRED in kinds and RecordKind.PROCLAIMED in kinds
        assert RecordKind.RENEWAL_FAILED in kinds
        # a ticket of another backend is refused
        await step("try_grant", _request("g", "jobs/z"), None)
        sync_ticket = sync.enqueue(_request("h", "jobs/z"))
        aio_ticket = await aio.enqueue(_request("h", "jobs/z"))
        with pytest.raises(ConfigurationError):
            await aio.try_grant(_request("h", "jobs/z"), sync_ticket)
        await step.each(
            "try_grant",
            (_request("h", "jobs/z"), sync_ticket),
            (_request("h", "jobs/z"), aio_ticket),
        )
        # free but someone queued: a caller without a ticket is behind the waiter
        await step("release", "jobs/z", 1, "g")
        await step("try_grant", _request("i", "jobs/z"), None)
        await step.each("leave", (sync_ticket,), (aio_ticket,))
        await step.each("leave", (sync_ticket,), (aio_ticket,))  # idempotent
        await step("records", "jobs/z")
    finally:
        sync.close()
        await aio.aclose()


async def test_errors_and_urls_as_the_sync_backend(postgres_server: PostgresServer) -> None:
    schema = _schema()
    bad = [
        postgres_server.url("postgres", schema=schema, timeout="soon"),
        postgres_server.url("postgres", schema="Not-A-Schema"),
        postgres_server.url("postgres", schema=schema, listen="maybe"),
        "mysql://localhost/db",
    ]
    for url in bad:
        with pytest.raises(ConfigurationError) as sync_error:
            PostgresBackend(url)
        with pytest.raises(ConfigurationError) as aio_error:
            await open_async_postgres(url)
        assert str(aio_error.value) == str(sync_error.value)
    # a missing database: ConfigurationError, the password never shown
    port = postgres_server.url().split(":")[-1].split("/")[0]
    missing = f"postgresql://postgres:s3cr3t-pw@127.0.0.1:{port}/no_such_db?schema={schema}"
    with pytest.raises(ConfigurationError) as caught:
        await open_async_postgres(missing)
    assert "s3cr3t-pw" not in str(caught.value) and "no_such_db" in str(caught.value)
    assert "s3cr3t-pw" not in repr(caught.value)
    # options belong in the URL's query string; pools are not taken (yet)
    with pytest.raises(ConfigurationError, match="query string"):
        await open_async_postgres(postgres_server.url(schema=schema), options={"timeout": 1})
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(postgres_server.dsn(), open=False)
    with pytest.raises(ConfigurationError, match="AsyncConnectionPool"):
        await open_async_postgres(pool)  # type: ignore[arg-type]
    # nothing reachable: Unavailable... within connect_timeout
    async with await open_async_postgres(_url(postgres_server, schema)) as backend:
        assert "s3cr3t" not in repr(backend)
    with pytest.raises(ConfigurationError, match="closed"):
        await backend.current(R)


# -- waiting ----------------------------------------------------------------------------------


async def test_a_release_by_the_sync_face_in_another_thread_wakes_the_waiting_task(
    aio: AsyncPostgresBackend, sync: PostgresBackend
) -> None:
    held = sync.try_grant(_request("a", ttl=30), None)
    assert isinstance(held, Granted)
    ticket = await aio.enqueue(_request("b"))
    assert aio.listener_state == "listening"
    assert isinstance(await aio.try_grant(_request("b"), ticket), Blocked)

    def release() -> bool:
        time.sleep(0.2)
        return sync.release(R, held.epoch, "a")

    releaser = ResultThread(release)
    releaser.start()
    started = time.monotonic()
    await aio.wait(ticket, 10)
    woke = time.monotonic()
    await _joined(releaser)
    assert releaser.result is True
    assert woke - releaser.finished_at < 1.0
    assert woke - started < 5  # not the timeout
    # the release handed the lease over (the waiter's listener holds its lock)
    granted = await aio.try_grant(_request("b"), ticket)
    assert isinstance(granted, Granted) and granted.epoch == held.epoch + 1
    info = await aio.current(R)
    assert info is not None and info.holder == "B" and info.epoch == granted.epoch
    await aio.wait(ticket, 5)  # an ended ticket: at once
    assert await aio.release(R, granted.epoch, "b")


async def test_an_async_release_wakes_a_sync_waiter(
    aio: AsyncPostgresBackend, sync: PostgresBackend
) -> None:
    held = await aio.try_grant(_request("a", ttl=30), None)
    assert isinstance(held, Granted)
    ticket = sync.enqueue(_request("b"))
    assert isinstance(sync.try_grant(_request("b"), ticket), Blocked)
    waiter = ResultThread(lambda: sync.wait(ticket, 10))
    waiter.start()
    await asyncio.sleep(0.1)
    released_at = time.monotonic()
    assert await aio.release(R, held.epoch, "a")
    await _joined(waiter)
    assert waiter.finished_at - released_at < 1.0
    granted = sync.try_grant(_request("b"), ticket)
    assert isinstance(granted, Granted) and granted.epoch == held.epoch + 1


@pytest.mark.parametrize("take", [True, False])
async def test_leave_after_a_handover(
    aio: AsyncPostgresBackend, sync: PostgresBackend, take: bool
) -> None:
    held = sync.try_grant(_request("a", ttl=30), None)
    assert isinstance(held, Granted)
    ticket = await aio.enqueue(_request("b", ttl=5))
    assert isinstance(await aio.try_grant(_request("b", ttl=5), ticket), Blocked)
    assert sync.release(R, held.epoch, "a")  # hands R to the ticket
    info = sync.current(R)
    assert info is not None and info.holder == "B"
    got = await aio.leave(ticket, take=take)
    if take:
        assert isinstance(got, Granted)
        assert (got.epoch, got.owner, got.holder, got.ttl) == (held.epoch + 1, "b", "B", 5.0)
        assert 4 < got.expires_in <= 5
        assert await aio.release(R, got.epoch, "b")
    else:
        assert got is None
        assert await aio.current(R) is None  # released and passed on (nobody else waits)
    assert await aio.leave(ticket, take=take) is None  # idempotent


async def test_a_cancelled_wait_leaves_no_task(aio: AsyncPostgresBackend) -> None:
    held = await aio.try_grant(_request("a", ttl=30), None)
    assert isinstance(held, Granted)
    ticket = await aio.enqueue(_request("b"))
    assert isinstance(await aio.try_grant(_request("b"), ticket), Blocked)
    before = _tasks()
    waiting = asyncio.create_task(aio.wait(ticket, 30))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert _tasks() == before
    # the ticket still works: the release wakes the next wait
    assert isinstance(await aio.try_grant(_request("b"), ticket), Blocked)
    waiting = asyncio.create_task(aio.wait(ticket, 10))
    started = time.monotonic()
    assert await aio.release(R, held.epoch, "a")
    await waiting
    assert time.monotonic() - started < 1.0
    assert isinstance(await aio.try_grant(_request("b"), ticket), Granted)


async def test_watch_is_woken_by_a_record(aio: AsyncPostgresBackend, sync: PostgresBackend) -> None:
    last = max((record.seq for record in await aio.records(R)), default=0)
    started = time.monotonic()
    await aio.watch(R, last, 0.3)  # nothing happens: the timeout
    assert 0.25 < time.monotonic() - started < 2
    watching = asyncio.create_task(aio.watch(R, last, 10))
    await asyncio.sleep(0.2)
    assert not watching.done()
    granted_at = time.monotonic()
    held = await asyncio.to_thread(sync.try_grant, _request("a", ttl=5), None)
    await asyncio.wait_for(watching, 5)
    assert time.monotonic() - granted_at < 1.0
    assert isinstance(held, Granted)
    records = await aio.records(R, last)
    assert [record.kind for record in records] == [RecordKind.GRANTED]
    # a cancelled watch leaves no task and removes its watcher row
    before = _tasks()
    watching = asyncio.create_task(aio.watch(R, records[-1].seq, 10))
    await asyncio.sleep(0.1)
    watching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watching
    assert _tasks() == before
    assert await _count(sync, "watchers") == 0


async def _count(backend: PostgresBackend, table: str) -> int:
    with psycopg.connect(backend._parsed.conninfo, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{backend.schema}".{table}'.encode()).fetchone()
    assert row is not None
    return int(row[0])


def _terminate(server: PostgresServer, application_name: str) -> int:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (application_name,),
        ).fetchall()
    return len(rows)


async def test_a_killed_listen_connection_is_reopened_and_waiters_still_woken(
    aio: AsyncPostgresBackend, sync: PostgresBackend, postgres_server: PostgresServer
) -> None:
    held = sync.try_grant(_request("a", ttl=30), None)
    assert isinstance(held, Granted)
    ticket = await aio.enqueue(_request("b"))
    assert isinstance(await aio.try_grant(_request("b"), ticket), Blocked)
    assert aio.listener_state == "listening"
    waiting = asyncio.create_task(aio.wait(ticket, 10))
    await asyncio.sleep(0.05)
    killed_at = time.monotonic()
    assert await asyncio.to_thread(_terminate, postgres_server, f"{APP}-listen") == 1
    await asyncio.wait_for(waiting, 5)  # woken to re-check once the listener is back
    assert time.monotonic() - killed_at < 3
    await _until(lambda: aio.listener_state == "listening", 5, "the listener back")
    # the waiter re-checks (keeping its place), then a release wakes it by NOTIFY again
    assert isinstance(await aio.try_grant(_request("b"), ticket), Blocked)
    waiting = asyncio.create_task(aio.wait(ticket, 10))
    await asyncio.sleep(0.05)
    released_at = time.monotonic()
    assert await asyncio.to_thread(sync.release, R, held.epoch, "a")
    await asyncio.wait_for(waiting, 5)
    assert time.monotonic() - released_at < 1.0
    granted = await aio.try_grant(_request("b"), ticket)
    assert isinstance(granted, Granted) and granted.epoch == held.epoch + 1


# -- connections: the kept one, the borrowed ones ---------------------------------------------


async def test_a_session_terminated_between_calls_is_replaced_before_sending(
    aio: AsyncPostgresBackend, postgres_server: PostgresServer
) -> None:
    for round_number in range(3):
        held = await aio.try_grant(_request(f"a{round_number}", ttl=30), None)
        assert isinstance(held, Granted)
        # the pooled sessions die while idle (the kept one among them): the next call sees it
        # without a round trip and runs on a new connection (a release is not sent twice, so
        # sending it on the dead one would be OutcomeUnknown)
        assert await asyncio.to_thread(_terminate, postgres_server, APP) >= 1
        await asyncio.sleep(0.05)
        assert await aio.release(R, held.epoch, f"a{round_number}")
    assert all(state == "idle" for _, state in await _sessions(postgres_server))


@pytest.mark.parametrize("pool_size", ["1", "3"])
async def test_concurrent_tasks_share_the_kept_connection_and_the_pool(
    postgres_server: PostgresServer, schema: str, pool_size: str
) -> None:
    async with await open_async_postgres(_url(postgres_server, schema, pool_size=pool_size)) as aio:

        async def cycles(number: int) -> int:
            done = 0
            for turn in range(10):
                owner = f"o{number}-{turn}"
                held = await aio.try_grant(_request(owner, f"r/{number}", ttl=30), None)
                assert isinstance(held, Granted)
                assert await aio.renew(f"r/{number}", held.epoch, owner, 30) > 0  # psycopg's
                assert await aio.release(f"r/{number}", held.epoch, owner)
                done += 1
            return done

        assert await asyncio.gather(*(cycles(n) for n in range(12))) == [10] * 12
        states = await _sessions(postgres_server)
        assert 0 < len(states) <= int(pool_size) and all(s == "idle" for _, s in states)
    await _until(_no_sessions(postgres_server), 5, "every session of the backend to end")


# -- cancellation, deadlines, closing ---------------------------------------------------------


async def _sessions(server: PostgresServer) -> list[tuple[str, str]]:
    def read() -> list[tuple[str, str]]:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT application_name, state FROM pg_stat_activity "
                "WHERE application_name LIKE %s",
                (f"{APP}%",),
            ).fetchall()
        return [(str(name), str(state)) for name, state in rows]

    return await asyncio.to_thread(read)


def _no_sessions(server: PostgresServer) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await _sessions(server) == []

    return check


class RowLock:
    """A transaction holding the lock of a resource's row (statements on it then block)."""

    def __init__(self, server: PostgresServer, schema: str, resource: str) -> None:
        self.conn = psycopg.connect(server.dsn())
        self.conn.execute(
            f'SELECT 1 FROM "{schema}".resources WHERE name = %s FOR UPDATE'.encode(), (resource,)
        )

    def release(self) -> None:
        self.conn.rollback()
        self.conn.close()


@pytest.mark.parametrize("operation", ["release", "renew"])  # a hot statement, a function
async def test_a_cancelled_statement_leaves_no_transaction_in_the_pool(
    aio: AsyncPostgresBackend, postgres_server: PostgresServer, schema: str, operation: str
) -> None:
    held = await aio.try_grant(_request("a", ttl=30), None)
    assert isinstance(held, Granted)
    lock = RowLock(postgres_server, schema, R)
    try:
        if operation == "release":
            call: Awaitable[object] = aio.release(R, held.epoch, "a")
        else:
            call = aio.renew(R, held.epoch, "a", 30)
        running = asyncio.ensure_future(call)
        await asyncio.sleep(0.3)
        assert not running.done()  # blocked by the row lock, on the server
        cancelled_at = time.monotonic()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert time.monotonic() - cancelled_at < 2
    finally:
        lock.release()
    # the statement was cancelled on the server: the lease lives, no session is left in a
    # transaction, and the pool's connections serve the next calls
    states = await _sessions(postgres_server)
    assert all(state == "idle" for _, state in states), states
    info = await aio.current(R)
    assert info is not None and info.epoch == held.epoch
    for _ in range(5):
        assert await aio.renew(R, held.epoch, "a", 30) > 0
    assert await aio.release(R, held.epoch, "a")


async def test_no_reply_within_the_timeout_is_outcome_unknown(
    postgres_server: PostgresServer, schema: str
) -> None:
    async with await open_async_postgres(_url(postgres_server, schema, timeout="0.3")) as aio:
        held = await aio.try_grant(_request("a", ttl=30), None)
        assert isinstance(held, Granted)
        lock = RowLock(postgres_server, schema, R)
        try:
            started = time.monotonic()
            with pytest.raises(OutcomeUnknown, match=r"no reply within 0\.3s"):
                await aio.release(R, held.epoch, "a")
            assert time.monotonic() - started < 1.5
        finally:
            lock.release()
        # the release did take effect once the lock was gone (its reply was what got lost);
        # the cut connection was replaced
        await _until(lambda: _is_none(aio.current(R)), 5, "the release to end the lease")
        assert isinstance(await aio.try_grant(_request("b"), None), Granted)


async def test_deadlines_of_concurrent_statements_each_cut_their_own(
    postgres_server: PostgresServer, schema: str
) -> None:
    """One timer serves every statement's deadline: two statements blocked at once (on the
    kept connection and on a borrowed one) both end at their own deadline."""
    async with await open_async_postgres(_url(postgres_server, schema, timeout="0.3")) as aio:
        resources = [f"{R}/{n}" for n in range(2)]
        helds = [await aio.try_grant(_request("a", name, ttl=30), None) for name in resources]
        locks = [RowLock(postgres_server, schema, name) for name in resources]
        try:
            started = time.monotonic()
            outcomes = await asyncio.gather(
                *(
                    aio.release(name, held.epoch, "a")
                    for name, held in zip(resources, helds, strict=True)
                    if isinstance(held, Granted)
                ),
                return_exceptions=True,
            )
            assert time.monotonic() - started < 1.5
        finally:
            for lock in locks:
                lock.release()
        assert [type(outcome) for outcome in outcomes] == [OutcomeUnknown, OutcomeUnknown]
        for name in resources:  # the releases took effect once the locks were gone
            await _until(partial(_ended, aio, name), 5, f"{name} released")
        assert isinstance(await aio.try_grant(_request("b"), None), Granted)


async def _ended(aio: AsyncPostgresBackend, resource: str) -> bool:
    return await aio.current(resource) is None


async def _is_none(value: Awaitable[object]) -> bool:
    return await value is None


async def test_aclose_leaves_no_task_and_no_thread(
    postgres_server: PostgresServer, sync: PostgresBackend, schema: str
) -> None:
    threads = set(threading.enumerate())
    tasks = asyncio.all_tasks()
    aio = await open_async_postgres(_url(postgres_server, schema))
    held = await aio.try_grant(_request("a", ttl=30), None)
    assert isinstance(held, Granted)
    ticket: Ticket = await aio.enqueue(_request("b"))
    await aio.watch(R, 0, 0.1)
    waiting = asyncio.create_task(aio.wait(ticket, 30))
    await asyncio.sleep(0.05)
    assert len(asyncio.all_tasks() - tasks) > 1  # the waiter, the listener, the pool's
    await aio.aclose()
    await asyncio.wait_for(waiting, 2)  # woken: its ticket ended
    assert asyncio.all_tasks() == tasks
    await _until(lambda: set(threading.enumerate()) <= threads, 2, "no thread left")
    await _until(_no_sessions(postgres_server), 5, "every session of the backend to end")
    assert await _count(sync, "waiters") == 0  # the open ticket left the queue
    await aio.aclose()  # idempotent
    with pytest.raises(ConfigurationError, match="closed"):
        await aio.try_grant(_request("a"), None)

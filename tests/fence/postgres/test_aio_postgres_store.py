"""The ``postgresql:`` store on the asyncio face runs on the event loop, not on a thread.

``await fenced.aio.open_store("postgresql://…")`` runs the sync store's code in greenlets of the
loop (:mod:`fenced._drivers.green`) over psycopg ``AsyncConnection`` s (the conformance suites
on this face are in ``tests/fence/test_aio_store.py``). These tests check what that design
promises: no thread, statements' deadlines as loop timers (a stalled server does not stall the
loop), calls one at a time in order, and the cancellation rules of the worker thread.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from psycopg_pool import ConnectionPool

from fenced._drivers.green import await_only
from fenced.aio._store import AsyncStore, GreenRunner, open_store
from fenced.core._errors import FencedError, OutcomeUnknown, Unavailable
from fenced.fence import Store
from fenced.testing.postgres import PostgresServer
from fenced.testing.proxy import TcpProxy
from fenced.testing.store_conformance import R, token
from support.postgres_stores import postgres_snapshot, store_url

__all__ = ["store_url"]  # a fixture from support.postgres_stores, used here


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[AsyncStore]:
    opened = await open_store(store_url, "monotonic")
    yield opened
    await opened.aclose()


async def _small_chunks() -> AsyncIterator[bytes]:
    for n in range(8):
        yield f"part {n};".encode() * 100
        await asyncio.sleep(0)


async def test_every_call_runs_on_the_loop_and_no_thread_is_started(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Open, write, publish from an async iterator, read, stream, gc, history, close: no thread is
    started and no task is left (data kept under the size hashed on the process's helper thread,
    see docs/asyncio.md). Threads of earlier tests may end meanwhile; only starts count."""
    started: list[threading.Thread] = []
    start = threading.Thread.start

    def recording_start(thread: threading.Thread) -> None:
        started.append(thread)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    store = await open_store(store_url, "monotonic")
    assert isinstance(store._worker, GreenRunner)
    assert await store.fence(token(1)) == 1
    version = await store.put(token(1), "k", b"v", op_id="op-1")
    assert (await store.put(token(1), "k", b"v", op_id="op-1")) == version  # the op's record
    item = await store.get(R, "k")
    assert item is not None and item.value == b"v"
    publication = await store.publish(token(1), _small_chunks(), name="report")
    expected = b"".join([f"part {n};".encode() * 100 for n in range(8)])
    assert publication.size == len(expected)
    assert await store.read(R, "report") == expected
    async with await store.open(R, "report") as reader:
        assert b"".join([chunk async for chunk in reader]) == expected
    await store.publish(token(1), b"second", name="report")
    assert await store.gc(keep=1, grace=0) == 1
    assert [r.kind.value for r in await store.history(R)][:1] == ["installed"]
    await store.aclose()
    assert started == []
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_calls_of_concurrent_tasks_run_one_at_a_time_in_order(store: AsyncStore) -> None:
    versions = await asyncio.gather(
        *(store.put(token(1), "counter", str(i).encode()) for i in range(30))
    )
    assert [v.version for v in versions] == list(range(1, 31))
    item = await store.get(R, "counter")
    assert item is not None and (item.value, item.version) == (b"29", 30)


async def test_a_cancelled_call_that_had_not_started_never_runs(store: AsyncStore) -> None:
    gate = asyncio.Event()
    store._worker.submit(lambda: await_only(gate.wait()))  # holds the store's turn
    putting = asyncio.create_task(store.put(token(1), "k", b"v"))
    await asyncio.sleep(0.05)
    putting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await putting
    gate.set()
    assert await store.get(R, "k") is None
    assert await store.floor(R) is None


async def test_a_cancelled_call_that_had_started_runs_to_its_end(
    store: AsyncStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, go = asyncio.Event(), asyncio.Event()
    put = store._store.put

    def slow_put(*args: Any, **kwargs: Any) -> Any:
        started.set()
        await_only(go.wait())  # the greenlet waits on the loop, inside the call
        return put(*args, **kwargs)

    monkeypatch.setattr(store._store, "put", slow_put)
    putting = asyncio.create_task(store.put(token(1), "k", b"v"))
    await asyncio.wait_for(started.wait(), 5)
    putting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await putting  # at once: the call goes on in its own task
    go.set()
    monkeypatch.undo()
    item = await store.get(R, "k")
    assert item is not None and (item.value, item.version) == (b"v", 1)


async def test_a_stalled_server_is_cut_at_the_deadline_while_the_loop_keeps_running(
    postgres_server: PostgresServer,
) -> None:
    """Replies stop (a proxy blackholes the connection): the statement is cut by a timer of the
    loop at ``?timeout=`` and fails with a retryable error naming it; meanwhile other tasks of
    the loop run; once the network is back, the store works again."""
    schema = "s_" + uuid.uuid4().hex[:12]
    with TcpProxy("127.0.0.1", postgres_server.port) as proxy:
        url = postgres_server.url("postgres", schema=schema, timeout="0.5").replace(
            f":{postgres_server.port}/", f":{proxy.port}/"
        )
        async with await open_store(url, "monotonic") as store:
            await store.fence(token(1))
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.01)
                    ticks += 1

            ticker = asyncio.create_task(tick())
            proxy.blackhole()
            with pytest.raises((Unavailable, OutcomeUnknown), match=r"no reply within 0\.5s"):
                await store.put(token(1), "k", b"v")
            assert ticks >= 10  # the loop ran all along (every 10 ms while 0.5 s passed)
            ticker.cancel()
            proxy.forward()
            for _ in range(50):  # the cut connection is replaced
                try:
                    await store.put(token(1), "k", b"w", op_id="after")
                    break
                except FencedError:
                    await asyncio.sleep(0.1)
            item = await store.get(R, "k")
            assert item is not None and item.value == b"w"


MiB = 1024 * 1024


async def test_data_that_fails_part_way_publishes_nothing(store: AsyncStore) -> None:
    first = await store.publish(token(1), b"first")
    before = postgres_snapshot(cast(Store, store))

    async def failing() -> AsyncIterator[bytes]:
        yield bytes(2 * MiB)
        raise OSError("the source broke")

    with pytest.raises(OSError, match="the source broke"):
        await store.publish(token(1), failing())
    assert await store.latest(R) == first
    assert postgres_snapshot(cast(Store, store)) == before


async def test_a_cancelled_publish_leaves_the_previous_publication_and_nothing_staged(
    store: AsyncStore,
) -> None:
    first = await store.publish(token(1), b"the first export")
    before = postgres_snapshot(cast(Store, store))
    sent = 0
    never = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(40):  # 2.5 MiB: COPY sends the first MiBs, then waits for more
            sent += 1
            yield bytes(64 * 1024)
        await never.wait()
        yield b"never sent"  # pragma: no cover

    publishing = asyncio.create_task(store.publish(token(2), stalls()))
    for _ in range(2000):
        if sent >= 40:
            break
        await asyncio.sleep(0.005)
    assert sent == 40
    publishing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await publishing
    assert await store.latest(R) == first  # runs after the cancelled publish ended
    assert await store.read(R) == b"the first export"
    assert postgres_snapshot(cast(Store, store)) == before  # the COPY was rolled back
    assert await store.floor(R) == 1


async def test_a_users_psycopg_pool_runs_on_a_worker_thread(store_url: str) -> None:
    """A sync pool (not a URL) has no asyncio connections: its store runs on a worker thread,
    with the same results."""
    url, _, query = store_url.partition("?")
    pool = ConnectionPool(url, kwargs={"autocommit": True}, min_size=1, max_size=2, open=True)
    try:
        store = await open_store(pool, "monotonic", options={"schema": query.split("=", 1)[1]})
        try:
            assert not isinstance(store._worker, GreenRunner)
            assert await store.fence(token(1)) == 1
            await store.put(token(1), "k", b"v")
            item = await store.get(R, "k")
            assert item is not None and item.value == b"v"
        finally:
            await store.aclose()
    finally:
        pool.close()

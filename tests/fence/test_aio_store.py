"""The asyncio face of stores (:mod:`fenced.aio._store`).

1. The store conformance suites, unchanged, on ``sqlite:``, ``file:``, ``postgresql:`` and
   ``s3:`` stores opened with ``await fenced.aio.open_store``: their ``make_store`` fixture
   hands out :class:`fenced.testing.aio_bridge.SyncStore` facades, whose calls run as coroutines
   on an event loop in a background thread.
2. What only the async face has: checks on the loop before any thread work, async iterators as
   publish data (back-pressure, failures, cancellation), ordering, closing, and a loop that keeps
   running while the worker syncs.
"""

from __future__ import annotations

import asyncio
import gc as garbage
import hashlib
import inspect
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import fenced.fence
from fenced.aio._store import PIPE_CHUNKS, THREAD_PREFIX, AsyncStore, open_store
from fenced.core._errors import (
    ConfigurationError,
    FencedError,
    InvalidName,
    NotFound,
    StaleToken,
)
from fenced.fence import Store
from fenced.fence._values import Mode
from fenced.testing.aio_bridge import LoopThread, SyncStore, open_sync_store
from fenced.testing.store_conformance import (
    C1,
    FencingConformance,
    KeysConformance,
    MakeStore,
    OpIdConformance,
    PublicationConformance,
    R,
    RecordsConformance,
    StoreConformance,
    directory_snapshot,
    sqlite_snapshot,
    token,
)
from support.postgres_stores import postgres_snapshot, store_url
from support.s3_stores import s3_bucket, s3_snapshot, s3_url

__all__ = ["s3_bucket", "s3_url", "store_url"]  # fixtures from support, used here

MiB = 1024 * 1024
KiB = 1024

# -- 1. the conformance suites on the async face --------------------------------------------


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    with LoopThread() as loop:
        yield loop


def _facades(loop: LoopThread, url: str) -> Iterator[MakeStore]:
    opened: list[SyncStore] = []

    def make(mode: Mode | None = None, **options: Any) -> Store:
        opened.append(open_sync_store(loop, url, mode, **options))
        return opened[-1].as_store()

    yield make
    for store in opened:
        store.close()


class TestAsyncLocalStore(StoreConformance):
    """``sqlite:`` and ``file:`` stores (the ``kind`` fixture)."""

    @pytest.fixture
    def make_store(self, loop_thread: LoopThread, kind: str, tmp_path: Path) -> Iterator[MakeStore]:
        area = tmp_path / "area"
        area.mkdir()
        yield from _facades(loop_thread, _url(kind, area))

    @pytest.fixture
    def snapshot(self, kind: str) -> Callable[[Store], object]:
        return _snapshot_of(kind)


class TestAsyncPostgresStore(
    FencingConformance,
    KeysConformance,
    PublicationConformance,
    OpIdConformance,
    RecordsConformance,
):
    @pytest.fixture
    def make_store(self, loop_thread: LoopThread, store_url: str) -> Iterator[MakeStore]:
        yield from _facades(loop_thread, store_url)

    @pytest.fixture
    def snapshot(self) -> Callable[[Store], object]:
        return postgres_snapshot


class TestAsyncS3Store(
    FencingConformance,
    KeysConformance,
    PublicationConformance,
    OpIdConformance,
    RecordsConformance,
):
    @pytest.fixture
    def make_store(self, loop_thread: LoopThread, s3_url: str) -> Iterator[MakeStore]:
        yield from _facades(loop_thread, s3_url)

    @pytest.fixture
    def snapshot(self) -> Callable[[Store], object]:
        return s3_snapshot


# -- 2. what only the async face has ---------------------------------------------------------


def _url(kind: str, tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/store.db" if kind == "sqlite" else f"file://{tmp_path}/store"


def _snapshot_of(kind: str) -> Callable[[Store], object]:
    """The snapshot helper of a local store (its state without records; it only needs ``url``)."""
    return sqlite_snapshot if kind == "sqlite" else directory_snapshot


def _snapshot(kind: str, store: AsyncStore) -> object:
    """The local store's state without records."""
    return _snapshot_of(kind)(cast(Store, store))


@pytest.fixture(params=["sqlite", "file"])
def kind(request: pytest.FixtureRequest) -> str:
    return cast(str, request.param)


@pytest.fixture
async def store(kind: str, tmp_path: Path) -> AsyncIterator[AsyncStore]:
    opened = await open_store(_url(kind, tmp_path), "monotonic")
    yield opened
    await opened.aclose()


def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}


def _payload(size: int) -> bytes:
    block = hashlib.sha256(b"fenced").digest()
    return (block * (size // len(block) + 1))[:size]


def test_the_async_store_has_the_sync_stores_methods_awaited() -> None:
    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(AsyncStore) - {"aclose"} == public(Store) - {"close"}
    for name in public(AsyncStore):
        attribute = inspect.getattr_static(AsyncStore, name)
        if not isinstance(attribute, property):
            assert inspect.iscoroutinefunction(attribute), name


_BAD_CALLS: list[tuple[str, Callable[[Any], Any]]] = [
    ("fence text", lambda s: s.fence(str(token(1)))),
    ("put key", lambda s: s.put(token(1), "../x", b"v")),
    ("put key type", lambda s: s.put(token(1), 5, b"v")),
    ("put value", lambda s: s.put(token(1), "k", "text")),
    ("put large", lambda s: s.put(token(1), "k", bytes(16 * MiB + 1))),
    ("put if_version", lambda s: s.put(token(1), "k", b"v", if_version=-1)),
    ("put op_id", lambda s: s.put(token(1), "k", b"v", op_id="")),
    ("put token", lambda s: s.put(str(token(1)), "k", b"v")),
    ("publish name", lambda s: s.publish(token(1), b"d", name="../x")),
    ("publish str path", lambda s: s.publish(token(1), "/etc/hostname")),
    ("publish int", lambda s: s.publish(token(1), 5)),
    ("publish op_id", lambda s: s.publish(token(1), b"d", op_id="a\nb")),
    ("publish token", lambda s: s.publish(None, b"d")),
    ("get key", lambda s: s.get(R, "a//b")),
    ("get resource", lambda s: s.get("../r", "k")),
    ("latest", lambda s: s.latest(R, "/abs")),
    ("read", lambda s: s.read(R, ".")),
    ("open", lambda s: s.open("", "")),
    ("floor", lambda s: s.floor("a//b")),
    ("binding", lambda s: s.binding("..")),
    ("gc keep", lambda s: s.gc(keep=-1)),
    ("gc bool", lambda s: s.gc(keep=True)),
    ("gc grace", lambda s: s.gc(grace=-1)),
    ("history after", lambda s: s.history(R, after=-1)),
    ("history resource", lambda s: s.history("../x")),
    ("rebind id", lambda s: s.rebind(R, "not-hex", ceiling=1)),
    ("rebind ceiling", lambda s: s.rebind(R, C1, ceiling=-1)),
    ("rebind previous", lambda s: s.rebind(R, C1, previous="x", ceiling=1)),
]


async def test_bad_input_raises_what_the_sync_store_raises_without_touching_the_thread(
    store: AsyncStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_thread_work(call: object) -> None:
        raise AssertionError("bad input reached the worker thread")

    with fenced.fence.open_store(store.url) as same:
        monkeypatch.setattr(store._worker, "submit", no_thread_work)
        for what, call in _BAD_CALLS:
            with pytest.raises(FencedError) as sync_error:
                call(same)
            with pytest.raises(FencedError) as async_error:
                await call(store)
            assert type(async_error.value) is type(sync_error.value), what
            assert str(async_error.value) == str(sync_error.value), what
            assert isinstance(async_error.value, ConfigurationError | InvalidName), what


async def test_bad_options_start_no_thread(tmp_path: Path) -> None:
    before = _store_threads()
    url = _url("sqlite", tmp_path)
    bad: list[tuple[Callable[[], Awaitable[AsyncStore]], str]] = [
        (lambda: open_store(url, "lenient"), "mode"),  # type: ignore[arg-type]
        (lambda: open_store("nosuch://x"), "no store for nosuch"),
        (lambda: open_store(url, op_retention=0), "op_retention"),
        (lambda: open_store(url, record_limit=0), "record_limit"),
    ]
    for opening, message in bad:
        with pytest.raises(ConfigurationError, match=message):
            await opening()
    assert _store_threads() == before
    with pytest.raises(ConfigurationError, match=r"not a fenced store|does not exist"):
        await open_store(_url("sqlite", tmp_path / "missing"), create=False)
    assert _store_threads() == before  # a failed open ends its thread


async def _chunks_of(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]
        await asyncio.sleep(0)


async def test_publish_from_an_async_generator_of_5_mib_in_64_kib_chunks(
    store: AsyncStore,
) -> None:
    data = _payload(5 * MiB)
    publication = await store.publish(token(1), _chunks_of(data, 64 * KiB))
    assert (publication.size, publication.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert await store.latest(R) == publication
    assert await store.read(R) == data

    async def mixed() -> AsyncIterator[bytes | bytearray | memoryview]:
        yield b""
        yield bytearray(b"ab")
        yield memoryview(b"cd")
        yield b""
        yield b"e"

    assert (await store.publish(token(1), mixed(), name="mixed")).size == 5
    assert await store.read(R, "mixed") == b"abcde"

    async def nothing() -> AsyncIterator[bytes]:
        return
        yield b""  # pragma: no cover - makes this an async generator

    assert (await store.publish(token(1), nothing(), name="empty")).size == 0
    assert await store.read(R, "empty") == b""


async def test_publish_from_a_file_path_and_a_sync_stream(
    store: AsyncStore, tmp_path: Path
) -> None:
    data = _payload(3 * MiB + 7)
    path = tmp_path / "export.bin"
    path.write_bytes(data)
    assert (await store.publish(token(1), path)).size == len(data)
    assert await store.read(R) == data
    with path.open("rb") as stream:
        assert (await store.publish(token(1), stream, name="stream")).size == len(data)
    assert await store.read(R, "stream") == data
    with pytest.raises(ConfigurationError, match="not str"):
        await store.publish(token(1), str(path))  # type: ignore[arg-type]


async def test_the_loop_runs_ahead_of_the_worker_by_at_most_the_pipes_chunks(
    store: AsyncStore,
) -> None:
    """Back-pressure: while the worker is busy, the loop takes no more chunks than the pipe
    holds (plus the one it waits to hand over)."""
    produced = 0
    busy = threading.Event()
    store._worker.submit(busy.wait)  # the worker is busy with something else

    async def counted() -> AsyncIterator[bytes]:
        nonlocal produced
        for _ in range(200):
            produced += 1
            yield bytes(64 * KiB)

    publishing = asyncio.create_task(store.publish(token(1), counted()))
    await asyncio.sleep(0.2)
    assert produced <= PIPE_CHUNKS + 1
    busy.set()
    publication = await publishing
    assert (produced, publication.size) == (200, 200 * 64 * KiB)


async def test_data_that_fails_part_way_publishes_nothing(kind: str, store: AsyncStore) -> None:
    first = await store.publish(token(1), b"first")
    before = _snapshot(kind, store)

    async def failing() -> AsyncIterator[object]:
        yield bytes(2 * MiB)
        raise OSError("the source broke")

    with pytest.raises(OSError, match="the source broke"):
        await store.publish(token(1), failing())  # type: ignore[arg-type]

    async def wrong_type() -> AsyncIterator[object]:
        yield bytes(MiB)
        yield "text"

    with pytest.raises(ConfigurationError, match="yielded str"):
        await store.publish(token(1), wrong_type())  # type: ignore[arg-type]
    assert await store.latest(R) == first
    assert _snapshot(kind, store) == before


async def test_a_stale_publish_is_refused_without_reading_all_the_data(
    store: AsyncStore,
) -> None:
    await store.fence(token(5))
    taken = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal taken
        while True:
            taken += 1
            yield bytes(64 * KiB)

    with pytest.raises(StaleToken):
        await store.publish(token(3), endless())
    assert taken <= PIPE_CHUNKS + 1
    assert await store.latest(R) is None


async def test_a_cancelled_publish_leaves_the_previous_publication_and_nothing_half_written(
    kind: str, store: AsyncStore
) -> None:
    first = await store.publish(token(1), b"the first export")
    before = _snapshot(kind, store)
    sent = 0
    never = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(40):  # 2.5 MiB: the worker stages its first MiBs, then waits
            sent += 1
            yield bytes(64 * KiB)
        await never.wait()
        yield b"never sent"  # pragma: no cover

    publishing = asyncio.create_task(store.publish(token(2), stalls(), name=""))
    deadline = time.monotonic() + 20
    while _snapshot(kind, store) == before:  # staging is under way: bytes are on disk
        assert time.monotonic() < deadline, "the publish never started staging"
        await asyncio.sleep(0.01)
    assert sent > 16
    publishing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await publishing
    assert await store.latest(R) == first  # runs after the cancelled publish ended
    assert await store.read(R) == b"the first export"
    assert _snapshot(kind, store) == before  # the staged bytes are gone
    assert await store.floor(R) == 1


async def test_a_cancelled_call_that_had_not_started_never_runs(store: AsyncStore) -> None:
    busy = threading.Event()
    store._worker.submit(busy.wait)
    putting = asyncio.create_task(store.put(token(1), "k", b"v"))
    await asyncio.sleep(0.05)
    putting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await putting
    busy.set()
    assert await store.get(R, "k") is None
    assert await store.floor(R) is None


async def test_a_cancelled_call_that_had_started_finishes_on_the_worker(
    store: AsyncStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, go = threading.Event(), threading.Event()
    put = store._store.put

    def slow_put(*args: Any, **kwargs: Any) -> Any:
        started.set()
        go.wait(10)
        return put(*args, **kwargs)

    monkeypatch.setattr(store._store, "put", slow_put)
    putting = asyncio.create_task(store.put(token(1), "k", b"v"))
    while not started.is_set():
        await asyncio.sleep(0.005)
    putting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await putting  # at once: the worker is still inside the put
    go.set()
    item = await store.get(R, "k")
    assert item is not None and (item.value, item.version) == (b"v", 1)


async def test_puts_of_50_concurrent_tasks_are_applied_in_the_order_they_were_made(
    store: AsyncStore,
) -> None:
    versions = await asyncio.gather(
        *(store.put(token(1), "counter", str(i).encode()) for i in range(50))
    )
    assert [v.version for v in versions] == list(range(1, 51))
    item = await store.get(R, "counter")
    assert item is not None and (item.value, item.version) == (b"49", 50)
    accepted = [r.detail["version"] for r in await store.history(R) if r.kind.value == "accepted"]
    assert accepted == list(range(1, 51))


async def test_aclose_ends_the_thread_and_leaves_no_task(tmp_path: Path) -> None:
    before = _store_threads()
    store = await open_store(_url("file", tmp_path))
    assert len(_store_threads() - before) == 1
    await store.fence(token(1))
    reader_store = store
    await reader_store.publish(token(1), b"data")
    reader = await store.open(R)
    await store.aclose()
    await store.aclose()  # idempotent
    assert _store_threads() == before
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert reader.closed  # closed with its store
    with pytest.raises(ConfigurationError, match="closed"):
        await store.floor(R)
    with pytest.raises(ConfigurationError, match="closed"):
        await store.publish(token(1), _chunks_of(b"x", 1))

    async with await open_store(_url("file", tmp_path)) as again:
        assert await again.floor(R) == 1
    assert _store_threads() == before


async def test_aclose_after_a_cancelled_publish_leaves_no_thread_or_task(tmp_path: Path) -> None:
    before = _store_threads()
    store = await open_store(_url("sqlite", tmp_path), "monotonic")
    never = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        yield bytes(MiB)
        await never.wait()
        yield b""  # pragma: no cover

    publishing = asyncio.create_task(store.publish(token(1), stalls()))
    await asyncio.sleep(0.1)
    publishing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await publishing
    await store.aclose()
    assert _store_threads() == before
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_store_dropped_unclosed_is_closed_by_its_worker(tmp_path: Path) -> None:
    before = _store_threads()
    store = await open_store(_url("sqlite", tmp_path))
    await store.fence(token(1))
    del store
    garbage.collect()
    deadline = time.monotonic() + 10
    while _store_threads() != before:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_open_reads_a_snapshot_on_the_worker(store: AsyncStore) -> None:
    with pytest.raises(NotFound):
        await store.open(R)
    old = _payload(3 * MiB)
    await store.publish(token(1), old)
    async with await store.open(R) as reader:
        first = await reader.read(1000)
        await store.publish(token(2), b"newer")
        rest = b"".join([chunk async for chunk in reader])
        assert first + rest == old
        assert await reader.read() == b""
    assert reader.closed
    assert await store.read(R) == b"newer"


async def test_slow_syncs_of_the_file_store_do_not_block_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A heartbeat task ticks every 10 ms while a large publish runs whose every sync takes
    0.3 s: if a sync ran on the loop, the heartbeat would stall for that long."""
    slow = 0.3
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def delayed(fd: int, real: Callable[[int], None] = real) -> None:
            time.sleep(slow)
            real(fd)

        monkeypatch.setattr(os, name, delayed)
    async with await open_store(_url("file", tmp_path), "monotonic") as store:
        ticks: list[float] = []

        async def heartbeat() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        beating = asyncio.create_task(heartbeat())
        started = time.monotonic()
        await store.publish(token(1), _chunks_of(_payload(16 * MiB), 64 * KiB))
        await store.put(token(1), "k", b"v")
        elapsed = time.monotonic() - started
        beating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await beating
    assert elapsed >= 2 * slow  # the syncs did run, slowly
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) >= elapsed / 0.05
    assert max(gaps) < slow / 2

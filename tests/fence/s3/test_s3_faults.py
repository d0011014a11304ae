"""The ``s3://`` store under real faults: ``kill -9`` of publishers (mid-multipart and between
staging and commit), gc after the grace period, a 1 GiB publish's memory, a stale owner racing a
new one, lost replies to commits, and processes racing on one key.

Everything runs against real Ceph RGW (the session's server, or a larger one of this module's for
the big uploads: its memstore holds data in memory and RGW frees deleted data only hours later)
and real child processes (``tests/support/s3_workers.py``), killed by PID with SIGKILL; lost
replies come from :class:`~fenced.testing.proxy.TcpProxy`. Every wait polls for a condition
with a deadline; no assertion is about speed (the 1 GiB test prints its time, for information).
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from fenced import OutcomeUnknown, Publication, StaleToken, Version
from fenced.core._records import Record, RecordKind
from fenced.fence import Store, open_store
from fenced.fence._values import Mode
from fenced.testing.conformance import wait_for
from fenced.testing.proxy import TcpProxy
from fenced.testing.rgw import RgwServer
from fenced.testing.store_conformance import R, token
from support.s3_stores import s3_bucket, s3_url
from support.worker_processes import WorkerProcess

__all__ = ["s3_bucket", "s3_url"]  # fixtures from support.s3_stores, used here

pytestmark = pytest.mark.slow

WORKERS = Path(__file__).parents[2] / "support" / "s3_workers.py"
MiB = 1 << 20
STARTUP = 60.0
"""Seconds a child may take to start, import boto3 and open its store on a loaded machine."""


# -- helpers ---------------------------------------------------------------------------------------


def write_file(path: Path, mib: int) -> None:
    """``mib`` MiB of random-looking bytes (one random block, each copy numbered)."""
    block = os.urandom(MiB)
    with path.open("wb") as out:
        for number in range(mib):
            out.write(number.to_bytes(8, "big") + block[8:])


def where(store: Store) -> tuple[str, str]:
    """The store's bucket and key prefix."""
    backend: Any = store._backend
    return backend.bucket, backend.location.prefix


def uploads(client: Any, store: Store) -> list[dict[str, Any]]:
    """The unfinished multipart uploads under the store's ``objects/``."""
    bucket, prefix = where(store)
    reply = client.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "objects/")
    return list(reply.get("Uploads") or [])


def parts(client: Any, store: Store, upload: dict[str, Any]) -> list[dict[str, Any]]:
    bucket, _ = where(store)
    reply = client.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
    return list(reply.get("Parts") or [])


def object_ids(client: Any, store: Store) -> set[str]:
    """The ids of the objects (staged publications) of ``R`` in the bucket."""
    bucket, prefix = where(store)
    area = f"{prefix}objects/{R.replace('/', '%2F')}/"
    reply = client.list_objects_v2(Bucket=bucket, Prefix=area)
    return {entry["Key"][len(area) :] for entry in reply.get("Contents") or []}


def proxied(url: str, port: int, timeout: float) -> str:
    """``url`` with its endpoint at the proxy on ``port`` and a reply ``timeout``."""
    base = url.partition("?")[0]
    return f"{base}?endpoint=http://127.0.0.1:{port}&timeout={timeout:g}"


def diagnostics(worker: WorkerProcess) -> str:
    log = worker.log.read_text(errors="replace")[-3000:] if worker.log.exists() else ""
    return f"exit {worker.proc.poll()}, events {worker.events()}, log:\n{log}"


def alive(worker: WorkerProcess) -> bool:
    """True while the worker runs; fails the test with its log if it exited."""
    if worker.proc.poll() is not None:
        pytest.fail(f"{worker.name} exited early: {diagnostics(worker)}")
    return True


def ready(worker: WorkerProcess) -> bool:
    return alive(worker) and bool(worker.events("ready"))


def records(store: Store, after: int) -> list[Record]:
    return store.history(R, after)


def version_of(store: Store, key: str = "k") -> int | None:
    item = store.get(R, key)
    return None if item is None else item.version


# -- a larger RGW for the big uploads ------------------------------------------------------------


@pytest.fixture(scope="module")
def large_rgw() -> Iterator[RgwServer]:
    """An RGW of this module's own, for the 256 MiB and 1 GiB uploads: its memory is freed when
    it stops, while the session server's deleted data would stay until RGW's own gc (hours)."""
    server = RgwServer(memstore_bytes=3 << 30)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def large_url(large_rgw: RgwServer, monkeypatch: pytest.MonkeyPatch) -> str:
    """A store URL on :func:`large_rgw` (a fresh bucket), its keys in the environment."""
    for name, value in large_rgw.environment().items():
        monkeypatch.setenv(name, value)
    return f"s3://{large_rgw.create_bucket()}/big?endpoint={large_rgw.endpoint}"


@pytest.fixture
def rgw_client(rgw_server: RgwServer) -> Iterator[Any]:
    client = rgw_server.client()
    yield client
    client.close()


# -- 1. kill -9 during a multipart publish ---------------------------------------------------------


def test_kill_9_during_a_multipart_publish_leaves_the_first_publication_and_gc_aborts_it(
    large_rgw: RgwServer, large_url: str, tmp_path: Path
) -> None:
    big = tmp_path / "big.bin"
    write_file(big, 256)
    first_bytes = b"first\n" + os.urandom(100_000)
    client = large_rgw.client()
    with open_store(large_url, "strict") as store:
        store.fence(token(1))
        first = store.publish(token(1), first_bytes)
        worker = WorkerProcess(
            WORKERS, tmp_path, "publisher", "publish", large_url,
            "--epoch", "2", "--path", str(big),
        )  # fmt: skip
        try:

            def uploading() -> bool:
                return alive(worker) and any(
                    parts(client, store, u) for u in uploads(client, store)
                )

            wait_for(uploading, STARTUP, "the child's multipart upload to have a part")
        finally:
            worker.kill()
        big.unlink()
        assert worker.events("fenced")
        assert not worker.events("published"), diagnostics(worker)
        assert len(uploads(client, store)) == 1  # left by the kill: parts, no object
        assert object_ids(client, store) == {first.object_id}

        assert store.floor(R) == 2
        assert store.latest(R) == first
        assert store.read(R) == first_bytes

        assert store.gc(grace=3600) == 0
        assert len(uploads(client, store)) == 1  # within the grace period: maybe still running
        assert store.gc(grace=0) == 0
        assert uploads(client, store) == []
        assert store.latest(R) == first
        assert store.read(R) == first_bytes
        assert object_ids(client, store) == {first.object_id}
    client.close()


# -- 2. gc and the grace period --------------------------------------------------------------------


def test_gc_deletes_unreferenced_objects_only_after_the_grace_period(
    rgw_server: RgwServer, s3_url: str, rgw_client: Any, tmp_path: Path
) -> None:
    with open_store(s3_url, "strict") as store:
        published: list[Publication] = []
        for epoch in (1, 2, 3):
            store.fence(token(epoch))
            published.append(store.publish(token(epoch), f"v{epoch}".encode() * 1000))
        v1, v2, v3 = published

        # A publisher killed between its staging PUT (applied; its reply held by the proxy)
        # and its commit leaves an object that no state names.
        with TcpProxy("127.0.0.1", rgw_server.port) as proxy:
            go = tmp_path / "go"
            worker = WorkerProcess(
                WORKERS, tmp_path, "stager", "stage", proxied(s3_url, proxy.port, 10),
                "--epoch", "3", "--go", str(go), "--size", "5000",
            )  # fmt: skip
            try:
                wait_for(partial(ready, worker), STARTUP, "the publisher to be ready")
                proxy.hold_replies()
                go.touch()
                wait_for(
                    lambda: alive(worker) and len(object_ids(rgw_client, store)) == 4,
                    STARTUP,
                    "the killed publisher's object to be staged",
                )
            finally:
                worker.kill()
        assert not worker.events("published")
        orphan = object_ids(rgw_client, store) - {v1.object_id, v2.object_id, v3.object_id}
        assert len(orphan) == 1
        assert store.latest(R) == v3

        everything = {v1.object_id, v2.object_id, v3.object_id, *orphan}
        assert store.gc(keep=2, grace=3600) == 0  # all idle for less than the grace period
        assert store.gc(keep=1, grace=3600) == 0
        assert object_ids(rgw_client, store) == everything

        assert store.gc(keep=2, grace=0) == 2  # v1 (beyond keep) and the orphan
        assert object_ids(rgw_client, store) == {v2.object_id, v3.object_id}
        assert store.latest(R) == v3
        assert store.read(R) == b"v3" * 1000

        assert store.gc(keep=1, grace=0) == 1  # v2; never the current target
        assert store.gc(keep=0, grace=0) == 0
        assert object_ids(rgw_client, store) == {v3.object_id}
        assert store.latest(R) == v3
        assert store.read(R) == b"v3" * 1000


# -- 3. the memory of a 1 GiB publish --------------------------------------------------------------


def test_a_1_gib_publish_from_a_file_grows_rss_by_at_most_64_mib(
    large_rgw: RgwServer, large_url: str, tmp_path: Path
) -> None:
    big = tmp_path / "1gib.bin"
    write_file(big, 1024)
    worker = WorkerProcess(WORKERS, tmp_path, "rss", "rss", large_url, "--path", str(big))
    try:
        code = worker.proc.wait(100)
    finally:
        worker.kill()
        big.unlink()
    assert code == 0, diagnostics(worker)
    [measured] = worker.events("rss")
    assert measured["size"] == 1024 * MiB
    growth = (measured["peak_kib"] - measured["baseline_kib"]) / 1024
    print(
        f"1 GiB publish: RSS {measured['baseline_kib'] / 1024:.1f} MiB before, peak "
        f"{measured['peak_kib'] / 1024:.1f} MiB (growth {growth:.1f} MiB, peak reset: "
        f"{measured['reset']}), {measured['after_kib'] / 1024:.1f} MiB after; "
        f"{measured['seconds']:.1f} s"
    )
    # Delete the object (RGW's own gc keeps the data for hours: the memory is released when the
    # module's server stops).
    client = large_rgw.client()
    with open_store(large_url) as store:
        bucket, prefix = where(store)
        current = store.latest(R)
        assert current is not None
        area = f"{prefix}objects/{R.replace('/', '%2F')}/"
        client.delete_object(Bucket=bucket, Key=area + current.object_id)
    client.close()
    assert growth <= 64, f"a 1 GiB publish grew RSS by {growth:.1f} MiB (at most 64 MiB)"


# -- 4. a stale publication racing a new owner -----------------------------------------------------

ROUNDS = 50


@pytest.mark.parametrize("mode", ["strict", "monotonic"])
def test_a_stale_publication_racing_a_new_owner_never_moves_the_pointer_back(
    s3_url: str, mode: Mode
) -> None:
    stores = [open_store(s3_url, mode) for _ in range(3)]
    owner_a, owner_b, watcher = stores
    seen: list[tuple[int, str]] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def watch() -> None:
        try:
            while not stop.is_set():
                current = watcher.latest(R)
                if current is not None:
                    seen.append((current.epoch, current.object_id))
                time.sleep(0.005)  # ~10 reads a round; polling flat out only slows RGW down
        except BaseException as error:
            failures.append(error)

    def a_publishes(n: int, start: threading.Barrier) -> Publication | StaleToken:
        start.wait(30)
        try:
            return owner_a.publish(token(n), f"A {n}".encode())
        except StaleToken as error:
            return error

    def b_takes_over(n: int, start: threading.Barrier, pause: float) -> Publication:
        start.wait(30)
        time.sleep(pause)  # so that A's commit lands before, between and after B's
        owner_b.fence(token(n + 1))
        return owner_b.publish(token(n + 1), f"B {n + 1}".encode())

    def watcher_saw(epoch: int) -> bool:
        return bool(failures) or (bool(seen) and seen[-1][0] == epoch)

    owner_a.fence(token(1))
    accepted = {owner_a.publish(token(1), b"initial").object_id}
    outcomes: list[tuple[int, Publication | StaleToken, Publication]] = []
    reader = threading.Thread(target=watch, name="latest-watcher")
    reader.start()
    try:
        with ThreadPoolExecutor(2) as pool:
            for n in range(2, 2 * ROUNDS + 2, 2):
                assert owner_a.fence(token(n)) == n  # A's epoch n is installed; B gets n + 1
                start = threading.Barrier(2)
                a_future: Future[Publication | StaleToken] = pool.submit(a_publishes, n, start)
                b_future = pool.submit(b_takes_over, n, start, random.uniform(0, 0.01))
                a_outcome, b_outcome = a_future.result(60), b_future.result(60)
                outcomes.append((n, a_outcome, b_outcome))
                assert b_outcome.epoch == n + 1
                assert owner_a.latest(R) == b_outcome
                assert owner_a.read(R) == f"B {n + 1}".encode()
                wait_for(partial(watcher_saw, n + 1), 10, "the watcher to see B's publication")
    finally:
        stop.set()
        reader.join(30)
        for store in stores[1:]:
            store.close()
    assert not failures, failures

    # A was refused, or accepted before B's fence (so before B's publication): never after.
    history = records(owner_a, 0)
    owner_a.close()
    stale = 0
    for n, a_outcome, b_outcome in outcomes:
        [b_fence] = [r for r in history if r.kind is RecordKind.INSTALLED and r.epoch == n + 1]
        [b_accepted] = [r for r in history if r.kind is RecordKind.ACCEPTED and r.epoch == n + 1]
        a_accepted = [r for r in history if r.kind is RecordKind.ACCEPTED and r.epoch == n]
        assert b_fence.seq < b_accepted.seq
        assert b_accepted.detail["object_id"] == b_outcome.object_id
        accepted.add(b_outcome.object_id)
        assert all(r.seq < b_fence.seq for r in a_accepted), (n, a_accepted, b_fence)
        if isinstance(a_outcome, StaleToken):
            stale += 1
            assert (a_outcome.presented, a_outcome.floor) == (n, n + 1)
            assert a_accepted == []
        else:
            assert a_outcome.epoch == n
            assert [r.detail["object_id"] for r in a_accepted] == [a_outcome.object_id]
            accepted.add(a_outcome.object_id)

    # The pointer never moved back, and never showed a publication that was not accepted.
    epochs = [epoch for epoch, _ in seen]
    assert epochs == sorted(epochs), "the pointer moved back"
    assert {object_id for _, object_id in seen} <= accepted
    print(
        f"{mode}: of {ROUNDS} races the stale owner's publish was refused {stale} times, "
        f"accepted before the new owner's fence {ROUNDS - stale} times; {len(seen)} reads"
    )


# -- 5. lost replies to commits, and racing conditional puts --------------------------------------


def test_a_lost_commit_reply_is_resolved_and_never_applied_twice(
    rgw_server: RgwServer, s3_url: str
) -> None:
    with (
        open_store(s3_url, "strict") as direct,
        TcpProxy("127.0.0.1", rgw_server.port) as proxy,
        open_store(proxied(s3_url, proxy.port, 2)) as store,
        ThreadPoolExecutor(1) as pool,
    ):
        direct.fence(token(1))
        assert store.put(token(1), "k", b"0").version == 1
        # ``store`` now remembers the state: its next put commits without reading it first,
        # so the only requests before the commit's PUT are for the op id (a GET, answered).

        def lose_the_reply(value: bytes, op_id: str, version: int, then: Callable[[], None]) -> Any:
            """Put through the proxy; once the commit is applied, lose its reply; ``then``."""
            proxy.delay(0.8)  # every reply late: the window to act in once the PUT applied
            future = pool.submit(store.put, token(1), "k", value, op_id=op_id)
            wait_for(
                lambda: future.done() or version_of(direct) == version,
                30,
                "the commit to apply",
            )
            assert not future.done(), "the reply arrived before it could be lost"
            proxy.hold_replies()
            proxy.cut()
            then()
            return future

        # Resolved: the state read back holds the commit's own nonce.
        future = lose_the_reply(b"1", "op-1", 2, proxy.forward)
        assert future.result(30) == Version(R, "k", 1, 2)

        # Unresolved: the read-back fails too (connections refused), so OutcomeUnknown.
        future = lose_the_reply(b"2", "op-2", 3, proxy.refuse)
        with pytest.raises(OutcomeUnknown):
            future.result(30)
        proxy.forward()

        # A retry with the same op id returns the first outcome; nothing is applied again.
        for op_id, value, version in (("op-1", b"1", 2), ("op-2", b"2", 3), ("op-2", b"2", 3)):
            assert store.put(token(1), "k", value, op_id=op_id) == Version(R, "k", 1, version)
        item = direct.get(R, "k")
        assert item is not None
        assert (item.version, item.value) == (3, b"2")
        puts = [r for r in direct.history(R) if r.kind is RecordKind.ACCEPTED]
        assert [(r.detail["version"], r.detail.get("op_id")) for r in puts] == [
            (1, None),
            (2, "op-1"),
            (3, "op-2"),
        ]


def test_a_commit_whose_lost_reply_was_overtaken_is_not_applied_again(
    rgw_server: RgwServer, s3_url: str
) -> None:
    """The commit applied, its reply was lost, and another writer committed on top before the
    writer read the state back: its own write is no longer the current one, yet it must not be
    taken for one that never applied (and run again: a put without op id applied twice)."""
    with (
        open_store(s3_url, "strict") as direct,
        TcpProxy("127.0.0.1", rgw_server.port) as proxy,
        open_store(proxied(s3_url, proxy.port, 2)) as store,
        ThreadPoolExecutor(1) as pool,
    ):
        direct.fence(token(1))
        assert store.put(token(1), "k", b"mine 1").version == 1
        proxy.hold_replies()  # no op id, state remembered: the put's only request is its commit
        future = pool.submit(store.put, token(1), "k", b"mine 2")
        wait_for(lambda: future.done() or version_of(direct) == 2, 30, "the commit to apply")
        assert not future.done(), "the reply arrived before it could be lost"
        assert direct.put(token(1), "k", b"theirs").version == 3  # overtaken
        proxy.cut()
        proxy.forward()
        with contextlib.suppress(OutcomeUnknown):  # allowed; applying it again is not
            assert future.result(30) == Version(R, "k", 1, 2)
        item = direct.get(R, "k")
        assert item is not None
        assert (item.version, item.value) == (3, b"theirs")
        puts = [r for r in direct.history(R) if r.kind is RecordKind.ACCEPTED]
        assert [r.detail["version"] for r in puts] == [1, 2, 3]


def test_processes_incrementing_one_key_with_if_version_lose_no_update(
    s3_url: str, tmp_path: Path
) -> None:
    processes, each = 4, 15
    go = tmp_path / "go"
    with open_store(s3_url, "strict") as store:
        store.fence(token(1))
        options = ("--go", str(go), "--count", str(each), "--key", "counter")
        workers = [
            WorkerProcess(WORKERS, tmp_path, f"incr{i}", "increment", s3_url, *options)
            for i in range(processes)
        ]
        try:
            for worker in workers:
                wait_for(partial(ready, worker), STARTUP, f"{worker.name} to be ready")
            go.touch()
            for worker in workers:
                assert worker.proc.wait(90) == 0, diagnostics(worker)
        finally:
            for worker in workers:
                worker.kill()
        puts = [event for worker in workers for event in worker.events("put")]
        conflicts = sum(worker.events("done")[0]["conflicts"] for worker in workers)
        total = processes * each
        assert sorted(event["version"] for event in puts) == list(range(1, total + 1))
        assert all(event["version"] == event["value"] for event in puts)
        item = store.get(R, "counter")
        assert item is not None
        assert (item.version, item.value) == (total, str(total).encode())
        accepted = [r for r in store.history(R) if r.kind is RecordKind.ACCEPTED]
        assert sorted(int(str(r.detail["version"])) for r in accepted) == list(range(1, total + 1))
    print(f"{total} increments by {processes} processes: {conflicts} version conflicts")

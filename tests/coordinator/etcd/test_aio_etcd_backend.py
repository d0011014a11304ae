"""The asyncio etcd backend (``_aio.py``) against real etcd clusters, beside the sync one.

- lockstep: one sequence of steps on :class:`AsyncEtcdBackend` and on the sync
  :class:`EtcdBackend` (own prefixes, one cluster) gives the same answers (but for times and
  record sequence numbers), errors included;
- waiting: a task waiting in line is woken and handed the lease by a release from a sync
  backend in another thread within a second (a handoff in the release's transaction, or the
  head taking the lease itself); an asyncio holder whose loop did not run while a waiter
  queued still hands over in its release's transaction (its view catches up first: the watch
  stream's ``caught_up``); ``leave(take=True)`` returns a handed lease; a cancelled wait leaves
  no task behind; ``watch`` wakes on a record;
- failures: a waiter is still woken when the member serving the watch is stopped (SIGSTOP,
  SIGCONT) or killed (and restarted); a lost grant reply is OutcomeUnknown and the retry with
  its request_id finds the grant; an unreachable cluster is Unavailable; ``api=gateway`` is
  refused;
- TLS and users: ``etcds://`` with a user on ``EtcdCluster(tls=True)``, tokens expiring after
  1 s (the watch stream gets a new one), passwords never shown;
- ``aclose()`` leaves no task of the backend and no extra non-daemon thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from fenced.coordinator.backend import Blocked, Granted, GrantRequest, Ticket
from fenced.coordinator.backends.etcd._aio import (
    AsyncEtcdBackend,
    AsyncEtcdTicket,
    open_async_etcd,
)
from fenced.coordinator.backends.etcd._aio_transport import AsyncTransport
from fenced.coordinator.backends.etcd._aio_watch import AsyncWatcher
from fenced.coordinator.backends.etcd._backend import EtcdBackend
from fenced.coordinator.backends.etcd._client import Event, b64
from fenced.coordinator.backends.etcd._grpc_transport import GrpcTransport
from fenced.coordinator.backends.etcd._keys import prefix_end
from fenced.coordinator.backends.etcd._settings import parse_etcd_url
from fenced.core._errors import (
    ConfigurationError,
    LeaseLost,
    OutcomeUnknown,
    Unavailable,
)
from fenced.core._lease import LeaseInfo
from fenced.core._records import Record, RecordKind
from fenced.testing.etcd import EtcdCluster, EtcdMember, free_ports
from fenced.testing.proxy import TcpProxy

R = "exports/daily"
PASSWORD = "hunter2-Async-Secret"
ROOT_PASSWORD = "root-Async-Secret-9"


def _prefix() -> str:
    return "/a" + uuid.uuid4().hex[:12]


def _request(
    resource: str = R,
    ttl: float = 3,
    *,
    owner: str | None = None,
    holder: str = "me",
    request_id: str | None = None,
    queues: bool = False,
) -> GrantRequest:
    return GrantRequest(
        resource,
        ttl,
        owner or secrets.token_hex(16),
        holder,
        request_id=request_id,
        queues=queues,
    )


@contextlib.asynccontextmanager
async def _opened(url: str) -> AsyncIterator[AsyncEtcdBackend]:
    backend = await open_async_etcd(url)
    try:
        yield backend
    finally:
        await backend.aclose()


@contextlib.contextmanager
def _sync(url: str) -> Iterator[EtcdBackend]:
    backend = EtcdBackend(url)
    try:
        yield backend
    finally:
        backend.close()


async def _until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def _acquire(
    backend: AsyncEtcdBackend, request: GrantRequest, wait: float, ticket: Ticket | None = None
) -> Granted:
    """The Coordinator's waiting loop, on the asyncio backend (queues when blocked)."""
    deadline = time.monotonic() + wait
    try:
        while True:
            result = await backend.try_grant(request, ticket)
            if isinstance(result, Granted):
                ticket = None
                return result
            left = deadline - time.monotonic()
            assert left > 0, f"not granted within {wait}s: {result}"
            if ticket is None:
                ticket = await backend.enqueue(request)
                continue
            await backend.wait(ticket, min(left, result.retry_in or left))
    finally:
        if ticket is not None:
            await backend.leave(ticket)


def _backend_tasks(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    return {task for task in asyncio.all_tasks() - before if not task.done()} - {
        asyncio.current_task()
    }


def _non_daemon_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if not thread.daemon}


# -- lockstep with the sync backend -------------------------------------------------------------


def _shape(value: object) -> object:
    """An answer without what differs between two runs: remaining times, seq, at."""
    if isinstance(value, Granted):
        return ("Granted", value.epoch, value.owner, value.holder, value.ttl)
    if isinstance(value, Blocked):
        return ("Blocked", value.holder, value.epoch, value.retry_in is None)
    if isinstance(value, LeaseInfo):
        return ("LeaseInfo", value.resource, value.epoch, value.holder, value.ttl, value.value)
    if isinstance(value, Record):
        return (value.kind, value.resource, value.epoch, value.holder, value.detail)
    if isinstance(value, list):
        return [_shape(item) for item in value]
    if isinstance(value, float):
        return "float"
    return value


Step = tuple[str, Callable[[Any], Any]]


def _steps() -> list[Step]:
    """One scenario, written once for both faces (each step gets the backend)."""
    a, b, c = (secrets.token_hex(16) for _ in range(3))
    first = _request(owner=a, holder="a", ttl=4)
    other = _request(owner=b, holder="b", ttl=4)
    asked = _request("exports/asked", owner=c, holder="c", ttl=4, request_id="rid-1")
    elsewhere = _request("exports/elsewhere", owner=c, holder="c", ttl=4, request_id="rid-1")
    return [
        ("grant", lambda x: x.try_grant(first, None)),
        ("busy", lambda x: x.try_grant(other, None)),
        ("busy, will queue", lambda x: x.try_grant(_request(owner=b, queues=True), None)),
        ("grant with a request_id", lambda x: x.try_grant(asked, None)),
        ("the same request_id again", lambda x: x.try_grant(asked, None)),
        ("that request_id elsewhere", lambda x: x.try_grant(elsewhere, None)),
        ("renew", lambda x: x.renew(R, 1, a, 4)),
        ("renew, wrong owner", lambda x: x.renew(R, 1, b, 4)),
        ("renew, stale epoch", lambda x: x.renew(R, 0, a, 4)),
        ("proclaim", lambda x: x.proclaim(R, 1, a, "v1")),
        ("proclaim, wrong owner", lambda x: x.proclaim(R, 1, b, "v2")),
        ("current", lambda x: x.current(R)),
        ("current, none", lambda x: x.current("exports/none")),
        ("release, wrong owner", lambda x: x.release(R, 1, b)),
        ("release, stale epoch", lambda x: x.release(R, 0, a)),
        ("release", lambda x: x.release(R, 1, a)),
        ("release again", lambda x: x.release(R, 1, a)),
        ("current after release", lambda x: x.current(R)),
        ("release with the request_id's grant", lambda x: x.release("exports/asked", 1, c)),
        ("the request_id after its release", lambda x: x.try_grant(asked, None)),
        ("grant again", lambda x: x.try_grant(other, None)),
        (
            "report",
            lambda x: x.report(R, 2, "b", RecordKind.RENEWAL_FAILED, {"error": "test"}),
        ),
        ("last epoch", lambda x: x.last_epoch(R)),
        ("last epoch, never granted", lambda x: x.last_epoch("exports/none")),
        ("resources", lambda x: x.resources()),
        ("records", lambda x: x.records(R)),
        ("all records", lambda x: x.records(None)),
        ("records, limit 2", lambda x: x.records(R, 0, 2)),
        ("release the second", lambda x: x.release(R, 2, b)),
    ]


async def _run_steps(backend: object, steps: list[Step], awaited: bool) -> list[tuple[str, object]]:
    answers: list[tuple[str, object]] = []
    records: list[Record] = []
    for name, step in steps:
        try:
            result = step(backend)
            if awaited:
                result = await result
        except Exception as error:
            answers.append((name, type(error).__name__))
            continue
        if name == "records":
            records = result
        answers.append((name, _shape(result)))
    # records after a seq: the same ones, by the seq each face gave them
    assert len(records) >= 4
    after = records[1].seq
    later = backend.records(R, after)  # type: ignore[attr-defined]
    answers.append(("records after", _shape(await later if awaited else later)))
    return answers


async def test_the_async_and_the_sync_backend_answer_alike(etcd_cluster: EtcdCluster) -> None:
    steps = _steps()
    with _sync(etcd_cluster.url(prefix=_prefix(), timeout=2)) as sync:
        expected = await _run_steps(sync, steps, awaited=False)
    async with _opened(etcd_cluster.url(prefix=_prefix(), timeout=2)) as backend:
        got = await _run_steps(backend, steps, awaited=True)
    assert got == expected
    # the scenario is what it claims to be
    answers: dict[str, Any] = dict(expected)
    assert answers["busy"] == ("Blocked", "a", 1, False)
    assert answers["renew, wrong owner"] == "LeaseLost"
    assert answers["that request_id elsewhere"] == "ConfigurationError"
    assert answers["the request_id after its release"] == "LeaseLost"
    assert answers["release, stale epoch"] is False and answers["release"] is True
    kinds = [record[0] for record in answers["records"]]
    assert kinds == [
        RecordKind.GRANTED,
        RecordKind.PROCLAIMED,
        RecordKind.RELEASED,
        RecordKind.GRANTED,
        RecordKind.RENEWAL_FAILED,
    ]


# -- waiting ------------------------------------------------------------------------------------


@pytest.mark.parametrize("handoff", [True, False], ids=["handed-over", "taken"])
async def test_a_waiting_task_is_woken_by_a_release_from_a_sync_backend_in_another_thread(
    etcd_cluster: EtcdCluster, handoff: bool
) -> None:
    """With ``handoff`` the sync holder's process keeps a view of the line (it took the
    resource twice) and hands the lease to the waiting task in its release's transaction;
    without, it deletes the lease key and the task takes the lease itself."""
    url = etcd_cluster.url(prefix=_prefix(), timeout=2)
    with _sync(url) as sync:
        async with _opened(url) as backend:
            held = sync.try_grant(_request(ttl=10, holder="sync"), None)
            assert isinstance(held, Granted)
            if handoff:  # taken again: the sync process watches the line
                assert sync.release(R, held.epoch, held.owner)
                held = sync.try_grant(_request(ttl=10, holder="sync"), None)
                assert isinstance(held, Granted)
            request = _request(ttl=10, holder="async", queues=True)
            blocked = await backend.try_grant(request, None)
            assert isinstance(blocked, Blocked) and blocked.holder == "sync"
            ticket = await backend.enqueue(request)
            assert isinstance(ticket, AsyncEtcdTicket)
            if handoff:
                await _until(lambda: sync._queue_head(R) is not None, 5, "the sync view")
            released: list[float] = []

            def release() -> None:
                time.sleep(0.2)
                released.append(time.monotonic())
                assert sync.release(R, held.epoch, held.owner)

            releaser = threading.Thread(target=release)
            releaser.start()
            granted = await _acquire(backend, request, 5, ticket)
            woken_after = time.monotonic() - released[0]
            releaser.join(5)
            assert granted.epoch == held.epoch + 1 and granted.holder == "async"
            assert woken_after < 1.0, woken_after
            info = await backend.current(R)
            assert info is not None and info.holder == "async"
            records = await backend.records(R)
            released_record, granted_record = records[-2], records[-1]
            assert (released_record.kind, granted_record.kind) == (
                RecordKind.RELEASED,
                RecordKind.GRANTED,
            )
            one_transaction = released_record.seq // 128 == granted_record.seq // 128
            assert one_transaction is handoff
            assert await backend.release(R, granted.epoch, granted.owner)


async def test_a_release_hands_over_to_a_waiter_that_queued_while_its_loop_did_not_run(
    etcd_cluster: EtcdCluster,
) -> None:
    """The holder's loop is blocked while a waiter of another process queues (as between two
    ``asyncio.run`` calls): the event waits in the watch stream. The release lets its view
    catch up first, so it still hands the lease over in its own transaction."""
    url = etcd_cluster.url(prefix=_prefix(), timeout=2)
    with _sync(url) as sync:
        async with _opened(url) as backend:
            once = await backend.try_grant(_request(ttl=10, holder="async"), None)
            assert isinstance(once, Granted)
            assert await backend.release(R, once.epoch, once.owner)
            held = await backend.try_grant(_request(ttl=10, holder="async"), None)  # taken again:
            assert isinstance(held, Granted)  # a view of the line, loaded by the keeper
            await _until(lambda: R in backend._views and backend._views[R].loaded, 5, "the view")
            request = _request(ttl=10, holder="sync", queues=True)
            ticket = sync.enqueue(request)  # the loop does not run meanwhile
            time.sleep(0.2)
            assert backend._queue_head(R) is None  # not read yet
            assert await backend.release(R, held.epoch, held.owner)
            records = await backend.records(R)
            released_record, granted_record = records[-2], records[-1]
            assert (released_record.kind, granted_record.kind) == (
                RecordKind.RELEASED,
                RecordKind.GRANTED,
            )
            assert released_record.seq // 128 == granted_record.seq // 128  # one transaction
            granted = await asyncio.to_thread(sync.try_grant, request, ticket)
            assert isinstance(granted, Granted)
            assert (granted.epoch, granted.holder) == (held.epoch + 1, "sync")
            assert await asyncio.to_thread(sync.release, R, granted.epoch, granted.owner)


async def test_a_watch_stream_catches_up_with_what_came_while_the_loop_did_not_run(
    etcd_cluster: EtcdCluster,
) -> None:
    """``caught_up``: etcd's progress notification comes after the events it sent before."""
    settings = parse_etcd_url(etcd_cluster.url(prefix=_prefix(), timeout=2))
    transport = AsyncTransport(
        settings.endpoints, timeout=settings.timeout, connect_timeout=settings.connect_timeout
    )
    watcher = AsyncWatcher(transport)
    writer = GrpcTransport(settings.endpoints, timeout=2, connect_timeout=1)
    prefix = f"{_prefix()}/keys/".encode()
    try:
        assert not await watcher.caught_up(0.1)  # no stream yet
        seen: list[Event] = []
        watch_id = watcher.add(prefix, prefix_end(prefix), seen.extend, lambda reason: None)
        assert await watcher.start(watch_id, 5)
        keys = [prefix + str(n).encode() for n in range(5)]
        for key in keys:  # the loop does not run meanwhile: the events wait in the stream
            writer.call("kv/put", {"key": b64(key), "value": b64("x")}, mutating=True)
        time.sleep(0.2)
        assert seen == []
        assert await watcher.caught_up(5)
        assert [event.kv.key for event in seen] == keys
        assert await watcher.caught_up(5)  # and again, answered in turn
        # enough: the caller saw what it needed before the answer
        enough = asyncio.get_running_loop().create_future()
        enough.set_result(None)
        assert await watcher.caught_up(5, enough)
        assert await watcher.caught_up(5)
    finally:
        writer.close()
        await watcher.aclose()
        await transport.aclose()


async def test_leave_with_take_returns_a_lease_handed_to_the_waiter(
    etcd_cluster: EtcdCluster,
) -> None:
    url = etcd_cluster.url(prefix=_prefix(), timeout=2)
    with _sync(url) as sync:
        async with _opened(url) as backend:
            once = sync.try_grant(_request(ttl=10, holder="sync"), None)
            assert isinstance(once, Granted) and sync.release(R, once.epoch, once.owner)
            held = sync.try_grant(_request(ttl=10, holder="sync"), None)  # taken again: the
            assert isinstance(held, Granted)  # sync process keeps a view, its release hands over
            request = _request(ttl=10, holder="async", queues=True)
            ticket = await backend.enqueue(request)
            await _until(lambda: sync._queue_head(R) is not None, 5, "the sync view")
            await asyncio.to_thread(sync.release, R, held.epoch, held.owner)
            # the waiter gave up just as the release handed it the lease: leave takes it
            taken = await backend.leave(ticket, take=True)
            assert isinstance(taken, Granted)
            assert (taken.epoch, taken.owner, taken.holder) == (
                held.epoch + 1,
                request.owner,
                "async",
            )
            assert 0 < taken.expires_in <= 10
            assert await backend.leave(ticket, take=True) is None  # idempotent
            assert await backend.renew(R, taken.epoch, taken.owner, 10) > 0
            assert await backend.release(R, taken.epoch, taken.owner)
            assert sync.current(R) is None


async def test_a_cancelled_wait_leaves_no_task_behind(etcd_cluster: EtcdCluster) -> None:
    url = etcd_cluster.url(prefix=_prefix(), timeout=2)
    async with _opened(url) as backend:
        held = await backend.try_grant(_request(ttl=10), None)
        assert isinstance(held, Granted)
        request = _request(ttl=10, queues=True)
        ticket = await backend.enqueue(request)
        before = asyncio.all_tasks()
        waiting = asyncio.create_task(backend.wait(ticket, 30))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert _backend_tasks(before) == set()
        assert await backend.leave(ticket) is None
        assert await backend.release(R, held.epoch, held.owner)
        # the waiter's key is gone: the next grant needs no queue
        again = await backend.try_grant(_request(ttl=2), None)
        assert isinstance(again, Granted)


async def test_watch_is_woken_by_a_record(etcd_cluster: EtcdCluster) -> None:
    url = etcd_cluster.url(prefix=_prefix(), timeout=2)
    with _sync(url) as sync:
        async with _opened(url) as backend:
            last = max((record.seq for record in await backend.records(R)), default=0)
            watching = asyncio.create_task(backend.watch(R, last, 10))
            await asyncio.sleep(0.3)
            assert not watching.done()
            started = time.monotonic()
            held = await asyncio.to_thread(sync.try_grant, _request(ttl=5), None)
            await asyncio.wait_for(watching, 2)
            assert time.monotonic() - started < 1.0
            assert isinstance(held, Granted)
            # nothing new: it waits its timeout
            latest = (await backend.records(R))[-1].seq
            started = time.monotonic()
            await backend.watch(R, latest, 0.5)
            assert time.monotonic() - started >= 0.45
            assert sync.release(R, held.epoch, held.owner)


# -- failures -----------------------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Any) -> Iterator[EtcdCluster]:
    """A cluster of this test's own (its members are stopped and killed)."""
    own = EtcdCluster(3, tmp_path / "etcd")
    try:
        own.start()
        yield own
    finally:
        own.stop()


def _serving(cluster: EtcdCluster, backend: AsyncEtcdBackend) -> EtcdMember:
    endpoint = backend._watcher.endpoint
    found = [member for member in cluster.members if member.endpoint == endpoint]
    assert found, f"no member serves the watch ({endpoint})"
    return found[0]


def _others_url(cluster: EtcdCluster, member: EtcdMember, prefix: str) -> str:
    hosts = ",".join(m.endpoint for m in cluster.members if m is not member)
    return f"etcd://{hosts}?prefix={prefix}&timeout=2"


async def _queued_behind(
    backend: AsyncEtcdBackend, sync: EtcdBackend, resource: str
) -> tuple[Granted, GrantRequest, Ticket]:
    held = await asyncio.to_thread(sync.try_grant, _request(resource, ttl=10), None)
    assert isinstance(held, Granted)
    request = _request(resource, ttl=10, holder="async", queues=True)
    ticket = await backend.enqueue(request)
    return held, request, ticket


async def test_a_waiter_is_woken_after_the_member_serving_its_watch_stops_and_resumes(
    cluster: EtcdCluster,
) -> None:
    prefix = _prefix()
    async with _opened(cluster.url(prefix=prefix, timeout=2)) as backend:
        with _sync(cluster.url(prefix=prefix, timeout=2)) as first:
            held, request, ticket = await _queued_behind(backend, first, R)
            assert isinstance(ticket, AsyncEtcdTicket)
            stopped = _serving(cluster, backend)
            with _sync(_others_url(cluster, stopped, prefix)) as releaser:
                assert stopped.pid is not None
                os.kill(stopped.pid, signal.SIGSTOP)
                try:
                    waiting = asyncio.create_task(backend.wait(ticket, 20))
                    # the release reaches the two members that still run
                    released = await asyncio.to_thread(releaser.release, R, held.epoch, held.owner)
                    assert released
                    await asyncio.sleep(1.0)
                    assert not waiting.done()  # its watch's member is stopped
                finally:
                    os.kill(stopped.pid, signal.SIGCONT)
                resumed = time.monotonic()
                await asyncio.wait_for(waiting, 10)
                assert time.monotonic() - resumed < 5
                granted = await _acquire(backend, request, 10, ticket)
                assert granted.epoch == held.epoch + 1
                assert await backend.release(R, granted.epoch, granted.owner)


async def test_a_waiter_is_woken_through_another_member_when_the_one_serving_its_watch_dies(
    cluster: EtcdCluster,
) -> None:
    prefix = _prefix()
    async with _opened(cluster.url(prefix=prefix, timeout=2)) as backend:
        with _sync(cluster.url(prefix=prefix, timeout=2)) as first:
            held, request, ticket = await _queued_behind(backend, first, R)
            killed = _serving(cluster, backend)
            with _sync(_others_url(cluster, killed, prefix)) as releaser:
                cluster.kill(killed)
                started = time.monotonic()
                waiting = asyncio.create_task(_acquire(backend, request, 15, ticket))
                await asyncio.sleep(0.5)
                assert await asyncio.to_thread(releaser.release, R, held.epoch, held.owner)
                granted = await asyncio.wait_for(waiting, 15)
                assert granted.epoch == held.epoch + 1
                assert time.monotonic() - started < 10
                assert backend._watcher.endpoint != killed.endpoint
                assert await backend.release(R, granted.epoch, granted.owner)
                # restarted: waiters are woken as before
                await asyncio.to_thread(cluster.restart, killed)
                held, request, ticket = await _queued_behind(backend, releaser, "exports/again")
                started = time.monotonic()
                waiting = asyncio.create_task(_acquire(backend, request, 10, ticket))
                await asyncio.sleep(0.2)
                assert await asyncio.to_thread(
                    releaser.release, "exports/again", held.epoch, held.owner
                )
                granted = await asyncio.wait_for(waiting, 10)
                assert time.monotonic() - started < 2.0
                assert await backend.release("exports/again", granted.epoch, granted.owner)


async def test_a_lost_grant_reply_is_an_unknown_outcome_and_the_request_id_finds_the_grant(
    etcd_cluster: EtcdCluster,
) -> None:
    prefix = _prefix()
    member = etcd_cluster.leader()
    with (
        TcpProxy("127.0.0.1", member.client_port) as proxy,
        _sync(etcd_cluster.url(prefix=prefix)) as direct,
    ):
        url = f"etcd://127.0.0.1:{proxy.port}?prefix={prefix}&timeout=20"
        async with _opened(url) as backend:
            # warm up: an idle etcd lease of ttl 5 and the retention lease, so the grant's
            # transaction is the only request of the attempt below
            warm = await backend.try_grant(_request("exports/warm", ttl=5, request_id="w"), None)
            assert isinstance(warm, Granted)
            assert await backend.release("exports/warm", warm.epoch, warm.owner)
            request = _request(ttl=5, request_id="lost-1")
            proxy.hold_replies()
            attempt = asyncio.create_task(backend.try_grant(request, None))
            await _until(lambda: direct.last_epoch(R) == 1, 10, "the grant at etcd")
            assert not attempt.done()
            proxy.cut()
            with pytest.raises(OutcomeUnknown):
                await asyncio.wait_for(attempt, 10)
            proxy.forward()
            found = await backend.try_grant(request, None)
            assert isinstance(found, Granted)
            assert (found.epoch, found.owner) == (1, request.owner)
            assert direct.last_epoch(R) == 1  # no second epoch
            assert await backend.release(R, found.epoch, found.owner)
            with pytest.raises(LeaseLost):
                await backend.try_grant(request, None)


async def test_an_unreachable_cluster_is_unavailable_and_the_gateway_is_refused() -> None:
    dead = free_ports(2)
    started = time.monotonic()
    with pytest.raises(Unavailable):
        await open_async_etcd(f"etcd://127.0.0.1:{dead[0]},127.0.0.1:{dead[1]}?timeout=0.5")
    assert time.monotonic() - started < 3
    with pytest.raises(ConfigurationError, match="api=gateway"):
        await open_async_etcd(f"etcd://127.0.0.1:{dead[0]}?api=gateway")
    with pytest.raises(ConfigurationError):
        await open_async_etcd("etcd://h:1/path")


# -- TLS and users ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(1, tls=True, extra_args=("--auth-token-ttl", "1", "--bcrypt-cost", "4"))
    with cluster:
        cluster.enable_auth(ROOT_PASSWORD)
        cluster.add_user("fenced", PASSWORD, "/tls")
        yield cluster


async def test_over_tls_with_a_user(tls_cluster: EtcdCluster) -> None:
    prefix = "/tls/a" + uuid.uuid4().hex[:10]
    url = tls_cluster.url(prefix=prefix, user=f"fenced:{PASSWORD}", timeout=2)
    with _sync(url) as sync:
        async with _opened(url) as backend:
            assert url.startswith("etcds://")
            assert PASSWORD not in backend.url and PASSWORD not in repr(backend)
            held = await backend.try_grant(_request(ttl=5), None)
            assert isinstance(held, Granted)
            assert await backend.release(R, held.epoch, held.owner)
            # a waiter woken across token expiries (tokens die after 1 s unused): its watch
            # stream's token is stale by the time the watch is created
            taken = sync.try_grant(_request(ttl=10, holder="sync"), None)
            assert isinstance(taken, Granted)
            await asyncio.sleep(1.5)
            request = _request(ttl=10, holder="async", queues=True)
            ticket = await backend.enqueue(request)
            await asyncio.sleep(1.5)
            started = time.monotonic()
            waiting = asyncio.create_task(_acquire(backend, request, 10, ticket))
            await asyncio.sleep(0.2)
            assert await asyncio.to_thread(sync.release, R, taken.epoch, taken.owner)
            granted = await asyncio.wait_for(waiting, 10)
            assert granted.epoch == taken.epoch + 1
            assert time.monotonic() - started < 2.5
            assert await backend.release(R, granted.epoch, granted.owner)
            # a token etcd no longer takes: a request gets a new one and is sent again; the
            # watch stream opened with it is refused (etcd 3.4: "permission denied") and
            # opened again with a new one
            refreshes = backend._transport.token_refreshes
            backend._transport._token = "stale.0"
            assert await backend.last_epoch(R) == granted.epoch
            assert backend._transport.token_refreshes == refreshes + 1
            transport = backend._transport
            opener = transport.open_stream

            async def opened_with_a_stale_token(path: str, timeout: float) -> Any:
                transport.open_stream = opener  # type: ignore[method-assign]
                transport._token = "stale.1"
                return await opener(path, timeout)

            transport.open_stream = opened_with_a_stale_token  # type: ignore[method-assign]
            backend._watcher._call.cancel()  # the stream breaks: it is opened again
            taken = sync.try_grant(_request(ttl=10, holder="sync"), None)
            assert isinstance(taken, Granted)
            request = _request(ttl=10, holder="async", queues=True)
            waiting = asyncio.create_task(_acquire(backend, request, 10))
            await _until(lambda: backend._watcher.endpoint is not None, 5, "the watch again")
            await asyncio.sleep(0.3)
            started = time.monotonic()
            assert await asyncio.to_thread(sync.release, R, taken.epoch, taken.owner)
            granted = await asyncio.wait_for(waiting, 10)
            assert time.monotonic() - started < 1.5
            assert backend._transport.token_refreshes >= refreshes + 2
            assert await backend.release(R, granted.epoch, granted.owner)
    wrong = tls_cluster.url(prefix=prefix, user="fenced:not-the-password", timeout=2)
    with pytest.raises(ConfigurationError) as refused:
        await open_async_etcd(wrong)
    assert "not-the-password" not in str(refused.value) and "\n" not in str(refused.value)
    elsewhere = tls_cluster.url(prefix="/elsewhere", user=f"fenced:{PASSWORD}", timeout=2)
    with pytest.raises(ConfigurationError, match="permission") as denied:
        await open_async_etcd(elsewhere)
    assert PASSWORD not in str(denied.value)
    plaintext = url.replace("etcds://", "etcd://").split("?")[0] + f"?prefix={prefix}"
    with pytest.raises((ConfigurationError, Unavailable)):
        await open_async_etcd(plaintext)


# -- closing ------------------------------------------------------------------------------------


async def test_aclose_leaves_no_task_and_no_thread(etcd_cluster: EtcdCluster) -> None:
    tasks = asyncio.all_tasks()
    threads = _non_daemon_threads()
    url = etcd_cluster.url(prefix=_prefix(), timeout=2)
    backend = await open_async_etcd(url)
    held = await backend.try_grant(_request(ttl=5), None)
    assert isinstance(held, Granted)
    ticket = await backend.enqueue(_request(ttl=5, queues=True))
    watching = asyncio.create_task(backend.watch(R, 10**12, 30))
    await asyncio.sleep(0.2)
    assert _backend_tasks(tasks) - {watching}  # the keeper and the watch task
    watching.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watching
    await backend.leave(ticket)
    await backend.aclose()
    await backend.aclose()  # idempotent
    assert _backend_tasks(tasks) == set()
    assert _non_daemon_threads() <= threads
    with pytest.raises(Unavailable):
        await backend.current(R)

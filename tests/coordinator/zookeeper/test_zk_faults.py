"""The ZooKeeper coordinator under real faults: a leader killed during contention, a client
paused past its session timeout, a client cut off by a TCP proxy, lost transaction replies.

Tests that kill members start an ensemble of their own (the session's stays healthy). Worker
processes run ``tests/support/lease_workers.py``; waits poll with deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import fenced
from fenced.coordinator import advance
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import open_backend
from fenced.coordinator.backend import Granted, GrantRequest
from fenced.coordinator.backends.zookeeper._aio import open_async_zookeeper
from fenced.coordinator.backends.zookeeper._driver import KICK_EVERY
from fenced.core._errors import Busy, LeaseLost, OutcomeUnknown, StaleToken, Unavailable
from fenced.core._lease import LeaseState
from fenced.core._records import RecordKind
from fenced.core._token import FencingToken
from fenced.testing.conformance import wait_for
from fenced.testing.proxy import TcpProxy
from fenced.testing.zookeeper import ZooKeeperEnsemble
from support.worker_processes import WorkerProcess

R = "exports/daily"
WORKERS = Path(__file__).parents[2] / "support" / "lease_workers.py"


@pytest.fixture
def ensemble(tmp_path: Path) -> Iterator[ZooKeeperEnsemble]:
    """An ensemble of this test's own (for tests that kill members)."""
    own = ZooKeeperEnsemble(3, tmp_path / "zk")
    try:
        own.start()
        yield own
    finally:
        own.stop()


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()


@pytest.mark.slow
def test_kill_9_of_the_leader_while_8_processes_contend(
    ensemble: ZooKeeperEnsemble, tmp_path: Path, workers: list[WorkerProcess]
) -> None:
    """Epochs stay unique, the store accepts them in order, and grants resume soon after a new
    leader is elected."""
    url = ensemble.url("/fenced", session_timeout=4, timeout=1)
    store = f"sqlite:///{tmp_path}/store.db"
    fenced.open_store(store, "strict").close()
    until = fenced_now() + 7.0
    for i in range(8):
        workers.append(
            WorkerProcess(
                WORKERS, tmp_path, f"w{i}", "contend", url,
                "--store", store, "--ttl", "2", "--until", str(until),
            )
        )  # fmt: skip
    wait_for(
        lambda: sum(len(w.events("held")) for w in workers) >= 40, timeout=20, what="contention"
    )
    killed_at = fenced_now()
    ensemble.kill(ensemble.leader())
    for worker in workers:
        worker.proc.wait(40)
    held = [(e["epoch"], e["version"], e["t"]) for w in workers for e in w.events("held")]
    epochs = [epoch for epoch, _, _ in held]
    assert len(epochs) == len(set(epochs)), "an epoch was granted twice"
    by_version = sorted(held, key=lambda h: h[1])
    assert [v for _, v, _ in by_version] == list(range(1, len(held) + 1))
    assert [e for e, _, _ in by_version] == sorted(epochs), "the store accepted a stale holder"
    after = sorted(t for _, _, t in held if t > killed_at)
    assert after, "no acquisition after the leader was killed"
    assert after[0] - killed_at < 5.0, f"acquisitions resumed {after[0] - killed_at:.2f}s after"
    errors = [e["error"] for w in workers for e in w.events("error")]
    assert not [e for e in errors if "StaleToken" in e or "NotInstalled" in e], errors


def fenced_now() -> float:
    """The deadline clock the workers stamp their events with."""
    from fenced.core._clock import SystemClock

    return SystemClock().now()


@pytest.mark.slow
def test_a_holder_paused_past_its_session_timeout_is_fenced_off(
    zk_ensemble: ZooKeeperEnsemble,
    tmp_path: Path,
    workers: list[WorkerProcess],
    open_coord: Callable[[str], Coordinator],
) -> None:
    """SIGSTOP a holder (ttl 1 s, session 2 s): the next holder gets the lease once the ttl has
    passed by the leader's clock, installs its epoch, and the paused holder's write, made when
    it wakes after its session ended, is rejected; the holder itself notices it lost."""
    url = zk_ensemble.url("/t" + secrets.token_hex(6), session_timeout=2, timeout=1)
    store = fenced.open_store(f"sqlite:///{tmp_path}/store.db", "strict")
    coord = open_coord(url)
    holder = WorkerProcess(
        WORKERS, tmp_path, "holder", "hold", url, "--ttl", "1", "--seconds", "20"
    )
    workers.append(holder)
    wait_for(lambda: holder.events("held"), timeout=10, what="the holder")
    old_epoch = holder.events("held")[0]["epoch"]
    old_token = FencingToken(coord.coordinator_id, R, old_epoch)
    store.fence(old_token)
    os.kill(holder.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    with coord.hold(R, ttl=5, wait=10, fence=[store]) as held:
        took = time.monotonic() - stopped_at
        assert held.epoch == old_epoch + 1
        assert 0.5 < took < 4.0, took  # the ttl (1 s) passed by the leader's clock
        wait_for(lambda: time.monotonic() - stopped_at > 3.0, 5, "the session timeout")
        os.kill(holder.pid, signal.SIGCONT)
        with pytest.raises(StaleToken):
            store.put(old_token, "k", b"stale")  # the paused holder's write, after it wakes
        wait_for(lambda: holder.events("done"), timeout=10, what="the holder to notice")
        assert holder.events("lost") or holder.events("state")
        store.put(held.token, "k", b"fresh")
    item = store.get(R, "k")
    assert item is not None and item.value == b"fresh"
    store.close()


@pytest.mark.slow
def test_a_client_cut_off_goes_uncertain_then_held_again_or_lost(
    zk_ensemble: ZooKeeperEnsemble, open_coord: Callable[[str], Coordinator]
) -> None:
    """A TCP proxy between the holder and its member: blackholed shorter than the session
    timeout, the lease goes UNCERTAIN and then HELD again once the renewal re-read it; cut
    longer than the session, ZooKeeper deletes the ephemeral lease, the lease is LOST, and
    another client takes it over at the next epoch."""
    chroot = "/t" + secrets.token_hex(6)
    member = zk_ensemble.leader()
    other = open_coord(zk_ensemble.url(chroot))
    with TcpProxy("127.0.0.1", zk_ensemble.client_port(member)) as proxy:
        url = f"zk://127.0.0.1:{proxy.port}{chroot}?session_timeout=4&timeout=0.5"
        coord = open_coord(url)
        with pytest.raises(LeaseLost), coord.hold(R, ttl=3, wait=0) as held:
            epoch = held.epoch
            proxy.blackhole()
            wait_for(lambda: held.state is LeaseState.UNCERTAIN, 8, "UNCERTAIN")
            proxy.forward()
            wait_for(lambda: held.state is LeaseState.HELD, 8, "HELD again")
            assert not held.lost.is_set()
            with pytest.raises(Busy):
                other.acquire(R, ttl=5, wait=0)
            proxy.refuse()  # longer than the session: ZooKeeper ends it
            wait_for(held.lost.is_set, 12, "LOST")
            taken = other.acquire(R, ttl=5, wait=8)
            assert taken.epoch == epoch + 1  # the body leaves; hold() raises LeaseLost


@pytest.mark.slow
def test_a_lost_grant_reply_is_outcome_unknown_and_the_request_id_finds_the_grant(
    zk_ensemble: ZooKeeperEnsemble, open_coord: Callable[[str], Coordinator]
) -> None:
    chroot = "/t" + secrets.token_hex(6)
    member = zk_ensemble.leader()
    other = open_coord(zk_ensemble.url(chroot))
    with TcpProxy("127.0.0.1", zk_ensemble.client_port(member)) as proxy:
        backend = open_backend(f"zk://127.0.0.1:{proxy.port}{chroot}?timeout=0.5")
        try:
            warm = backend.try_grant(GrantRequest(R, 30.0, "owner-0", "h"), None)
            assert isinstance(warm, Granted) and backend.release(R, warm.epoch, "owner-0")
            # the backend remembers the resource: the grant is one transaction, its only request
            request = GrantRequest(R, 30.0, "owner-1", "h", request_id="req-1")
            proxy.hold_replies()
            with pytest.raises(OutcomeUnknown):
                backend.try_grant(request, None)
            proxy.cut()  # the reply is lost after ZooKeeper applied the transaction
            proxy.forward()
            answer = None
            for _ in range(100):  # retried with the same request id, as DESIGN §2 says
                with contextlib.suppress(Unavailable, OutcomeUnknown):
                    answer = backend.try_grant(request, None)
                    break
                time.sleep(0.05)
            assert isinstance(answer, Granted) and answer.epoch == 2
            assert answer.owner == "owner-1"
            info = other.current(R)
            assert info is not None and info.epoch == 2  # one grant, never a second epoch
            assert other.last_epoch(R) == 2
        finally:
            backend.close()


@pytest.mark.slow
def test_a_place_whose_leave_failed_is_swept_once_the_connection_is_back(
    zk_ensemble: ZooKeeperEnsemble, open_coord: Callable[[str], Coordinator]
) -> None:
    """A waiter's znode lives as long as its session: a leave that failed (the connection was
    cut, the session survived) would hold up the queue. The backend sweeps it as soon as it is
    connected again."""
    chroot = "/t" + secrets.token_hex(6)
    other = open_coord(zk_ensemble.url(chroot))
    holder = other.acquire(R, ttl=30, wait=0)
    with TcpProxy("127.0.0.1", zk_ensemble.client_port(zk_ensemble.leader())) as proxy:
        backend = open_backend(f"zk://127.0.0.1:{proxy.port}{chroot}?timeout=0.5")
        try:
            ticket = backend.enqueue(GrantRequest(R, 30.0, "owner-w", "waiter"))
            proxy.refuse()
            with pytest.raises((Unavailable, OutcomeUnknown)):  # refused, or cut while sent
                backend.leave(ticket)
            other.release(holder)
            with pytest.raises(Busy):  # the forgotten place is first in line
                other.acquire(R, ttl=5, wait=0)
            proxy.forward()
            wait_for(lambda: other_can_acquire(other), 10, "the place to be swept")
        finally:
            backend.close()


def other_can_acquire(coord: Coordinator) -> bool:
    try:
        coord.acquire(R, ttl=5, wait=0)
    except Busy:
        return False
    return True


@pytest.mark.slow
def test_a_restored_ensemble_would_issue_epochs_again_and_advance_prevents_it(
    ensemble: ZooKeeperEnsemble, tmp_path: Path
) -> None:
    """Copy every member's data (the backup), grant more epochs, put the copy back (the
    restore): the restored counter would hand out the later epochs again. ``advance`` with the
    store's floors puts every later grant above every epoch issued before."""
    url = ensemble.url("/fenced", timeout=2)
    store = fenced.open_store(f"sqlite:///{tmp_path}/store.db", "strict")
    with fenced.connect(url) as coord:
        for _ in range(2):
            lease = coord.acquire(R, ttl=5, wait=0)
            store.fence(lease.token)
            coord.release(lease)
    backup = _copy_data(ensemble, tmp_path / "backup", restore=False)
    with fenced.connect(url) as coord:
        for _ in range(3):
            lease = coord.acquire(R, ttl=5, wait=0)
            store.fence(lease.token)
            coord.release(lease)
        issued = lease.epoch
        assert issued == 5
    _copy_data(ensemble, backup, restore=True)
    with fenced.connect(url) as coord:
        assert coord.last_epoch(R) == 2  # forgotten: epochs 3 to 5 would be issued again
        report = advance(coord, stores=[store], reason="restore")
        assert report.minimum > issued
        later = coord.acquire(R, ttl=5, wait=0)
        assert later.epoch > report.minimum > issued
        store.fence(later.token)  # the store accepts it: above its floor
        assert [r.kind for r in coord.history(R)][-2:] == [
            RecordKind.RESTORED,
            RecordKind.GRANTED,
        ]
    store.close()


def _copy_data(ensemble: ZooKeeperEnsemble, to: Path, *, restore: bool) -> Path:
    """Stop every member, copy its data directory to ``to`` (or back from it), start them."""

    for member in ensemble.members:
        ensemble.kill(member)
    for member in ensemble.members:
        data = ensemble.member(member).data_dir
        copy = to / str(member)
        if restore:
            shutil.rmtree(data)
            shutil.copytree(copy, data)
        else:
            shutil.copytree(data, copy)
    ensemble.start()
    return to


def test_reads_on_one_member_see_what_another_member_acknowledged(
    zk_ensemble: ZooKeeperEnsemble,
) -> None:
    """A reader on one member and a writer on another: every read made after the write was
    acknowledged sees it (ZooKeeper reads are as fresh as their member; fenced's read
    operations sync the member first)."""
    chroot = "/t" + secrets.token_hex(6)
    leader = zk_ensemble.leader()
    writer_on, reader_on = [i for i in zk_ensemble.members if i != leader][:2]
    writer = open_backend(f"zk://127.0.0.1:{zk_ensemble.client_port(writer_on)}{chroot}")
    reader = open_backend(f"zk://127.0.0.1:{zk_ensemble.client_port(reader_on)}{chroot}")
    try:
        for floor in range(1, 151):
            writer.advance(0, {R: floor}, {"why": "test"})
            assert reader.last_epoch(R) == floor
            assert reader.resources() == [R]
            assert reader.records(R)[-1].epoch == floor
    finally:
        writer.close()
        reader.close()


def _received(ensemble: ZooKeeperEnsemble, member: int) -> int:
    reply = ensemble.four_letter(member, "srvr")
    assert reply is not None
    (line,) = [line for line in reply.splitlines() if line.startswith("Received:")]
    return int(line.split(":")[1])


def test_a_reply_later_than_the_kick_interval_is_still_its_requests_answer(
    zk_ensemble: ZooKeeperEnsemble,
) -> None:
    """Every reply delayed 0.8 s by a proxy: the backend sends kicks while it waits (the
    member receives more requests than the read's own), and each face gets its request's own
    answer, within the timeout."""
    chroot = "/t" + secrets.token_hex(6)
    member = zk_ensemble.leader()
    direct = open_backend(f"zk://127.0.0.1:{zk_ensemble.client_port(member)}{chroot}")
    try:
        direct.advance(0, {R: 7}, {"why": "test"})
        with TcpProxy("127.0.0.1", zk_ensemble.client_port(member)) as proxy:
            url = f"zk://127.0.0.1:{proxy.port}{chroot}?timeout=3"
            late = open_backend(url)
            try:
                proxy.delay(0.8)
                before = _received(zk_ensemble, member)
                assert late.last_epoch(R) == 7  # its own 3 requests: sync, meta, counter
                assert _received(zk_ensemble, member) - before >= 3 + int(0.8 / KICK_EVERY) - 1
            finally:
                late.close()

            async def on_the_loop() -> int:
                backend = await open_async_zookeeper(url)
                try:
                    return await backend.last_epoch(R)
                finally:
                    await backend.aclose()

            assert asyncio.run(on_the_loop()) == 7  # the proxy still delays every reply
    finally:
        direct.close()

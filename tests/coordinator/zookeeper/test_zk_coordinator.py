"""The coordinator on ``zk://`` against the real 3-member ZooKeeper ensemble the session starts.

It runs :class:`CoordinatorConformance` and :class:`HistoryConformance` on both faces (each test
in its own chroot). It does **not** run :class:`ManualClockConformance`: expiry is decided by
the ZooKeeper leader's clock (the znodes' ``mtime``) and by sessions, which cannot be injected.
What only ZooKeeper has is tested below: the layout of znodes, waiting by ephemeral sequential
nodes with a watch on the predecessor only, renewals that never revive, the session's end, and
restore. Faults of the ensemble itself are in ``test_zk_faults.py``.
"""

from __future__ import annotations

import functools
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from kazoo.client import KazooClient

import fenced
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import open_backend
from fenced.coordinator._restore import advance
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator.backends.zookeeper import _plans
from fenced.coordinator.backends.zookeeper._backend import ZooKeeperBackend
from fenced.coordinator.backends.zookeeper._settings import parse_zk_url
from fenced.coordinator.backends.zookeeper._steps import Children
from fenced.core._clock import ManualClock
from fenced.core._errors import Busy, ConfigurationError, LeaseLost, Unavailable
from fenced.core._records import RecordKind
from fenced.testing.aio_conformance import AsyncCoordinatorConformance, AsyncHistoryConformance
from fenced.testing.conformance import CoordinatorConformance, HistoryConformance, wait_for
from fenced.testing.zookeeper import ZooKeeperEnsemble

R = "exports/daily"


def _chroot() -> str:
    return "/t" + secrets.token_hex(6)


@pytest.fixture
def zk(zk_ensemble: ZooKeeperEnsemble) -> str:
    """A fresh chroot of this test's own; sessions of 2 s so a dead client's znodes go soon."""
    return zk_ensemble.url(_chroot(), session_timeout=2, timeout=2)


@pytest.fixture
def kazoo(zk_ensemble: ZooKeeperEnsemble) -> Iterator[KazooClient]:
    """A plain kazoo client, to look at the znodes fenced wrote."""
    client = KazooClient(hosts=zk_ensemble.connect_string(), timeout=10.0)
    client.start(timeout=10)
    yield client
    client.stop()
    client.close()


class TestZooKeeperCoordinator(CoordinatorConformance):
    @pytest.fixture
    def url(self, zk: str) -> str:
        return zk


class TestZooKeeperHistory(HistoryConformance):
    @pytest.fixture
    def url(self, zk: str) -> str:
        return zk


class TestZooKeeperCoordinatorAsync(AsyncCoordinatorConformance):
    @pytest.fixture
    def url(self, zk: str) -> str:
        return zk


class TestZooKeeperHistoryAsync(AsyncHistoryConformance):
    @pytest.fixture
    def url(self, zk: str) -> str:
        return zk


# -- URLs and configuration ----------------------------------------------------------------------


def test_url_forms() -> None:
    settings = parse_zk_url("zk://a:1,b:2,[::1]:3/apps/fenced?session_timeout=4&timeout=1.5")
    assert settings.hosts == (("a", 1), ("b", 2), ("::1", 3))
    assert settings.chroot == "/apps/fenced"
    assert (settings.session_timeout, settings.timeout, settings.connect_timeout) == (4, 1.5, 1.5)
    assert settings.display() == "zk://a:1,b:2,[::1]:3/apps/fenced"
    default = parse_zk_url("zk://zk1")
    assert default.hosts == (("zk1", 2181),) and default.chroot == "/fenced"
    assert default.display() == "zk://zk1:2181"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("zk://", "expected host:port"),
        ("zk://a:1,,b:2", "expected host:port"),
        ("zk://a:x", "bad port"),
        ("zk://a:70000", "bad port"),
        ("zk://:1", "empty host"),
        ("zk://[::1:1", "unclosed"),
        ("zk://user:secret@a:1", "no user or password"),
        ("zk://a:1/bad name", "the chroot must be"),
        ("zk://a:1/zookeeper", "the chroot must be"),
        ("zk://a:1/x/../y", "the chroot must be"),
        ("zk://a:1/x/", "the chroot must be"),
        ("zk://a:1?session_timeout=0", "session_timeout must be a positive"),
        ("zk://a:1?timeout=nan", "timeout must be a positive"),
        ("zk://a:1?prefix=/x", "unknown zk URL parameter"),
        ("zk://a:1#frag", "no fragment"),
    ],
)
def test_bad_urls_are_one_line_configuration_errors(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says) as caught:
        fenced.connect(url)
    assert "\n" not in str(caught.value)
    assert "secret" not in str(caught.value)


def test_the_expiry_clock_cannot_be_injected(zk: str) -> None:
    with pytest.raises(ConfigurationError, match="leader's clock"):
        fenced.connect(zk, host_clock=ManualClock())


def test_an_unreachable_ensemble_is_unavailable_not_a_hang() -> None:
    with socketless_port() as port:
        started = time.monotonic()
        with pytest.raises(Unavailable, match="no session"):
            fenced.connect(f"zk://127.0.0.1:{port}?connect_timeout=0.5")
        assert time.monotonic() - started < 3


class socketless_port:
    """A loopback port nothing listens on (bound, never listening, for the test's duration)."""

    def __enter__(self) -> int:
        import socket

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        return int(self._socket.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self._socket.close()


def test_a_chroot_holding_foreign_data_is_a_configuration_error(
    zk_ensemble: ZooKeeperEnsemble, kazoo: KazooClient
) -> None:
    chroot = _chroot()
    kazoo.create(f"{chroot}/meta", b"not fenced", makepath=True)
    with pytest.raises(ConfigurationError, match="did not write"):
        fenced.connect(zk_ensemble.url(chroot))


def test_create_false_on_an_empty_chroot_creates_nothing(
    zk_ensemble: ZooKeeperEnsemble, kazoo: KazooClient
) -> None:
    chroot = _chroot()
    with pytest.raises(ConfigurationError, match="create=False"):
        fenced.connect(zk_ensemble.url(chroot), create=False)
    assert kazoo.exists(chroot) is None
    fenced.connect(zk_ensemble.url(chroot)).close()  # creates
    fenced.connect(zk_ensemble.url(chroot), create=False).close()


# -- the znodes ------------------------------------------------------------------------------------


def test_a_grant_writes_counter_lease_and_record_in_one_transaction(
    zk: str, kazoo: KazooClient, open_coord: Callable[[str], Coordinator]
) -> None:
    chroot = parse_zk_url(zk).chroot
    coord = open_coord(zk)
    lease = coord.acquire(R, ttl=5, wait=0, holder="a")
    counter, _ = kazoo.get(f"{chroot}/res/exports%2Fdaily")
    assert b'"epoch":1' in counter and b'"state":"live"' in counter
    data, stat = kazoo.get(f"{chroot}/res/exports%2Fdaily/lease")
    assert stat.ephemeralOwner == 0 and b'"holder":"a"' in data
    records = kazoo.get_children(f"{chroot}/log")
    assert records == ["exports%2Fdaily@0000000000"]
    coord.release(lease)
    assert kazoo.exists(f"{chroot}/res/exports%2Fdaily/lease") is None
    assert b'"state":"released"' in kazoo.get(f"{chroot}/res/exports%2Fdaily")[0]


def test_epochs_stay_unique_when_many_clients_grant_at_once(
    zk: str, open_coord: Callable[[str], Coordinator]
) -> None:
    """Each grant sets the counter at the version it read: concurrent grants on one resource
    (8 clients, each its own session, releasing at once) never write the same epoch."""
    coords = [open_coord(zk) for _ in range(8)]
    epochs: list[int] = []
    lock = threading.Lock()

    def cycle(coord: Coordinator) -> None:
        for _ in range(15):
            try:
                lease = coord.acquire(R, ttl=5, wait=0)
            except Busy:
                continue
            with lock:
                epochs.append(lease.epoch)
            coord.release(lease)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(cycle, coords))
    assert epochs and len(epochs) == len(set(epochs))
    assert coords[0].last_epoch(R) == max(epochs)


class _Counting:
    """A backend whose try_grant calls are counted per caller thread's name."""

    def __init__(self, url: str) -> None:
        self.backend = open_backend(url)
        self.calls: dict[str, int] = {}
        real = self.backend.try_grant

        def counted(request: GrantRequest, ticket: Any) -> Granted | Blocked:
            name = threading.current_thread().name
            self.calls[name] = self.calls.get(name, 0) + 1
            return real(request, ticket)

        self.backend.try_grant = counted  # type: ignore[method-assign]


def test_a_release_wakes_only_the_head_waiter_and_waiters_are_served_in_order(
    zk: str, kazoo: KazooClient, open_coord: Callable[[str], Coordinator]
) -> None:
    holder = open_coord(zk)
    lease = holder.acquire(R, ttl=30, wait=0)
    counting = _Counting(zk)
    coord = Coordinator(counting.backend)
    order: list[str] = []
    queue = f"{parse_zk_url(zk).chroot}/queue/exports%2Fdaily"

    def wait_in_line(name: str) -> None:
        got = coord.acquire(R, ttl=30, wait=20, holder=name)
        order.append(name)
        time.sleep(0.3)
        coord.release(got)

    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=wait_in_line, args=(f"w{i}",), name=f"w{i}"))
        threads[-1].start()
        wait_for(functools.partial(_queued, kazoo, queue, i + 1), 5, "the waiter's place")
    time.sleep(0.3)
    before = dict(counting.calls)
    holder.release(lease)
    wait_for(lambda: order == ["w0"], 5, "the head waiter's grant")
    time.sleep(0.1)
    woken = {name: counting.calls[name] - before.get(name, 0) for name in counting.calls}
    assert woken["w0"] >= 1
    assert woken["w1"] == woken["w2"] == woken["w3"] == 0, woken  # no herd
    for thread in threads:
        thread.join(20)
    assert order == ["w0", "w1", "w2", "w3"]
    assert kazoo.get_children(queue) == []
    coord.close()


def _queued(kazoo: KazooClient, queue: str, count: int) -> bool:
    return len(kazoo.get_children(queue)) == count


def test_a_waiter_that_gives_up_deletes_its_node(
    zk: str, kazoo: KazooClient, open_coord: Callable[[str], Coordinator]
) -> None:
    holder, waiter = open_coord(zk), open_coord(zk)
    holder.acquire(R, ttl=30, wait=0)
    with pytest.raises(Busy):
        waiter.acquire(R, ttl=5, wait=0.3)
    assert kazoo.get_children(f"{parse_zk_url(zk).chroot}/queue/exports%2Fdaily") == []


def test_a_renewal_that_arrives_after_the_expiry_never_revives_the_lease(
    zk: str, open_coord: Callable[[str], Coordinator]
) -> None:
    coord = open_coord(zk)
    backend = coord.backend
    lease = coord.acquire(R, ttl=0.5, wait=0, holder="late")
    time.sleep(0.8)  # nobody looked: the lease znode is still there, expired by the leader
    with pytest.raises(LeaseLost):
        backend.renew(R, lease.epoch, lease.owner, 5)
    assert coord.current(R) is None
    kinds = [r.kind for r in coord.history(R)]
    assert kinds == [RecordKind.GRANTED, RecordKind.EXPIRED]
    assert coord.acquire(R, ttl=5, wait=0).epoch == lease.epoch + 1


def test_a_lease_may_be_longer_than_the_session(
    zk: str, open_coord: Callable[[str], Coordinator]
) -> None:
    """The lease ends by the leader's clock, not with a session: a ttl beyond the session
    timeout (2 s here) is granted and renewed whole."""
    coord = open_coord(zk)
    lease = coord.acquire(R, ttl=30, wait=0)
    assert lease.ttl == 30.0
    renewed = coord.renew(lease)
    assert renewed.ttl == 30.0 and renewed.expires_in == 30.0
    info = coord.current(R)
    assert info is not None and info.ttl == 30.0


def test_the_end_of_the_holders_session_leaves_its_lease_to_its_ttl(
    zk: str, open_coord: Callable[[str], Coordinator]
) -> None:
    """The lease znode is persistent: when the holder's session ends (closed here; a crashed
    or silent client's session expires), the lease lives on to its ttl, as the holder's
    deadline counts on: a session can end milliseconds after a grant to a client that had been
    silent for a session timeout. Then it expires, and the expiry is recorded."""
    holder, other = open_coord(zk), open_coord(zk)
    lease = holder.acquire(R, ttl=1.5, wait=0)
    granted_at = time.monotonic()
    holder.backend._client.stop()  # type: ignore[attr-defined]
    time.sleep(0.5)
    info = other.current(R)
    assert info is not None and info.epoch == lease.epoch  # the session ended, the lease not
    taken = other.acquire(R, ttl=5, wait=5)
    assert time.monotonic() - granted_at >= 1.5 * 0.99  # not before its ttl
    assert taken.epoch == lease.epoch + 1
    assert [r.kind for r in other.history(R)][:3] == [
        RecordKind.GRANTED,
        RecordKind.EXPIRED,
        RecordKind.GRANTED,
    ]


def test_advance_ends_leases_and_puts_every_later_epoch_above_the_minimum(
    zk: str, open_coord: Callable[[str], Coordinator]
) -> None:
    coord = open_coord(zk)
    held = coord.acquire(R, ttl=30, wait=0)
    coord.acquire("other", ttl=30, wait=0)
    report = advance(zk, reason="test")
    assert coord.current(R) is None
    later = coord.acquire(R, ttl=5, wait=0)
    assert later.epoch > report.minimum > held.epoch
    assert coord.acquire("never-granted", ttl=5, wait=0).epoch > report.minimum
    kinds = [r.kind for r in coord.history(R)]
    assert RecordKind.RESTORED in kinds
    with pytest.raises(LeaseLost):
        coord.renew(held)


def test_records_and_old_request_ids_are_pruned(
    zk: str,
    kazoo: KazooClient,
    monkeypatch: pytest.MonkeyPatch,
    open_coord: Callable[[str], Coordinator],
) -> None:
    monkeypatch.setattr(_plans, "RECORDS_KEPT", 30)
    monkeypatch.setattr(_plans, "_PRUNE_EVERY", 20)
    coord = open_coord(zk)
    requests = f"{parse_zk_url(zk).chroot}/request"
    coord.release(coord.acquire(R, ttl=5, wait=0, request_id="old-request"))
    time.sleep(0.3)
    monkeypatch.setattr(_plans, "REQUESTS_KEPT_S", 0.2)
    for i in range(40):
        coord.release(coord.acquire(R, ttl=5, wait=0, request_id=f"r{i}"))
    wait_for(lambda: len(coord.history(R)) < 50, 10, "the prune, in the background")
    history = coord.history(R)
    assert 30 <= len(history) < 50
    assert history[-1].kind is RecordKind.RELEASED
    assert [r.seq for r in history] == sorted(r.seq for r in history)
    wait_for(lambda: "old-request" not in kazoo.get_children(requests), 10, "request ids pruned")
    assert "r39" in kazoo.get_children(requests)


def test_the_backend_is_the_zookeeper_one(zk: str) -> None:
    backend = open_backend(zk)
    try:
        assert isinstance(backend, ZooKeeperBackend)
        assert backend.url == zk.partition("?")[0]
    finally:
        backend.close()


@pytest.fixture
def handoffs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What every one-round-trip handoff attempt returned (None: the guess was wrong)."""
    seen: list[object] = []
    real = _plans._handoff

    def spy(*args: Any) -> Any:
        result = yield from real(*args)
        seen.append(result)
        return result

    monkeypatch.setattr(_plans, "_handoff", spy)
    return seen


def test_the_head_waiter_woken_by_a_release_grants_itself_in_one_round_trip(
    zk: str, open_coord: Callable[[str], Coordinator], handoffs: list[object]
) -> None:
    """The head's grant is sent right after a read of the counter, guessing the release's
    outcome; the records say the lease came after a release."""
    holder, waiter = open_coord(zk), open_coord(zk)
    lease = holder.acquire(R, ttl=30, wait=0)
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(waiter.acquire(R, ttl=30, wait=10).epoch))
    thread.start()
    queue = f"{parse_zk_url(zk).chroot}/queue/exports%2Fdaily"
    wait_for(lambda: holder_sees_waiters(holder, queue), 5, "the waiter's place")
    time.sleep(0.2)  # the waiter watches the lease
    holder.release(lease)
    thread.join(10)
    assert got == [lease.epoch + 1]
    assert [isinstance(h, Granted) for h in handoffs] == [True]
    granted = [r for r in holder.history(R) if r.kind is RecordKind.GRANTED]
    assert granted[-1].detail["after"] == "released"


def holder_sees_waiters(coord: Coordinator, queue: str) -> bool:
    client = coord.backend._client  # type: ignore[attr-defined]
    return bool(client.get_children(queue))


def test_a_head_woken_by_an_expiry_someone_else_recorded_gets_the_after_right(
    zk: str, open_coord: Callable[[str], Coordinator], handoffs: list[object]
) -> None:
    """The guess is "released"; when the lease was ended by another client recording its
    expiry instead, the read sent before the grant says so and the record is corrected."""
    holder, other = open_coord(zk), open_coord(zk)
    backend = open_backend(zk)
    try:
        lease = holder.acquire(R, ttl=0.5, wait=0)
        request = GrantRequest(R, 5.0, "owner-w", "waiter")
        ticket = backend.enqueue(request)
        assert isinstance(backend.try_grant(request, ticket), Blocked)  # head, behind the lease
        time.sleep(0.7)
        assert other.current(R) is None  # records the expiry, deletes the lease znode
        ticket.head_woken = True  # type: ignore[attr-defined]  # what wait() sets on a deletion
        granted = backend.try_grant(request, ticket)
        assert isinstance(granted, Granted) and granted.epoch == lease.epoch + 1
        assert [isinstance(h, Granted) for h in handoffs] == [True]  # the guess held
        kinds = [(r.kind, r.detail.get("after")) for r in other.history(R)]
        assert kinds == [
            (RecordKind.GRANTED, "none"),
            (RecordKind.EXPIRED, None),
            (RecordKind.GRANTED, "expired"),
        ]
    finally:
        backend.close()


def test_a_failing_prune_never_fails_the_step_that_made_it_due(
    zk: str, monkeypatch: pytest.MonkeyPatch, open_coord: Callable[[str], Coordinator]
) -> None:
    """A prune runs after a committed grant or release, in the background: when it fails, the
    acquire still returns its lease (it was granted) and the release its True."""
    failed: list[str] = []

    def failing_prune(state: Any) -> Any:
        failed.append("prune")
        yield Children(state.paths.log)
        raise Unavailable("the prune's read failed")

    monkeypatch.setattr(_plans, "_PRUNE_EVERY", 2)
    monkeypatch.setattr(_plans, "prune", failing_prune)
    coord = open_coord(zk)
    for _ in range(4):
        lease = coord.acquire(R, ttl=5, wait=0)
        assert coord.release(lease) is True
    wait_for(lambda: bool(failed), 5, "a prune")
    assert coord.last_epoch(R) == 4

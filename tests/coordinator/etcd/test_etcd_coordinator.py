"""The coordinator on ``etcd://`` against a real 3-member etcd cluster started by the session.

It runs :class:`CoordinatorConformance` and :class:`HistoryConformance` (each test on its own key
prefix). It does **not** run :class:`ManualClockConformance`: expiry is decided by etcd leases,
i.e. by the etcd leader's clock, which cannot be injected (``connect(url, host_clock=...)`` is
refused loudly). Expiry by etcd leases is tested directly instead, with etcd's granularity (a
lease of ttl T expires between ceil(T) and ceil(T) + 0.5 s after its last keep-alive).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import fenced
import fenced.coordinator.backends.etcd._records as etcd_records
from fenced.coordinator._client import Coordinator
from fenced.coordinator._connect import connect, open_backend
from fenced.coordinator.backend import Blocked, Granted, GrantRequest
from fenced.coordinator.backends.etcd._backend import EtcdBackend, EtcdTicket, parse_etcd_url
from fenced.coordinator.backends.etcd._client import (
    KV,
    MaybeApplied,
    NotApplied,
    Transport,
    b64,
)
from fenced.coordinator.backends.etcd._keys import (
    SEQ_PER_REVISION,
    STAMP_LATER,
    records_from,
    records_value,
    stamped,
)
from fenced.coordinator.backends.etcd._watch import WatchStream
from fenced.core._clock import ManualClock
from fenced.core._errors import (
    Busy,
    ConfigurationError,
    FencedError,
    LeaseLost,
    OutcomeUnknown,
    StaleToken,
    Unavailable,
)
from fenced.core._lease import LeaseState
from fenced.core._records import Record, RecordKind
from fenced.core._restore_base import restore_base
from fenced.core._token import FencingToken
from fenced.testing.conformance import CoordinatorConformance, HistoryConformance, wait_for
from fenced.testing.etcd import EtcdCluster, free_ports
from fenced.testing.proxy import TcpProxy
from support.coordinators import DEADLINE_CLOCK, restore_again_and_again
from support.worker_processes import read_events

R = "exports/daily"


def _prefix() -> str:
    return "/t" + uuid.uuid4().hex[:12]


@pytest.fixture
def etcd_url(etcd_cluster: EtcdCluster) -> str:
    return etcd_cluster.url(prefix=_prefix(), timeout=2)


class TestEtcdCoordinator(CoordinatorConformance):
    @pytest.fixture
    def url(self, etcd_url: str) -> str:
        return etcd_url


class TestEtcdHistory(HistoryConformance):
    @pytest.fixture
    def url(self, etcd_url: str) -> str:
        return etcd_url


# -- helpers --------------------------------------------------------------------------------------

WORKERS = Path(__file__).parents[2] / "support" / "lease_workers.py"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A cluster of this test's own (for tests that kill, restart or restore members)."""
    own = EtcdCluster(3, tmp_path / "etcd")
    try:
        own.start()
        yield own
    finally:
        own.stop()


class Worker:
    """A worker process of ``tests/support/lease_workers.py`` and its JSON-lines output."""

    def __init__(self, out: Path, mode: str, *args: str, netns: str | None = None) -> None:
        self.out = out
        argv = [sys.executable, str(WORKERS), mode, "--out", str(out), *args]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        return [e for e in read_events(self.out) if name is None or e["event"] == name]

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGCONT)
                os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.stop()


# -- URLs and configuration -----------------------------------------------------------------------


def test_url_forms_and_bad_urls() -> None:
    settings = parse_etcd_url("etcd://10.0.0.1:2379,[::1]:2380,etcd3?prefix=/p/q&timeout=2")
    assert settings.endpoints == [("10.0.0.1", 2379), ("::1", 2380), ("etcd3", 2379)]
    assert (settings.prefix, settings.timeout, settings.connect_timeout) == ("/p/q", 2.0, 1.0)
    for bad in [
        "etcd://",
        "etcd://h:0",
        "etcd://h:x",
        "etcd://h:1/path",
        "etcd://h:1?prefix=nope",
        "etcd://h:1?prefix=/a/",
        "etcd://h:1?timeout=-1",
        "etcd://h:1?tls=on",
        "etcd://user@h:1",
        "etcd://[::1:2379",
        "etcd://h:1#frag",
    ]:
        with pytest.raises(ConfigurationError):
            parse_etcd_url(bad)


def test_the_expiry_clock_cannot_be_injected(etcd_url: str) -> None:
    with pytest.raises(ConfigurationError, match="etcd leases"):
        open_backend(etcd_url, host_clock=ManualClock())


def test_an_unreachable_cluster_is_unavailable_not_a_hang() -> None:
    dead = free_ports(2)
    started = time.monotonic()
    with pytest.raises(Unavailable):
        connect(f"etcd://127.0.0.1:{dead[0]},127.0.0.1:{dead[1]}?timeout=0.5")
    assert time.monotonic() - started < 3


def test_a_dead_first_endpoint_fails_over(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    dead = free_ports(1)[0]
    url = f"etcd://127.0.0.1:{dead}," + ",".join(etcd_cluster.endpoints) + f"?prefix={_prefix()}"
    coord = open_coord(url)
    lease = coord.acquire(R, ttl=5, wait=0)
    assert coord.release(lease)


def test_a_foreign_value_under_the_prefix_is_a_configuration_error(
    etcd_cluster: EtcdCluster,
) -> None:
    prefix = _prefix()
    raw = Transport(
        [("127.0.0.1", etcd_cluster.members[0].client_port)], timeout=2, connect_timeout=1
    )
    raw.call("kv/put", {"key": b64(f"{prefix}/meta/id"), "value": b64("not an id")}, mutating=True)
    raw.close()
    with pytest.raises(ConfigurationError, match="coordinator id"):
        connect(etcd_cluster.url(prefix=prefix))


# -- expiry by etcd leases ------------------------------------------------------------------------


def test_the_time_left_on_a_pooled_etcd_lease_counts_a_suspended_host(
    etcd_url: str, open_coord: Callable[[str], Coordinator]
) -> None:
    """etcd kept counting while the host slept: 0.8 s of suspend after the grant, a lease of
    ttl 2 has at most 1.2 s left, both in ``current`` and in the replay of its request_id (the
    holder's deadline), where ``time.monotonic()`` would not have seen the 0.8 s."""
    backend = _etcd(open_coord(etcd_url))
    clock = ManualClock(now=time.monotonic())
    backend._clock = clock  # before the first etcd lease is taken
    request = GrantRequest(R, 2.0, "7" * 32, "a", request_id="suspended")
    granted = backend.try_grant(request, None)
    assert isinstance(granted, Granted) and granted.expires_in > 1.9
    clock.suspend(0.8)
    info = backend.current(R)
    assert info is not None and info.expires_in <= 1.2 + 1e-6
    replayed = backend.try_grant(request, None)
    assert isinstance(replayed, Granted) and replayed.epoch == granted.epoch
    assert replayed.expires_in <= 1.2 + 1e-6


def test_expiry_is_decided_by_the_etcd_lease(
    etcd_url: str, open_coord: Callable[[str], Coordinator]
) -> None:
    """ttl 0.4 becomes an etcd lease of etcd's minimum TTL (1 s here); it expires 1-1.5 s after
    its last keep-alive, and renew reports that TTL (the Coordinator caps the deadline at ttl)."""
    coord = open_coord(etcd_url)
    lease = coord.acquire(R, ttl=0.4, wait=0, safety_margin=0.05)
    assert lease.deadline - DEADLINE_CLOCK.now() <= 0.4
    backend = _etcd(coord)
    assert backend.renew(R, lease.epoch, lease.owner, 0.4) >= 1.0
    renewed_at = time.monotonic()
    renewed = coord.renew(lease)
    assert renewed.deadline <= DEADLINE_CLOCK.now() + 0.4
    wait_for(lambda: coord.current(R) is None, timeout=4, what="the etcd lease to expire")
    gone_after = time.monotonic() - renewed_at
    assert 0.9 <= gone_after <= 3.0
    with pytest.raises(LeaseLost):
        backend.renew(R, lease.epoch, lease.owner, 0.4)
    assert coord.acquire(R, ttl=5, wait=0).epoch == lease.epoch + 1
    assert [r.kind for r in coord.history(R)][-2:] == [RecordKind.EXPIRED, RecordKind.GRANTED]


def test_one_etcd_lease_carries_one_grant_and_renewing_one_never_extends_another(
    etcd_url: str, open_coord: Callable[[str], Coordinator]
) -> None:
    coord = open_coord(etcd_url)
    a = coord.acquire("res/a", ttl=1, wait=0)
    b = coord.acquire("res/b", ttl=1, wait=0)
    backend = _etcd(coord)
    leases = {_lease_id(backend, name) for name in ("res/a", "res/b")}
    assert len(leases) == 2
    give_up = time.monotonic() + 10  # b's etcd lease ends 1-1.5 s after its grant
    while coord.current("res/b") is not None:  # renew a only (every 0.2 s), until b expires
        assert time.monotonic() < give_up, "renewing a kept b alive"
        a = coord.renew(a)
        time.sleep(0.2)
    assert coord.current("res/a") is not None
    assert coord.release(a)
    # the released etcd lease is reused for the next grant (no LeaseGrant on the hot path)
    c = coord.acquire("res/c", ttl=1, wait=0)
    assert _lease_id(backend, "res/c") in leases
    with pytest.raises(LeaseLost):  # a late renew of the released grant touches nothing
        coord.renew(a)
    assert coord.current("res/c") is not None and coord.current("res/c").epoch == c.epoch  # type: ignore[union-attr]
    del b


class _WatchedLock:
    """A lock that tells when a thread had to wait for it (another thread held it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited = threading.Event()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_late_renew_never_returns_to_the_pool_an_etcd_lease_that_a_new_grant_carries(
    etcd_url: str, open_coord: Callable[[str], Coordinator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forced interleaving: a renew of A stops just after it found the pooled etcd lease that
    carries A; then A is released and B granted. The release waits for that renew (renew and
    release of a resource hold one lock in the backend), so the renew extends A, and B and then
    C get etcd leases of their own. Were the release not to wait, the renew would go on after it,
    find A gone and return to the pool the etcd lease that B's grant carried meanwhile: C's grant
    would share it, and renewing C would keep B alive."""
    patience = 20.0  # seconds any awaited step may take on a loaded machine
    coord = open_coord(etcd_url)
    backend = _etcd(coord)
    a = coord.acquire("res/a", ttl=5, wait=0)
    carrying_a = _lease_id(backend, "res/a")
    locks: dict[str, _WatchedLock] = {}
    monkeypatch.setattr(
        backend,
        "_grant_lock",
        lambda resource: locks.setdefault(resource, _WatchedLock()),
        raising=False,
    )
    found, resume = threading.Event(), threading.Event()
    carrier = backend._carrying_lease

    def renew_stops_after_finding_its_lease(resource: str, epoch: int, owner: str) -> Any:
        pooled = carrier(resource, epoch, owner)
        if threading.current_thread() is renewer:
            found.set()
            resume.wait(patience)
        return pooled

    monkeypatch.setattr(backend, "_carrying_lease", renew_stops_after_finding_its_lease)
    renewed: list[object] = []
    released: list[object] = []
    renewer = threading.Thread(
        target=lambda: renewed.append(_attempt(lambda: backend.renew("res/a", a.epoch, a.owner, 5)))
    )
    renewer.start()
    assert found.wait(patience), "the renew never looked for its etcd lease"

    def release_a_then_grant_b() -> None:
        released.append(_attempt(lambda: coord.release(a)))
        released.append(_attempt(lambda: coord.acquire("res/b", ttl=5, wait=0)))

    releaser = threading.Thread(target=release_a_then_grant_b)
    releaser.start()
    waits = locks.get("res/a")
    wait_for(
        lambda: not releaser.is_alive() or (waits is not None and waits.waited.is_set()),
        timeout=patience,
        what="the release to finish, or to wait for the renew",
    )
    resume.set()
    renewer.join(patience)
    releaser.join(patience)
    assert not renewer.is_alive() and not releaser.is_alive()
    assert released[0] is True and isinstance(released[1], fenced.Lease)
    assert _lease_id(backend, "res/b") == carrying_a  # reused once A was released
    c = coord.acquire("res/c", ttl=5, wait=0)
    assert _lease_id(backend, "res/c") != _lease_id(backend, "res/b"), "two grants, one etcd lease"
    assert renewed == [5.0], "the renew that came first did not extend A"
    assert coord.release(c) and coord.release(released[1])


def test_a_waiter_that_gives_up_leaves_no_key_behind(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    prefix = _prefix()
    url = etcd_cluster.url(prefix=prefix)
    holder, waiter = open_coord(url), open_coord(url)
    lease = holder.acquire(R, ttl=10, wait=0)
    with pytest.raises(Busy):
        waiter.acquire(R, ttl=5, wait=0.3)
    raw = Transport(
        [("127.0.0.1", etcd_cluster.members[1].client_port)], timeout=2, connect_timeout=1
    )
    queue = f"{prefix}/queue/".encode()
    reply = raw.call(
        "kv/range", {"key": b64(queue), "range_end": b64(queue[:-1] + b"0")}, mutating=False
    )
    raw.close()
    assert int(reply.get("count", 0)) == 0
    assert holder.release(lease)


# -- watches: resume and compaction ---------------------------------------------------------------


def test_a_watch_resumes_after_a_cut_connection_without_losing_events(
    etcd_cluster: EtcdCluster,
) -> None:
    member = etcd_cluster.members[0]
    key = f"{_prefix()}/w".encode()
    with TcpProxy("127.0.0.1", member.client_port) as proxy:
        watched = Transport([("127.0.0.1", proxy.port)], timeout=2, connect_timeout=1)
        direct = Transport([("127.0.0.1", member.client_port)], timeout=2, connect_timeout=1)
        reply = direct.call("kv/put", {"key": b64(key), "value": b64("0")}, mutating=True)
        start = int(reply["header"]["revision"]) + 1
        seen: list[bytes] = []
        stream = WatchStream(
            watched,
            key,
            None,
            start,
            lambda ev, rev: seen.extend(e.kv.value for e in ev),
            lambda reason: None,
        )
        assert stream.created.wait(5)
        for i in range(1, 11):
            direct.call("kv/put", {"key": b64(key), "value": b64(str(i))}, mutating=True)
            if i in (3, 7):
                proxy.cut()
        direct.call("kv/put", {"key": b64(key), "value": b64("end")}, mutating=True)
        wait_for(lambda: b"end" in seen, timeout=5, what="the last event")
        stream.stop()
        # every event once, in order: none lost, none repeated before the last one
        assert seen == [*(str(i).encode() for i in range(1, 11)), b"end"]
        watched.close()
        direct.close()


def test_an_idle_watch_keeps_its_connection(etcd_cluster: EtcdCluster) -> None:
    """Opening a watch is bounded (2 x connect_timeout); once created, a quiet watch is normal
    and must not time out and reconnect (a resumed watch lands in etcd's unsynced group)."""
    member = etcd_cluster.members[0]
    key = f"{_prefix()}/idle".encode()
    with TcpProxy("127.0.0.1", member.client_port) as proxy:
        watched = Transport([("127.0.0.1", proxy.port)], timeout=2, connect_timeout=0.2)
        direct = Transport([("127.0.0.1", member.client_port)], timeout=2, connect_timeout=1)
        seen: list[bytes] = []
        troubles: list[str] = []
        stream = WatchStream(
            watched,
            key,
            None,
            1,
            lambda ev, rev: seen.extend(e.kv.value for e in ev),
            troubles.append,
        )
        try:
            assert stream.created.wait(5)
            time.sleep(1.0)  # 2.5 x the open budget, with nothing to deliver
            direct.call("kv/put", {"key": b64(key), "value": b64("late")}, mutating=True)
            wait_for(lambda: seen == [b"late"], timeout=5, what="the event")
            assert proxy.connections == 1 and not troubles
        finally:
            stream.stop()
            watched.close()
            direct.close()


# -- sent or not sent: the classification of transport errors ---------------------------------


class _LoopbackServer:
    """A loopback server for the client's tests: :meth:`handle` serves each connection in a
    thread of its own; :meth:`request` reads one HTTP request from it."""

    def __init__(self, receive_buffer: int = 0) -> None:
        self.listener = socket.socket()
        if receive_buffer:
            self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.closed = 0
        """Connections this server has closed."""
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            self.handle(conn)
        self.closed += 1

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def request(self, conn: socket.socket, data: bytes, *, body: bool = True) -> bytes | None:
        """Read one request (its head; with ``body``, its Content-Length body too) from ``conn``,
        ``data`` being what was read already; what was read beyond it (None: the peer closed)."""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(4096)
            if not chunk:
                return None
            data += chunk
        self.requests += 1
        head, _, data = data.partition(b"\r\n\r\n")
        if not body:
            return data
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        while len(data) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        return data[length:]

    def close(self) -> None:
        self.listener.close()


class _BadServer(_LoopbackServer):
    """A server that never answers: ``reset`` resets each connection as soon as the request head
    has arrived (the body cannot have been sent whole); ``close`` reads the whole request, then
    closes the connection without a reply."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        super().__init__(receive_buffer=4096)  # no room for a body

    def handle(self, conn: socket.socket) -> None:
        if self.request(conn, b"", body=self.mode != "reset") is not None and self.mode == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")


def test_a_request_not_sent_whole_was_not_applied() -> None:
    """The server resets the connection once the head arrived: ``request()`` raises (its
    ``sendall`` could not hand the whole body to the kernel), so nothing was applied."""
    server = _BadServer("reset")
    transport = Transport([("127.0.0.1", server.port)], timeout=0.5, connect_timeout=0.2)
    body = {"key": b64("k"), "value": b64(b"x" * (16 << 20))}  # more than the socket buffers
    try:
        with pytest.raises(NotApplied, match="not sent whole"):
            transport.call("kv/put", body, mutating=True)
        assert server.requests >= 1
    finally:
        transport.close()
        server.close()


def test_a_request_sent_whole_whose_reply_is_lost_may_have_been_applied() -> None:
    server = _BadServer("close")
    transport = Transport([("127.0.0.1", server.port)], timeout=0.5, connect_timeout=0.2)
    try:
        with pytest.raises(MaybeApplied, match="reply lost"):
            transport.call("kv/put", {"key": b64("k"), "value": b64("v")}, mutating=True)
        assert server.requests == 1  # not retried: it may have been applied
        with pytest.raises(NotApplied, match="reply lost"):  # a read is retried until the budget
            transport.call("kv/range", {"key": b64("k")}, mutating=False)
        assert server.requests > 2
    finally:
        transport.close()
        server.close()


class _CannedServer(_LoopbackServer):
    """A server that answers each request with the next of ``replies`` (raw bytes), keeping the
    connection open unless the reply says ``close``."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = list(replies)
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        data: bytes | None = b""
        while self.replies and data is not None:
            data = self.request(conn, data)
            if data is None:
                return
            reply = self.replies.pop(0)
            conn.sendall(reply)
            if b"close" in reply.split(b"\r\n\r\n")[0].lower():
                return


def _chunked(*chunks: bytes, head: bytes = b"") -> bytes:
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(c), c) for c in chunks)
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
        + head
        + b"\r\n"
        + body
        + b"0\r\nX-Trailer: t\r\n\r\n"
    )


def _plain(body: bytes, version: bytes = b"HTTP/1.1", head: bytes = b"") -> bytes:
    return b"%s 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (version, len(body), head, body)


def test_the_client_reads_chunked_closing_and_http_1_0_replies() -> None:
    """http.client de-chunks (extensions, trailers); a connection is reused only if the reply
    keeps it open (not after ``Connection: close`` nor an HTTP/1.0 reply)."""
    server = _CannedServer(
        [
            _chunked(b'{"result":{"a":', b"1}}"),
            _plain(b'{"b":2}'),
            _plain(b'{"c":3}', head=b"Connection: close\r\n"),
            _plain(b'{"d":4}', b"HTTP/1.0"),
            _plain(b'{"e":5}'),
        ]
    )
    transport = Transport([("127.0.0.1", server.port)], timeout=2, connect_timeout=1)
    try:
        got = [transport.call("kv/range", {}, mutating=False) for _ in range(5)]
        assert got == [{"a": 1}, {"b": 2}, {"c": 3}, {"d": 4}, {"e": 5}]
        assert server.connections == 3
    finally:
        transport.close()
        server.close()


class _ClosingServer(_LoopbackServer):
    """Answers one request per connection, then closes it without saying so."""

    def handle(self, conn: socket.socket) -> None:
        if self.request(conn, b"") is not None:
            conn.sendall(_plain(b'{"ok":true}'))


def test_a_pooled_connection_the_server_closed_is_not_reused() -> None:
    """The next request must not go out on a connection the server closed while it was idle
    (the reply would be lost: an unknown outcome for a request that never arrived)."""
    server = _ClosingServer()
    transport = Transport([("127.0.0.1", server.port)], timeout=2, connect_timeout=1)
    try:
        for done in range(1, 4):
            assert transport.call("kv/put", {}, mutating=True) == {"ok": True}
            # the server has closed the idle connection (its FIN is sent) before the next call
            wait_for(lambda: server.closed >= done, timeout=5, what="the server to close")  # noqa: B023
        assert server.connections == 3
    finally:
        transport.close()
        server.close()


def test_a_malformed_reply_may_have_been_applied() -> None:
    server = _CannedServer(
        [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nnot json!"]
    )
    transport = Transport([("127.0.0.1", server.port)], timeout=0.5, connect_timeout=0.2)
    try:
        with pytest.raises(MaybeApplied):
            transport.call("kv/put", {}, mutating=True)
        with pytest.raises(MaybeApplied, match="unreadable reply"):
            transport.call("kv/put", {}, mutating=True)
    finally:
        transport.close()
        server.close()


def test_a_stream_yields_its_lines_across_chunk_boundaries() -> None:
    server = _CannedServer(
        [_chunked(b'{"result":{"n":1}}\n{"res', b'ult":{"n":2}}\n', b'\n{"result":{"n":3}}\n')]
    )
    transport = Transport([("127.0.0.1", server.port)], timeout=2, connect_timeout=1)
    try:
        stream = transport.open_stream("watch", {}, 1.0)
        assert [m["result"]["n"] for m in stream.messages()] == [1, 2, 3]
        stream.close()
    finally:
        transport.close()
        server.close()


def test_a_compacted_start_revision_makes_the_waiter_re_read(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    url = etcd_cluster.url(prefix=_prefix())
    holder, waiter = open_coord(url), open_coord(url)
    lease = holder.acquire(R, ttl=10, wait=0)
    raw = Transport(
        [("127.0.0.1", etcd_cluster.members[0].client_port)], timeout=2, connect_timeout=1
    )
    troubles: list[str] = []
    head = int(raw.call("kv/range", {"key": b64("x")}, mutating=False)["header"]["revision"])
    raw.call("kv/compaction", {"revision": str(head)}, mutating=True)
    stream = WatchStream(raw, b"x", None, 1, lambda ev, rev: None, troubles.append)
    wait_for(lambda: troubles == ["compacted"], timeout=5, what="the compaction to be reported")
    stream.stop()
    # a waiter whose watch must resume at a compacted revision (its connection broke) re-reads
    backend = _etcd(waiter)
    request = GrantRequest(R, 5.0, "1" * 32, "waiter")
    ticket = backend.enqueue(request)
    assert isinstance(ticket, EtcdTicket)
    assert isinstance(backend.try_grant(request, ticket), Blocked)
    wait_for(lambda: all(w.created.is_set() for w in ticket.watches), what="the watches")
    assert not ticket.changed.is_set()
    watch = ticket.watches[0]
    watch.revision = 1  # as if it had been idle since then: resuming there hits the compaction
    reply = watch._stream
    assert reply is not None
    reply.shutdown()  # as if the connection broke
    backend.wait(ticket, 5)
    assert ticket.changed.is_set()
    assert isinstance(backend.try_grant(request, ticket), Blocked)  # re-read: still held
    assert not ticket.changed.is_set() and ticket.watching  # and watching again
    holder.release(lease)
    backend.wait(ticket, 5)
    granted = backend.try_grant(request, ticket)
    assert isinstance(granted, Granted) and granted.epoch == lease.epoch + 1
    raw.close()


# -- processes and faults -------------------------------------------------------------------------


def _contend(url: str, tmp_path: Path, workers: list[Worker], seconds: float) -> None:
    """Start 8 ``contend`` workers on one resource and a strict store, for ``seconds``."""
    store_url = f"sqlite:///{tmp_path}/store.db"
    fenced.open_store(store_url, "strict").close()
    until = DEADLINE_CLOCK.now() + seconds
    args = ["--url", url, "--store", store_url, "--ttl", "2", "--until", str(until)]
    for i in range(8):
        workers.append(Worker(tmp_path / f"w{i}.jsonl", "contend", *args))


@pytest.mark.slow
def test_kill_9_of_the_leader_while_8_processes_contend(
    cluster: EtcdCluster, tmp_path: Path, workers: list[Worker]
) -> None:
    url = cluster.url(prefix="/fenced", timeout=1, connect_timeout=0.3)
    _contend(url, tmp_path, workers, 7.0)
    wait_for(
        lambda: sum(len(w.events("held")) for w in workers) >= 40, timeout=20, what="contention"
    )
    killed_at = DEADLINE_CLOCK.now()
    cluster.kill(cluster.leader())
    for worker in workers:
        worker.process.wait(40)
    held = [(e["epoch"], e["version"], e["t"], e["pid"]) for w in workers for e in w.events("held")]
    epochs = [epoch for epoch, _, _, _ in held]
    assert len(epochs) == len(set(epochs)), "an epoch was granted twice"
    by_version = sorted(held, key=lambda h: h[1])
    assert [v for _, v, _, _ in by_version] == list(range(1, len(held) + 1))
    assert [e for e, _, _, _ in by_version] == sorted(epochs), "the store accepted a stale holder"
    after = sorted(t for _, _, t, _ in held if t > killed_at)
    assert after, "no acquisition after the leader was killed"
    assert after[0] - killed_at < 2.0, f"acquisitions resumed {after[0] - killed_at:.2f}s after"
    errors = [e["error"] for w in workers for e in w.events("error")]
    assert not [e for e in errors if "StaleToken" in e or "NotInstalled" in e], errors


@pytest.mark.slow
def test_a_stopped_holder_loses_the_lease_and_its_stale_writes_are_rejected(
    etcd_cluster: EtcdCluster,
    tmp_path: Path,
    workers: list[Worker],
    open_coord: Callable[[str], Coordinator],
) -> None:
    url = etcd_cluster.url(prefix=_prefix(), timeout=1)
    store = fenced.open_store(f"sqlite:///{tmp_path}/store.db", "strict")
    coord = open_coord(url)
    holder = Worker(tmp_path / "h.jsonl", "hold", "--url", url, "--ttl", "1", "--seconds", "20")
    workers.append(holder)
    wait_for(lambda: holder.events("held"), timeout=10, what="the holder")
    old_epoch = holder.events("held")[0]["epoch"]
    old_token = FencingToken(coord.coordinator_id, R, old_epoch)
    store.fence(old_token)
    os.kill(holder.process.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    with coord.hold(R, ttl=5, wait=10, fence=[store]) as held:
        took = time.monotonic() - stopped_at
        assert held.epoch == old_epoch + 1
        assert 0.5 < took < 4.0  # the etcd lease (1 s) expired; no keep-alive came
        with pytest.raises(StaleToken):
            store.put(old_token, "k", b"stale")  # the paused holder's write, after it wakes
        os.kill(holder.process.pid, signal.SIGCONT)
        wait_for(lambda: holder.events("done"), timeout=10, what="the holder to notice")
        assert any(e["event"] == "lost" for e in holder.events())
        store.put(held.token, "k", b"fresh")
    assert store.get(R, "k").value == b"fresh"  # type: ignore[union-attr]
    store.close()


@pytest.mark.slow
def test_a_restart_of_the_whole_cluster_with_leases_held(
    cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    url = cluster.url(prefix="/fenced", timeout=1, connect_timeout=0.3)
    coord, other = open_coord(url), open_coord(url)
    states: list[LeaseState] = []
    with coord.hold(R, ttl=6, wait=0) as held:
        epoch = held.epoch
        for member in cluster.members:
            cluster.kill(member)
        wait_for(lambda: held.state is LeaseState.UNCERTAIN, timeout=6, what="UNCERTAIN")
        states.append(held.state)
        cluster.start_all()
        wait_for(lambda: held.state is LeaseState.HELD, timeout=6, what="HELD again")
        states.append(held.state)
        assert not held.lost.is_set()
        with pytest.raises(Busy):
            other.acquire(R, ttl=5, wait=0)
        info = other.current(R)
        assert info is not None and info.epoch == epoch
    assert states == [LeaseState.UNCERTAIN, LeaseState.HELD]
    assert other.acquire(R, ttl=5, wait=0).epoch == epoch + 1


@pytest.mark.slow
def test_lost_and_delayed_replies_through_a_tcp_proxy(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    prefix = _prefix()
    member = etcd_cluster.leader()
    direct = open_coord(etcd_cluster.url(prefix=prefix))
    with TcpProxy("127.0.0.1", member.client_port) as proxy:
        proxied = open_coord(f"etcd://127.0.0.1:{proxy.port}?prefix={prefix}&timeout=1")
        # the client's own deadline (20 s) never ends a request first: only the proxy does
        patient = open_coord(f"etcd://127.0.0.1:{proxy.port}?prefix={prefix}&timeout=20")
        # a lost grant reply: OutcomeUnknown, and the retry with the request_id finds the grant.
        # The warm-up leaves an idle etcd lease of ttl 5 in the pool and the request_id
        # retention lease, so the grant's transaction is the acquire's only request. Its reply
        # is held until etcd shows the grant, then lost with the connection. (lose_replies would
        # cut at the first byte back: an HTTP/2 frame etcd sends as the request arrives, after
        # which etcd may cancel the request and grant nothing, or grant after the read below.)
        warm = patient.acquire("exports/warm", ttl=5, wait=0, request_id="warm")
        assert patient.release(warm)
        proxy.hold_replies()
        attempts: list[object] = []
        granting = threading.Thread(
            target=lambda: attempts.append(
                _attempt(lambda: patient.acquire(R, ttl=5, wait=0, request_id="lost-1"))
            )
        )
        granting.start()
        wait_for(lambda: direct.last_epoch(R) == 1, timeout=10, what="the grant at etcd")
        assert granting.is_alive() and not attempts  # its reply has not come back
        proxy.cut()
        granting.join(10)
        assert len(attempts) == 1 and isinstance(attempts[0], OutcomeUnknown), attempts
        proxy.forward()
        info = direct.current(R)
        assert info is not None and info.epoch == 1
        lease = patient.acquire(R, ttl=5, wait=0, request_id="lost-1")
        assert lease.epoch == 1
        assert direct.last_epoch(R) == 1  # the retry found the grant: no second epoch
        assert patient.release(lease)
        # a delayed reply to a renewal: the local deadline counts from the send time
        lease = proxied.acquire(R, ttl=3, wait=0)
        proxy.delay(0.5)
        sent = DEADLINE_CLOCK.now()
        renewed = proxied.renew(lease)
        assert DEADLINE_CLOCK.now() - sent >= 0.9  # two requests, each reply 0.5 s late
        assert renewed.deadline <= sent + 3
        proxy.forward()
        # a delayed release from the old owner never affects the newer lease: it reaches etcd
        # after the newer grant, and its client (timeout 20 s) is still there to hear the answer
        short = patient.acquire("exports/other", ttl=1, wait=0)
        proxy.blackhole()
        outcome: list[object] = []
        releaser = threading.Thread(
            target=lambda: outcome.append(_attempt(lambda: patient.release(short)))
        )
        releaser.start()
        newer = direct.acquire("exports/other", ttl=10, wait=5)
        assert newer.epoch == short.epoch + 1
        assert releaser.is_alive()  # its release has not reached etcd yet
        proxy.forward()
        releaser.join(30)
        assert outcome == [False]  # etcd's answer: no longer this owner's lease
        info = direct.current("exports/other")
        assert info is not None and info.epoch == newer.epoch
        assert direct.release(newer)
        assert direct.release(lease) is True


def _lease_id(backend: EtcdBackend, resource: str) -> int:
    kv = backend._lease_kv(resource)
    assert kv is not None
    return kv.lease


def _etcd(coord: Coordinator) -> EtcdBackend:
    backend = coord.backend
    assert isinstance(backend, EtcdBackend)
    return backend


def _attempt(call: Callable[[], object]) -> object:
    try:
        return call()
    except FencedError as error:
        return error


@pytest.mark.slow
def test_snapshot_restore_then_advance_puts_every_later_epoch_above_the_earlier_ones(
    cluster: EtcdCluster, tmp_path: Path, open_coord: Callable[[str], Coordinator]
) -> None:
    url = cluster.url(prefix="/fenced", timeout=2)
    coord = open_coord(url)
    store = fenced.open_store(f"sqlite:///{tmp_path}/store.db", "strict")
    for _ in range(41):
        coord.release(coord.acquire(R, ttl=5, wait=0))
    assert coord.last_epoch(R) == 41
    snapshot = cluster.snapshot_save(tmp_path / "snap.db")
    coord.release(coord.acquire(R, ttl=5, wait=0))
    with coord.hold(R, ttl=5, wait=0, fence=[store]) as held:
        assert held.epoch == 43
        store.put(held.token, "k", b"by 43")
    cluster.restore(snapshot)
    restored = open_coord(url)
    assert restored.coordinator_id == coord.coordinator_id
    assert restored.last_epoch(R) == 41  # etcd went back: epoch 42 would be handed out again
    floor = store.floor(R)
    assert floor == 43
    minimum = restored.backend.advance(restore_base(time.time()), {R: floor}, {"why": "restore"})
    assert minimum >= restore_base(time.time() - 60)
    with restored.hold(R, ttl=5, wait=0, fence=[store]) as held:
        assert held.epoch > 43
        store.put(held.token, "k", b"after the restore")
    assert store.get(R, "k").value == b"after the restore"  # type: ignore[union-attr]
    assert coord.acquire("exports/fresh", ttl=5, wait=0).epoch > minimum  # an old client too
    kinds = [r.kind for r in restored.history(R)]
    assert RecordKind.RESTORED in kinds
    store.close()


@pytest.mark.slow
def test_restoring_one_snapshot_again_and_again_never_repeats_a_token(
    cluster: EtcdCluster, tmp_path: Path
) -> None:
    """``etcdctl snapshot restore`` of the same snapshot three times in a few seconds, each
    followed by the advance step (``fenced restore --advance``) and grants: every first grant is
    above every earlier one."""
    snapshot = tmp_path / "snap.db"
    restore_again_and_again(
        cluster.url(prefix="/fenced", timeout=2),
        R,
        lambda: cluster.snapshot_save(snapshot),
        lambda: cluster.restore(snapshot),
    )


# -- a partition in a network-namespace lab -------------------------------------------------------


class NetnsLab:
    """A private network: a "switch" namespace with a bridge, one namespace per host, each joined
    to the bridge by a veth pair; addresses in a private /24 that exists only inside the lab (no
    link to this namespace, no default route). ``cut(i)`` downs host i's switch port."""

    SUBNET = "10.199.77"

    def __init__(self, hosts: int) -> None:
        tag = uuid.uuid4().hex[:6]
        self.switch = f"fz{tag}sw"
        self.hosts = [f"fz{tag}h{i + 1}" for i in range(hosts)]
        self.addresses = [f"{self.SUBNET}.{i + 1}" for i in range(hosts)]

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)

    def __enter__(self) -> NetnsLab:
        try:
            self._ip("netns", "add", self.switch)
            self._ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.switch, "link", "set", "br0", "up")
            for i, (host, address) in enumerate(zip(self.hosts, self.addresses, strict=True)):
                port = f"p{i + 1}"
                self._ip("netns", "add", host)
                self._ip("-n", host, "link", "set", "lo", "up")
                self._ip(
                    "link", "add", "eth0", "netns", host, "type", "veth",
                    "peer", "name", port, "netns", self.switch,
                )  # fmt: skip
                self._ip("-n", self.switch, "link", "set", port, "master", "br0")
                self._ip("-n", self.switch, "link", "set", port, "up")
                self._ip("-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
                self._ip("-n", host, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def cut(self, index: int) -> None:
        self._ip("-n", self.switch, "link", "set", f"p{index + 1}", "down")

    def heal(self, index: int) -> None:
        self._ip("-n", self.switch, "link", "set", f"p{index + 1}", "up")

    def close(self) -> None:
        """Delete every namespace of the lab (that removes its veths and bridge)."""
        for name in [*self.hosts, self.switch]:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.mark.slow
def test_a_holder_whose_member_is_cut_off_goes_uncertain_then_lost_and_others_proceed(
    tmp_path: Path, workers: list[Worker]
) -> None:
    with NetnsLab(3) as lab:
        cluster = EtcdCluster(
            3, tmp_path / "etcd", hosts=list(zip(lab.addresses, lab.hosts, strict=True))
        )
        try:
            cluster.start(timeout=30)
            url = cluster.url(prefix="/fenced", timeout=0.5, connect_timeout=0.2)
            leader = cluster.leader()
            cut = cluster.members.index(leader)
            holder = Worker(
                tmp_path / "holder.jsonl", "hold", "--url", url, "--ttl", "3", "--seconds", "20",
                netns=leader.netns,
            )  # fmt: skip
            workers.append(holder)
            wait_for(lambda: holder.events("held"), timeout=15, what="the holder")
            epoch = holder.events("held")[0]["epoch"]
            time.sleep(0.3)
            cut_at = DEADLINE_CLOCK.now()
            lab.cut(cut)
            other_host = lab.hosts[(cut + 1) % 3]
            other = Worker(
                tmp_path / "other.jsonl", "acquire", "--url", url, "--ttl", "5", "--wait", "20",
                netns=other_host,
            )  # fmt: skip
            workers.append(other)
            wait_for(lambda: other.events("granted") or other.events("failed"), timeout=25)
            assert other.events("granted"), other.events("failed")
            granted = other.events("granted")[0]
            assert granted["epoch"] == epoch + 1
            wait_for(lambda: holder.events("done"), timeout=15, what="the holder to give up")
            states = [(e["state"], e["t"]) for e in holder.events("state")]
            names = [name for name, _ in states]
            assert names[:2] == ["UNCERTAIN", "LOST"], states
            uncertain_at, lost_at = states[0][1], states[1][1]
            assert cut_at < uncertain_at < lost_at <= cut_at + 3.0 + 0.5
            assert lost_at < granted["t"], "the other holder was granted before the old one knew"
            assert [e["reason"] for e in holder.events("lost")] == ["EXPIRED"]
            lab.heal(cut)
        finally:
            for worker in workers:
                worker.stop()
            cluster.stop()


# -- a release hands the lease to the head of the line --------------------------------------------


def _raw(cluster: EtcdCluster) -> Transport:
    member = cluster.members[0]
    return Transport([("127.0.0.1", member.client_port)], timeout=5, connect_timeout=1)


def _queued(cluster: EtcdCluster, prefix: str) -> int:
    """How many waiters' keys exist under ``prefix``."""
    raw = _raw(cluster)
    queue = f"{prefix}/queue/".encode()
    try:
        reply = raw.call(
            "kv/range",
            {"key": b64(queue), "range_end": b64(queue[:-1] + b"0"), "count_only": True},
            mutating=False,
        )
    finally:
        raw.close()
    return int(reply.get("count", 0))


def _records(cluster: EtcdCluster, prefix: str) -> list[tuple[int, Any]]:
    """``(revision that wrote it, record)`` of every record under ``prefix``, in order."""
    raw = _raw(cluster)
    start = f"{prefix}/log/".encode()
    try:
        reply = raw.call(
            "kv/range", {"key": b64(start), "range_end": b64(start[:-1] + b"0")}, mutating=False
        )
    finally:
        raw.close()
    found = [KV.from_json(kv) for kv in reply.get("kvs", [])]
    records = [
        (kv.create_revision, record)
        for kv in found
        for record in records_from(kv.value, kv.create_revision)
    ]
    return sorted(records, key=lambda item: item[1].seq)


def _handoffs(records: list[tuple[int, Any]]) -> list[tuple[Any, Any]]:
    """(RELEASED, GRANTED) pairs written by one transaction: a release that handed over."""
    pairs = []
    for (rev, first), (next_rev, second) in itertools.pairwise(records):
        kinds = (first.kind, second.kind)
        if kinds == (RecordKind.RELEASED, RecordKind.GRANTED) and rev == next_rev:
            pairs.append((first, second))
    return pairs


def _count_requests(backend: EtcdBackend) -> list[tuple[float, str, bool]]:
    """Record ``(time, path, writes)`` of every request ``backend`` makes from now on
    (``writes``: sent as one that may change something)."""
    calls: list[tuple[float, str, bool]] = []
    transport = backend._transport
    attempts = transport._attempts

    def counted(path: str, body: Any, mutating: bool, timeout: float | None) -> Any:
        calls.append((time.monotonic(), path, mutating))
        return attempts(path, body, mutating, timeout)

    transport._attempts = counted  # type: ignore[method-assign]
    return calls


def test_a_release_hands_the_lease_to_the_head_in_its_own_transaction(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    """The release puts the head's grant (epoch + 1, on the etcd lease the waiter created when
    it queued); the waiter returns from the watch event, without a write of its own (a read
    may coincide: the catch-up read of its watch, or its periodic recheck, on a busy machine)."""
    prefix = _prefix()
    url = etcd_cluster.url(prefix=prefix)
    holder, waiter = open_coord(url), open_coord(url)
    held = _etcd(holder)
    requests = _count_requests(_etcd(waiter))
    lease = holder.acquire(R, ttl=10, wait=0)
    with ThreadPoolExecutor(1) as pool:
        for round_number in range(2):  # the first release shows the holder's process a waiter
            waiting = pool.submit(waiter.acquire, R, ttl=10, wait=10, holder="waiter")
            wait_for(lambda: _queued(etcd_cluster, prefix) == 1, what="the waiter to queue")
            if round_number:
                wait_for(lambda: held._queue_head(R) is not None, what="the holder's view")
            released_at = time.monotonic()
            assert holder.release(lease)
            granted = waiting.result(10)
            returned_at = time.monotonic()
            assert granted.epoch == lease.epoch + 1
            assert waiter.current(R) is not None
            assert waiter.release(granted)
            lease = holder.acquire(R, ttl=10, wait=5)
    assert holder.release(lease)
    handed = _handoffs(_records(etcd_cluster, prefix))
    assert [(r.epoch, g.epoch, g.holder) for r, g in handed] == [(3, 4, "waiter")]
    assert handed[0][1].detail == {"after": "released"}
    during = [path for at, path, writes in requests if released_at <= at <= returned_at and writes]
    assert not during, during


@pytest.mark.parametrize("api", ["grpc", "gateway"])
def test_a_handoff_built_ahead_is_stamped_at_the_release_and_rebuilt_when_stale(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator], api: str
) -> None:
    """The holder's process builds the handoff to a new head when its view of the line changes
    (off the release's path); the release sends that transaction with its records' time set
    at the release, and builds a fresh one when anything it was built from changed since (here
    a proclaim moved the lease key and the resource's record number)."""
    prefix = _prefix()
    url = etcd_cluster.url(prefix=prefix, api=api)
    holder, waiter = open_coord(url), open_coord(url)
    held = _etcd(holder)
    built_by: list[str] = []
    build = held._release_plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        built_by.append(threading.current_thread().name)
        return build(*args, **kwargs)

    held._release_plan = counted  # type: ignore[method-assign]
    assert holder.release(holder.acquire(R, ttl=10, wait=0))
    lease = holder.acquire(R, ttl=10, wait=0)  # taken again: the holder's process watches
    wait_for(lambda: R in held._views, what="the holder's view of the line")
    released_at: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        for stale in (False, True):
            waiting = pool.submit(waiter.acquire, R, ttl=10, wait=10, holder=f"stale={stale}")
            wait_for(lambda: R in held._planned, what="the handoff built ahead")
            if stale:
                held.proclaim(R, lease.epoch, lease.owner, "moved")
            built_by.clear()
            released_at.append(time.time())
            assert holder.release(lease)
            granted = waiting.result(10)
            assert granted.epoch == lease.epoch + 1
            here = threading.current_thread().name
            assert built_by.count(here) == (1 if stale else 0), built_by
            assert R not in held._planned
            assert waiter.release(granted)
            lease = holder.acquire(R, ttl=10, wait=5)
    assert holder.release(lease)
    handed = _handoffs(_records(etcd_cluster, prefix))
    assert [(g.holder, g.epoch - r.epoch) for r, g in handed] == [
        ("stale=False", 1),
        ("stale=True", 1),
    ]
    for (released, granted), at in zip(handed, released_at, strict=True):
        assert at <= released.at == granted.at <= time.time()


def test_records_built_ahead_get_their_time_wherever_the_pattern_appears_in_strings() -> None:
    """``stamped`` replaces only the records' own ``at`` fields: a holder label or value that
    spells the placeholder is left as it was (a quote inside a JSON string is escaped)."""
    trap = '"at":-8.125,'
    records = [
        (0, Record(0, STAMP_LATER, RecordKind.RELEASED, R, 6, trap, {})),
        (1, Record(0, STAMP_LATER, RecordKind.GRANTED, R, 7, "b", {"value": trap})),
    ]
    value = stamped(records_value(records), 1_764_820_000.123456)
    found = records_from(value, 5)
    assert [(r.at, r.holder, dict(r.detail)) for r in found] == [
        (1_764_820_000.123456, trap, {}),
        (1_764_820_000.123456, "b", {"value": trap}),
    ]


def test_a_caller_whose_process_sees_a_waiter_queues_without_a_failed_grant(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    """A process that watches the line of a resource (it took it twice) and sees a waiter in
    it queues a new acquire at once: one write (its queue key), not a grant attempt that etcd
    would commit as a failed write first; it is still served after that waiter, and a caller
    that will not wait still asks etcd."""
    prefix = _prefix()
    url = etcd_cluster.url(prefix=prefix)
    holder, first, late = open_coord(url), open_coord(url), open_coord(url)
    for _ in range(2):
        assert late.release(late.acquire(R, ttl=10, wait=0))
    seen = _etcd(late)
    lease = holder.acquire(R, ttl=10, wait=0)
    with ThreadPoolExecutor(2) as pool:
        waiting_first = pool.submit(first.acquire, R, ttl=10, wait=10, holder="first")
        wait_for(lambda: seen._queue_head(R) is not None, what="the late process's view")
        requests = _count_requests(seen)
        with pytest.raises(Busy):
            late.acquire(R, ttl=10, wait=0)
        assert ("kv/txn", True) in [(path, writes) for _, path, writes in requests]  # tried
        requests.clear()
        waiting_late = pool.submit(late.acquire, R, ttl=10, wait=10, holder="late")
        wait_for(lambda: _queued(etcd_cluster, prefix) == 2, what="the late caller to queue")
        txns = [path for _, path, writes in requests if writes and path == "kv/txn"]
        assert txns == ["kv/txn"], requests  # its queue key, no failed grant before it
        assert holder.release(lease)
        served = waiting_first.result(10)
        assert served.holder == "first"
        assert first.release(served)
        assert waiting_late.result(10).epoch == served.epoch + 1


def test_a_waiter_that_leaves_after_being_handed_the_lease_hands_it_on(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    """The waiter gave up (its acquire timed out) just as the release handed it the lease: its
    leave() releases that grant, handing it on to the next waiter."""
    prefix = _prefix()
    url = etcd_cluster.url(prefix=prefix)
    holder, leaver, third = open_coord(url), open_coord(url), open_coord(url)
    lease = holder.acquire(R, ttl=10, wait=0)
    held = _etcd(holder)
    held._watch_queue(R)
    backend = _etcd(leaver)
    ticket = backend.enqueue(GrantRequest(R, 30.0, "1" * 32, "leaver"))
    assert isinstance(ticket, EtcdTicket)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(third.acquire, R, ttl=10, wait=20, holder="third")
        wait_for(lambda: _queued(etcd_cluster, prefix) == 2, what="two waiters")
        wait_for(lambda: held._queue_head(R) is not None, what="the holder's view")
        assert holder.release(lease)
        wait_for(lambda: ticket.handed is not None, what="the handoff to the leaver")
        backend.leave(ticket)  # it never takes the lease
        granted = waiting.result(10)
    assert granted.epoch == lease.epoch + 2
    records = _records(etcd_cluster, prefix)
    assert [(r.kind, r.epoch, r.holder) for _, r in records][-4:] == [
        (RecordKind.RELEASED, lease.epoch, lease.holder),
        (RecordKind.GRANTED, lease.epoch + 1, "leaver"),
        (RecordKind.RELEASED, lease.epoch + 1, "leaver"),
        (RecordKind.GRANTED, lease.epoch + 2, "third"),
    ]
    assert len(_handoffs(records)) == 2  # the holder's release, then the leaver's leave()
    assert third.release(granted)


def test_a_lease_handed_to_a_waiter_with_a_request_id_is_found_again_by_that_id(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    prefix = _prefix()
    url = etcd_cluster.url(prefix=prefix)
    holder, waiter, other = open_coord(url), open_coord(url), open_coord(url)
    lease = holder.acquire(R, ttl=10, wait=0)
    _etcd(holder)._watch_queue(R)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(waiter.acquire, R, ttl=10, wait=10, request_id="rid-1")
        wait_for(lambda: _queued(etcd_cluster, prefix) == 1, what="the waiter to queue")
        wait_for(lambda: _etcd(holder)._queue_head(R) is not None, what="the holder's view")
        assert holder.release(lease)
        granted = waiting.result(10)
    assert granted.epoch == lease.epoch + 1
    assert len(_handoffs(_records(etcd_cluster, prefix))) == 1
    again = other.acquire(R, ttl=10, wait=0, request_id="rid-1")  # a retry after a lost reply
    assert (again.epoch, again.owner) == (granted.epoch, granted.owner)
    assert other.last_epoch(R) == granted.epoch
    assert waiter.release(granted)
    with pytest.raises(LeaseLost):
        other.acquire(R, ttl=10, wait=0, request_id="rid-1")


@pytest.mark.slow
def test_a_head_waiter_that_times_out_as_the_lease_is_released_never_blocks_it(
    etcd_cluster: EtcdCluster,
    tmp_path: Path,
    workers: list[Worker],
    open_coord: Callable[[str], Coordinator],
) -> None:
    """Releases land around the waiter's give-up time: whether it got the lease (and released it)
    or gave up (and its leave() released a lease handed to it), the next acquire is prompt."""
    prefix = _prefix()
    url = etcd_cluster.url(prefix=prefix)
    holder = open_coord(url)
    _etcd(holder)._watch_queue(R)
    outcomes = []
    for i in range(8):
        lease = holder.acquire(R, ttl=10, wait=10)
        waiter = Worker(
            tmp_path / f"w{i}.jsonl", "acquire", "--url", url, "--ttl", "30", "--wait", "0.6",
            "--hold", "0.01",
        )  # fmt: skip
        workers.append(waiter)
        wait_for(functools.partial(waiter.events, "ready"), timeout=10, what="the waiter")
        wait_for(lambda: _queued(etcd_cluster, prefix) == 1, what="the waiter to queue")
        give_up = waiter.events("ready")[0]["t"] + 0.6
        time.sleep(max(give_up - DEADLINE_CLOCK.now() + (i - 4) * 0.004, 0.0))
        assert holder.release(lease)
        assert waiter.process.wait(10) == 0
        outcomes.append("granted" if waiter.events("granted") else "gave up")
        started = time.monotonic()
        lease = holder.acquire(R, ttl=10, wait=5)  # a grant stuck on the leaver would take 30 s
        assert time.monotonic() - started < 3.0, outcomes
        assert holder.release(lease)
    epochs = [r.epoch for _, r in _records(etcd_cluster, prefix) if r.kind is RecordKind.GRANTED]
    assert epochs == sorted(set(epochs))


def _dead_head_scenario(
    cluster: EtcdCluster, tmp_path: Path, workers: list[Worker], holder: Coordinator, sig: int
) -> tuple[Worker, Worker, int]:
    """A holder, a head waiter (ttl 2) that gets ``sig`` just before the release, a third waiter
    behind it, which gets the lease once the head's etcd lease expired. Returns (head, third,
    the released epoch)."""
    url = holder.url
    lease = holder.acquire(R, ttl=10, wait=0)
    held = _etcd(holder)
    held._watch_queue(R)
    head = Worker(
        tmp_path / "head.jsonl", "acquire", "--url", url, "--ttl", "2", "--wait", "30",
        "--holder", "head", "--hold", "0.05",
    )  # fmt: skip
    workers.append(head)
    prefix = url.partition("prefix=")[2]
    wait_for(lambda: _queued(cluster, prefix) == 1, timeout=10, what="the head to queue")
    third = Worker(
        tmp_path / "third.jsonl", "acquire", "--url", url, "--ttl", "5", "--wait", "30",
        "--holder", "third", "--hold", "0.05",
    )  # fmt: skip
    workers.append(third)
    wait_for(lambda: _queued(cluster, prefix) == 2, timeout=10, what="the third to queue")
    wait_for(lambda: held._queue_head(R) is not None, what="the holder's view")
    os.kill(head.process.pid, sig)
    released_at = DEADLINE_CLOCK.now()
    assert holder.release(lease)  # within the head's queue-lease TTL: its key is still first
    wait_for(lambda: third.events("granted"), timeout=15, what="the third waiter")
    granted = third.events("granted")[0]
    assert granted["epoch"] == lease.epoch + 2
    assert granted["t"] - released_at < 2 + 0.5 + 1.5  # the head's etcd lease: TTL 2 s
    return head, third, lease.epoch


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_head_waiter_dead_or_stopped_at_the_release_is_handed_a_grant_that_expires(
    sig: signal.Signals,
    etcd_cluster: EtcdCluster,
    tmp_path: Path,
    workers: list[Worker],
    open_coord: Callable[[str], Coordinator],
) -> None:
    """The release hands the lease to the head, whose process nobody keeps alive any more: the
    grant expires with its etcd lease (TTL 2 s) and the next waiter gets the next epoch. A stopped
    head, continued, sees that grant ended and queues again."""
    holder = open_coord(etcd_cluster.url(prefix=_prefix()))
    head, third, epoch = _dead_head_scenario(etcd_cluster, tmp_path, workers, holder, sig)
    kinds = [(r.kind, r.epoch, r.holder) for r in holder.history(R)]
    assert [kind[:2] for kind in kinds[-4:]] == [
        (RecordKind.RELEASED, epoch),
        (RecordKind.GRANTED, epoch + 1),  # handed to the head by the release
        (RecordKind.EXPIRED, epoch + 1),  # with its etcd lease
        (RecordKind.GRANTED, epoch + 2),
    ]
    assert [kind[2] for kind in kinds[-3:]] == ["head", "head", "third"]
    if sig == signal.SIGSTOP:
        wait_for(lambda: third.events("released"), timeout=10, what="the third to release")
        os.kill(head.process.pid, signal.SIGCONT)
        wait_for(lambda: head.events("granted") or head.events("failed"), timeout=15)
        assert head.events("granted"), head.events("failed")
        assert head.events("granted")[0]["epoch"] > epoch + 2  # never the grant that expired


@pytest.mark.slow
def test_epochs_stay_unique_while_8_processes_contend_and_hand_over(
    etcd_cluster: EtcdCluster, tmp_path: Path, workers: list[Worker]
) -> None:
    prefix = _prefix()
    _contend(etcd_cluster.url(prefix=prefix, timeout=2), tmp_path, workers, 6.0)
    for worker in workers:
        assert worker.process.wait(40) == 0
    held = [(e["epoch"], e["version"]) for w in workers for e in w.events("held")]
    epochs = [epoch for epoch, _ in held]
    assert len(held) > 40
    assert len(epochs) == len(set(epochs)), "an epoch was granted twice"
    assert [e for _, e in sorted((v, e) for e, v in held)] == sorted(epochs)
    assert not [e for w in workers for e in w.events("error")]
    assert all(w.events("held") for w in workers), "a process never got the lease"
    records = _records(etcd_cluster, prefix)
    granted = [r.epoch for _, r in records if r.kind is RecordKind.GRANTED]
    assert granted == sorted(set(granted))
    assert len(_handoffs(records)) > len(held) // 2, "releases did not hand over"


# -- records: numbered per resource, ordered by etcd revision -------------------------------------


def test_changes_of_different_resources_never_conflict(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    """No key is written by every change: while another client changes other resources, a
    client's grant and release of its own resource each succeed at the first transaction."""
    url = etcd_cluster.url(prefix=_prefix())
    mine, other = open_coord(url), open_coord(url)
    mine.release(mine.acquire("a", ttl=5, wait=0))  # caches the state of "a"
    for _ in range(3):
        other.release(other.acquire("b", ttl=5, wait=0))
    requests = _count_requests(_etcd(mine))
    lease = mine.acquire("a", ttl=5, wait=0)
    assert mine.release(lease)
    assert [path for _, path, _ in requests if path == "kv/txn"] == ["kv/txn", "kv/txn"]
    kinds = [(r.resource, r.kind, r.epoch) for r in mine.history()]
    GRANTED, RELEASED = RecordKind.GRANTED, RecordKind.RELEASED
    assert kinds == [
        ("a", GRANTED, 1),
        ("a", RELEASED, 1),
        *[
            ("b", kind, epoch)
            for epoch in (1, 2, 3)
            for kind in (RecordKind.GRANTED, RecordKind.RELEASED)
        ],
        ("a", GRANTED, 2),
        ("a", RELEASED, 2),
    ]


def test_records_are_read_in_pages_that_end_inside_a_transaction(
    etcd_cluster: EtcdCluster,
    open_coord: Callable[[str], Coordinator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One advance transaction records the restore of several resources (one etcd revision);
    pages of 3 records split it, and every suffix of the history is still read whole."""
    coord = open_coord(etcd_cluster.url(prefix=_prefix()))
    for name in ("a", "b", "c", "d", "e"):
        coord.release(coord.acquire(name, ttl=5, wait=0))
    coord.backend.advance(1000, {}, {"reason": "advance"})
    whole = coord.history()
    assert [r.kind for r in whole].count(RecordKind.RESTORED) == 5
    assert len({r.seq // SEQ_PER_REVISION for r in whole if r.kind is RecordKind.RESTORED}) == 1
    seqs = [r.seq for r in whole]
    assert seqs == sorted(set(seqs))
    monkeypatch.setattr(etcd_records, "_PAGE", 3)
    assert coord.history() == whole
    for index, record in enumerate(whole):
        assert coord.history(after=record.seq) == whole[index + 1 :]
    assert coord.history("c") == [r for r in whole if r.resource == "c"]


def test_each_resource_keeps_its_newest_records(
    etcd_cluster: EtcdCluster,
    open_coord: Callable[[str], Coordinator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(etcd_records, "RECORDS_KEPT", 4)
    monkeypatch.setattr(etcd_records, "_PRUNE_EVERY", 2)
    coord = open_coord(etcd_cluster.url(prefix=_prefix()))
    coord.release(coord.acquire("b", ttl=5, wait=0))
    for _ in range(5):
        coord.release(coord.acquire("a", ttl=5, wait=0))
    kept = [(r.kind, r.epoch) for r in coord.history("a")]
    assert kept == [
        (RecordKind.GRANTED, 4),
        (RecordKind.RELEASED, 4),
        (RecordKind.GRANTED, 5),
        (RecordKind.RELEASED, 5),
    ]
    assert [(r.kind, r.epoch) for r in coord.history("b")] == [
        (RecordKind.GRANTED, 1),
        (RecordKind.RELEASED, 1),
    ]


def test_a_restore_recorded_after_a_grant_keeps_that_grant(
    etcd_cluster: EtcdCluster,
    open_coord: Callable[[str], Coordinator],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An advance records most resources after its own transaction; a resource granted in
    between keeps that grant's state, so its next epoch is still new."""
    url = etcd_cluster.url(prefix=_prefix())
    coord, other = open_coord(url), open_coord(url)
    for name in ("a", "b"):
        coord.release(coord.acquire(name, ttl=5, wait=0))
    monkeypatch.setattr(etcd_records, "_RESTORE_CHUNK", 1)  # "b" is recorded after the advance
    leases = []
    record_restored = EtcdBackend._record_restored

    def grant_first(self: EtcdBackend, *args: Any) -> None:
        leases.append(other.acquire("b", ttl=5, wait=0))
        record_restored(self, *args)

    monkeypatch.setattr(EtcdBackend, "_record_restored", grant_first)
    minimum = coord.backend.advance(100, {}, {"reason": "advance"})
    assert minimum == 100 and leases[0].epoch == 101
    current = coord.current("b")
    assert current is not None and current.epoch == 101
    assert other.release(leases[0])
    again = coord.acquire("b", ttl=5, wait=0)
    assert again.epoch == 102
    grants = [r for r in coord.history("b") if r.kind is RecordKind.GRANTED]
    assert [(r.epoch, r.detail["after"]) for r in grants] == [
        (1, "none"),
        (101, "released"),
        (102, "released"),
    ]
    assert RecordKind.RESTORED in [r.kind for r in coord.history("b")]


def test_only_a_caller_that_will_not_queue_pays_for_the_precise_remaining_time(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    """``Busy.remaining`` of ``wait=0`` asks etcd for the holder's etcd lease's time to live; a
    caller that queues (``wait`` > 0) does not need it and makes no such request."""
    url = etcd_cluster.url(prefix=_prefix())
    holder, other = open_coord(url), open_coord(url)
    held = holder.acquire(R, ttl=10, wait=0)
    requests = _count_requests(_etcd(other))
    with pytest.raises(Busy) as busy:
        other.acquire(R, ttl=10, wait=0)
    assert busy.value.epoch == held.epoch and 0 < busy.value.remaining <= 11
    assert "lease/timetolive" in [path for _, path, _ in requests]
    requests.clear()
    with pytest.raises(Busy):
        other.acquire(R, ttl=10, wait=0.3)
    assert "lease/timetolive" not in [path for _, path, _ in requests]
    assert holder.release(held)


def test_a_record_key_of_another_shape_is_a_configuration_error(
    etcd_cluster: EtcdCluster, open_coord: Callable[[str], Coordinator]
) -> None:
    """A value under ``P/log/`` that is not fenced's list of records (a list of objects
    without the fields) is a one-line ConfigurationError, not a KeyError from deep inside."""
    prefix = _prefix()
    coord = open_coord(etcd_cluster.url(prefix=prefix))
    coord.release(coord.acquire(R, ttl=5, wait=0))
    raw = _raw(etcd_cluster)
    try:
        raw.call(
            "kv/put",
            {"key": b64(f"{prefix}/log/other:{'9' * 20}"), "value": b64('[{"kind": "granted"}]')},
            mutating=True,
        )
    finally:
        raw.close()
    with pytest.raises(ConfigurationError, match="unreadable records in etcd"):
        coord.history()
    assert [r.kind for r in coord.history(R)] == [RecordKind.GRANTED, RecordKind.RELEASED]

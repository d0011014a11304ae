"""``fenced serve`` as a real process under real faults: SIGTERM, kill -9 and a restart, two
servers of one coordinator, a client cut off by a TCP proxy. Clients are the ``http://``
backend in this process; the servers are ``python -m fenced serve`` children stopped by PID."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import fenced
from fenced import Busy, LeaseLost, LeaseState, StaleToken
from fenced.core._records import RecordKind
from fenced.testing.conformance import wait_for
from fenced.testing.etcd import free_ports
from fenced.testing.postgres import PostgresServer
from fenced.testing.proxy import TcpProxy
from fenced.testing.server import ServeProcess

R = "jobs/nightly"


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'fenced.db'}"


@pytest.fixture
def port() -> int:
    return free_ports(1)[0]


@pytest.fixture
def processes() -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for process in started:
        process.kill()


@pytest.fixture(autouse=True)
def _close_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every coordinator a test connects is closed after it (their connection pools)."""
    opened: list[fenced.Coordinator] = []
    real = fenced.connect

    def connect(url: str) -> fenced.Coordinator:
        coordinator = real(url)
        opened.append(coordinator)
        return coordinator

    monkeypatch.setattr(fenced, "connect", connect)
    yield
    for coordinator in opened:
        coordinator.close()


def _serve(processes: list[ServeProcess], url: str, port: int, *extra: str) -> ServeProcess:
    process = ServeProcess(url, "--listen", f"127.0.0.1:{port}", "--poll", "1", *extra).start()
    processes.append(process)
    return process


def _granted_epochs(coordinator: fenced.Coordinator, resource: str) -> list[int]:
    return [r.epoch for r in coordinator.history(resource) if r.kind is RecordKind.GRANTED]


def test_sigterm_answers_waiters_and_exits_0(
    db: str, port: int, processes: list[ServeProcess]
) -> None:
    """SIGTERM: a long-polling waiter is answered at once (it keeps waiting, not failing), the
    process exits 0 within its grace, and the holder's lease is untouched by the stop."""
    server = _serve(processes, db, port)
    holder = fenced.connect(server.url)
    waiter = fenced.connect(server.url + "?timeout=1")
    lease = holder.acquire(R, ttl=30, wait=0)
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(_acquire(waiter, wait=8)), daemon=True)
    thread.start()
    _wait_for_a_long_poll(server)
    started = time.monotonic()
    assert server.terminate(timeout=15) == 0
    assert time.monotonic() - started < 5
    assert outcome == []  # the waiter did not fail: it waits for a server
    restarted = _serve(processes, db, port)
    assert fenced.connect(restarted.url).current(R) is not None  # the lease outlived the stop
    assert holder.release(lease)
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], fenced.Lease)
    assert outcome[0].epoch == lease.epoch + 1
    waiter.release(outcome[0])


def _wait_for_a_long_poll(server: ServeProcess) -> None:
    """Until a request waits on the server (its ``fenced_serve_waiting`` gauge)."""

    def waiting() -> bool:
        return "fenced_serve_waiting 1.0" in httpx.get(server.url + "/metrics").text

    wait_for(waiting, timeout=5, what="a long poll on the server")


def _acquire(coordinator: fenced.Coordinator, wait: float) -> fenced.Lease | Exception:
    try:
        return coordinator.acquire(R, ttl=30, wait=wait)
    except Exception as error:  # reported to the test
        return error


def test_kill_9_then_restart_holder_goes_uncertain_then_held_and_no_epoch_twice(
    db: str, port: int, processes: list[ServeProcess]
) -> None:
    """kill -9 of the server while a client holds and another waits: the holder goes UNCERTAIN,
    then HELD again once a new server runs on the same backend; the waiter keeps waiting
    through the outage and gets the next epoch when the holder releases; no epoch twice.

    The ttl outlasts the outage: a new server process takes seconds to start on a loaded CI
    machine (with a 2 s ttl, one run's lease reached its deadline before the server was up)."""
    server = _serve(processes, db, port)
    coordinator = fenced.connect(server.url + "?timeout=0.5")
    waiter = fenced.connect(server.url + "?timeout=0.5")
    outcome: list[object] = []
    with coordinator.hold(R, ttl=10.0, wait=0) as held:
        first = held.lease.epoch
        thread = threading.Thread(
            target=lambda: outcome.append(_acquire(waiter, wait=40)), daemon=True
        )
        thread.start()
        _wait_for_a_long_poll(server)
        server.kill()
        wait_for(lambda: held.state is LeaseState.UNCERTAIN, timeout=10, what="UNCERTAIN")
        _serve(processes, db, port)
        assert held.state is not LeaseState.LOST, "the server restarted after the lease's end"
        wait_for(lambda: held.state is LeaseState.HELD, timeout=10, what="HELD again")
        assert held.lease.epoch == first
        assert outcome == []  # still waiting: the lease is held
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], fenced.Lease), outcome
    assert outcome[0].epoch == first + 1
    waiter.release(outcome[0])
    epochs = _granted_epochs(coordinator, R)
    assert epochs == sorted(set(epochs)) == [first, first + 1]


def test_kill_9_without_restart_loses_the_lease_at_its_deadline(
    db: str, port: int, processes: list[ServeProcess]
) -> None:
    server = _serve(processes, db, port)
    coordinator = fenced.connect(server.url + "?timeout=0.3")
    with pytest.raises(LeaseLost), coordinator.hold(R, ttl=1.0, wait=0) as held:
        server.kill()
        wait_for(lambda: held.state is LeaseState.UNCERTAIN, timeout=2, what="UNCERTAIN")
        assert held.lost.wait(2)
        assert held.state is LeaseState.LOST
    successor = fenced.connect(_serve(processes, db, port).url)
    lease = successor.acquire(R, ttl=5, wait=3)  # the lost lease expires on the coordinator too
    assert lease.epoch == 2 and _granted_epochs(successor, R) == [1, 2]


def test_two_servers_of_one_postgres_coordinator_clients_fail_over(
    postgres_server: PostgresServer, processes: list[ServeProcess]
) -> None:
    url = postgres_server.url("postgres", schema=f"s{time.monotonic_ns() % 10**12}")
    one, two = free_ports(2)
    first, second = _serve(processes, url, one), _serve(processes, url, two)
    both = f"http://127.0.0.1:{one},127.0.0.1:{two}?timeout=0.5"
    holder, rival = fenced.connect(both), fenced.connect(both)
    assert holder.coordinator_id == fenced.connect(second.url).coordinator_id
    with holder.hold(R, ttl=3.0, wait=0) as held:
        first.kill()
        before = held.deadline
        wait_for(lambda: held.deadline > before + 0.5, timeout=3, what="a renewal via two")
        assert held.state is LeaseState.HELD
        with pytest.raises(Busy):
            rival.acquire(R, ttl=3.0, wait=0)  # one holder, whichever server is asked
        epoch = held.lease.epoch
    lease = rival.acquire(R, ttl=3.0, wait=0)
    assert lease.epoch == epoch + 1
    rival.release(lease)


def test_a_client_cut_off_by_a_proxy_goes_lost_and_its_late_write_is_rejected(
    db: str, port: int, processes: list[ServeProcess], tmp_path: Path
) -> None:
    """A holder whose connection to the server stops forwarding goes UNCERTAIN, then LOST at
    its deadline; the successor takes the next epoch and installs it at the gateway's store;
    when the old holder's connection comes back, its late write through the gateway is
    rejected (StaleToken) and the successor's value stays."""
    server = _serve(processes, db, port, "--store", f"main=sqlite:///{tmp_path / 'store.db'}")
    proxy = TcpProxy("127.0.0.1", port).start()
    try:
        cut_url = f"http://127.0.0.1:{proxy.port}"
        cut = fenced.connect(cut_url + "?timeout=0.3")
        successor = fenced.connect(server.url)
        with (
            fenced.open_store(cut_url + "/stores/main?timeout=0.3") as cut_store,
            fenced.open_store(server.url + "/stores/main") as store,
        ):
            with pytest.raises(LeaseLost), cut.hold(R, ttl=1.2, wait=0, fence=[cut_store]) as held:
                cut_store.put(held.token, "report", b"from the first holder")
                proxy.blackhole()
                wait_for(lambda: held.state is LeaseState.UNCERTAIN, timeout=2, what="UNCERTAIN")
                assert held.lost.wait(2.5)
            with successor.hold(R, ttl=5, wait=3, fence=[store]) as second:
                assert second.epoch == held.epoch + 1
                store.put(second.token, "report", b"from the successor")
                proxy.forward()
                with pytest.raises(StaleToken):
                    cut_store.put(held.token, "report", b"late write of the first holder")
            item = store.get(R, "report")
            assert item is not None and item.value == b"from the successor"
    finally:
        proxy.stop()

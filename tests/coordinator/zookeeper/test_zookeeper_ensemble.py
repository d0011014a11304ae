"""The throwaway ZooKeeper ensemble (:mod:`fenced.testing.zookeeper`), checked with kazoo: one
leader, writes seen through every member, a new leader after the old one is killed, a killed
member serving again after a restart, chroots that isolate, pausing, and a stop that leaves no
process and no directory.

Tests that kill, pause or restart members start an ensemble of their own; the others use the
session's (``zk_ensemble``). Every wait polls with a deadline.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.retry import KazooRetry

from fenced.testing.netlab import NetLab, unavailable
from fenced.testing.zookeeper import ZooKeeperEnsemble


@contextmanager
def _client(hosts: str) -> Iterator[Any]:
    """A started kazoo client of ``hosts`` (a connect string, with a chroot or not)."""
    client = KazooClient(hosts=hosts, timeout=10.0)
    try:
        client.start(timeout=10)
        yield client
    finally:
        client.stop()
        client.close()


def _retry(call: Any, *args: Any) -> Any:
    """``call(*args)``, again after a lost connection, for up to 10 s (it must be idempotent)."""
    return KazooRetry(max_tries=-1, delay=0.05, max_delay=0.2, deadline=10)(call, *args)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_three_members_elect_exactly_one_leader(zk_ensemble: ZooKeeperEnsemble) -> None:
    modes = [zk_ensemble.mode(i) for i in zk_ensemble.members]
    assert sorted(str(mode) for mode in modes) == ["follower", "follower", "leader"]
    assert modes[zk_ensemble.leader()] == "leader"
    assert zk_ensemble.members == [0, 1, 2]
    assert len({zk_ensemble.client_port(i) for i in zk_ensemble.members}) == 3


def test_a_write_through_one_member_is_read_through_another(
    zk_ensemble: ZooKeeperEnsemble, zk_url: str
) -> None:
    chroot = "/" + zk_url.split("/", 3)[3]
    one, other = (zk_ensemble.member(i).endpoint + chroot for i in (0, 1))
    with _client(one) as writer, _client(other) as reader:
        writer.create("/key", b"written through member 0")
        reader.sync("/key")  # the reader's member has caught up with the leader
        assert reader.get("/key")[0] == b"written through member 0"


def test_a_chroot_url_isolates(zk_ensemble: ZooKeeperEnsemble, zk_url: str) -> None:
    assert zk_url.startswith("zk://" + zk_ensemble.connect_string() + "/t-")
    chroot, other = "/" + zk_url.split("/", 3)[3], f"/t-{secrets.token_hex(6)}"
    with _client(zk_ensemble.connect_string()) as root:
        root.create(other)
        with (
            _client(zk_url.removeprefix("zk://")) as mine,
            _client(zk_ensemble.connect_string(chroot=other)) as theirs,
        ):
            mine.create("/key", b"mine")
            theirs.create("/key", b"theirs")
            assert mine.get("/key")[0] == b"mine"
            assert theirs.get("/key")[0] == b"theirs"
            assert mine.get_children("/") == ["key"]
        assert root.get(chroot + "/key")[0] == b"mine"
        assert root.get(other + "/key")[0] == b"theirs"


def test_killing_the_leader_elects_a_new_one_and_a_restart_serves_again() -> None:
    with ZooKeeperEnsemble(3) as ensemble, _client(ensemble.connect_string()) as client:
        client.create("/key", b"before")
        old = ensemble.leader()
        old_pid = ensemble.pid(old)
        assert old_pid is not None
        ensemble.kill(old)
        assert _gone(old_pid)
        assert ensemble.mode(old) is None
        new = ensemble.leader(timeout=10)
        assert new != old
        assert [ensemble.mode(i) for i in ensemble.members].count("leader") == 1
        _retry(client.set, "/key", b"after")  # the session survives the failover
        ensemble.restart(old)
        assert ensemble.mode(old) == "follower"
        assert ensemble.pid(old) not in (None, old_pid)
        with _client(ensemble.member(old).endpoint) as through_old:
            through_old.sync("/key")
            assert through_old.get("/key")[0] == b"after"


def test_a_paused_member_answers_nothing_until_resumed() -> None:
    with ZooKeeperEnsemble(3) as ensemble:
        follower = next(i for i in ensemble.members if i != ensemble.leader())
        ensemble.pause(follower)
        assert ensemble.running(follower)
        assert ensemble.mode(follower, timeout=0.3) is None
        ensemble.resume(follower)
        ensemble.wait_ready(10, members=[follower])
        assert ensemble.mode(follower) == "follower"


def test_stop_leaves_no_process_and_no_directory() -> None:
    ensemble = ZooKeeperEnsemble(3).start()
    pids = [ensemble.pid(i) for i in ensemble.members]
    assert None not in pids
    ensemble.pause(0)  # a stopped process is killed too
    directory = ensemble.directory
    assert (directory / "m1" / "data" / "myid").read_text().strip() == "1"
    ensemble.stop()
    assert all(_gone(pid) for pid in pids if pid is not None)
    assert not directory.exists()
    ensemble.stop()  # idempotent


def test_one_member_is_a_standalone_server() -> None:
    with ZooKeeperEnsemble(1) as ensemble, _client(ensemble.connect_string()) as client:
        assert ensemble.mode(0) == "standalone"
        assert ensemble.leader() == 0
        client.create("/key", b"alone")
        assert client.get("/key")[0] == b"alone"
        assert "Mode: standalone" in str(ensemble.four_letter(0, "srvr"))
        assert str(ensemble.four_letter(0, "ruok")) == "imok"


def test_a_member_that_cannot_start_fails_the_start_with_its_log() -> None:
    ensemble = ZooKeeperEnsemble(3)
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("127.0.0.1", ensemble.client_port(1)))
    taken.listen()
    try:
        with pytest.raises(RuntimeError, match="member m2 exited") as raised, ensemble:
            pass
    finally:
        taken.close()
    assert "Address already in use" in str(raised.value)
    assert not ensemble.directory.exists()  # the failed start was stopped
    assert all(not ensemble.running(i) for i in ensemble.members)


def test_bad_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="at least one member"):
        ZooKeeperEnsemble(0)
    with pytest.raises(ValueError, match="tick_ms"):
        ZooKeeperEnsemble(3, tick_ms=0)
    with pytest.raises(ValueError, match="min_session_ms"):
        ZooKeeperEnsemble(3, min_session_ms=5000, max_session_ms=4000)
    with pytest.raises(ValueError, match="one"):
        ZooKeeperEnsemble(3, hosts=[("10.0.0.1", None)])


def test_urls_name_every_member(zk_ensemble: ZooKeeperEnsemble) -> None:
    endpoints = [f"127.0.0.1:{zk_ensemble.client_port(i)}" for i in zk_ensemble.members]
    assert zk_ensemble.connect_string() == ",".join(endpoints)
    assert zk_ensemble.url("/a/b") == "zk://" + ",".join(endpoints) + "/a/b"
    assert zk_ensemble.url("/a", timeout=2, session_timeout=None) == (
        "zk://" + ",".join(endpoints) + "/a?timeout=2"
    )
    with pytest.raises(ValueError, match="absolute"):
        zk_ensemble.url("relative")
    with pytest.raises(IndexError):
        zk_ensemble.client_port(3)


def test_members_in_network_namespaces_elect_a_leader() -> None:
    why = unavailable()
    if why is not None:
        pytest.fail(f"the lab cannot be built: {why} (run the test suite as root, as CI does)")
    with NetLab(hosts=3) as lab:
        hosts = [(lab.host_address(h), lab.namespace(h)) for h in (1, 2, 3)]
        with ZooKeeperEnsemble(3, hosts=hosts) as ensemble:
            assert ensemble.connect_string().startswith(f"{lab.host_address(1)}:2181,")
            old = ensemble.leader()
            ensemble.kill(old)
            assert ensemble.leader(timeout=10) != old  # leader() waits for one
            ensemble.restart(old)
            assert ensemble.mode(old) == "follower"

"""Real network partitions against networked backends (:mod:`fenced.testing.netlab`).

Worker A runs inside a lab host and reaches the coordinator and the store through the lab's
relays; the test cuts it with nftables rules in its namespace, which TCP sees as silence, as a
partition looks. Worker B is the successor, on this machine's loopback. Per networked backend
(the PostgreSQL, etcd and ZooKeeper coordinators; the PostgreSQL and S3 stores; ``fenced serve``,
coordinator and stores over HTTP):

* A is cut from the coordinator (not from the store) past its ttl; B acquires, fences and
  writes; A's late write, which still reaches the store, is rejected (StaleToken), and the store
  keeps B's value and records the rejection;
* A is cut from the store after its write reached it and before the reply came back; after the
  heal, its retry with the same op id learns the first outcome, and the write applied once.

Root only (CI runs as root); a test fails, never skips, without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import fenced
from fenced.testing.conformance import wait_for
from fenced.testing.etcd import EtcdCluster
from fenced.testing.netlab import NetLab, unavailable
from fenced.testing.postgres import PostgresServer
from fenced.testing.rgw import RgwServer
from fenced.testing.server import ServeProcess
from fenced.testing.zookeeper import ZooKeeperEnsemble
from support.s3_stores import s3_bucket, s3_url

WORKER = str(Path(__file__).resolve().parents[1] / "support" / "partition_worker.py")
SRC = str(Path(__file__).resolve().parents[2] / "src")
R = "partitions/export"

__all__ = ["s3_bucket", "s3_url"]  # fixtures from support.s3_stores, used here


@pytest.fixture(autouse=True)
def _root() -> None:
    why = unavailable()
    if why is not None:
        pytest.fail(f"the lab cannot be built: {why} (run the test suite as root, as CI does)")


class Worker:
    """The worker process inside a lab host (tests/support/partition_worker.py)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        assert line, f"the worker exited: {self.process.poll()}"
        answer: dict[str, Any] = json.loads(line)
        return answer


@contextmanager
def worker(
    lab: NetLab, host: int, coordinator: str, store: str, env: dict[str, str] | None = None
) -> Iterator[Worker]:
    argv = lab.command(host, [sys.executable, WORKER, coordinator, store])
    with subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin", **(env or {})},
    ) as process:
        try:
            assert process.stdout is not None
            assert json.loads(process.stdout.readline()) == {"ready": True}
            yield Worker(process)
        finally:
            process.kill()


def _through(lab: NetLab, url: str, server: str, port: int) -> str:
    """``url`` with the loopback address of ``port`` replaced by the lab's relay of ``server``."""
    host, relay = lab.address(server)
    return url.replace(f"127.0.0.1:{port}", f"{host}:{relay}")


def _cut_from_the_coordinator_past_its_ttl(
    lab: NetLab, coordinator_inside: str, coordinator: str, store_inside: str, store: str
) -> None:
    """The first scenario (module docstring), on any coordinator and store."""
    with worker(lab, 1, coordinator_inside, store_inside) as a:
        first = a.ask(op="acquire", resource=R, ttl=1)
        assert "epoch" in first, first
        assert a.ask(op="fence") == {"floor": first["epoch"]}
        assert a.ask(op="put", key="k", value="by A")["version"] == 1
        lab.cut(1, "coordinator")
        renewed = a.ask(op="renew")  # silence: the renewal fails, it never succeeds
        assert "error" in renewed, renewed
        with fenced.connect(coordinator) as coord, fenced.open_store(store) as direct:
            successor = coord.acquire(R, 5, 20)  # once A's lease expired
            assert successor.epoch == first["epoch"] + 1
            direct.fence(successor.token)
            direct.put(successor.token, "k", b"by B")
            late = a.ask(op="put", key="k", value="late by A")  # A still reaches the store
            assert late["error"] == "StaleToken", late
            item = direct.get(R, "k")
            assert item is not None and item.value == b"by B" and item.epoch == successor.epoch
            rejected = [r for r in direct.history(R) if r.kind.value == "rejected"]
            assert [(r.epoch, r.detail["reason"]) for r in rejected] == [(first["epoch"], "stale")]
            coord.release(successor)


def _cut_from_the_store_after_the_write(
    lab: NetLab,
    coordinator_inside: str,
    store_inside: str,
    store: str,
    env: dict[str, str] | None = None,
    *,
    delay: float = 1.0,
) -> None:
    """The second scenario (module docstring); ``delay``: of every reply, shorter than the
    worker's timeout (the write must apply while its reply is late)."""
    with (
        worker(lab, 1, coordinator_inside, store_inside, env) as a,
        fenced.open_store(store) as direct,
    ):
        assert "epoch" in a.ask(op="acquire", resource=R, ttl=30)
        a.ask(op="fence")
        assert a.ask(op="put", key="k", value="v0")["version"] == 1
        relay = lab.relay("store")
        relay.delay(delay)  # every reply is late: the commit's too, after the write applied
        assert a.process.stdin is not None
        a.process.stdin.write(json.dumps({"op": "put", "key": "k", "value": "v", "op_id": "x"}))
        a.process.stdin.write("\n")
        a.process.stdin.flush()
        wait_for(lambda: _version(direct) == 2, 20, "the write to apply")
        lab.cut(1, "store")  # and then the partition: the reply never comes
        relay.cut()
        assert a.process.stdout is not None
        lost = json.loads(a.process.stdout.readline())
        assert lost.get("error") in ("OutcomeUnknown", "Unavailable"), lost
        lab.heal(1)
        relay.forward()
        again = a.ask(op="put", key="k", value="v", op_id="x")
        assert again.get("version") == 2, again  # the first outcome, learned
        assert _version(direct) == 2  # applied once


def _version(store: fenced.Store) -> int | None:
    item = store.get(R, "k")
    return None if item is None else item.version


@pytest.fixture
def postgres_urls(postgres_server: PostgresServer) -> tuple[str, str]:
    name = uuid.uuid4().hex[:10]
    coordinator = postgres_server.url("postgres", schema=f"c_{name}", timeout="2")
    store = postgres_server.url("postgres", schema=f"s_{name}", timeout="8")
    return coordinator, store


def test_postgres_a_worker_cut_from_the_coordinator_past_its_ttl_is_rejected_late(
    postgres_server: PostgresServer, postgres_urls: tuple[str, str]
) -> None:
    coordinator, store = postgres_urls
    port = postgres_server.port
    servers = {"coordinator": ("127.0.0.1", port), "store": ("127.0.0.1", port)}
    with NetLab(1, servers) as lab:
        _cut_from_the_coordinator_past_its_ttl(
            lab,
            _through(lab, coordinator, "coordinator", port),
            coordinator,
            _through(lab, store, "store", port),
            store,
        )


def test_postgres_a_worker_cut_from_the_store_learns_its_first_outcome_by_op_id(
    postgres_server: PostgresServer, postgres_urls: tuple[str, str]
) -> None:
    coordinator, store = postgres_urls
    port = postgres_server.port
    servers = {"coordinator": ("127.0.0.1", port), "store": ("127.0.0.1", port)}
    with NetLab(1, servers) as lab:
        _cut_from_the_store_after_the_write(
            lab,
            _through(lab, coordinator, "coordinator", port),
            _through(lab, store, "store", port),
            store,
        )


def test_etcd_a_worker_cut_from_the_coordinator_past_its_ttl_is_rejected_late(
    etcd_cluster: EtcdCluster, postgres_urls: tuple[str, str], postgres_server: PostgresServer
) -> None:
    member = etcd_cluster.members[0]
    prefix = f"/partitions-{uuid.uuid4().hex[:8]}"
    coordinator = f"etcd://127.0.0.1:{member.client_port}?prefix={prefix}"  # one member: one relay
    store = postgres_urls[1]
    port = postgres_server.port
    servers = {"coordinator": ("127.0.0.1", member.client_port), "store": ("127.0.0.1", port)}
    with NetLab(1, servers) as lab:
        _cut_from_the_coordinator_past_its_ttl(
            lab,
            _through(lab, coordinator, "coordinator", member.client_port),
            coordinator,
            _through(lab, store, "store", port),
            store,
        )


def test_s3_a_worker_cut_from_the_store_learns_its_first_outcome_by_op_id(
    postgres_server: PostgresServer,
    postgres_urls: tuple[str, str],
    rgw_server: RgwServer,
    s3_url: str,
) -> None:
    coordinator = postgres_urls[0]
    servers = {
        "coordinator": ("127.0.0.1", postgres_server.port),
        "store": ("127.0.0.1", rgw_server.port),
    }
    with NetLab(1, servers) as lab:
        _cut_from_the_store_after_the_write(
            lab,
            _through(lab, coordinator, "coordinator", postgres_server.port),
            _through(lab, s3_url + "&timeout=1", "store", rgw_server.port),
            s3_url,
            rgw_server.environment(),
            delay=0.4,
        )


def test_zookeeper_a_worker_cut_from_the_coordinator_past_its_ttl_is_rejected_late(
    zk_ensemble: ZooKeeperEnsemble,
    zk_url: str,
    postgres_urls: tuple[str, str],
    postgres_server: PostgresServer,
) -> None:
    chroot = zk_url.removeprefix("zk://").partition("/")[2]
    port = zk_ensemble.client_port(0)
    options = "?session_timeout=2&timeout=2"
    inside = f"zk://127.0.0.1:{port}/{chroot}{options}"  # one member: one relay
    store = postgres_urls[1]
    servers = {"coordinator": ("127.0.0.1", port), "store": ("127.0.0.1", postgres_server.port)}
    with NetLab(1, servers) as lab:
        _cut_from_the_coordinator_past_its_ttl(
            lab,
            _through(lab, inside, "coordinator", port),
            f"{zk_url}{options}",
            _through(lab, store, "store", postgres_server.port),
            store,
        )


def test_serve_a_worker_cut_from_the_served_store_learns_its_first_outcome_by_op_id(
    tmp_path: Path,
) -> None:
    served = f"main=sqlite:///{tmp_path / 'store.db'}"
    with ServeProcess(f"sqlite:///{tmp_path / 'fenced.db'}", "--store", served) as server:
        port = int(server.url.rpartition(":")[2])
        store = f"{server.url}/stores/main"
        servers = {"coordinator": ("127.0.0.1", port), "store": ("127.0.0.1", port)}
        with NetLab(1, servers) as lab:
            _cut_from_the_store_after_the_write(
                lab,
                _through(lab, server.url, "coordinator", port),
                _through(lab, store + "?timeout=3", "store", port),
                store,
            )

"""Member faults: kills and isolation of the members of an etcd cluster that verify started.

Verify never kills, restarts or cuts off a server it did not start. :class:`ManagedEtcd` is the
3-member etcd cluster verify starts itself (the release check does, and the tests): each member
runs in a host of a private network lab (:class:`~fenced.testing.netlab.NetLab`, root only),
listens on its lab address, and talks to its peers over the lab's bridge; a relay on this
machine's loopback carries client connections into each member's namespace
(:meth:`NetLab.expose <fenced.testing.netlab.NetLab.expose>`), so to the workers, their proxies
and their partitions the cluster is three servers on loopback, as a user-given one would be.
Without root (no lab) the members run on loopback and only kills are possible.

Two kinds of member fault, always real:

* ``member-kill``: SIGKILL of a member's process (by PID), restarted later on the same data
  directory (``--initial-cluster-state existing``). Killing the leader makes the others elect a
  new one; killing a follower leaves the cluster writable with two members.
* ``member-isolate``: nftables rules in the member's namespace drop every packet between it and
  its peers (both ways) while clients still reach it. An isolated follower is the minority
  side: the clients connected to it stall, then get "no leader"; the majority keeps (or elects)
  a leader. An isolated leader steps down (check-quorum) and the majority elects a new one.

The victim is the leader or a follower, as the nemesis asks. The faults of the whole cluster go
through one :class:`MemberFaults` service in the process that started it (schedules of ``--jobs``
run in processes of their own and share the cluster): one fault at a time, and none until the
cluster agrees on a leader and :data:`SETTLE` seconds have passed since the last heal. That
bounds what a leader change does to leases: a new etcd leader restarts the countdown of every
lease it has (one election timeout plus the lease's TTL, from when it takes over), including
leases whose holder stopped renewing at the old leader; the checker is told how much longer a
lease may live (:meth:`MemberControl.failover`). A fault the nemesis does not heal (its process
died) is healed by the service :data:`GRACE` seconds after its planned end;
:meth:`ManagedEtcd.stop` stops every member by PID, then deletes the lab.

The service listens on a Unix socket in the cluster's own temporary directory (mode 0700); a
:class:`MemberControl` (picklable: a path) is what the nemesis of any schedule process uses.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fenced.core._clock import SystemClock
from fenced.testing._lifecycle import StartStop
from fenced.testing.etcd import EtcdCluster, EtcdMember
from fenced.testing.netlab import NetLab, unavailable
from fenced.testing.proxy import TcpProxy
from fenced.verify._recorder import Event

__all__ = [
    "GRACE",
    "MEMBER_FAULTS",
    "MEMBER_HEALS",
    "SETTLE",
    "ManagedEtcd",
    "MemberControl",
    "MemberFaults",
    "count_member_faults",
]

MEMBER_FAULTS = ("member-kill", "member-isolate")
"""The kinds of member fault (history events and fault counts)."""
MEMBER_HEALS = {"member-kill": "member-restart", "member-isolate": "member-heal"}
"""The event recorded when a member fault ends."""
SETTLE = 4.0
"""Seconds after a member fault is healed before the next one may strike (and then only once
every member agrees on one leader): the leases a leader change restarted have run out."""
GRACE = 5.0
"""Seconds after its planned end a member fault is healed by the service itself."""
ELECTION_ROUNDS = 4
"""Election timeouts a new leader may take to be elected after a fault (two rounds of the
randomized timeout, which lies between one and two election timeouts)."""
PRE_VOTE = ("--pre-vote",)
"""Members run with Raft's pre-vote (etcd 3.5's default): a member that comes back from an
isolation or a restart does not depose the leader, so each member fault changes the leader at
most once (killing or isolating the leader), which is what :meth:`MemberControl.failover`
allows for."""
_PROBE_TIMEOUT = 0.5


@dataclass(frozen=True)
class MemberControl:
    """How a nemesis (in any process of this host) asks for member faults: the path of the
    service's socket; the election timeout; why members cannot be isolated (None: they can)."""

    address: str
    election: float
    no_isolation: str | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        """The member faults possible here."""
        return MEMBER_FAULTS if self.no_isolation is None else MEMBER_FAULTS[:1]

    def describe(self) -> str:
        faults = "kills (SIGKILL, restarted on the same data directory)"
        if self.no_isolation is None:
            return (
                f"member faults on verify's own etcd cluster: {faults} and isolation of a "
                "member from its peers (nftables), of the leader or a follower"
            )
        return (
            f"member faults on verify's own etcd cluster: {faults} of the leader or a "
            f"follower; no isolation ({self.no_isolation})"
        )

    def failover(self, etcd_ttl: float) -> float:
        """How much longer a lease of ``etcd_ttl`` seconds may live when a member fault changes
        the leader: the time an election may take, then the new leader's restarted countdown
        (one election timeout + the TTL) and its 500 ms expiry tick."""
        return ELECTION_ROUNDS * self.election + self.election + etcd_ttl + 0.5

    def strike(
        self, kind: str, *, leader: bool, pick: float, length: float, by: str
    ) -> dict[str, Any]:
        """Ask for a fault of ``kind`` on the leader (``leader``) or a follower (chosen by
        ``pick`` in [0, 1)), healed by the service ``length`` + :data:`GRACE` seconds from now
        unless :meth:`heal` comes first; ``by`` names the schedule asking. The fault (``id``,
        ``member``, ``role``, ``pid``) once it is in place, or ``{"refused": why}`` (another
        fault, settling, no agreed leader)."""
        return self._ask(op="strike", kind=kind, leader=leader, pick=pick, length=length, by=by)

    def elsewhere(self, since: float, by: str) -> list[dict[str, Any]]:
        """The faults not made by ``by`` that were in place at some time from ``since`` (the
        recorder's clock) until now: ``kind``, ``member``, ``role``, ``t`` (in place) and
        ``healed`` (None: still in place). Schedules running at the same time share the cluster:
        each records the others' faults too (``elsewhere``), as they explain its delays."""
        faults = self._ask(op="elsewhere", since=since, by=by).get("faults")
        return list(faults) if isinstance(faults, list) else []

    def heal(self, fault: int) -> dict[str, Any]:
        """End fault ``fault`` (restart the member, remove the rules); ``{"healed": False}`` if
        it already ended."""
        return self._ask(op="heal", fault=fault)

    def _ask(self, **request: Any) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(30)
            connection.connect(self.address)
            connection.sendall(json.dumps(request).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = connection.recv(4096)
                if not chunk:
                    raise ConnectionError("the member-fault service closed the connection")
                reply += chunk
        answer = json.loads(reply)
        if not isinstance(answer, dict):
            raise ConnectionError(f"the member-fault service answered {answer!r}")
        if "error" in answer:
            raise RuntimeError(f"member fault: {answer['error']}")
        return answer


def count_member_faults(events: Iterable[Event], stats: Counter[str]) -> None:
    """Count the member faults of a history into a report's ``stats`` (``fault member-kill``,
    ``fault member-isolate``, and ``faults``); a count already there is not counted twice, nor
    a fault another schedule made (``elsewhere``: counted there)."""
    made = Counter(
        str(event["ev"])
        for event in events
        if event["ev"] in MEMBER_FAULTS and not event.get("elsewhere")
    )
    for kind, count in made.items():
        counted = stats[f"fault {kind}"]
        if count > counted:
            stats["faults"] += count - counted
            stats[f"fault {kind}"] = count


@dataclass
class _Fault:
    id: int
    kind: str
    member: EtcdMember
    role: str
    until: float


class MemberFaults:
    """The member-fault service of one cluster (see the module docstring): it alone kills,
    restarts, isolates and heals members, on requests from :class:`MemberControl`."""

    def __init__(
        self,
        cluster: EtcdCluster,
        probes: list[tuple[str, int]],
        lab: NetLab | None,
        address: Path,
    ) -> None:
        self.cluster = cluster
        self.probes = dict(zip((m.name for m in cluster.members), probes, strict=True))
        """Per member: where this process reaches its client port."""
        self.lab = lab
        self.address = address
        self._lock = threading.Lock()
        self._fault: _Fault | None = None
        self._settled = 0.0
        self._ids = 0
        self._stopped = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self.log: list[dict[str, Any]] = []
        """Every fault made, with who asked and when (the recorder's clock) it was in place and
        healed."""
        self._clock = SystemClock()

    def start(self) -> MemberFaults:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.address))
        listener.listen(16)
        listener.settimeout(0.2)
        self._listener = listener
        for target, name in ((self._serve, "serve"), (self._watch, "watch")):
            thread = threading.Thread(target=target, name=f"fenced-members-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop serving (a fault still in place stays: the cluster is stopped next). Idempotent."""
        self._stopped.set()
        for thread in self._threads:
            thread.join(5)
        self._threads.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(OSError):
                self.address.unlink()

    # -- requests ---------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stopped.is_set():
            listener = self._listener
            if listener is None:
                return
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with connection, connection.makefile("rb") as stream:
                connection.settimeout(10)
                with contextlib.suppress(OSError, ValueError):
                    request = json.loads(stream.readline())
                    connection.sendall(json.dumps(self.handle(request)).encode() + b"\n")

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request of a :class:`MemberControl`."""
        try:
            with self._lock:
                if request.get("op") == "strike":
                    return self._strike(
                        str(request["kind"]),
                        bool(request["leader"]),
                        float(request["pick"]),
                        float(request["length"]),
                        str(request.get("by", "")),
                    )
                if request.get("op") == "elsewhere":
                    since, by = float(request["since"]), str(request["by"])
                    return {
                        "faults": [
                            entry
                            for entry in self.log
                            if entry["by"] != by
                            and (entry["healed"] is None or entry["healed"] >= since)
                        ]
                    }
                if request.get("op") == "heal":
                    fault = self._fault
                    if fault is None or fault.id != int(request["fault"]):
                        return {"healed": False}
                    return {"healed": True, **self._end()}
        except (KeyError, TypeError, ValueError, RuntimeError, OSError) as error:
            return {"error": repr(error)}
        return {"error": f"unknown request {request!r}"}

    def _strike(
        self, kind: str, leader: bool, pick: float, length: float, by: str
    ) -> dict[str, Any]:
        if kind not in MEMBER_FAULTS:
            raise ValueError(f"no member fault {kind!r}")
        if kind == "member-isolate" and self.lab is None:
            return {"refused": "members cannot be isolated here"}
        if self._fault is not None:
            return {"refused": f"{self._fault.kind} of {self._fault.member.name} in place"}
        if time.monotonic() < self._settled:
            return {"refused": "the cluster is settling after the last fault"}
        chief = self.agreed_leader()
        if chief is None:
            return {"refused": "the members do not agree on a leader"}
        followers = [m for m in self.cluster.members if m is not chief]
        victim = chief if leader else followers[min(int(pick * len(followers)), len(followers) - 1)]
        pid = victim.pid
        if kind == "member-kill":
            self.cluster.kill(victim)
        else:
            assert self.lab is not None
            host = self._host(victim)
            others = [self._host(m) for m in self.cluster.members if m is not victim]
            try:
                self.lab.isolate(host, *others)
            except RuntimeError:
                self.lab.heal(host)  # nothing half made stays
                raise
        self._ids += 1
        role = "leader" if victim is chief else "follower"
        self._fault = _Fault(self._ids, kind, victim, role, time.monotonic() + length + GRACE)
        self.log.append(
            {"kind": kind, "member": victim.name, "role": role, "by": by, "t": self._clock.now(),
             "healed": None}
        )  # fmt: skip
        return {"id": self._ids, "member": victim.name, "role": role, "pid": pid}

    def _end(self) -> dict[str, Any]:
        """Heal the fault in place (with the lock held): what was done."""
        fault, self._fault = self._fault, None
        if fault is None:
            return {}
        try:
            return self._heal(fault)
        finally:
            self._settled = time.monotonic() + SETTLE
            self.log[-1]["healed"] = self._clock.now()

    def _heal(self, fault: _Fault) -> dict[str, Any]:
        if fault.kind == "member-kill":
            if not fault.member.running:
                self.cluster.restart(fault.member, wait=False)
            return {"member": fault.member.name, "pid": fault.member.pid}
        assert self.lab is not None
        self.lab.heal(self._host(fault.member))
        return {"member": fault.member.name}

    def _watch(self) -> None:
        """Heal a fault nobody healed :data:`GRACE` seconds after its planned end."""
        while not self._stopped.wait(0.2):
            with self._lock:
                if self._fault is not None and time.monotonic() > self._fault.until:
                    with contextlib.suppress(RuntimeError, OSError):
                        self._end()

    def _host(self, member: EtcdMember) -> int:
        return self.cluster.members.index(member) + 1

    # -- probes -----------------------------------------------------------------------------

    def status(self, member: EtcdMember) -> dict[str, Any] | None:
        """``/v3/maintenance/status`` of ``member`` (through its probe address), or None."""
        host, port = self.probes[member.name]
        request = urllib.request.Request(
            f"http://{host}:{port}/v3/maintenance/status", b"{}", method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=_PROBE_TIMEOUT) as answer:  # noqa: S310
                reply = json.loads(answer.read())
        except (OSError, ValueError, urllib.error.URLError):
            return None
        return reply if isinstance(reply, dict) and isinstance(reply.get("header"), dict) else None

    def agreed_leader(self) -> EtcdMember | None:
        """The leader, if every member answers and names it."""
        ids: dict[str, EtcdMember] = {}
        leaders = set()
        for member in self.cluster.members:
            status = self.status(member)
            if status is None:
                return None
            ids[str(status["header"].get("member_id"))] = member
            leaders.add(str(status.get("leader")))
        (chief,) = leaders if len(leaders) == 1 else (None,)
        return ids.get(str(chief)) if chief not in (None, "0") else None


class ManagedEtcd(StartStop):
    """A 3-member etcd cluster that verify starts and may strike (see the module docstring)::

    with ManagedEtcd() as etcd:
        target = Target.create(etcd.url("/verify"), members=etcd.control)
    """

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.lab: NetLab | None = None
        self.cluster: EtcdCluster | None = None
        self.faults: MemberFaults | None = None
        self.relays: list[TcpProxy] = []
        self.endpoints: list[tuple[str, int]] = []
        self.no_isolation = unavailable()
        self._directory: str | None = None

    def start(self) -> ManagedEtcd:
        self._directory = tempfile.mkdtemp(prefix="fenced-verify-etcd-")
        hosts: list[tuple[str, str | None]] | None = None
        if self.no_isolation is None:
            self.lab = NetLab(hosts=self.size).start()
            hosts = [
                (self.lab.host_address(i), self.lab.namespace(i)) for i in range(1, self.size + 1)
            ]
        self.cluster = EtcdCluster(
            self.size, Path(self._directory) / "cluster", hosts=hosts, extra_args=PRE_VOTE
        )
        self.cluster.start()
        if self.lab is not None:
            self.relays = [self.lab.expose(i, 2379) for i in range(1, self.size + 1)]
            self.endpoints = [("127.0.0.1", relay.port) for relay in self.relays]
        else:
            self.endpoints = [("127.0.0.1", m.client_port) for m in self.cluster.members]
        address = Path(self._directory) / "faults.sock"
        self.faults = MemberFaults(self.cluster, self.endpoints, self.lab, address).start()
        return self

    @property
    def control(self) -> MemberControl:
        """The handle a target carries to its schedules' nemeses."""
        if self.faults is None or self.cluster is None:
            raise RuntimeError("the cluster is not running")
        return MemberControl(
            str(self.faults.address), self.cluster.election_ms / 1000, self.no_isolation
        )

    def url(self, prefix: str) -> str:
        """``etcd://`` naming every member's loopback address, with key prefix ``prefix``, a
        request timeout of 2 s and a connect timeout of 0.5 s (schedules' ttls are at most 1 s:
        the defaults, 5 s and 1 s, would stall a worker whose request went to a dead or isolated
        member for several ttls; a dead member's relay accepts, then closes)."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.endpoints)
        return f"etcd://{hosts}?prefix={prefix}&timeout=2&connect_timeout=0.5"

    def stop(self) -> None:
        """Stop every member by PID, close the relays, delete the lab. Idempotent."""
        if self.faults is not None:
            self.faults.stop()
            self.faults = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self.lab is not None:
            self.lab.stop()  # the exposed relays too
            self.lab = None
        self.relays.clear()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = None

    def __repr__(self) -> str:
        return f"<ManagedEtcd {self.size} members {self.endpoints}>"

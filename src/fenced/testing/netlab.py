"""A private network lab for real partitions (Linux, root only): :class:`NetLab`.

::

    servers = {"coordinator": ("127.0.0.1", 5432), "store": ("127.0.0.1", 9000)}
    with NetLab(hosts=2, servers=servers) as lab:
        host, port = lab.address("coordinator")     # what a program inside the lab connects to
        subprocess.run(lab.command(1, ["python", "worker.py", f"{host}:{port}"]))
        lab.cut(1, "coordinator")                   # host 1 no longer reaches the coordinator
        lab.loss(2, 30)                             # host 2 loses 30 % of what it receives
        lab.heal(1); lab.heal(2)

Topology: a *hub* namespace holding a bridge (``br0``, address :data:`HUB_ADDRESS`, link
address :data:`HUB_MAC`) and, per host, a namespace with one veth (``eth0``, ``10.213.0.N/24``)
into that bridge. The bridge's link address is set, never left to the kernel: a bridge without
one takes the lowest of its ports' addresses and changes it when a host with a lower one joins;
the hosts that cached the old one then send to an address the hub no longer takes, and their
connections fall silent until ARP resolves it again, for up to a minute (a release check saw
the calls of surviving workers stall for 3-13 s after a killed worker's replacement joined).
No namespace has a link to the host's own namespace or a route out of the lab, so no packet of
the lab leaves it.
The servers stay where they are, on the host's loopback: for each one, a :class:`TcpProxy`
listens *inside the hub namespace* on :data:`HUB_ADDRESS` and carries each connection to the
server from the host's namespace (a socket belongs to the namespace it was created in, so one
process can hold both ends). So a host reaches a server only through the lab, and:

* :meth:`cut` adds an nftables rule in the host's namespace that drops its packets to one relay
  (one server) or to the whole hub: a real partition, seen by the kernel's TCP as silence.
* :meth:`loss` drops a share of the packets the host receives (``nft numgen random``).
* :meth:`relay` gives the server's proxy: delays, lost replies and cuts of connections (``tc
  netem`` does not exist on these kernels; delays come from the proxies).
* :meth:`heal` removes the host's rules.

A server can also run *inside* a host (``lab.command(host, [...])``, listening on
:meth:`host_address`): :meth:`expose` gives a relay on this machine's loopback that carries each
connection into the host's namespace, so programs outside the lab reach it as a server on
loopback, and :meth:`isolate` cuts the host from other hosts of the lab (both directions) while
those loopback connections still reach it: the etcd members of ``fenced verify``'s own cluster
run this way, and isolating one cuts its peer traffic only.

Names: every namespace is ``fenced-<pid>-<lab>-…`` with the creating process's PID. A lab's
:meth:`stop` deletes its namespaces (which takes their veths, addresses and nftables rules with
them). A process killed with SIGKILL cannot: :meth:`start` first deletes the namespaces of
every earlier lab whose process no longer runs (:func:`reap`), so nothing outlives the next run.

:func:`unavailable` says in one line why no lab can be built here (not root, no ``ip`` or
``nft``, namespaces not permitted), or None. Only ever addresses inside the lab are used.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Mapping, Sequence

from fenced.testing._lifecycle import StartStop
from fenced.testing.proxy import TcpProxy

__all__ = ["HUB_ADDRESS", "HUB_MAC", "SUBNET", "NetLab", "lab_namespaces", "reap", "unavailable"]

SUBNET = "10.213.0"
"""The lab's /24 (inside its namespaces only)."""
HUB_ADDRESS = f"{SUBNET}.254"
"""The hub's address: the relays listen on it."""
HUB_MAC = "02:66:6e:63:65:64"
"""The bridge's link address (locally administered), fixed so that no joining host changes it."""
PREFIX = "fenced-"
"""Every lab namespace's name begins with it (then the creating process's PID)."""
_CLONE_NEWNET = 0x40000000
_counter = itertools.count(1)
_libc = ctypes.CDLL(None, use_errno=True)


def _run(*argv: str) -> None:
    """Run ``argv``; RuntimeError with its error output if it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


@functools.cache
def unavailable() -> str | None:
    """Why no lab can be built on this machine (one line), or None if one can. Asked once per
    process (it creates and deletes a probe namespace)."""
    if os.geteuid() != 0:
        return "network partitions need root (network namespaces and nftables)"
    for program in ("ip", "nft"):
        if shutil.which(program) is None:
            return (
                f"network partitions need the {program!r} program "
                "(apt-get install iproute2 nftables)"
            )
    probe = f"{PREFIX}{os.getpid()}-probe-{next(_counter)}"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError) as error:
        return f"network namespaces are not permitted here ({error})"
    finally:
        with contextlib.suppress(RuntimeError, OSError):
            _run("ip", "netns", "delete", probe)
    return None


def lab_namespaces() -> list[str]:
    """The names of every lab namespace on this machine (of any process)."""
    done = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=False, timeout=30
    )
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(PREFIX)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap() -> list[str]:
    """Delete the namespaces of labs whose process no longer runs; their names."""
    reaped = []
    for name in lab_namespaces():
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and int(owner) != os.getpid() and not _alive(int(owner)):
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "delete", name)
                reaped.append(name)
    return reaped


def _in_namespace(name: str) -> socket.socket:
    """A new TCP socket created inside network namespace ``name`` (on a short-lived thread: a
    namespace switch is per thread, and this process's other threads never see it)."""
    made: list[socket.socket | BaseException] = []

    def create() -> None:
        try:
            with open(f"/var/run/netns/{name}", "rb") as target:
                if _libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
                    errno = ctypes.get_errno()
                    raise OSError(errno, f"setns into {name}: {os.strerror(errno)}")
            made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except BaseException as error:
            made.append(error)

    thread = threading.Thread(target=create, name=f"fenced-netlab-{name}")
    thread.start()
    thread.join()
    result = made[0]
    if isinstance(result, BaseException):
        raise result
    return result


class _LabProxy(TcpProxy):
    """A :class:`TcpProxy` whose listening socket lives in the lab's hub namespace."""

    def __init__(self, hub: str, target_host: str, target_port: int) -> None:
        super().__init__(target_host, target_port, lifetime=None)
        self._hub = hub

    def _listening_socket(self) -> socket.socket:
        listener = _in_namespace(self._hub)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HUB_ADDRESS, 0))
        return listener


class _InwardProxy(TcpProxy):
    """A :class:`TcpProxy` on this machine's loopback whose connections to the server are made
    inside a lab host's namespace."""

    def __init__(self, namespace: str, address: str, port: int) -> None:
        super().__init__("127.0.0.1", port, lifetime=None)
        self._namespace = namespace
        self._address = (address, port)

    def _server_connection(self) -> socket.socket:
        server = _in_namespace(self._namespace)
        server.settimeout(5)
        try:
            server.connect(self._address)
        except OSError:
            server.close()
            raise
        return server


class NetLab(StartStop):
    """A lab of ``hosts`` namespaces around one hub that relays to ``servers`` (see the module
    docstring). ``servers``: name → (loopback host, port) of a server on this machine."""

    def __init__(
        self, hosts: int = 0, servers: Mapping[str, tuple[str, int]] | None = None
    ) -> None:
        if hosts < 0:
            raise ValueError("a lab has no negative number of hosts")
        self._initial = hosts
        self.hosts = 0
        self._servers = dict(servers or {})
        self.name = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.hub = f"{self.name}-hub"
        self._relays: dict[str, TcpProxy] = {}
        self._exposed: list[TcpProxy] = []
        self._made: list[str] = []

    # -- names and addresses ----------------------------------------------------------------

    def namespace(self, host: int) -> str:
        """The namespace of host ``host`` (1 … hosts)."""
        if not 1 <= host <= self.hosts:
            raise ValueError(f"no host {host} in a lab of {self.hosts}")
        return f"{self.name}-h{host}"

    def host_address(self, host: int) -> str:
        """Host ``host``'s address in the lab."""
        self.namespace(host)
        return f"{SUBNET}.{host}"

    def address(self, server: str) -> tuple[str, int]:
        """Where a host connects to reach ``server`` (the hub's relay)."""
        return HUB_ADDRESS, self.relay(server).port

    def relay(self, server: str) -> TcpProxy:
        """The proxy that carries the lab's connections to ``server``."""
        return self._relays[server]

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> NetLab:
        """Reap dead labs, then build this one; RuntimeError (after removing what was made)
        if a step fails."""
        reap()
        try:
            self._add(self.hub)
            self._ip("link", "add", "br0", "address", HUB_MAC, "type", "bridge")
            self._ip("addr", "add", f"{HUB_ADDRESS}/24", "dev", "br0")
            self._ip("link", "set", "br0", "up")
            for _ in range(self._initial):
                self.add_host()
            for server, (host_name, port) in list(self._servers.items()):
                self._relays[server] = _LabProxy(self.hub, host_name, port).start()
        except BaseException:
            self.stop()
            raise
        return self

    def add_host(self) -> int:
        """A new host in the running lab (a veth into the hub, its address); its number."""
        if self.hosts >= 253:
            raise RuntimeError("a lab holds at most 253 hosts")
        host = self.hosts + 1
        name = f"{self.name}-h{host}"
        self._add(name)
        self.hosts = host
        self._ip("link", "add", f"p{host}", "type", "veth", "peer", "name", "eth0", "netns", name)
        self._ip("link", "set", f"p{host}", "master", "br0", "up")
        _run("ip", "-n", name, "addr", "add", f"{self.host_address(host)}/24", "dev", "eth0")
        _run("ip", "-n", name, "link", "set", "eth0", "up")
        return host

    def add_relay(self, server: str, host: str, port: int) -> TcpProxy:
        """A new relay named ``server`` in the running lab, to ``host:port`` (loopback)."""
        if server in self._relays:
            raise ValueError(f"the lab already relays {server!r}")
        relay = _LabProxy(self.hub, host, port).start()
        self._relays[server] = relay
        self._servers[server] = (host, port)
        return relay

    def expose(self, host: int, port: int) -> TcpProxy:
        """A relay on this machine's loopback (its ``port``) to port ``port`` of host ``host``'s
        address, connecting from inside the host's namespace (see the module docstring)."""
        relay = _InwardProxy(self.namespace(host), self.host_address(host), port).start()
        self._exposed.append(relay)
        return relay

    def stop(self) -> None:
        """Close the relays and delete the lab's namespaces. Idempotent."""
        for relay in [*self._relays.values(), *self._exposed]:
            relay.stop()
        self._relays.clear()
        self._exposed.clear()
        for name in reversed(self._made):
            with contextlib.suppress(RuntimeError, OSError):
                _run("ip", "netns", "delete", name)
        self._made.clear()

    def _add(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _ip(self, *argv: str) -> None:
        _run("ip", "-n", self.hub, *argv)

    # -- faults -----------------------------------------------------------------------------

    def cut(self, host: int, *servers: str) -> None:
        """Drop host ``host``'s packets to the relays of ``servers`` (none: to the whole hub)."""
        match = f"ip daddr {HUB_ADDRESS}"
        if servers:
            ports = ", ".join(str(self.relay(server).port) for server in servers)
            match += f" tcp dport {{ {ports} }}"
        self._rule(host, "output", f"{match} drop")

    def loss(self, host: int, percent: int) -> None:
        """Drop ``percent`` % of the packets host ``host`` receives, at random."""
        if not 0 <= percent <= 100:
            raise ValueError("loss is a percentage")
        if percent == 0:
            return
        share = "" if percent == 100 else f" numgen random mod 100 lt {percent}"
        self._rule(host, "input", f"ip saddr {SUBNET}.0/24{share} drop")

    def isolate(self, host: int, *others: int) -> None:
        """Drop every packet between host ``host`` and the hosts ``others`` (both ways), in
        ``host``'s namespace; its exposed relays (:meth:`expose`) still reach it."""
        if not others:
            raise ValueError("isolate from which hosts?")
        addresses = ", ".join(self.host_address(other) for other in others)
        self._rule(host, "input", f"ip saddr {{ {addresses} }} drop")
        self._rule(host, "output", f"ip daddr {{ {addresses} }} drop")

    def heal(self, host: int) -> None:
        """Remove every rule of host ``host``."""
        with contextlib.suppress(RuntimeError):
            _run(
                "ip",
                "netns",
                "exec",
                self.namespace(host),
                "nft",
                "delete",
                "table",
                "inet",
                "fenced",
            )

    def _rule(self, host: int, hook: str, rule: str) -> None:
        nft = ["ip", "netns", "exec", self.namespace(host), "nft"]
        _run(*nft, "add", "table", "inet", "fenced")
        _run(*nft, "add", "chain", "inet", "fenced", hook,
             f"{{ type filter hook {hook} priority 0; policy accept; }}")  # fmt: skip
        _run(*nft, f"add rule inet fenced {hook} {rule}")

    def __repr__(self) -> str:
        return f"<NetLab {self.name} hosts={self.hosts} servers={sorted(self._servers)}>"

"""Throwaway ZooKeeper ensembles for tests and benchmarks: :class:`ZooKeeperEnsemble`.

One or three members (any number, really) of Debian's ZooKeeper 3.8 on free loopback ports, each
with its own directory (``zoo.cfg``, ``data/myid``, ``zookeeper.log``) and its own client, peer
and election port. Elections are fast: ``tickTime=200`` with ``initLimit=10`` and
``syncLimit=5`` (a follower that hears nothing from its leader for 1 s looks for a new one), a
1 s connect timeout between members (``zookeeper.cnxTimeout``) and at most 1 s between election
notifications (``zookeeper.fastleader.maxNotificationInterval``). Every member of a 3-member
ensemble serves ~1.3 s after spawn (on two cores); a new leader serves 0.4-0.6 s after the old
one is killed. Every process is started by the harness and stopped by its PID; nothing touches a
system service. ::

    with ZooKeeperEnsemble(3) as ensemble:          # every member serving ~1.3 s after spawn
        url = ensemble.url("/t1", timeout=2)        # zk://127.0.0.1:P1,...,127.0.0.1:P3/t1?timeout=2
        leader = ensemble.leader()                  # a member index: 0, 1 or 2
        ensemble.kill(leader)                       # SIGKILL by PID
        ensemble.leader()                           # waits for the new one
        ensemble.restart(leader)                    # same data directory; waits until it serves
        ensemble.pause(0); ensemble.resume(0)       # SIGSTOP / SIGCONT

Members are numbered from 0 (``members``); member ``i`` has ``myid`` ``i + 1`` (its
``server.N`` line and its log say ``myid=i+1``). ``ZooKeeperEnsemble(1)`` runs one standalone
server (``ZooKeeperServerMain``, mode ``standalone``) instead of a quorum peer.

Each member is ``java -Xmx256m -XX:+UseSerialGC -XX:TieredStopAtLevel=1`` on Debian's jars
(``zookeeper.jar`` names its dependencies in its manifest; SLF4J's log4j binding and log4j 1.2
are added so that it logs at all), with ``forceSync=no``, the admin server off and the
four-letter words ``ruok``, ``stat``, ``srvr`` and ``mntr`` allowed. A member logs (log4j
``INFO``) to ``zookeeper.log`` in its directory, never to the console. A member is *serving*
when its ``srvr`` reply says ``Mode:`` (``leader``, ``follower`` or ``standalone``): a quorum
peer answers ``srvr`` without a mode while it looks for a leader or syncs with one, and
``ruok`` answers ``imok`` before either.

Members can also run inside network namespaces (a partition lab, see
:mod:`fenced.testing.netlab`): pass ``hosts=[(address, netns), ...]``; each member then runs
with ``ip netns exec`` on ports 2181 (client), 2888 (peer) and 3888 (election) of its address,
and is probed from inside its namespace.

Failure behaviour: an ensemble that does not become ready raises :class:`RuntimeError` with the
tail of the members' logs (tests that need it fail; they never skip). A member whose client
port was taken since it was found free exits at once (the start fails with the reason in the
log); one whose election port was taken exits 1 s later (``zookeeper.electionPortBindRetry=1``:
one try instead of three), possibly after :meth:`~ZooKeeperEnsemble.start` returned.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fenced.testing._lifecycle import StartStop
from fenced.testing.etcd import free_ports

__all__ = ["ZooKeeperEnsemble", "ZooKeeperMember"]

CLASSPATH = ":".join(
    [
        "/etc/zookeeper/conf",  # log4j.properties: its CONSOLE appender (stdout: the member's log)
        "/usr/share/java/zookeeper.jar",  # its manifest names jute, netty, slf4j-api, ...
        "/usr/share/java/slf4j-log4j12.jar",  # ... but no SLF4J binding: without one, no log at all
        "/usr/share/java/log4j-1.2.jar",
    ]
)
JAVA_OPTIONS = (
    "-Xmx256m",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",  # the quick compiler only: an ensemble is ready ~0.4 s sooner
    "-Dzookeeper.root.logger=INFO,CONSOLE",
    "-Dzookeeper.jmx.log4j.disable=true",  # log4j's MBeans cost ~0.2 s at start
    "-Dzookeeper.cnxTimeout=1000",  # connecting to a peer for an election (default 5 s)
    "-Dzookeeper.fastleader.maxNotificationInterval=1000",  # default: backs off up to 60 s
    "-Dzookeeper.electionPortBindRetry=1",  # one try, exit 1 s later (default: 3 tries, 1 s apart)
)
QUORUM_MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
STANDALONE_MAIN = "org.apache.zookeeper.server.ZooKeeperServerMain"
_MODE = re.compile(r"^Mode: (\S+)", re.MULTILINE)
_PROBE = """
import socket, sys
host, port, word, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
with socket.create_connection((host, port), timeout=timeout) as connection:
    connection.sendall(word.encode())
    while chunk := connection.recv(4096):
        sys.stdout.buffer.write(chunk)
"""  # four_letter from inside a member's network namespace


@dataclass
class ZooKeeperMember:
    """One member: its ``myid``, address, ports, directory and process."""

    myid: int
    host: str
    client_port: int
    peer_port: int
    election_port: int
    directory: Path
    netns: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"m{self.myid}"

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def config_path(self) -> Path:
        return self.directory / "zoo.cfg"

    @property
    def log_path(self) -> Path:
        return self.directory / "zookeeper.log"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class ZooKeeperEnsemble(StartStop):
    """A private ZooKeeper ensemble (see the module docstring).

    ``size``: members (1 or 3 usually; 1 is a standalone server). ``directory``: where data and
    logs go (default: a new temporary directory, removed by :meth:`stop`). ``tick_ms``:
    ZooKeeper's ``tickTime``, the unit of its timeouts. ``min_session_ms`` and
    ``max_session_ms``: the range a client's requested session timeout is clamped to. ``hosts``:
    per member ``(address, netns)`` to run members inside network namespaces (default: all on
    127.0.0.1 in this namespace). ``extra_config``: more ``zoo.cfg`` settings for every member
    (they replace the harness's own of the same name). ``java``: the Java launcher.

    Raises :class:`ValueError` at construction for a size below 1, a non-positive tick or an
    empty session range.
    """

    def __init__(
        self,
        size: int = 3,
        directory: Path | None = None,
        *,
        tick_ms: int = 200,
        min_session_ms: int = 400,
        max_session_ms: int = 60_000,
        hosts: Sequence[tuple[str, str | None]] | None = None,
        extra_config: Mapping[str, object] | None = None,
        java: str = "java",
    ) -> None:
        if size < 1:
            raise ValueError("a ZooKeeper ensemble has at least one member")
        if hosts is not None and len(hosts) != size:
            raise ValueError("hosts must name one (address, netns) per member")
        if tick_ms <= 0:
            raise ValueError(f"tick_ms must be positive, not {tick_ms}")
        if not 0 < min_session_ms <= max_session_ms:
            raise ValueError(
                f"need 0 < min_session_ms <= max_session_ms: {min_session_ms}, {max_session_ms}"
            )
        self.java = shutil.which(java) or java
        self._own_directory = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="fenced-zookeeper-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tick_ms = tick_ms
        self.min_session_ms = min_session_ms
        self.max_session_ms = max_session_ms
        self.extra_config = {key: str(value) for key, value in (extra_config or {}).items()}
        if hosts is None:
            ports = free_ports(3 * size)
            places: list[tuple[str, str | None, int, int, int]] = [
                ("127.0.0.1", None, ports[3 * i], ports[3 * i + 1], ports[3 * i + 2])
                for i in range(size)
            ]
        else:
            places = [(address, netns, 2181, 2888, 3888) for address, netns in hosts]
        self._members = [
            ZooKeeperMember(
                i + 1,
                address,
                client_port,
                peer_port,
                election_port,
                self.directory / f"m{i + 1}",
                netns,
            )
            for i, (address, netns, client_port, peer_port, election_port) in enumerate(places)
        ]

    # -- members and addresses --------------------------------------------------------------
    @property
    def members(self) -> list[int]:
        """The members' indices: ``[0, 1, 2]`` for three (member ``i`` has ``myid`` i + 1)."""
        return list(range(len(self._members)))

    def member(self, i: int) -> ZooKeeperMember:
        """Member ``i``'s address, ports, directory and process."""
        if not 0 <= i < len(self._members):
            raise IndexError(f"no member {i} in an ensemble of {len(self._members)}")
        return self._members[i]

    def client_port(self, i: int) -> int:
        return self.member(i).client_port

    def pid(self, i: int) -> int | None:
        """The PID of member ``i``'s process (None before its first start)."""
        return self.member(i).pid

    def running(self, i: int) -> bool:
        """Member ``i``'s process exists and has not exited (it may be paused)."""
        return self.member(i).running

    def connect_string(self, chroot: str | None = None) -> str:
        """``host:port,host:port,...`` of every member, then ``chroot`` (e.g. ``/t1``) if given:
        what ZooKeeper clients (``KazooClient(hosts=...)``) take."""
        if chroot is not None and not chroot.startswith("/"):
            raise ValueError(f"a chroot is an absolute path, not {chroot!r}")
        return ",".join(member.endpoint for member in self._members) + (chroot or "")

    def url(self, chroot: str | None = None, **params: object) -> str:
        """``zk://`` and :meth:`connect_string`, then ``params`` as the query (``None`` leaves
        one out): ``url("/t1", session_timeout=2)`` is ``zk://…/t1?session_timeout=2``."""
        query = "&".join(f"{name}={value}" for name, value in params.items() if value is not None)
        return "zk://" + self.connect_string(chroot) + ("?" + query if query else "")

    # -- configuration ----------------------------------------------------------------------
    def _config(self, member: ZooKeeperMember) -> str:
        settings = {
            "tickTime": str(self.tick_ms),
            "initLimit": "10",
            "syncLimit": "5",
            "dataDir": str(member.data_dir),
            "clientPort": str(member.client_port),
            "clientPortAddress": member.host,
            "minSessionTimeout": str(self.min_session_ms),
            "maxSessionTimeout": str(self.max_session_ms),
            "admin.enableServer": "false",
            "4lw.commands.whitelist": "ruok,stat,srvr,mntr",
            "forceSync": "no",
            "preAllocSize": "1024",  # KiB of transaction log allocated ahead (default 64 MiB)
        }
        if len(self._members) > 1:
            for peer in self._members:
                settings[f"server.{peer.myid}"] = (
                    f"{peer.host}:{peer.peer_port}:{peer.election_port}"
                )
        settings.update(self.extra_config)
        return "".join(f"{key}={value}\n" for key, value in settings.items())

    def _argv(self, member: ZooKeeperMember) -> list[str]:
        main = QUORUM_MAIN if len(self._members) > 1 else STANDALONE_MAIN
        argv = [self.java, *JAVA_OPTIONS, "-cp", CLASSPATH, main, str(member.config_path)]
        if member.netns is not None:
            argv = ["ip", "netns", "exec", member.netns, *argv]
        return argv

    # -- processes --------------------------------------------------------------------------
    def _spawn(self, member: ZooKeeperMember) -> None:
        member.data_dir.mkdir(parents=True, exist_ok=True)
        (member.data_dir / "myid").write_text(f"{member.myid}\n")
        member.config_path.write_text(self._config(member))
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(
                self._argv(member),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=member.directory,  # where a crashing JVM writes hs_err_pid*.log
                start_new_session=True,
            )

    def start(self, timeout: float = 20.0) -> ZooKeeperEnsemble:
        """Start every member; return once every one is serving (a quorum has a leader)."""
        for member in self._members:
            self._spawn(member)
        self.wait_ready(timeout)
        return self

    def restart(self, i: int, timeout: float = 20.0) -> None:
        """Start a stopped (killed) member again on its data directory; return once it serves
        (it has synced with the leader, or leads)."""
        member = self.member(i)
        if member.running:
            raise RuntimeError(f"ZooKeeper member {member.name} is still running")
        self._spawn(member)
        self.wait_ready(timeout, members=[i])

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to member ``i``'s process (by PID); SIGKILL, SIGTERM and SIGINT also
        wait for it to exit (a paused member is resumed to handle SIGTERM or SIGINT).
        Nothing happens if it is not running."""
        member = self.member(i)
        if member.process is None or member.process.poll() is not None:
            return
        os.kill(member.process.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            if sig != signal.SIGKILL:
                os.kill(member.process.pid, signal.SIGCONT)
            try:
                member.process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(member.process.pid, signal.SIGKILL)
                member.process.wait(5)

    def pause(self, i: int) -> None:
        """SIGSTOP member ``i``: its sockets stay open, it answers nothing (followers drop a
        paused leader after ``syncLimit`` ticks, 1 s)."""
        self._signal(i, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT member ``i`` after :meth:`pause`."""
        self._signal(i, signal.SIGCONT)

    def _signal(self, i: int, sig: int) -> None:
        member = self.member(i)
        if member.process is None or member.process.poll() is not None:
            raise RuntimeError(f"ZooKeeper member {member.name} is not running")
        os.kill(member.process.pid, sig)

    def stop(self) -> None:
        """Stop every member by PID (SIGKILL) and remove the directory it created. Idempotent."""
        for member in self._members:
            if member.process is not None and member.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.process.pid, signal.SIGCONT)
                    os.kill(member.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    member.process.wait(10)
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    # -- probes -----------------------------------------------------------------------------
    def four_letter(self, i: int, word: str = "srvr", timeout: float = 1.0) -> str | None:
        """Member ``i``'s reply to the four-letter word ``word`` (``ruok``, ``stat``, ``srvr``
        or ``mntr``), or None if it does not answer within ``timeout`` seconds."""
        member = self.member(i)
        if member.netns is None:
            return _four_letter(member.host, member.client_port, word, timeout)
        try:
            done = subprocess.run(
                ["ip", "netns", "exec", member.netns, sys.executable, "-c", _PROBE, member.host,
                 str(member.client_port), word, str(timeout)],
                capture_output=True, timeout=timeout + 5, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
        return done.stdout.decode(errors="replace") if done.returncode == 0 else None

    def mode(self, i: int, timeout: float = 1.0) -> str | None:
        """``leader``, ``follower`` or ``standalone`` from member ``i``'s ``srvr`` reply; None
        if it does not answer or is not serving (looking for a leader, syncing, paused, dead)."""
        reply = self.four_letter(i, "srvr", timeout)
        found = _MODE.search(reply) if reply else None
        return found.group(1) if found else None

    def leader(self, timeout: float = 10.0) -> int:
        """The index of the member that leads now (a standalone server leads itself); waits up
        to ``timeout`` seconds for one, then raises RuntimeError with the logs' tails."""
        deadline = time.monotonic() + timeout
        while True:
            for i, member in enumerate(self._members):
                if member.running and self.mode(i, timeout=0.5) in ("leader", "standalone"):
                    return i
            if time.monotonic() > deadline:
                raise RuntimeError(f"no ZooKeeper leader within {timeout}s\n{self.logs()}")
            time.sleep(0.03)

    def wait_ready(self, timeout: float = 20.0, members: list[int] | None = None) -> None:
        """Wait until ``members`` (default: all running ones) serve (``srvr`` says ``Mode:``).

        Raises RuntimeError with the logs' tails if one exits or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        waiting = list(members if members is not None else
                       [i for i, m in enumerate(self._members) if m.running])  # fmt: skip
        while waiting:
            member = self.member(waiting[0])
            if not member.running:
                raise RuntimeError(f"ZooKeeper member {member.name} exited\n{self.logs()}")
            if self.mode(waiting[0], timeout=0.5) is not None:
                waiting.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"ZooKeeper not ready within {timeout}s\n{self.logs()}")
            time.sleep(0.03)

    def logs(self, lines: int = 15) -> str:
        """The last ``lines`` lines of every member's log."""
        parts = []
        for member in self._members:
            with contextlib.suppress(OSError):
                tail = member.log_path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {member.name} ---\n" + "\n".join(tail))
        return "\n".join(parts)


def _four_letter(host: str, port: int, word: str, timeout: float) -> str | None:
    """Send ``word`` to ``host:port``; the whole reply (the server closes after it), or None."""
    chunks = []
    try:
        with socket.create_connection((host, port), timeout=timeout) as connection:
            connection.sendall(word.encode())
            while chunk := connection.recv(4096):
                chunks.append(chunk)
    except OSError:  # refused, reset, timed out (socket.timeout is an OSError)
        return None
    return b"".join(chunks).decode(errors="replace")

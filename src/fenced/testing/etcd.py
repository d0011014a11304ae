"""Throwaway etcd clusters for tests and benchmarks: :class:`EtcdCluster`.

One or three members (any number, really) on free loopback ports, each with its own data
directory, all sharing a unique ``--initial-cluster-token``, with fast elections
(``--heartbeat-interval 50 --election-timeout 500``: a new leader ~0.5-0.8 s after the old one
dies). Every process is started by the harness and stopped by its PID; nothing touches a system
service. ::

    with EtcdCluster(3) as cluster:                 # writable ~0.3 s after spawn
        url = cluster.url(prefix="/t1")             # etcd://127.0.0.1:P1,127.0.0.1:P2,...?prefix=/t1
        leader = cluster.leader()
        cluster.kill(leader)                        # SIGKILL by PID
        cluster.restart(leader)                     # same data dir, cluster state 'existing'
        cluster.snapshot_save(path)                 # etcdctl snapshot save (from a live member)
        cluster.restore(path)                       # stop all, etcdctl snapshot restore, start

``EtcdCluster(3, tls=True)`` runs every member with TLS on both sides: client and peer
certificates from a private :class:`~fenced.testing.tls.Authority` (``--client-cert-auth``,
``--peer-client-cert-auth``), so clients need a certificate of that CA; :meth:`url` then gives an
``etcds://`` URL with ``ca``, ``cert`` and ``key`` (a client certificate whose common name is
``fenced``). :meth:`enable_auth` turns on etcd's authentication with a ``root`` user, and
:meth:`add_user` makes a user limited to one key prefix. :meth:`rotate_certificate` restarts a
member with a new server certificate of the same CA.

Members can also run inside network namespaces (a partition lab, see the etcd tests): pass
``hosts=[(address, netns), ...]``; the harness then starts each member with ``ip netns exec`` and
probes it from inside its namespace.

Failure behaviour: a cluster that does not become ready raises :class:`RuntimeError` with the
tail of the members' logs (tests that need it fail; they never skip).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fenced.testing._lifecycle import StartStop

__all__ = ["EtcdCluster", "EtcdMember", "free_ports"]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            probe.bind(("127.0.0.1", 0))
            sockets.append(probe)
        return [probe.getsockname()[1] for probe in sockets]
    finally:
        for probe in sockets:
            probe.close()


@dataclass
class EtcdMember:
    """One member: its name, address, ports, data directory and process."""

    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    netns: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    scheme: str = "http"
    certificate: Any = field(default=None, repr=False)
    """With TLS: the member's :class:`~fenced.testing.tls.Issued` server certificate."""

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


class EtcdCluster(StartStop):
    """A private etcd cluster (see the module docstring).

    ``size``: members (1 or 3 usually). ``directory``: where data and logs go (default: a new
    temporary directory, removed by :meth:`stop`). ``hosts``: per member ``(address, netns)`` to
    run members inside network namespaces (default: all on 127.0.0.1 in this namespace).
    ``extra_args``: more etcd flags for every member. ``tls``: TLS with client certificates on
    client and peer connections (module docstring; needs the ``cryptography`` package).
    """

    def __init__(
        self,
        size: int = 3,
        directory: Path | None = None,
        *,
        binary: str = "etcd",
        etcdctl: str = "etcdctl",
        heartbeat_ms: int = 50,
        election_ms: int = 500,
        hosts: list[tuple[str, str | None]] | None = None,
        extra_args: tuple[str, ...] = (),
        tls: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError("an etcd cluster has at least one member")
        if hosts is not None and len(hosts) != size:
            raise ValueError("hosts must name one (address, netns) per member")
        self.binary = shutil.which(binary) or binary
        self.etcdctl = shutil.which(etcdctl) or etcdctl
        self._own_directory = directory is None
        self.directory = Path(directory or tempfile.mkdtemp(prefix="fenced-etcd-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.extra_args = tuple(extra_args)
        self.token = "fenced-" + secrets.token_hex(6)
        self.generation = 0
        if hosts is None:
            ports = free_ports(2 * size)
            places: list[tuple[str, str | None, int, int]] = [
                ("127.0.0.1", None, ports[2 * i], ports[2 * i + 1]) for i in range(size)
            ]
        else:
            places = [(address, netns, 2379, 2380) for address, netns in hosts]
        self.members = [
            EtcdMember(
                f"m{i + 1}",
                address,
                client_port,
                peer_port,
                self.directory / f"m{i + 1}.data",
                self.directory / f"m{i + 1}.log",
                netns,
            )
            for i, (address, netns, client_port, peer_port) in enumerate(places)
        ]
        self.tls = tls
        self.root_password: str | None = None
        self.authority: Any = None
        self.admin: Any = None
        self.client: Any = None
        self.anonymous: Any = None
        if tls:
            from fenced.testing.tls import Authority  # noqa: PLC0415 - needs cryptography

            self.authority = Authority(self.directory / "tls")
            for member in self.members:
                member.scheme = "https"
                self._issue_server(member)
            self.admin = self.authority.issue("root", common_name="root", client=True)
            self.client = self.authority.issue("fenced", common_name="fenced", client=True)
            # without a common name: etcd's gateway refuses a client certificate that has one
            self.anonymous = self.authority.issue("anonymous", common_name="", client=True)

    # -- addresses --------------------------------------------------------------------------
    @property
    def endpoints(self) -> list[str]:
        return [member.endpoint for member in self.members]

    def url(self, prefix: str | None = None, *, user: str | None = None, **params: object) -> str:
        """``etcd://`` URL naming every member (``prefix`` and other query parameters).

        With ``tls``: ``etcds://`` with ``ca``, ``cert`` and ``key`` (the ``fenced`` client
        certificate; with ``api="gateway"`` one without a common name, which etcd's gateway
        requires) unless ``params`` give them (``None`` leaves one out). ``user``: the
        ``user[:password]`` part."""
        query = [f"prefix={prefix}"] if prefix else []
        scheme = "etcd"
        if self.tls:
            scheme = "etcds"
            client = self.anonymous if params.get("api") == "gateway" else self.client
            tls = {"ca": self.authority.cert, "cert": client.cert, "key": client.key}
            params = {**tls, **params}
        query += [f"{name}={value}" for name, value in params.items() if value is not None]
        login = f"{user}@" if user else ""
        hosts = ",".join(self.endpoints)
        return f"{scheme}://{login}{hosts}" + ("?" + "&".join(query) if query else "")

    # -- TLS and users ----------------------------------------------------------------------
    def _issue_server(self, member: EtcdMember) -> None:
        """A server (and peer) certificate for ``member`` from the cluster's authority."""
        member.certificate = self.authority.issue(
            f"{member.name}-server-{secrets.token_hex(3)}",
            hosts=[member.host, "localhost", f"{member.name}.etcd.test"],
            client=True,  # a member also dials its peers with it
        )

    def rotate_certificate(self, member: EtcdMember, timeout: float = 20.0) -> None:
        """Restart ``member`` (SIGTERM by PID, same data directory) with a new server
        certificate of the same authority."""
        self.kill(member, signal.SIGTERM)
        self._issue_server(member)
        self.restart(member, timeout)

    def _ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.authority.cert))
        context.load_cert_chain(str(self.anonymous.cert), str(self.anonymous.key))
        return context

    def etcdctl_run(self, *args: str, timeout: float = 30.0) -> str:
        """Run ``etcdctl`` against the running members as ``root`` (with TLS and the root
        password when set); its output. Raises ``RuntimeError`` with etcdctl's message."""
        endpoints = ",".join(m.client_url for m in self.members if m.running)
        done = subprocess.run(
            [*self._etcdctl(endpoints), *args], capture_output=True, timeout=timeout,
            check=False, env={**os.environ, "ETCDCTL_API": "3"},
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)}: {done.stderr.decode().strip()}")
        return done.stdout.decode()

    def _etcdctl(self, endpoints: str) -> list[str]:
        argv = [self.etcdctl, "--endpoints", endpoints, "--dial-timeout", "5s"]
        if self.tls:
            argv += ["--cacert", str(self.authority.cert), "--cert", str(self.admin.cert),
                     "--key", str(self.admin.key)]  # fmt: skip
        if self.root_password is not None:
            argv += ["--user", f"root:{self.root_password}"]
        return argv

    def add_user(
        self, name: str, password: str | None, prefix: str, permission: str = "readwrite"
    ) -> None:
        """An etcd user whose role may ``permission`` (read, write, readwrite; "" for none)
        the keys under ``prefix`` and nothing else (``password`` None: it signs in by client
        certificate only)."""
        if password is None:
            self.etcdctl_run("user", "add", name, "--no-password")
        else:
            self.etcdctl_run("user", "add", f"{name}:{password}")
        self.etcdctl_run("role", "add", f"{name}-role")
        if permission:
            self.etcdctl_run(
                "role", "grant-permission", f"{name}-role", permission, prefix, "--prefix=true"
            )
        self.etcdctl_run("user", "grant-role", name, f"{name}-role")

    def enable_auth(self, root_password: str) -> None:
        """Turn on etcd's authentication, with a ``root`` user (password ``root_password``)."""
        self.etcdctl_run("user", "add", f"root:{root_password}")
        self.etcdctl_run("user", "grant-role", "root", "root")
        self.etcdctl_run("auth", "enable")
        self.root_password = root_password

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    # -- processes ------------------------------------------------------------------------
    def _argv(self, member: EtcdMember, state: str) -> list[str]:
        argv = [
            self.binary,
            "--name", member.name,
            "--data-dir", str(member.data_dir),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", self._initial_cluster(),
            "--initial-cluster-token", self.token,
            "--initial-cluster-state", state,
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--log-level", "warn",
            *self._tls_args(member),
            *self.extra_args,
        ]  # fmt: skip
        if member.netns is not None:
            argv = ["ip", "netns", "exec", member.netns, *argv]
        return argv

    def _tls_args(self, member: EtcdMember) -> list[str]:
        if not self.tls:
            return []
        cert, key, ca = member.certificate.cert, member.certificate.key, self.authority.cert
        return [
            "--cert-file", str(cert), "--key-file", str(key), "--trusted-ca-file", str(ca),
            "--client-cert-auth",
            "--peer-cert-file", str(cert), "--peer-key-file", str(key),
            "--peer-trusted-ca-file", str(ca), "--peer-client-cert-auth",
        ]  # fmt: skip

    def _spawn(self, member: EtcdMember, state: str) -> None:
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(
                self._argv(member, state),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        """Start every member of a new cluster; return once it has a leader and takes writes."""
        for member in self.members:
            self._spawn(member, "new")
        self.wait_ready(timeout)
        return self

    def restart(self, member: EtcdMember, timeout: float = 20.0, *, wait: bool = True) -> None:
        """Start a stopped (killed) member again on its data directory (``wait``: until it
        answers and knows a leader)."""
        if member.running:
            raise RuntimeError(f"{member.name} is still running")
        self._spawn(member, "existing")
        if wait:
            self.wait_ready(timeout, members=[member])

    def start_all(self, timeout: float = 20.0) -> None:
        """Start every stopped member again (a whole-cluster restart) and wait for a leader."""
        for member in self.members:
            if not member.running:
                self._spawn(member, "existing")
        self.wait_ready(timeout)

    def kill(self, member: EtcdMember, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the member's process (by PID); SIGKILL/SIGTERM also reap it."""
        if member.process is None or member.process.poll() is not None:
            return
        os.kill(member.process.pid, sig)
        if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
            try:
                member.process.wait(10)
            except subprocess.TimeoutExpired:
                os.kill(member.process.pid, signal.SIGKILL)
                member.process.wait(5)

    def stop(self) -> None:
        """Stop every member by PID and remove the directory it created. Idempotent."""
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.process.pid, signal.SIGCONT)
                    os.kill(member.process.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    member.process.wait(10)
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)

    # -- probes ---------------------------------------------------------------------------
    def status(self, member: EtcdMember, timeout: float = 1.0) -> dict[str, object] | None:
        """``/v3/maintenance/status`` of ``member``, or None if it does not answer."""
        if member.netns is not None:
            probe = (
                "import sys,urllib.request as u;"
                "r=u.Request(sys.argv[1],data=b'{}',method='POST');"
                "print(u.urlopen(r,timeout=float(sys.argv[2])).read().decode())"
            )
            url = f"{member.client_url}/v3/maintenance/status"
            try:
                done = subprocess.run(
                    ["ip", "netns", "exec", member.netns, sys.executable, "-c", probe, url,
                     str(timeout)],
                    capture_output=True, timeout=timeout + 5, check=False,
                )  # fmt: skip
                reply: object = json.loads(done.stdout) if done.stdout else None
            except (subprocess.TimeoutExpired, ValueError):
                return None
        else:
            try:
                reply = self._post(member, "maintenance/status", {}, timeout)
            except (OSError, ValueError, urllib.error.URLError):
                return None
        return reply if isinstance(reply, dict) and "header" in reply else None

    def _post(self, member: EtcdMember, path: str, body: object, timeout: float) -> object:
        """POST ``body`` to the member's gateway (as root, with a fresh token, once auth is on;
        the gateway does not pass a client certificate's name on)."""
        context = self._ssl_context() if self.tls else None
        headers = {"Content-Type": "application/json"}
        if self.root_password is not None and path != "auth/authenticate":
            login = {"name": "root", "password": self.root_password}
            answer = self._post(member, "auth/authenticate", login, timeout)
            headers["Authorization"] = (
                str(answer.get("token", "")) if isinstance(answer, dict) else ""
            )
        request = urllib.request.Request(  # noqa: S310 (an http(s):// URL built here)
            f"{member.client_url}/v3/{path}", json.dumps(body).encode(), headers, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout, context=context) as answer:  # noqa: S310
            return json.loads(answer.read())

    def _member_id(self, status: dict[str, object]) -> str:
        header = status.get("header")
        return str(header.get("member_id")) if isinstance(header, dict) else ""

    def leader(self, timeout: float = 10.0) -> EtcdMember:
        """The member that is leader now (waits up to ``timeout`` for one)."""
        deadline = time.monotonic() + timeout
        while True:
            for member in self.members:
                if not member.running:
                    continue
                status = self.status(member)
                if (
                    status
                    and status.get("leader")
                    and status.get("leader") == self._member_id(status)
                ):
                    return member
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd leader within {timeout}s\n{self.logs()}")
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 20.0, members: list[EtcdMember] | None = None) -> None:
        """Wait until ``members`` (default: all running ones) answer and a leader exists."""
        deadline = time.monotonic() + timeout
        waiting = list(members or [m for m in self.members if m.running])
        while waiting:
            member = waiting[0]
            if not member.running:
                raise RuntimeError(f"etcd member {member.name} exited\n{self.logs()}")
            status = self.status(member, timeout=0.5)
            if status is not None and status.get("leader") not in (None, "0"):
                waiting.pop(0)
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not ready within {timeout}s\n{self.logs()}")
            time.sleep(0.03)

    def logs(self, lines: int = 15) -> str:
        parts = []
        for member in self.members:
            with contextlib.suppress(OSError):
                tail = member.log_path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {member.name} ---\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- snapshots --------------------------------------------------------------------------
    def snapshot_save(self, path: Path) -> Path:
        """``etcdctl snapshot save`` from a running member into ``path``."""
        member = next(m for m in self.members if m.running)
        subprocess.run(
            [*self._etcdctl(member.client_url), "snapshot", "save", str(path)],
            check=True, capture_output=True, timeout=30,
            env={**os.environ, "ETCDCTL_API": "3"},
        )  # fmt: skip
        return path

    def restore(self, snapshot: Path, timeout: float = 20.0) -> None:
        """Replace the whole cluster's state by ``snapshot`` (``etcdctl snapshot restore``).

        Stops every member, restores the snapshot into fresh data directories (a new cluster
        token, as etcd requires) and starts them as a new cluster. Revisions go back to the
        snapshot's: that is what ``EtcdBackend.advance`` exists for.
        """
        for member in self.members:
            self.kill(member)
        self.generation += 1
        self.token = f"fenced-{secrets.token_hex(6)}"
        for member in self.members:
            member.data_dir = self.directory / f"{member.name}.data.{self.generation}"
            subprocess.run(
                [self.etcdctl, "snapshot", "restore", str(snapshot),
                 "--name", member.name,
                 "--initial-cluster", self._initial_cluster(),
                 "--initial-cluster-token", self.token,
                 "--initial-advertise-peer-urls", member.peer_url,
                 "--data-dir", str(member.data_dir)],
                check=True, capture_output=True, timeout=30,
                env={**os.environ, "ETCDCTL_API": "3"},
            )  # fmt: skip
        for member in self.members:
            self._spawn(member, "existing")
        self.wait_ready(timeout)

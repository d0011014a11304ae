"""A throwaway S3 server for tests and benchmarks: :class:`RgwServer` (Ceph RGW).

Ceph's RADOS Gateway from Debian 12's packages (Ceph 16 "pacific": ``apt-get install -y
--no-install-recommends ceph-mon ceph-osd radosgw ceph-common uuid-runtime``), the only S3 server
on this project's machines that implements conditional writes atomically (``If-None-Match: *``
and ``If-Match`` are checked by the OSD in the same operation as the write). The harness runs a
private single-node cluster in a temporary directory: one monitor, one OSD on ``memstore`` (the
data lives in the OSD's memory) and ``radosgw``, each on a free loopback port, in the foreground,
started and stopped by its PID; authentication between the daemons is off (``auth_*_required =
none``). It never touches a system service, ``/etc/ceph`` or ``/var/lib/ceph``. ::

    with RgwServer() as rgw:                       # ~1.1-1.4 s to an S3 user that can write
        bucket = rgw.create_bucket()               # a new bucket with a unique name
        s3 = rgw.client()                          # a boto3 S3 client with the user's keys
        s3.put_object(Bucket=bucket, Key="k", Body=b"v", IfNoneMatch="*")
        rgw.endpoint, rgw.access_key, rgw.secret_key, rgw.region

The S3 user's keys are random per server (``access_key``, ``secret_key``); :meth:`environment`
gives them as the standard ``AWS_*`` variables for a child process. Buckets use path-style
addressing (``http://127.0.0.1:PORT/BUCKET/KEY``).

Server behaviour that the ``s3://`` store relies on is pinned down by
``tests/fence/s3/test_rgw_conditional_writes.py``. Note RGW's quirk: a PUT's ``If-Match`` is
compared with the *unquoted* ETag (``"abc…"`` as S3 returns it never matches: 412).

Not for durability tests: memstore loses everything when the OSD dies, and pools have one
replica. Failure behaviour: a server that does not start raises :class:`RuntimeError` with the
tail of the daemons' logs (tests that need it fail; they never skip).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import string
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from fenced.testing._lifecycle import StartStop
from fenced.testing.etcd import free_ports

__all__ = ["RgwServer"]

_PROGRAMS = ("ceph-mon", "ceph-osd", "radosgw", "ceph", "radosgw-admin", "monmaptool")
_INSTALL = (
    "apt-get install -y --no-install-recommends ceph-mon ceph-osd radosgw ceph-common uuid-runtime"
)
_KEY_ALPHABET = string.ascii_uppercase + string.digits


class RgwServer(StartStop):
    """A private Ceph cluster with an S3 gateway on 127.0.0.1 (see the module docstring).

    ``directory``: where configuration, monitor store, sockets and logs go (default: a new
    temporary directory, removed by :meth:`stop`). ``region``: the region clients sign for
    (RGW accepts any; ``us-east-1`` keeps boto3 from adding a location constraint).
    ``memstore_bytes``: the OSD's capacity (its data is held in memory; writes fail when it is
    nearly full). ``settings``: more ``name = value`` lines for the ``[global]`` section.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        region: str = "us-east-1",
        memstore_bytes: int = 2 << 30,
        settings: dict[str, str] | None = None,
    ) -> None:
        self._own_directory = directory is None
        self.directory = Path(directory) if directory is not None else None
        self.region = region
        self.memstore_bytes = memstore_bytes
        self._settings = dict(settings or {})
        self.host = "127.0.0.1"
        self.mon_port = 0
        self.port = 0
        self.access_key = ""
        self.secret_key = ""
        self.user = "fenced"
        self.started_in: float | None = None
        """Seconds from :meth:`start` to a usable S3 user (measured; for the docs)."""
        self._processes: dict[str, subprocess.Popen[bytes]] = {}

    # -- addresses --------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: the S3 endpoint URL (path-style buckets)."""
        return f"http://{self.host}:{self.port}"

    @property
    def pids(self) -> dict[str, int]:
        """The running daemons' PIDs by name (``mon``, ``osd``, ``rgw``)."""
        return {name: p.pid for name, p in self._processes.items() if p.poll() is None}

    def environment(self) -> dict[str, str]:
        """The standard AWS variables for a client of this server (keys, region, endpoint)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
        }

    def _dir(self) -> Path:
        if self.directory is None:
            raise RuntimeError("the RGW server was not started")
        return self.directory

    @property
    def config_path(self) -> Path:
        return self._dir() / "ceph.conf"

    # -- life cycle -------------------------------------------------------------------------

    def start(self, timeout: float = 90.0) -> RgwServer:
        """Create the cluster, start mon, OSD and radosgw, create the S3 user; return self.

        Raises :class:`RuntimeError` (with the logs' tails) if a daemon exits or the gateway
        does not serve within ``timeout`` seconds; whatever was started is then still running
        until :meth:`stop` (``with`` does that).
        """
        if self._processes:
            return self
        missing = [name for name in _PROGRAMS if shutil.which(name) is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not found: {_INSTALL}")
        began = time.monotonic()
        deadline = began + timeout
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="fenced-rgw-"))
        for sub in ("mon.a", "osd.0", "run", "log"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        self.mon_port, self.port = free_ports(2)
        fsid = str(uuid.uuid4())
        self.config_path.write_text(self._config(fsid))
        monmap = self.directory / "monmap"
        self._run(
            "monmaptool", "--create", "--clobber", "--fsid", fsid,
            "--addv", "a", f"[v2:{self.host}:{self.mon_port}]", str(monmap),
        )  # fmt: skip
        self._run("ceph-mon", "--mkfs", "-i", "a", "--monmap", str(monmap))
        self._spawn("mon", "ceph-mon", "-f", "-i", "a")
        osd_id = self._ceph("osd", "create", deadline=deadline).strip()
        if osd_id != "0":
            raise RuntimeError(f"ceph osd create gave id {osd_id!r}, expected 0\n{self.logs()}")
        self._run("ceph-osd", "-i", "0", "--mkfs")
        self._spawn("osd", "ceph-osd", "-f", "-i", "0")
        self._wait(self._osd_up, "the OSD is up", deadline)
        self._spawn("rgw", "radosgw", "-f", "-n", "client.rgw")
        self._wait(self._serving, f"radosgw serves on port {self.port}", deadline)
        self.access_key = "".join(secrets.choice(_KEY_ALPHABET) for _ in range(20))
        self.secret_key = secrets.token_urlsafe(30)
        self.radosgw_admin(
            "user", "create", f"--uid={self.user}", f"--display-name={self.user}",
            f"--access-key={self.access_key}", f"--secret-key={self.secret_key}",
        )  # fmt: skip
        self.started_in = time.monotonic() - began
        return self

    def _config(self, fsid: str) -> str:
        d = self._dir()
        settings = {
            "fsid": fsid,
            "mon host": f"v2:{self.host}:{self.mon_port}",
            "public addr": self.host,
            "ms bind ipv6": "false",
            "ms bind msgr1": "false",
            "auth cluster required": "none",
            "auth service required": "none",
            "auth client required": "none",
            # radosgw asks for a 'secure' connection to the monitor by default, which auth=none
            # cannot give ("get_initial_auth_request returned -13"): allow crc
            "ms mon client mode": "crc secure",
            "ms client mode": "crc secure",
            "osd pool default size": "1",
            "osd pool default min size": "1",
            "osd pool default pg num": "8",
            "osd pool default pgp num": "8",
            "osd pool default pg autoscale mode": "off",
            "mon allow pool size one": "true",
            "mon warn on pool no redundancy": "false",
            "mon max pg per osd": "1000",
            # the monitor batches map changes for 1 s by default; radosgw's start-up and first
            # bucket wait on a dozen pool creations in a row: 17 s to a first object, 1.5 s so
            "paxos propose interval": "0.05",
            "paxos min wait": "0.01",
            "osd crush chooseleaf type": "0",
            "osd objectstore": "memstore",
            "memstore device bytes": str(self.memstore_bytes),
            "osd data": f"{d}/osd.$id",
            "mon data": f"{d}/mon.$id",
            "run dir": f"{d}/run",
            "log file": f"{d}/log/$name.log",
            "admin socket": f"{d}/run/$name.asok",
            "pid file": f"{d}/run/$name.pid",
            "keyring": f"{d}/keyring",
            **self._settings,
        }
        rgw = {
            # without tcp_nodelay, beast writes a reply's headers and body apart and a small
            # GET waits for the client's delayed ACK: 44 ms instead of 1.5 ms (measured)
            "rgw frontends": f"beast endpoint={self.host}:{self.port} tcp_nodelay=1",
            "rgw dns name": self.host,
            "rgw enable usage log": "false",
        }
        lines = ["[global]", *(f"{k} = {v}" for k, v in settings.items())]
        lines += ["[client.rgw]", *(f"{k} = {v}" for k, v in rgw.items())]
        return "\n".join(lines) + "\n"

    def stop(self) -> None:
        """SIGKILL every daemon by PID (radosgw first), reap it, remove the directory it
        created. Idempotent."""
        for name in ("rgw", "osd", "mon"):
            process = self._processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        self._processes.clear()
        if self._own_directory and self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def _spawn(self, name: str, *argv: str) -> None:
        with open(self._dir() / "log" / f"{name}.out", "ab") as out:
            self._processes[name] = subprocess.Popen(
                [argv[0], "-c", str(self.config_path), *argv[1:]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _run(self, program: str, *args: str, timeout: float = 60.0) -> str:
        """Run a Ceph tool against this cluster; its standard output (RuntimeError if it
        fails, with its message and the daemons' logs)."""
        argv = [program, "-c", str(self.config_path), *args]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"{program} {' '.join(args)}: no answer in {timeout}s") from error
        if done.returncode != 0:
            message = (done.stderr or done.stdout).decode(errors="replace").strip()
            raise RuntimeError(
                f"{program} {' '.join(args)} failed ({done.returncode}): {message}\n{self.logs()}"
            )
        return done.stdout.decode(errors="replace")

    def _ceph(self, *args: str, deadline: float) -> str:
        """``ceph ARGS`` once the monitor answers (it may take a moment after its spawn)."""
        left = max(1, int(deadline - time.monotonic()))
        self._check_running()
        return self._run("ceph", "--connect-timeout", str(left), *args, timeout=left + 5)

    def radosgw_admin(self, *args: str) -> str:
        """``radosgw-admin ARGS`` against this cluster; its output (RuntimeError on failure)."""
        return self._run("radosgw-admin", *args)

    # -- readiness --------------------------------------------------------------------------

    def _check_running(self) -> None:
        for name, process in self._processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode}\n{self.logs()}")

    def _wait(self, ready: Any, what: str, deadline: float) -> None:
        while True:
            self._check_running()
            if time.monotonic() > deadline:
                raise RuntimeError(f"RGW start-up: timed out waiting until {what}\n{self.logs()}")
            if ready():
                return
            time.sleep(0.1)

    def _osd_up(self) -> bool:
        try:
            status = json.loads(
                self._run("ceph", "--connect-timeout", "5", "osd", "stat", "-f", "json", timeout=10)
            )
        except (RuntimeError, ValueError):
            return False
        return isinstance(status, dict) and status.get("num_up_osds") == 1

    def _serving(self) -> bool:
        """An anonymous ``GET /`` answers (any HTTP status: the gateway is serving)."""
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=1):  # noqa: S310 (http here)
                return True
        except urllib.error.HTTPError:
            return True
        except (OSError, urllib.error.URLError):
            return False

    def logs(self, lines: int = 15) -> str:
        """The last ``lines`` lines of each daemon's log and captured output."""
        if self.directory is None:
            return "(no logs)"
        parts = []
        for path in sorted((self.directory / "log").glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                if tail:
                    parts.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(parts) or "(no logs)"

    # -- S3 ---------------------------------------------------------------------------------

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server with the user's keys (path-style addressing, no
        retries: a test sees every status). ``config``: more ``botocore.config.Config``
        arguments. Needs ``boto3`` (the ``s3`` extra)."""
        import boto3  # noqa: PLC0415 - the s3 extra is needed only here
        from botocore.config import Config  # noqa: PLC0415

        options: dict[str, Any] = {
            "s3": {"addressing_style": "path"},
            "retries": {"max_attempts": 1, "mode": "standard"},
            **config,
        }
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**options),
        )

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (default: a new unique ``fenced-…`` name) owned by the user; its
        name. The first bucket and object of a server take ~0.3 s (RGW creates its pools)."""
        bucket = name or f"fenced-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=bucket)
        return bucket

    def __repr__(self) -> str:
        return f"<RgwServer {self.endpoint} pids={self.pids}>"

"""Throwaway PostgreSQL (and PgBouncer) servers for tests and benchmarks.

:class:`PostgresServer` runs a private cluster: ``initdb`` into a temporary directory, ``pg_ctl
start`` on a free loopback port (TCP on 127.0.0.1 only, the Unix socket inside the directory),
and ``stop()`` by ``pg_ctl`` — or by the postmaster's PID if ``pg_ctl`` fails. It never touches a
system cluster or service. As root, every server program runs as the ``postgres`` user (initdb
refuses root). ::

    with PostgresServer() as server:              # ~1-1.5 s to connected
        url = server.create_database("t1")         # postgresql://postgres@127.0.0.1:PORT/t1
        ...
        server.restart(mode="immediate")           # a crash of the server (not of the OS)

Over TLS (certificates from :class:`fenced.testing.tls.Authority`), with ``hba`` lines checked
before the defaults (here: a client certificate required for one database)::

    ca = Authority(tmp_path)
    server = PostgresServer(
        tls=ca.issue("pg", hosts=["127.0.0.1"]),   # ssl=on with this certificate and key
        ca=ca.cert,                                 # ssl_ca_file: client certificates' CA
        hba=["hostssl certs all 127.0.0.1/32 trust clientcert=verify-full"],
    )
    server.url("certs", sslmode="verify-full", sslrootcert=str(ca.cert), sslcert=..., sslkey=...)

``durable=False`` (the default, for functional tests) turns off ``fsync``, ``synchronous_commit``
and ``full_page_writes``: commits survive the death of the server (the WAL reaches the OS), not of
the machine. Benchmarks and durability tests use ``durable=True`` (PostgreSQL's defaults).
Note that fenced raises ``synchronous_commit`` for its grants itself (see
:mod:`fenced.coordinator.backends.postgres._backend`), so epochs survive
``restart(mode="immediate")`` even on a non-durable server.

:class:`PgBouncer` runs a private PgBouncer in front of a server (transaction pooling by default).

Failure behaviour: a server that cannot be started raises :class:`RuntimeError` with the tail of
its log (tests that need it fail; they never skip).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fenced.testing._lifecycle import StartStop

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fenced.testing.tls import Issued

__all__ = ["DEFAULT_BIN_DIR", "PgBouncer", "PostgresServer", "free_port"]

DEFAULT_BIN_DIR = Path("/usr/lib/postgresql/15/bin")
"""Where the PostgreSQL server programs are (Debian's layout); ``$FENCED_PG_BIN`` overrides."""

_DB_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
StopMode = Literal["smart", "fast", "immediate"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _as_user(user: str | None, argv: list[str]) -> list[str]:
    return argv if user is None else ["runuser", "-u", user, "--", *argv]


def _service_user() -> str | None:
    """``postgres`` when running as root (server programs refuse root), else None."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError as error:
        raise RuntimeError("running as root, but there is no 'postgres' user to run as") from error
    return "postgres"


def _chown_tree(path: Path, user: str | None) -> None:
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(path, entry.pw_uid, entry.pw_gid)


def _wait_port(port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return True
        time.sleep(0.02)
    return False


class PostgresServer(StartStop):
    """A private PostgreSQL cluster on 127.0.0.1 (see the module docstring).

    ``directory``: where the cluster lives (default: a new temporary directory, removed by
    :meth:`stop`). ``durable``: keep PostgreSQL's durable defaults (fsync on). ``bin_dir``: the
    server programs (default ``$FENCED_PG_BIN`` or :data:`DEFAULT_BIN_DIR`). ``settings``: extra
    ``-c name=value`` server settings.

    ``tls``: the server's certificate and key (``ssl=on``; plaintext connections stay allowed
    unless ``hba`` refuses them). ``ca``: the CA file that client certificates are checked
    against (``ssl_ca_file``). The files are copied into the cluster's directory, readable by
    the server only (PostgreSQL refuses a key that others may read). ``hba``: ``pg_hba.conf``
    lines matched before the defaults (``local``, and ``host`` on loopback, all ``trust``);
    :meth:`execute` then goes through the Unix socket, whatever they refuse over TCP.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        durable: bool = False,
        bin_dir: Path | None = None,
        settings: dict[str, str] | None = None,
        max_connections: int = 200,
        tls: Issued | None = None,
        ca: Path | None = None,
        hba: Sequence[str] = (),
    ) -> None:
        if ca is not None and tls is None:
            raise ValueError("ca= (client certificates) needs tls= (the server's certificate)")
        self.tls = tls
        self.ca = ca
        self._hba = list(hba)
        self.bin_dir = Path(bin_dir or os.environ.get("FENCED_PG_BIN") or DEFAULT_BIN_DIR)
        self.durable = durable
        self._own_directory = directory is None
        self.directory = Path(directory) if directory is not None else None
        self.port = 0
        self.host = "127.0.0.1"
        self.user = "postgres"
        self._settings = dict(settings or {})
        self._max_connections = max_connections
        self._service_user = _service_user()
        self._running = False

    # -- paths ------------------------------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        return self._dir() / "data"

    @property
    def log_file(self) -> Path:
        return self._dir() / "server.log"

    def _dir(self) -> Path:
        if self.directory is None:
            raise RuntimeError("the server was not started")
        return self.directory

    def _program(self, name: str) -> str:
        path = self.bin_dir / name
        if not path.exists():
            raise RuntimeError(
                f"{path} does not exist: install PostgreSQL 15 (Debian: postgresql-15) or set "
                "FENCED_PG_BIN to the directory holding initdb and pg_ctl"
            )
        return str(path)

    # -- life cycle -------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> PostgresServer:
        """Create the cluster (first time) and start the server; return self."""
        if self._running:
            return self
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="fenced-pg-"))
        self.directory.mkdir(parents=True, exist_ok=True)
        _chown_tree(self.directory, self._service_user)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        self.port = self.port or free_port()
        options = {
            "port": str(self.port),
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": str(self.directory),
            "max_connections": str(self._max_connections),
        }
        if not self.durable:
            options.update(
                fsync="off",
                synchronous_commit="off",
                full_page_writes="off",
                wal_level="minimal",
                max_wal_senders="0",
                autovacuum="off",
            )
        options.update(self._tls_settings())
        if self._hba:
            self._write_hba()
        options.update(self._settings)
        opts = " ".join(f"-c {key}={value}" for key, value in options.items())
        self._pg_ctl(["start", "-o", opts], timeout)
        if not _wait_port(self.port, timeout):
            raise RuntimeError(f"PostgreSQL did not listen on port {self.port}:\n{self.log_tail()}")
        self._running = True
        return self

    def _tls_settings(self) -> dict[str, str]:
        """``ssl=on`` and the server's copies of the certificate files (none without ``tls``)."""
        if self.tls is None:
            return {}
        directory = self._dir() / "tls"
        directory.mkdir(mode=0o700, exist_ok=True)
        files = {"ssl_cert_file": self.tls.cert, "ssl_key_file": self.tls.key}
        if self.ca is not None:
            files["ssl_ca_file"] = self.ca
        settings = {"ssl": "on"}
        for name, source in files.items():
            target = directory / f"{name}.pem"
            target.write_bytes(Path(source).read_bytes())
            target.chmod(0o600)
            _chown_tree(target, self._service_user)
            settings[name] = f"'{target}'"
        _chown_tree(directory, self._service_user)
        return settings

    def _write_hba(self) -> None:
        """``pg_hba.conf``: the ``hba`` lines, then the defaults (all ``trust``)."""
        defaults = [
            "local all all trust",
            "host all all 127.0.0.1/32 trust",
            "host all all ::1/128 trust",
        ]
        path = self.data_dir / "pg_hba.conf"
        path.write_text("\n".join([*self._hba, *defaults]) + "\n")
        _chown_tree(path, self._service_user)

    def _initdb(self) -> None:
        argv = [
            self._program("initdb"),
            "-D", str(self.data_dir),
            "-U", self.user,
            "-A", "trust",
            "-E", "UTF8",
            "--locale=C",
            "--no-sync",
        ]  # fmt: skip
        result = subprocess.run(
            _as_user(self._service_user, argv), capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed ({result.returncode}):\n{result.stderr}")

    def _pg_ctl(self, args: list[str], timeout: float) -> None:
        argv = [
            self._program("pg_ctl"),
            "-D", str(self.data_dir),
            "-l", str(self.log_file),
            "-w", "-t", str(int(max(timeout, 1))),
            *args,
        ]  # fmt: skip
        result = subprocess.run(
            _as_user(self._service_user, argv),
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout + 10,
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"pg_ctl {args[0]} failed ({result.returncode}): {result.stderr.strip()}\n"
                f"{self.log_tail()}"
            )

    def postmaster_pid(self) -> int | None:
        """The postmaster's PID from ``postmaster.pid``, or None if it is not running."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    def stop(self, mode: StopMode = "fast", *, remove: bool = True) -> None:
        """Stop the server (``pg_ctl stop -m mode``; SIGKILL by PID if that fails).

        ``remove``: delete the temporary directory this object created. Idempotent.
        """
        if self.directory is None:
            return
        if self._running or self.postmaster_pid() is not None:
            try:
                self._pg_ctl(["stop", "-m", mode], 30)
            except (RuntimeError, subprocess.TimeoutExpired):
                pid = self.postmaster_pid()
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        self._running = False
        if remove and self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

    def restart(self, mode: StopMode = "fast", timeout: float = 60.0) -> None:
        """``pg_ctl restart -m mode``: ``immediate`` is a crash of the server (recovery runs)."""
        self._pg_ctl(["restart", "-m", mode], timeout)
        if not _wait_port(self.port, timeout):
            raise RuntimeError(f"PostgreSQL did not come back:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the postmaster (its backends exit when they notice); no restart."""
        pid = self.postmaster_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._running = False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    # -- databases ---------------------------------------------------------------------------

    def dsn(self, database: str = "postgres") -> str:
        """A libpq URL for ``database`` (user postgres, no password: trust on loopback)."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"

    def admin_dsn(self, database: str = "postgres") -> str:
        """:meth:`dsn`, or with ``hba`` lines the Unix socket's URL (``local`` is ``trust``)."""
        if not self._hba:
            return self.dsn(database)
        return f"postgresql://{self.user}@/{database}?host={self._dir()}&port={self.port}"

    def url(self, database: str = "postgres", **query: str) -> str:
        """:meth:`dsn` with a query string (fenced's URL parameters, e.g. ``schema=...``)."""
        suffix = "&".join(f"{key}={value}" for key, value in query.items())
        return self.dsn(database) + (f"?{suffix}" if suffix else "")

    def execute(self, sql: str, database: str = "postgres") -> None:
        """Run one statement in autocommit mode (administration: CREATE DATABASE, ...)."""
        import psycopg  # noqa: PLC0415 - the postgres extra is needed only here

        with psycopg.connect(self.admin_dsn(database), autocommit=True) as conn:
            conn.execute(sql.encode())

    def create_database(self, name: str) -> str:
        """``CREATE DATABASE name TEMPLATE template0 STRATEGY FILE_COPY``; return its URL."""
        if not _DB_NAME.fullmatch(name):
            raise ValueError(f"database name must match {_DB_NAME.pattern}, got {name!r}")
        self.execute(f'CREATE DATABASE "{name}" TEMPLATE template0 STRATEGY FILE_COPY')
        return self.dsn(name)

    def drop_database(self, name: str) -> None:
        """``DROP DATABASE IF EXISTS name WITH (FORCE)``."""
        if not _DB_NAME.fullmatch(name):
            raise ValueError(f"database name must match {_DB_NAME.pattern}, got {name!r}")
        self.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _stop_at_exit(self) -> None:
        self.stop("immediate")

    def __repr__(self) -> str:
        tls = " tls" if self.tls is not None else ""
        return f"<PostgresServer {self.host}:{self.port} durable={self.durable}{tls}>"


class PgBouncer(StartStop):
    """A private PgBouncer on a free loopback port in front of ``server`` (stopped by PID).

    ``pool_mode``: ``transaction`` (default), ``session`` or ``statement``. ``round_robin``:
    ``server_round_robin`` (default off: PgBouncer's LIFO reuse). Every database of the server
    is reachable through it; :meth:`url` names one.
    """

    def __init__(
        self,
        server: PostgresServer,
        *,
        pool_mode: str = "transaction",
        pool_size: int = 4,
        round_robin: bool = False,
        binary: str | None = None,
    ) -> None:
        self.server = server
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.round_robin = round_robin
        self.binary = binary or shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        self.port = 0
        self.directory: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._service_user = _service_user()

    def start(self, timeout: float = 15.0) -> PgBouncer:
        if not Path(self.binary).exists():
            raise RuntimeError(
                "pgbouncer is not installed: apt-get install -y --no-install-recommends "
                "pgbouncer (it starts no service by itself here)"
            )
        self.directory = Path(tempfile.mkdtemp(prefix="fenced-pgbouncer-"))
        _chown_tree(self.directory, self._service_user)
        self.port = free_port()
        users = self.directory / "userlist.txt"
        users.write_text(f'"{self.server.user}" ""\n')
        config = self.directory / "pgbouncer.ini"
        config.write_text(
            "[databases]\n"
            f"* = host={self.server.host} port={self.server.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            f"pool_mode = {self.pool_mode}\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 500\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.directory / 'pgbouncer.log'}\n"
            "server_check_delay = 0\n"
            f"server_round_robin = {int(self.round_robin)}\n"
        )
        for path in (users, config):
            _chown_tree(path, self._service_user)
        self._proc = subprocess.Popen(
            _as_user(self._service_user, [self.binary, str(config)]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        if not _wait_port(self.port, timeout):
            log = self.directory / "pgbouncer.log"
            text = log.read_text(errors="replace") if log.exists() else "(no log)"
            self.stop()
            raise RuntimeError(f"pgbouncer did not listen on port {self.port}:\n{text}")
        return self

    def url(self, database: str = "postgres", **query: str) -> str:
        suffix = "&".join(f"{key}={value}" for key, value in query.items())
        base = f"postgresql://{self.server.user}@127.0.0.1:{self.port}/{database}"
        return base + (f"?{suffix}" if suffix else "")

    def stop(self) -> None:
        """Stop pgbouncer by PID (SIGINT of its process group, then SIGKILL). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(1)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None

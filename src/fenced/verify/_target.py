"""What a verification run runs against: the coordinator URL and the stores.

By default everything is embedded and fresh: each case and each schedule gets its own SQLite
coordinator database and two new stores in a temporary directory — a **strict** one (``S``, where
every holder installs its epoch with ``hold(fence=[S])``) and a **monotonic** one (``M``, the
largest-seen rule, no install). The two embedded store kinds alternate between the roles
(``sqlite:`` strict and ``file:`` monotonic, then the other way round), so both store backends
are verified in both modes.

``--coordinator URL`` replaces the embedded coordinator (each run uses a fresh resource name, so
runs never see each other's leases); ``--store URL`` (repeatable) replaces the temporary store of
the role matching that store's mode (a new store is created strict). The coordinator must be
reachable by every worker process; ``memory://`` is refused (its state lives in one process).

A networked coordinator (``postgresql://``, ``etcd://``, ``zk://``) on loopback is reached by
each worker through its own :class:`~fenced.testing.proxy.TcpProxy` (:attr:`Target.proxied`),
so that the nemesis can delay, blackhole or drop the replies of one worker on the real wire. A
server on another host is used directly (the proxy forwards to loopback only); the in-process
wire faults (:mod:`fenced.verify._faults`) apply to every backend either way.

Member faults (killing and isolating etcd members) need a cluster verify started itself
(:class:`~fenced.verify._members.ManagedEtcd`, whose :class:`~fenced.verify._members.MemberControl`
is :attr:`Target.members`): verify never kills or cuts off a server given by URL.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

from fenced.coordinator._connect import connect, resolve_url
from fenced.core._errors import ConfigurationError
from fenced.core._urls import redacted, scheme_of, url_of_path
from fenced.fence._store import open_store
from fenced.fence._values import Mode
from fenced.testing.netlab import unavailable
from fenced.verify._members import MemberControl

__all__ = [
    "NETWORKED",
    "Target",
    "endpoints",
    "store_endpoint",
    "with_endpoints",
    "with_store_endpoint",
]

NETWORKED = ("postgresql", "postgres", "etcd", "etcds", "zk", "http", "https")
"""Coordinator URL schemes whose wire verification can cut with a TCP proxy."""


def endpoints(url: str) -> list[tuple[str, int]]:
    """The ``host:port`` endpoints of a networked coordinator URL (in order)."""
    parts = urlsplit(url)
    hosts = parts.netloc.rpartition("@")[2]
    found = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"{redacted(url)!r}: cannot find host:port in {item!r}")
        found.append((host.strip("[]"), int(port)))
    return found


def with_endpoints(url: str, replaced: list[tuple[str, int]]) -> str:
    """``url`` with its endpoints replaced, in order, by ``replaced``."""
    parts = urlsplit(url)
    user, at, _ = parts.netloc.rpartition("@")
    hosts = ",".join(f"{host}:{port}" for host, port in replaced)
    return urlunsplit(parts._replace(netloc=f"{user}{at}{hosts}"))


def store_endpoint(url: str) -> tuple[str, int] | None:
    """The loopback ``host:port`` a networked store URL reaches (``postgresql:``, ``http:``,
    ``s3:``'s ``endpoint=``); None for a local store or one elsewhere."""
    scheme = scheme_of(url)
    target = url
    if scheme == "s3":
        found = parse_qs(urlsplit(url).query).get("endpoint")
        if not found:
            return None
        target = found[0]
    elif scheme not in ("postgresql", "postgres", "http", "https"):
        return None
    try:
        (host, port), *more = endpoints(target)
    except (ConfigurationError, ValueError):
        return None
    return (host, port) if not more and _loopback(host) else None


def with_store_endpoint(url: str, address: tuple[str, int]) -> str:
    """``url`` reaching its store at ``address`` instead (see :func:`store_endpoint`)."""
    if scheme_of(url) != "s3":
        return with_endpoints(url, [address])
    parts = urlsplit(url)
    query = [
        (name, with_endpoints(value, [address]) if name == "endpoint" else value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
    ]
    return urlunsplit(parts._replace(query=urlencode(query, safe=":/")))


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


APIS = ("sync", "async")
"""The faces ``fenced verify --api`` can run its workers on."""


@dataclass
class Target:
    """The coordinator and stores under verification (see the module docstring)."""

    coordinator: str | None = None
    """A coordinator URL, or None for a fresh embedded SQLite coordinator per run."""
    stores: dict[str, str] = field(default_factory=dict)
    """User-given stores by role (``S`` strict, ``M`` monotonic)."""
    api: str = "sync"
    """The face the workers use: ``sync`` (:mod:`fenced`) or ``async`` (:mod:`fenced.aio`)."""
    members: MemberControl | None = None
    """The member faults of the etcd cluster ``coordinator`` names, when verify started it."""

    @classmethod
    def create(
        cls,
        coordinator: str | None,
        stores: tuple[str, ...] = (),
        api: str = "sync",
        *,
        members: MemberControl | None = None,
    ) -> Target:
        """Validate the URLs (connecting once to each) and the API before anything runs.

        ``members``: the cluster is one verify started (:class:`~fenced.verify._members.
        ManagedEtcd`), whose members the nemesis may kill and isolate."""
        if api not in APIS:
            raise ConfigurationError(f"api must be one of {', '.join(APIS)}, got {api!r}")
        url = None
        if coordinator is not None:
            url = resolve_url(coordinator)
            if scheme_of(url) == "memory":
                raise ConfigurationError(
                    "fenced verify needs a coordinator shared between processes; memory:// is not"
                )
            connect(url).close()
        roles: dict[str, str] = {}
        for store_url in stores:
            with open_store(store_url) as store:
                role = "S" if store.mode == "strict" else "M"
            if role in roles:
                raise ConfigurationError(
                    f"two --store URLs of the same mode ({store.mode}): {redacted(roles[role])}, "
                    f"{redacted(store_url)}"
                )
            roles[role] = store_url
        if members is not None and (url is None or scheme_of(url) not in ("etcd", "etcds")):
            raise ConfigurationError("member faults need the etcd cluster verify started")
        return cls(url, roles, api, members)

    @property
    def proxied(self) -> bool:
        """True if every worker reaches the coordinator through its own TCP proxy (a networked
        coordinator on loopback: the proxy only forwards to loopback)."""
        if self.coordinator is None or scheme_of(self.coordinator) not in NETWORKED:
            return False
        return all(_loopback(host) for host, _ in endpoints(self.coordinator))

    @property
    def embedded(self) -> bool:
        """True if the coordinator is an embedded (SQLite) one."""
        return self.coordinator is None or scheme_of(self.coordinator) == "sqlite"

    @property
    def restorable(self) -> bool:
        """True if verify may back up and restore the coordinator: only one it created itself.

        A restore advances the epochs of *every* resource of a coordinator and ends all its
        leases, so verify never restores a coordinator given with ``--coordinator``.
        """
        return self.coordinator is None

    @property
    def partitions(self) -> bool:
        """True if randomized schedules cut workers off with real network partitions: a
        networked coordinator on loopback, on a machine where a network lab can be built."""
        return self.proxied and unavailable() is None

    @property
    def member_faults(self) -> tuple[str, ...]:
        """The member faults randomized schedules strike (``member-kill``, ``member-isolate``;
        empty unless verify started the etcd cluster itself)."""
        return () if self.members is None else self.members.kinds

    def failover(self, ttl: float, overrun: float) -> float:
        """How much longer than ``ttl`` + ``overrun`` a lease may live when member faults change
        the etcd leader (0 without member faults)."""
        return 0.0 if self.members is None else round(self.members.failover(ttl + overrun), 3)

    def describe(self) -> str:
        coordinator = self.coordinator or "embedded SQLite (fresh per run)"
        stores = ", ".join(f"{r}={u}" for r, u in sorted(self.stores.items())) or "embedded"
        face = "; workers on fenced.aio" if self.api == "async" else ""
        network = ""
        if self.proxied:
            why = unavailable()
            network = (
                "; real network partitions"
                if why is None
                else f"; no network partitions ({why}): in-process and proxy faults only"
            )
        members = ""
        if self.members is not None:
            members = f"; {self.members.describe()}"
        elif self.coordinator is not None and scheme_of(self.coordinator) in ("etcd", "etcds"):
            members = "; no member faults (verify kills and isolates only members it started)"
        return f"coordinator {coordinator}; stores {stores}{face}{network}{members}"

    def lease_overrun(self, ttl: float) -> float:
        """How much longer than ``ttl`` the coordinator may keep a lease live after the send
        time of its grant or last renewal: its backend's ``lease_overrun(ttl)`` (etcd rounds
        TTLs up), 0 for a backend without one (it expires leases exactly at ttl)."""
        if self.coordinator is None:
            return 0.0
        with contextlib.closing(connect(self.coordinator)) as coordinator:
            overrun = getattr(coordinator.backend, "lease_overrun", None)
            return 0.0 if overrun is None else float(overrun(ttl))

    def coordinator_url(self, workdir: Path) -> str:
        return self.coordinator or url_of_path("sqlite", str(workdir / "coordinator.db"))

    def store_urls(
        self, workdir: Path, index: int, kinds: tuple[str, str] | None = None
    ) -> dict[str, str]:
        """``{"S": strict URL, "M": monotonic URL}`` for run number ``index`` (created here).

        ``kinds`` overrides the alternation of embedded store kinds (``sqlite``, ``file``).
        """
        kinds = kinds or (("sqlite", "file") if index % 2 == 0 else ("file", "sqlite"))
        urls: dict[str, str] = {}
        roles: tuple[tuple[str, str, Mode], ...] = (
            ("S", kinds[0], "strict"),
            ("M", kinds[1], "monotonic"),
        )
        for role, kind, mode in roles:
            url = self.stores.get(role)
            if url is None:
                suffix = ".db" if kind == "sqlite" else ""
                url = url_of_path(kind, str(workdir / f"store-{role}{suffix}"))
                with contextlib.closing(open_store(url, mode=mode)):
                    pass
            urls[role] = url
        return urls

    def store_kinds(self, index: int) -> dict[str, str]:
        """What each role is, for reports."""
        kinds = ("sqlite", "file") if index % 2 == 0 else ("file", "sqlite")
        return {
            "S": self.stores.get("S", kinds[0]),
            "M": self.stores.get("M", kinds[1]),
        }

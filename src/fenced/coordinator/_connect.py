"""``fenced.connect(url)``: one URL picks the backend.

================================  ===========================================================
URL                               backend
================================  ===========================================================
none                              ``$FENCED_URL`` if set, else ``sqlite:.fenced/fenced.db``
``sqlite:////abs/path.db``        embedded: one host, many processes; ``sqlite:///rel.db``
                                  and ``sqlite:rel.db`` are relative (SQLAlchemy's rule)
``memory://NAME``                 in-process reference backend, for tests
``postgresql[+psycopg]://…``      PostgreSQL (``postgres://`` too; see docs/postgres.md)
``etcd://host:port[,…]``          an etcd 3.4+ cluster (``?prefix=/fenced``; see docs/etcd.md)
``zk://host:port[,…][/chroot]``   a ZooKeeper 3.5+ ensemble (see docs/zookeeper.md)
================================  ===========================================================

Instead of a URL, a ``psycopg_pool.ConnectionPool`` or a SQLAlchemy ``Engine`` (psycopg driver)
opens the PostgreSQL backend on the user's connections (see
:mod:`fenced._drivers.postgres_borrowed`). URLs are parsed by :mod:`fenced.core._urls` (local
paths by :func:`fenced._drivers.local.local_path`), the same parser every command uses.
An unknown scheme, or a backend whose extra is not installed, is a :class:`ConfigurationError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NoReturn

from fenced._drivers.local import local_path
from fenced.coordinator._client import Coordinator
from fenced.coordinator.backend import CoordinatorBackend
from fenced.core._clock import Clock, HostClock
from fenced.core._errors import ConfigurationError
from fenced.core._urls import redacted, scheme_of, url_of_path

__all__ = [
    "DEFAULT_URL",
    "absolute_url",
    "connect",
    "open_backend",
    "refuse_scheme",
    "resolve_url",
]

DEFAULT_URL = "sqlite:.fenced/fenced.db"
_SCHEMES = (
    "sqlite", "memory", "postgresql", "postgres", "etcd", "etcds", "zk", "http", "https",
)  # fmt: skip
_LATER: dict[str, str] = {}


def resolve_url(url: str | None) -> str:
    """The URL to use: ``url``, else ``$FENCED_URL``, else :data:`DEFAULT_URL`."""
    if url is None:
        url = os.environ.get("FENCED_URL") or DEFAULT_URL
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError("the coordinator URL must be a non-empty string")
    return url.strip()


def absolute_url(url: str) -> str:
    """``url`` as it must be handed to another process (``FENCED_URL`` of ``fenced run``'s
    command) or used after a ``chdir``: a ``sqlite:`` path made absolute (``sqlite:x.db`` →
    ``sqlite:////cwd/x.db``, what ``Coordinator.url`` says), any other URL unchanged (with its
    password, which ``Coordinator.url`` masks).

    Checks the URL as :func:`open_backend` would (ConfigurationError), and opens nothing (it
    reads at most two file headers: :func:`~fenced._drivers.local.local_path`).
    """
    scheme = scheme_of(url)
    if scheme == "sqlite":
        return url_of_path("sqlite", str(local_path(url, "sqlite")))
    if scheme not in _SCHEMES:
        refuse_scheme(scheme, url)
    return url


def refuse_scheme(scheme: str, url: str) -> NoReturn:
    shown = redacted(url)
    if scheme in _LATER:
        raise ConfigurationError(
            f"{shown!r}: {_LATER[scheme]} is not available in this version of fenced"
        )
    raise ConfigurationError(
        f"unknown coordinator URL scheme {scheme!r} in {shown!r}; "
        "expected sqlite:////abs/path.db (sqlite:///rel/path.db is relative), "
        "postgresql://..., etcd://host:port, zk://host:port[/chroot], "
        "http(s)://host:port (fenced serve) or memory://name"
    )


def open_backend(
    url: str | object,
    *,
    host_clock: HostClock | None = None,
    options: Mapping[str, object] | None = None,
    create: bool = True,
) -> CoordinatorBackend:
    """Open the backend named by ``url`` (already resolved), or the PostgreSQL backend on a
    user's pool or engine (``options``: what a URL's query would carry). ``create``: see
    :func:`connect`."""
    if not isinstance(url, str):
        return _postgres(url, "a pool or an engine", host_clock, options)
    scheme = scheme_of(url)
    if options is not None and scheme not in ("postgresql", "postgres"):
        raise ConfigurationError("options= is for a PostgreSQL pool or engine, not a URL")
    if scheme == "sqlite":
        from fenced.coordinator.backends.sqlite._backend import SQLiteBackend  # noqa: PLC0415

        backend: CoordinatorBackend = SQLiteBackend(
            local_path(url, "sqlite"), host_clock=host_clock, create=create
        )
        return backend
    if scheme == "memory":
        from fenced.coordinator.backends.memory._backend import MemoryBackend  # noqa: PLC0415

        return MemoryBackend(url[len("memory://") :] or "default", host_clock=host_clock)
    if scheme in ("postgresql", "postgres"):
        return _postgres(url, f"{scheme}://", host_clock, options)
    if scheme in ("etcd", "etcds"):
        if host_clock is not None:
            raise ConfigurationError(
                "etcd:// decides expiry by etcd leases (the etcd leader's clock); "
                "host_clock cannot be injected"
            )
        try:
            from fenced.coordinator.backends.etcd._backend import EtcdBackend  # noqa: PLC0415
        except ImportError as error:
            raise ConfigurationError(
                f"the etcd backend needs protobuf and grpcio: pip install 'fenced[etcd]' ({error})"
            ) from error
        return EtcdBackend(url)
    if scheme == "zk":
        if host_clock is not None:
            raise ConfigurationError(
                "zk:// decides expiry by the ZooKeeper leader's clock; "
                "host_clock cannot be injected"
            )
        try:
            from fenced.coordinator.backends.zookeeper._backend import (  # noqa: PLC0415
                ZooKeeperBackend,
            )
        except ImportError as error:
            raise ConfigurationError(
                f"the ZooKeeper backend needs kazoo: pip install 'fenced[zookeeper]' ({error})"
            ) from error
        return ZooKeeperBackend(url, create=create)
    if scheme in ("http", "https"):
        if host_clock is not None:
            raise ConfigurationError("host_clock= is for the embedded and memory backends")
        try:
            from fenced.coordinator.backends.http._backend import HttpBackend  # noqa: PLC0415
        except ImportError as error:
            raise ConfigurationError(
                f"the fenced serve client needs httpx: pip install 'fenced[http]' ({error})"
            ) from error
        return HttpBackend(url)
    refuse_scheme(scheme, url)


def _postgres(
    url: object, what: str, host_clock: HostClock | None, options: Mapping[str, object] | None
) -> CoordinatorBackend:
    if url is None or isinstance(url, os.PathLike | bytes):
        raise ConfigurationError(
            "a coordinator is named by a URL or given as a PostgreSQL pool or engine, not "
            + redacted(url)
        )
    if host_clock is not None:
        raise ConfigurationError(
            f"{what} decides expiry by the PostgreSQL server's clock; host_clock cannot be injected"
        )
    if options is not None and not isinstance(options, Mapping):
        raise ConfigurationError(f"options must be a mapping, got {type(options).__name__}")
    try:
        from fenced.coordinator.backends.postgres._backend import PostgresBackend  # noqa: PLC0415
    except ImportError as error:
        raise ConfigurationError(
            f"the PostgreSQL backend needs psycopg: pip install 'fenced[postgres]' ({error})"
        ) from error
    return PostgresBackend(url, options=options)


def connect(
    url: str | object | None = None,
    *,
    clock: Clock | None = None,
    host_clock: HostClock | None = None,
    options: Mapping[str, object] | None = None,
    create: bool = True,
) -> Coordinator:
    """Connect to the coordinator named by ``url`` (see the module docstring).

    ``create=False`` connects to an existing coordinator only, as a reader wants (``fenced
    status``, ``timeline``, ``metrics``): a ``sqlite:`` database that does not exist, or is
    empty, is a one-line :class:`ConfigurationError` naming it, and nothing is created (no
    directory, no file). Such a coordinator also reads on a full file system, where SQLite
    has no room for its shared memory (its writes then raise :class:`~fenced.Unavailable`).
    The server backends are not affected (their database exists; fenced's tables in it are
    created on first use either way).

    ``url`` may also be a ``psycopg_pool.ConnectionPool`` or a SQLAlchemy ``Engine``
    (``postgresql+psycopg``): the coordinator borrows its connections, never closes it, and
    takes one more for LISTEN while it waits (docs/postgres.md). ``options`` then carries what
    a URL's query would (``schema``, ``timeout``, ``listen``, ``listen_url``, ``prepare``); with a
    URL it must be None.

    ``clock`` (the deadline clock (``Clock.now``, CLOCK_BOOTTIME on Linux) of the holders'
    deadlines) and ``host_clock`` (the embedded backends' expiry clock) are injectable for
    tests; leave them unset in production.
    """
    target = resolve_url(url) if url is None or isinstance(url, str) else url
    backend = open_backend(target, host_clock=host_clock, options=options, create=create)
    return Coordinator(backend, clock=clock)

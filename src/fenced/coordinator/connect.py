"""``fenced.connect(url)``: one URL picks the backend.

============================  ===============================================================
URL                           backend
============================  ===============================================================
none                          ``$FENCED_URL`` if set, else ``sqlite:.fenced/fenced.db``
``sqlite:///abs/path``        embedded: one host, many processes (``sqlite:rel/path`` too)
``memory://NAME``             in-process reference backend, for tests
``postgresql://…``            PostgreSQL (``postgres://`` too; see docs/postgres.md)
``etcd://host:port[,…]``      an etcd 3.4+ cluster (``?prefix=/fenced``; see docs/etcd.md)
============================  ===============================================================

An unknown scheme, or a backend whose extra is not installed, is a :class:`ConfigurationError`.
"""

from __future__ import annotations

import os

from fenced.coordinator.backend import CoordinatorBackend
from fenced.coordinator.client import Coordinator
from fenced.core.clock import Clock, HostClock
from fenced.core.errors import ConfigurationError
from fenced.core.urls import path_from_url, scheme_of

__all__ = ["DEFAULT_URL", "connect", "open_backend", "resolve_url"]

DEFAULT_URL = "sqlite:.fenced/fenced.db"
_LATER = {
    "http": "the fenced server",
    "https": "the fenced server",
}


def resolve_url(url: str | None) -> str:
    """The URL to use: ``url``, else ``$FENCED_URL``, else :data:`DEFAULT_URL`."""
    if url is None:
        url = os.environ.get("FENCED_URL") or DEFAULT_URL
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError("the coordinator URL must be a non-empty string")
    return url.strip()


def open_backend(url: str, *, host_clock: HostClock | None = None) -> CoordinatorBackend:
    """Open the backend named by ``url`` (already resolved)."""
    scheme = scheme_of(url)
    if scheme == "sqlite":
        from fenced.coordinator.backends.sqlite.backend import SQLiteBackend  # noqa: PLC0415

        backend: CoordinatorBackend = SQLiteBackend(
            path_from_url(url, "sqlite"), host_clock=host_clock
        )
        return backend
    if scheme == "memory":
        from fenced.coordinator.backends.memory.backend import MemoryBackend  # noqa: PLC0415

        return MemoryBackend(url[len("memory://") :] or "default", host_clock=host_clock)
    if scheme in ("postgresql", "postgres"):
        if host_clock is not None:
            raise ConfigurationError(
                f"{scheme}:// decides expiry by the PostgreSQL server's clock; "
                "host_clock cannot be injected"
            )
        try:
            from fenced.coordinator.backends.postgres.backend import PostgresBackend  # noqa: PLC0415
        except ImportError as error:
            raise ConfigurationError(
                f"the PostgreSQL backend needs psycopg: pip install 'fenced[postgres]' ({error})"
            ) from error
        return PostgresBackend(url)
    if scheme == "etcd":
        if host_clock is not None:
            raise ConfigurationError(
                "etcd:// decides expiry by etcd leases (the etcd leader's clock); "
                "host_clock cannot be injected"
            )
        try:
            from fenced.coordinator.backends.etcd.backend import EtcdBackend  # noqa: PLC0415
        except ImportError as error:
            raise ConfigurationError(
                f"the etcd backend needs protobuf and grpcio: pip install 'fenced[etcd]' ({error})"
            ) from error
        return EtcdBackend(url)
    if scheme in _LATER:
        raise ConfigurationError(
            f"{url!r}: the {_LATER[scheme]} backend is not available in this version of fenced"
        )
    raise ConfigurationError(
        f"unknown coordinator URL scheme {scheme!r} in {url!r}; "
        "expected sqlite:///path, postgresql://..., etcd://host:port or memory://name"
    )


def connect(
    url: str | None = None, *, clock: Clock | None = None, host_clock: HostClock | None = None
) -> Coordinator:
    """Connect to the coordinator named by ``url`` (see the module docstring).

    ``clock`` (the deadline clock (``Clock.now``, CLOCK_BOOTTIME on Linux) of the holders'
    deadlines) and ``host_clock`` (the embedded backends' expiry clock) are injectable for
    tests; leave them unset in production.
    """
    return Coordinator(open_backend(resolve_url(url), host_clock=host_clock), clock=clock)

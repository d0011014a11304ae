"""``await fenced.aio.connect(url)``: one URL picks the backend, as for :func:`fenced.connect`.

The URL forms are the sync face's (:mod:`fenced.coordinator._connect`; ``None`` means
``$FENCED_URL``, else ``sqlite:.fenced/fenced.db``), and every backend has a native asyncio
twin: ``sqlite:`` (statements on one worker thread, waiting on the event loop's selector),
``memory://``, ``postgresql://`` (psycopg's async connections, LISTEN as async notifies) and
``etcd://`` / ``etcds://`` (``grpc.aio``, an async watch), ``zk://`` (kazoo's asynchronous
results handed to the loop). Bad URLs raise the same
:class:`~fenced.ConfigurationError` as the sync face, before any I/O.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from fenced._drivers.local import local_path
from fenced.aio._coordinator import AsyncCoordinator
from fenced.coordinator._connect import refuse_scheme, resolve_url
from fenced.coordinator.aio_backend import AsyncCoordinatorBackend
from fenced.core._clock import Clock
from fenced.core._errors import ConfigurationError
from fenced.core._urls import scheme_of

__all__ = ["connect", "open_async_backend"]


async def open_async_backend(
    url: str | object, *, create: bool = True, offload: bool = False
) -> AsyncCoordinatorBackend:
    """Open the asyncio backend named by ``url`` (already resolved); ``offload``: see
    :func:`connect`."""
    if not isinstance(url, str):
        raise ConfigurationError(
            "fenced.aio.connect takes a coordinator URL, not " + type(url).__name__
        )
    scheme = scheme_of(url)
    if not isinstance(offload, bool):
        raise ConfigurationError(f"offload must be True or False, got {offload!r}")
    if offload and scheme != "sqlite":
        raise ConfigurationError(
            "offload= is for the embedded sqlite: coordinator (the other backends do not block)"
        )
    if scheme == "sqlite":
        from fenced.coordinator.backends.sqlite._aio import open_async_sqlite  # noqa: PLC0415

        path = local_path(url, "sqlite")
        return await open_async_sqlite(path, create=create, offload=offload)
    if scheme == "memory":
        from fenced.coordinator.backends.memory._aio import AsyncMemoryBackend  # noqa: PLC0415

        return AsyncMemoryBackend(url[len("memory://") :] or "default")
    if scheme in ("postgresql", "postgres"):
        try:
            from fenced.coordinator.backends.postgres._aio import (  # noqa: PLC0415
                open_async_postgres,
            )
        except ImportError as error:
            raise ConfigurationError(
                f"the PostgreSQL backend needs psycopg: pip install 'fenced[postgres]' ({error})"
            ) from error
        backend: AsyncCoordinatorBackend = await open_async_postgres(url)
        return backend
    if scheme in ("etcd", "etcds"):
        try:
            from fenced.coordinator.backends.etcd._aio import open_async_etcd  # noqa: PLC0415
        except ImportError as error:
            raise ConfigurationError(
                f"the etcd backend needs protobuf and grpcio: pip install 'fenced[etcd]' ({error})"
            ) from error
        return await open_async_etcd(url)
    if scheme == "zk":
        try:
            from fenced.coordinator.backends.zookeeper._aio import (  # noqa: PLC0415
                open_async_zookeeper,
            )
        except ImportError as error:
            raise ConfigurationError(
                f"the ZooKeeper backend needs kazoo: pip install 'fenced[zookeeper]' ({error})"
            ) from error
        return await open_async_zookeeper(url, create=create)
    if scheme in ("http", "https"):
        try:
            from fenced.coordinator.backends.http._aio import open_async_http  # noqa: PLC0415
        except ImportError as error:
            raise ConfigurationError(
                f"an http(s):// coordinator needs httpx: pip install 'fenced[http]' ({error})"
            ) from error
        return await open_async_http(url)
    refuse_scheme(scheme, url)


class _Connecting:
    """What :func:`connect` returns: await it for the coordinator, or ``async with`` it to
    have the coordinator closed at the end of the block."""

    def __init__(self, url: str | None, clock: Clock | None, create: bool, offload: bool) -> None:
        self._url = url
        self._clock = clock
        self._create = create
        self._offload = offload
        self._coordinator: AsyncCoordinator | None = None

    async def _open(self) -> AsyncCoordinator:
        backend = await open_async_backend(
            resolve_url(self._url), create=self._create, offload=self._offload
        )
        try:
            return AsyncCoordinator(backend, clock=self._clock)
        except BaseException:
            await backend.aclose()
            raise

    def __await__(self) -> Generator[Any, None, AsyncCoordinator]:
        return self._open().__await__()

    async def __aenter__(self) -> AsyncCoordinator:
        self._coordinator = await self._open()
        return self._coordinator

    async def __aexit__(self, *exc: object) -> None:
        if self._coordinator is not None:
            await self._coordinator.aclose()


def connect(
    url: str | None = None,
    *,
    clock: Clock | None = None,
    create: bool = True,
    offload: bool = False,
) -> _Connecting:
    """Connect to the coordinator named by ``url`` for asyncio use.

    ``coord = await fenced.aio.connect(url)`` (close it with ``await coord.aclose()``), or
    ``async with fenced.aio.connect(url) as coord:``. ``create=False``: connect to an existing
    coordinator only (see :func:`fenced.connect`). ``offload=True`` (``sqlite:`` only): run the
    embedded coordinator's statements on a worker thread instead of the loop (docs/asyncio.md,
    "How each backend waits"). ``clock`` is injectable for tests.
    """
    return _Connecting(url, clock, create, offload)

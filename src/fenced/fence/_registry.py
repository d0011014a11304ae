"""The store kinds: which URL scheme opens which backend, loaded only when a URL asks for it.

:data:`STORE_KINDS` is the one table of store kinds (as SQLAlchemy finds dialects): a scheme
names the module and factory of a backend, as ``"module:factory"``. :func:`open_backend`
imports the module on first use, so an optional extra (``psycopg`` for ``postgresql://``) is
needed only by the URLs that use it, and :mod:`fenced.fence._store` imports no store kind.

A factory is called as ``factory(location, mode, options)`` and returns a
:class:`~fenced.fence.backend.Backend`; ``location`` is the URL's absolute path (``path`` kinds,
resolved by :func:`fenced._drivers.local.local_path`: the one parser of local URLs, with its
transition check) or the whole URL (``url`` kinds). A URL is parsed by
:func:`fenced.core._urls.scheme_of` (``postgresql+psycopg://`` is ``postgresql://``). Instead of a
URL, a ``psycopg_pool.ConnectionPool`` or a SQLAlchemy ``Engine`` opens the ``postgresql`` kind
with that object as its location. An unknown scheme is :class:`~fenced.ConfigurationError`; a
kind whose extra is not installed is a ConfigurationError naming the extra to install.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

from fenced._drivers.local import local_path
from fenced.core._errors import ConfigurationError
from fenced.core._urls import redacted, scheme_of
from fenced.fence._values import Mode
from fenced.fence.backend import Backend, StoreOptions

__all__ = ["STORE_KINDS", "StoreKind", "check_url", "kind_of", "open_backend"]

Factory = Callable[[object, Mode | None, StoreOptions], Backend]


@dataclass(frozen=True, slots=True)
class StoreKind:
    """One store kind: where its backend factory lives and what it is given."""

    factory: str
    """``"package.module:function"``, imported on first use."""
    location: Literal["path", "url"]
    """Whether the factory gets the URL's path or the whole URL."""
    alias: bool = False
    """Another spelling of a scheme listed before it (not shown in error messages)."""
    green: str | None = None
    """The factory of the same backend for sync code run on an event loop
    (:mod:`fenced._drivers.green`: the asyncio face's non-blocking I/O), if the kind has one;
    it is given a URL only."""
    store: bool = False
    """The factory opens a whole :class:`~fenced.Store`, not a backend: a store served
    elsewhere (``http``: ``fenced serve``'s own store decides every operation). Called as
    ``factory(url, mode, options)``."""
    extra: str | None = None
    """The extra that installs the kind's driver, named when its import fails."""

    def load(self, green: bool = False) -> Factory:
        """Import the module and return the factory (the ``green`` one if asked).

        A missing driver is :class:`ConfigurationError` naming the extra to install.
        """
        module, _, name = (self.green if green and self.green else self.factory).partition(":")
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as error:
            if self.extra is None or (error.name or "").startswith("fenced"):
                raise
            raise ConfigurationError(
                f"this store kind needs {(error.name or '?').split('.')[0]}: pip install "
                f"'fenced[{self.extra}]'"
            ) from None
        return cast(Factory, getattr(loaded, name))

    def runs_green(self, url: object) -> bool:
        """Whether the asyncio face opens ``url`` (of this kind) with :attr:`green`."""
        return self.green is not None and isinstance(url, str)


STORE_KINDS: dict[str, StoreKind] = {
    "file": StoreKind("fenced.fence.file._store:open_file_backend", "path"),
    "sqlite": StoreKind("fenced.fence.sqlite._store:open_sqlite_backend", "path"),
    "postgresql": StoreKind(
        "fenced.fence.postgres._store:open_postgres_backend",
        "url",
        green="fenced.fence.postgres._store:open_green_postgres_backend",
        extra="postgres",
    ),
    "postgres": StoreKind(
        "fenced.fence.postgres._store:open_postgres_backend",
        "url",
        alias=True,
        green="fenced.fence.postgres._store:open_green_postgres_backend",
        extra="postgres",
    ),
    "s3": StoreKind("fenced.fence.s3._store:open_s3_backend", "url", extra="s3"),
    "http": StoreKind("fenced.fence.http._store:open_http_store", "url", store=True, extra="http"),
    "https": StoreKind("fenced.fence.http._store:open_http_store", "url", store=True, extra="http"),
}
"""Every store kind, by URL scheme."""


POOL_KIND = "postgresql"
"""The kind a pool or an engine (anything but a URL string) opens."""


def kind_of(url: object) -> tuple[str, StoreKind]:
    """The scheme of ``url`` and its store kind; :class:`ConfigurationError` if none. A
    non-string (a user's pool or engine) is the :data:`POOL_KIND` kind, checked by its
    backend."""
    if not isinstance(url, str):
        if url is None or isinstance(url, os.PathLike | bytes):
            raise ConfigurationError(
                f"a store is named by a URL (e.g. sqlite:////abs/store.db, file:///abs/dir) or "
                f"given as a PostgreSQL pool or engine, not {redacted(url)}"
            )
        return POOL_KIND, STORE_KINDS[POOL_KIND]
    scheme = scheme_of(url)
    kind = STORE_KINDS.get(scheme)
    if kind is None:
        known = ", ".join(f"{name}://" for name, kind in STORE_KINDS.items() if not kind.alias)
        raise ConfigurationError(f"no store for {scheme}: URLs (available: {known})")
    return scheme, kind


def check_url(url: object) -> None:
    """Refuse what :func:`open_backend` would refuse of ``url`` itself (its scheme, a local
    path's spelling), opening and creating nothing: ConfigurationError."""
    scheme, kind = kind_of(url)
    if kind.location == "path":
        assert isinstance(url, str)
        local_path(url, scheme)


def open_backend(
    url: object, mode: Mode | None, options: StoreOptions, *, green: bool = False
) -> Backend:
    """Open the backend of ``url`` with validated ``options`` (see the module docstring); with
    ``green``, the kind's green factory where :meth:`StoreKind.runs_green`."""
    scheme, kind = kind_of(url)
    if kind.location == "path":
        assert isinstance(url, str)
        if options.backend_options is not None:
            raise ConfigurationError(f"options= is for a pool or an engine, not {scheme}: stores")
        return kind.load()(str(local_path(url, scheme)), mode, options)
    return kind.load(green and kind.runs_green(url))(url, mode, options)

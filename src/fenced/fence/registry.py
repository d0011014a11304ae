"""The store kinds: which URL scheme opens which backend, loaded only when a URL asks for it.

:data:`STORE_KINDS` is the one table of store kinds (as SQLAlchemy finds dialects): a scheme
names the module and factory of a backend, as ``"module:factory"``. :func:`open_backend`
imports the module on first use, so an optional extra (``psycopg`` for ``postgresql://``) is
needed only by the URLs that use it, and :mod:`fenced.fence.store` imports no store kind.

A factory is called as ``factory(location, mode, options)`` and returns a
:class:`~fenced.fence.backend.Backend`; ``location`` is the URL's path (``path`` kinds) or the
whole URL (``url`` kinds). An unknown scheme is :class:`~fenced.ConfigurationError`; a kind
whose extra is not installed fails as its module's import does (with the extra to install).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

from fenced.core.errors import ConfigurationError
from fenced.core.urls import path_from_url, scheme_of
from fenced.fence.backend import Backend, StoreOptions
from fenced.fence.values import Mode

__all__ = ["STORE_KINDS", "StoreKind", "kind_of", "open_backend"]

Factory = Callable[[str, Mode | None, StoreOptions], Backend]


@dataclass(frozen=True, slots=True)
class StoreKind:
    """One store kind: where its backend factory lives and what it is given."""

    factory: str
    """``"package.module:function"``, imported on first use."""
    location: Literal["path", "url"]
    """Whether the factory gets the URL's path or the whole URL."""
    alias: bool = False
    """Another spelling of a scheme listed before it (not shown in error messages)."""

    def load(self) -> Factory:
        """Import the module and return the factory."""
        module, _, name = self.factory.partition(":")
        return cast(Factory, getattr(importlib.import_module(module), name))


STORE_KINDS: dict[str, StoreKind] = {
    "file": StoreKind("fenced.fence.file.store:open_file_backend", "path"),
    "sqlite": StoreKind("fenced.fence.sqlite.store:open_sqlite_backend", "path"),
    "postgresql": StoreKind("fenced.fence.postgres.store:open_postgres_backend", "url"),
    "postgres": StoreKind("fenced.fence.postgres.store:open_postgres_backend", "url", alias=True),
}
"""Every store kind, by URL scheme."""


def kind_of(url: str) -> tuple[str, StoreKind]:
    """The scheme of ``url`` and its store kind; :class:`ConfigurationError` if none."""
    scheme = scheme_of(url)
    kind = STORE_KINDS.get(scheme)
    if kind is None:
        known = ", ".join(f"{name}://" for name, kind in STORE_KINDS.items() if not kind.alias)
        raise ConfigurationError(f"no store for {scheme}: URLs (available: {known})")
    return scheme, kind


def open_backend(url: str, mode: Mode | None, options: StoreOptions) -> Backend:
    """Open the backend of ``url`` with validated ``options`` (see the module docstring)."""
    scheme, kind = kind_of(url)
    location = path_from_url(url, scheme) if kind.location == "path" else url
    return kind.load()(location, mode, options)

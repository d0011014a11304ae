"""What the store conformance classes share: the names and tokens their tests use, the
``make_store`` fixture's type, the snapshots of local stores, and :class:`CapabilityConformance`,
the base class every conformance class derives from.

:func:`sqlite_snapshot` and :func:`directory_snapshot` read a local store's state with their own
connection or file reads, leaving out records (diagnostics that a rejected operation still adds);
they raise what :mod:`sqlite3` or the file system raises when the location cannot be read.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pytest

from fenced._drivers.local import local_path
from fenced.core._token import FencingToken
from fenced.fence import Capability, Store
from fenced.fence._values import Mode

__all__ = [
    "C1",
    "C2",
    "CapabilityConformance",
    "MakeStore",
    "R",
    "directory_snapshot",
    "sqlite_snapshot",
    "store_location",
    "token",
]

R = "exports/daily"
C1 = "c1" * 16
C2 = "c2" * 16


def token(epoch: int, resource: str = R, coordinator: str = C1) -> FencingToken:
    """A token of ``coordinator`` (default :data:`C1`) for ``resource`` at ``epoch``."""
    return FencingToken(coordinator, resource, epoch)


class MakeStore(Protocol):
    """The ``make_store`` fixture: opens the test's store URL (the same URL at every call)."""

    def __call__(self, mode: Mode | None = None, **options: Any) -> Store: ...


def store_location(store: Store) -> Path:
    """The path a local store lives at (a database file or a directory)."""
    return local_path(store.url)


def sqlite_snapshot(store: Store) -> list[str]:
    """Every row of a ``sqlite:`` store but its records, as SQL text (own connection)."""
    conn = sqlite3.connect(store_location(store))
    try:
        return [
            line
            for line in conn.iterdump()
            if not line.startswith('INSERT INTO "records"') and '"sqlite_sequence"' not in line
        ]
    finally:
        conn.close()


def directory_snapshot(store: Store) -> dict[str, bytes]:
    """Every file of a ``file:`` store with its bytes, except lock files, record journals and
    ``trash/`` (what gc removed, unlinked by a helper thread at its own pace: never read)."""
    root = store_location(store)
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
        and path.parent.name not in ("locks", "trash")
        and path.name != "records.jsonl"
    }


class CapabilityConformance:
    """The base of every store conformance class: the capabilities it tests (``required``),
    the ``strict`` and ``monotonic`` fixtures, and the check that the store declares them.

    The store's test module provides ``make_store`` and ``snapshot`` (see
    :mod:`fenced.testing.store_conformance`).
    """

    required: ClassVar[frozenset[Capability]] = frozenset()

    @pytest.fixture
    def strict(self, make_store: MakeStore) -> Store:
        return make_store("strict")

    @pytest.fixture
    def monotonic(self, make_store: MakeStore) -> Store:
        return make_store("monotonic")

    def test_declares_the_capabilities_it_is_tested_for(self, make_store: MakeStore) -> None:
        assert self.required <= make_store().capabilities

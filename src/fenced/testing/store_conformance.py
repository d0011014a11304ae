"""The store conformance suite: docs/stores.md as tests, run against every store URL.

A store's test module subclasses the classes of the capabilities its store has (all of them:
:class:`StoreConformance`) and provides two fixtures::

    class TestSQLiteStore(StoreConformance):
        @pytest.fixture
        def make_store(self, tmp_path):           # make_store(mode=None, **options) -> Store
            opened = []
            def make(mode=None, **options):
                opened.append(fenced.open_store(f"sqlite:///{tmp_path}/s.db", mode, **options))
                return opened[-1]
            yield make
            for store in opened:
                store.close()

        @pytest.fixture
        def snapshot(self):                      # the store's complete state, comparable with ==
            return sqlite_snapshot

Every call of ``make_store`` within one test opens the **same** fresh URL. ``snapshot(store)``
returns everything the store holds (:func:`sqlite_snapshot`, :func:`directory_snapshot`), so a
test can assert that a rejected operation changed nothing at all.

* :class:`FencingConformance` — every store: fence, floor, binding, modes, closing.
* :class:`KeysConformance` — :attr:`Capability.KEYS`: put/get, ``if_version``, the seeds' traces.
* :class:`PublicationConformance` — :attr:`Capability.PUBLICATION`: publish/latest/read/open/gc.
* :class:`OpIdConformance` — :attr:`Capability.OP_IDS`: operation ids.
* :class:`LocalFilesConformance` — :attr:`Capability.LOCAL_FILES`: nothing written outside.
* :class:`RecordsConformance` — :attr:`Capability.RECORDS`: install, accept and reject records
  (``history``), retention, ``floors``.

Records are diagnostics: the snapshots leave them out (a rejected operation changes no data,
even though it leaves a record), and :class:`RecordsConformance` checks them through
``history``.

Nothing here skips: a store that lacks a capability does not subclass that class, and each class
checks that the store declares the capability it tests. Multi-process behaviour (SIGSTOP,
SIGKILL) is tested by the repository's own process tests.

This module holds :class:`FencingConformance`, :class:`KeysConformance`,
:class:`LocalFilesConformance` and :class:`StoreConformance`, and re-exports the rest of the suite:
the shared names, tokens and snapshots (:mod:`fenced.testing.store_fixtures`),
:class:`PublicationConformance` (:mod:`fenced.testing.store_publication_conformance`),
:class:`OpIdConformance` and :class:`RecordsConformance`
(:mod:`fenced.testing.store_records_conformance`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from fenced.core._errors import (
    ConfigurationError,
    ForeignToken,
    InvalidName,
    NotInstalled,
    StaleToken,
    VersionConflict,
)
from fenced.fence import Capability, Store, open_store
from fenced.fence._values import Mode
from fenced.testing.store_fixtures import (
    C1,
    C2,
    CapabilityConformance,
    MakeStore,
    R,
    directory_snapshot,
    sqlite_snapshot,
    store_location,
    token,
)
from fenced.testing.store_publication_conformance import PublicationConformance
from fenced.testing.store_records_conformance import OpIdConformance, RecordsConformance

__all__ = [
    "C1",
    "C2",
    "FencingConformance",
    "KeysConformance",
    "LocalFilesConformance",
    "MakeStore",
    "OpIdConformance",
    "PublicationConformance",
    "R",
    "RecordsConformance",
    "StoreConformance",
    "directory_snapshot",
    "sqlite_snapshot",
    "store_location",
    "token",
]


class FencingConformance(CapabilityConformance):
    """fence, floor, binding and modes: every store."""

    def test_fence_sets_and_returns_the_floor(
        self, strict: Store, snapshot: Callable[[Store], object]
    ) -> None:
        assert strict.floor(R) is None
        assert strict.fence(token(5)) == 5
        assert strict.fence(token(5)) == 5  # idempotent
        assert strict.fence(token(7)) == 7
        before = snapshot(strict)
        with pytest.raises(StaleToken) as caught:
            strict.fence(token(6))
        assert (caught.value.resource, caught.value.presented, caught.value.floor) == (R, 6, 7)
        assert strict.floor(R) == 7
        assert snapshot(strict) == before

    def test_floors_are_per_resource(self, strict: Store) -> None:
        strict.fence(token(9, "a"))
        assert strict.floor("a") == 9
        assert strict.floor("b") is None
        assert strict.fence(token(1, "b")) == 1

    def test_the_first_token_binds_the_resource_to_its_coordinator(
        self, strict: Store, snapshot: Callable[[Store], object]
    ) -> None:
        strict.fence(token(5))
        before = snapshot(strict)
        with pytest.raises(ForeignToken) as caught:
            strict.fence(token(50, coordinator=C2))
        assert (caught.value.presented, caught.value.bound) == (C2, C1)
        assert snapshot(strict) == before
        assert strict.floor(R) == 5
        assert strict.fence(token(3, "other", C2)) == 3  # another resource binds on its own

    def test_the_mode_is_chosen_at_creation_and_kept(self, make_store: MakeStore) -> None:
        store = make_store()
        assert store.mode == "strict"
        assert make_store(None).mode == "strict"
        assert make_store("strict").mode == "strict"
        with pytest.raises(ConfigurationError, match="strict mode"):
            make_store("monotonic")

    def test_a_monotonic_store_stays_monotonic(self, make_store: MakeStore) -> None:
        assert make_store("monotonic").mode == "monotonic"
        assert make_store().mode == "monotonic"
        with pytest.raises(ConfigurationError, match="monotonic mode"):
            make_store("strict")

    def test_bad_arguments_are_configuration_errors(self, strict: Store) -> None:
        with pytest.raises(ConfigurationError, match="mode"):
            open_store(strict.url, "lenient")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="FencingToken"):
            strict.fence(str(token(1)))  # type: ignore[arg-type]
        for bad in ("", "../x", "/abs", "a//b", "x" * 256, "nul\x00"):
            with pytest.raises(InvalidName):
                strict.floor(bad)
        with pytest.raises(ConfigurationError, match="op_retention"):
            open_store(strict.url, op_retention=0)
        with pytest.raises(ConfigurationError, match="gc_grace"):
            open_store(strict.url, gc_grace=-1)
        with pytest.raises(ConfigurationError, match="busy_timeout"):
            open_store(strict.url, busy_timeout=float("nan"))

    def test_a_closed_store_refuses_work(self, strict: Store) -> None:
        with strict as same:
            assert same is strict
        strict.close()  # idempotent
        with pytest.raises(ConfigurationError, match="closed"):
            strict.floor(R)
        with pytest.raises(ConfigurationError, match="closed"):
            strict.fence(token(1))

    def test_concurrent_fences_leave_the_largest_epoch(self, strict: Store) -> None:
        results: list[int] = []
        stale: list[int] = []
        epochs = list(range(1, 41))
        lock = threading.Lock()

        def work(mine: list[int]) -> None:
            for epoch in mine:
                try:
                    floor = strict.fence(token(epoch))
                    with lock:
                        results.append(floor)
                except StaleToken as error:
                    assert error.floor > epoch
                    with lock:
                        stale.append(epoch)

        threads = [threading.Thread(target=work, args=(epochs[i::4][::-1],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert len(results) + len(stale) == len(epochs)
        assert strict.floor(R) == 40


class KeysConformance(CapabilityConformance):
    """put/get with ``if_version`` and the fencing rules on keys."""

    required = frozenset({Capability.KEYS})

    def test_put_and_get_round_trip(self, monotonic: Store) -> None:
        assert monotonic.get(R, "config") is None
        version = monotonic.put(token(3), "config", b"one")
        assert (version.resource, version.key, version.epoch, version.version) == (
            R,
            "config",
            3,
            1,
        )
        assert monotonic.put(token(4), "config", bytearray(b"two")).version == 2
        item = monotonic.get(R, "config")
        assert item is not None
        assert (item.resource, item.key, item.value, item.epoch, item.version) == (
            R,
            "config",
            b"two",
            4,
            2,
        )
        assert monotonic.put(token(4), "empty", memoryview(b"")).version == 1
        empty = monotonic.get(R, "empty")
        assert empty is not None and empty.value == b""
        assert monotonic.get("other", "config") is None

    def test_a_token_writes_only_its_own_resource(self, monotonic: Store) -> None:
        monotonic.put(token(1, "team/a"), "k", b"a")
        assert monotonic.get("team/b", "k") is None
        item = monotonic.get("team/a", "k")
        assert item is not None and item.value == b"a"
        assert monotonic.floor("team/b") is None

    def test_strict_mode_needs_the_epoch_installed(
        self, strict: Store, snapshot: Callable[[Store], object]
    ) -> None:
        before = snapshot(strict)
        with pytest.raises(NotInstalled, match="fence") as caught:
            strict.put(token(5), "k", b"v")
        assert (caught.value.presented, caught.value.floor) == (5, 0)
        assert snapshot(strict) == before
        assert strict.floor(R) is None
        strict.fence(token(5))
        assert strict.put(token(5), "k", b"v").version == 1
        before = snapshot(strict)
        with pytest.raises(NotInstalled) as not_installed:
            strict.put(token(6), "k", b"newer")
        assert (not_installed.value.presented, not_installed.value.floor) == (6, 5)
        with pytest.raises(StaleToken):
            strict.put(token(4), "k", b"older")
        assert snapshot(strict) == before

    def test_monotonic_mode_installs_a_higher_epoch(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        monotonic.put(token(5), "k", b"five")
        assert monotonic.floor(R) == 5
        monotonic.put(token(7), "k", b"seven")
        assert monotonic.floor(R) == 7
        before = snapshot(monotonic)
        with pytest.raises(StaleToken) as caught:
            monotonic.put(token(6), "k", b"six")
        assert (caught.value.presented, caught.value.floor) == (6, 7)
        assert snapshot(monotonic) == before

    @pytest.mark.parametrize("mode", ["strict", "monotonic"])
    def test_seed_trace_a_delayed_41_fails_atomically_once_42_is_installed(
        self, make_store: MakeStore, snapshot: Callable[[Store], object], mode: Mode
    ) -> None:
        store = make_store(mode)
        store.fence(token(41))  # the store has seen 41
        store.put(token(41), "export", b"by 41")
        assert store.fence(token(42)) == 42  # the successor installs 42 before it writes
        before = snapshot(store)
        with pytest.raises(StaleToken) as caught:
            store.put(token(41), "export", b"late write of 41")
        assert (caught.value.presented, caught.value.floor) == (41, 42)
        assert snapshot(store) == before  # nothing changed at all
        item = store.get(R, "export")
        assert item is not None and (item.value, item.epoch) == (b"by 41", 41)

    def test_an_old_write_before_the_new_owners_first_write_monotonic_accepts_it(
        self, monotonic: Store
    ) -> None:
        """Monotonic mode orders writes; it does not exclude an old owner before the new one
        writes: A (81) is accepted as long as the store has seen nothing newer."""
        monotonic.put(token(81), "export", b"A part 1")
        # B was granted 82 by the coordinator but has not reached the store yet.
        assert monotonic.put(token(81), "export", b"A part 2 (late)").version == 2
        monotonic.put(token(82), "export", b"B")
        with pytest.raises(StaleToken):
            monotonic.put(token(81), "export", b"A part 3")
        item = monotonic.get(R, "export")
        assert item is not None and (item.value, item.epoch) == (b"B", 82)

    def test_an_old_write_before_the_new_owners_first_write_strict_rejects_it(
        self, strict: Store, snapshot: Callable[[Store], object]
    ) -> None:
        """Strict mode: once B installed 82 (fence, as hold(fence=[store]) does), A's 81 is
        rejected even though B has not written anything yet."""
        strict.fence(token(81))
        strict.put(token(81), "export", b"A part 1")
        strict.fence(token(82))  # B installs, writes nothing yet
        before = snapshot(strict)
        with pytest.raises(StaleToken):
            strict.put(token(81), "export", b"A part 2 (late)")
        assert snapshot(strict) == before

    def test_if_version_compare_and_set(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        assert monotonic.put(token(1), "k", b"a", if_version=0).version == 1
        before = snapshot(monotonic)
        with pytest.raises(VersionConflict) as caught:
            monotonic.put(token(1), "k", b"b", if_version=0)
        assert (caught.value.expected, caught.value.actual) == (0, 1)
        with pytest.raises(VersionConflict):
            monotonic.put(token(1), "k", b"b", if_version=2)
        with pytest.raises(VersionConflict) as absent:
            monotonic.put(token(1), "missing", b"b", if_version=1)
        assert (absent.value.expected, absent.value.actual) == (1, 0)
        assert snapshot(monotonic) == before
        assert monotonic.put(token(1), "k", b"b", if_version=1).version == 2
        assert monotonic.put(token(1), "k", b"c").version == 3

    def test_a_foreign_token_is_rejected(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        monotonic.put(token(1), "k", b"mine")
        before = snapshot(monotonic)
        with pytest.raises(ForeignToken):
            monotonic.put(token(2, coordinator=C2), "k", b"theirs")
        assert snapshot(monotonic) == before

    def test_bad_input_is_refused_before_any_change(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        monotonic.put(token(1), "k", b"v")
        before = snapshot(monotonic)
        bad_keys: list[object] = ["", "x" * 256, "../x", "/abs", "a\x00b", "a//b", "a/./b", "é", 5]
        for key in bad_keys:
            with pytest.raises(InvalidName):
                monotonic.put(token(1), key, b"v")  # type: ignore[arg-type]
            with pytest.raises(InvalidName):
                monotonic.get(R, key)  # type: ignore[arg-type]
        assert monotonic.put(token(1), "x" * 255, b"v").version == 1  # the limit itself is fine
        before = snapshot(monotonic)
        for value in ("text", 5, None):
            with pytest.raises(ConfigurationError, match="bytes"):
                monotonic.put(token(1), "k", value)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="at most"):
            monotonic.put(token(1), "k", bytes(16 * 1024 * 1024 + 1))
        for if_version in (-1, True, "1", 1.0):
            with pytest.raises(ConfigurationError, match="if_version"):
                monotonic.put(token(1), "k", b"v", if_version=if_version)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="FencingToken"):
            monotonic.put(str(token(1)), "k", b"v")  # type: ignore[arg-type]
        assert snapshot(monotonic) == before

    def test_threads_racing_with_compare_and_set_lose_no_update(self, monotonic: Store) -> None:
        """Four threads increment one counter with compare-and-set. Their first attempts are
        forced to collide: none writes before all four have read version 1."""
        monotonic.put(token(1), "counter", b"0")
        errors: list[BaseException] = []
        conflicts: list[int] = []
        all_read = threading.Barrier(4)

        def increment(times: int) -> None:
            first = True
            try:
                for _ in range(times):
                    while True:
                        item = monotonic.get(R, "counter")
                        assert item is not None
                        value = str(int(item.value) + 1).encode()
                        if first:
                            first = False
                            all_read.wait(timeout=30)
                        try:
                            monotonic.put(token(1), "counter", value, if_version=item.version)
                            break
                        except VersionConflict:
                            conflicts.append(item.version)
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=increment, args=(8,)) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        assert conflicts.count(1) == 3  # the first attempts collided: one won, three retried
        item = monotonic.get(R, "counter")
        assert item is not None and (item.value, item.version) == (b"32", 33)


def _outside(store: Store) -> Callable[[], set[str]]:
    """A function listing every path under the store's parent that is not the store's own."""
    location = store_location(store)
    parent = location.parent
    mine = (location.name, f"{location.name}-wal", f"{location.name}-shm")

    def listing() -> set[str]:
        found: set[str] = set()
        for directory, dirs, files in os.walk(parent):
            if Path(directory) == parent:
                dirs[:] = [d for d in dirs if d not in mine]
            names = [*dirs, *(f for f in files if Path(directory) != parent or f not in mine)]
            found.update(os.path.join(directory, name) for name in names)
        return found

    return listing


class LocalFilesConformance(CapabilityConformance):
    """A local store writes nothing outside its location, whatever names it is given."""

    required = frozenset({Capability.LOCAL_FILES})

    def test_traversal_attempts_write_nothing_outside_the_store(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        listing = _outside(monotonic)
        monotonic.put(token(1), "k", b"v")
        monotonic.publish(token(1), b"data")
        outside_before, before = listing(), snapshot(monotonic)
        attempts = ["../evil", "../../evil", "/etc/evil", "a/../../evil", "evil\x00.txt", ".."]
        for name in attempts:
            with pytest.raises(InvalidName):
                monotonic.put(token(1), name, b"evil")
            with pytest.raises(InvalidName):
                monotonic.publish(token(1), b"evil", name=name)
            with pytest.raises(InvalidName):
                monotonic.get(R, name)
            with pytest.raises(InvalidName):
                token(1, resource=name)
        assert listing() == outside_before
        assert snapshot(monotonic) == before
        assert not [p for p in listing() if "evil" in p]

    def test_normal_work_stays_inside_the_store(self, monotonic: Store) -> None:
        listing = _outside(monotonic)
        outside_before = listing()
        for index in range(3):
            monotonic.put(token(1, f"r/{index}"), "k", b"v")
            monotonic.publish(token(1, f"r/{index}"), b"data", name="a/b/c")
        monotonic.gc(keep=0, grace=0)
        assert listing() == outside_before


class StoreConformance(
    FencingConformance,
    KeysConformance,
    PublicationConformance,
    OpIdConformance,
    LocalFilesConformance,
    RecordsConformance,
):
    """Every conformance class, for a store with every capability."""

    required = frozenset(Capability)

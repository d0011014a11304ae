"""The store conformance suite: DESIGN §3 as tests, run against every store URL.

A store's test module subclasses the classes of the capabilities its store has (all of them:
:class:`StoreConformance`) and provides two fixtures::

    class TestSQLiteStore(StoreConformance):
        @pytest.fixture
        def make_store(self, tmp_path):           # make_store(mode=None, **options) -> Store
            opened = []
            def make(mode=None, **options):
                opened.append(fenced.open_store(f"sqlite://{tmp_path}/s.db", mode, **options))
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
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import pytest

from fenced.core.clock import ManualClock
from fenced.core.errors import (
    ConfigurationError,
    ForeignToken,
    IdempotencyConflict,
    InvalidName,
    NotInstalled,
    StaleToken,
    VersionConflict,
)
from fenced.core.records import Record, RecordKind
from fenced.core.token import FencingToken
from fenced.core.urls import path_from_url, scheme_of
from fenced.fence import Capability, Publication, Store, open_store
from fenced.fence.values import Mode

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
    return Path(path_from_url(store.url, scheme_of(store.url)))


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


def _payload(size: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (size // len(block) + 1))[:size]


class _Base:
    """Fixtures shared by the conformance classes.

    The store's test module provides ``make_store`` and ``snapshot`` (see the module docstring).
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


class FencingConformance(_Base):
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


class KeysConformance(_Base):
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


class PublicationConformance(_Base):
    """publish / latest / read / open / gc."""

    required = frozenset({Capability.PUBLICATION})

    def test_publish_then_latest_read_and_open(self, monotonic: Store) -> None:
        data = _payload(5000)
        publication = monotonic.publish(token(7), data)
        assert isinstance(publication, Publication)
        assert (publication.resource, publication.name, publication.epoch) == (R, "", 7)
        assert publication.object_id.startswith(f"{7:020d}-")
        assert publication.sha256 == hashlib.sha256(data).hexdigest()
        assert publication.size == len(data)
        assert isinstance(publication.published_at, float)
        assert monotonic.latest(R) == publication
        assert monotonic.read(R) == data
        with monotonic.open(R) as stream:
            assert stream.read(10) == data[:10]
            assert stream.read() == data[10:]

    def test_nothing_published(self, monotonic: Store) -> None:
        assert monotonic.latest(R) is None
        with pytest.raises(LookupError):
            monotonic.read(R)
        with pytest.raises(LookupError):
            monotonic.open(R)
        monotonic.publish(token(1), b"x")
        assert monotonic.latest(R, "other") is None

    def test_names_are_separate_pointers(self, monotonic: Store) -> None:
        first = monotonic.publish(token(1), b"default")
        second = monotonic.publish(token(1), b"part", name="parts/0001.csv")
        assert monotonic.latest(R) == first
        assert monotonic.latest(R, "parts/0001.csv") == second
        assert monotonic.read(R, "parts/0001.csv") == b"part"
        assert first.object_id != second.object_id

    def test_publish_streams_a_path_and_a_binary_stream(
        self, monotonic: Store, tmp_path: Path
    ) -> None:
        data = _payload(2 * 1024 * 1024 + 12345, seed=1)
        path = tmp_path / "export.bin"
        path.write_bytes(data)
        from_path = monotonic.publish(token(1), path)
        assert (from_path.size, from_path.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        assert monotonic.read(R) == data
        from_stream = monotonic.publish(token(1), io.BytesIO(data[:100]), name="head")
        assert from_stream.size == 100
        assert monotonic.read(R, "head") == data[:100]
        empty = monotonic.publish(token(1), b"", name="empty")
        assert (empty.size, monotonic.read(R, "empty")) == (0, b"")
        for bad in (str(path), 5, io.StringIO("text")):
            with pytest.raises(ConfigurationError):
                monotonic.publish(token(1), bad, name="bad")  # type: ignore[arg-type]
        assert monotonic.latest(R, "bad") is None

    @pytest.mark.parametrize("mode", ["strict", "monotonic"])
    def test_seed_trace_export_81_82_the_visible_export_stays_bs(
        self, make_store: MakeStore, snapshot: Callable[[Store], object], mode: Mode
    ) -> None:
        store = make_store(mode)
        store.fence(token(81))  # A got 81, then paused during its long transformation
        store.fence(token(82))  # B got 82 and installed it
        b_export = store.publish(token(82), b"export by B")
        before = snapshot(store)
        with pytest.raises(StaleToken) as caught:  # A resumes and publishes
            store.publish(token(81), b"export by A")
        assert (caught.value.presented, caught.value.floor) == (81, 82)
        assert snapshot(store) == before  # A's staged object is gone too
        assert store.latest(R) == b_export
        assert store.read(R) == b"export by B"

    def test_the_pointer_never_moves_backwards(self, monotonic: Store) -> None:
        monotonic.publish(token(5), b"five")
        same_epoch = monotonic.publish(token(5), b"five again")
        assert monotonic.latest(R) == same_epoch
        with pytest.raises(StaleToken):
            monotonic.publish(token(3), b"three")
        assert monotonic.latest(R) == same_epoch
        assert monotonic.read(R) == b"five again"

    def test_strict_publication_needs_the_epoch_installed(
        self, strict: Store, snapshot: Callable[[Store], object]
    ) -> None:
        before = snapshot(strict)
        with pytest.raises(NotInstalled):
            strict.publish(token(1), b"data")
        assert snapshot(strict) == before
        strict.fence(token(1))
        assert strict.publish(token(1), b"data").epoch == 1

    def test_a_foreign_publication_is_rejected(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        monotonic.publish(token(1), b"mine")
        before = snapshot(monotonic)
        with pytest.raises(ForeignToken):
            monotonic.publish(token(2, coordinator=C2), b"theirs")
        assert snapshot(monotonic) == before

    def test_an_open_stream_is_a_snapshot(self, monotonic: Store) -> None:
        old = _payload(3 * 1024 * 1024, seed=2)
        monotonic.publish(token(1), old)
        with monotonic.open(R) as stream:
            first = stream.read(1000)
            monotonic.publish(token(2), b"newer")
            assert monotonic.gc(keep=1) == 0  # superseded just now: inside the grace period
            assert first + stream.read() == old
        assert monotonic.read(R) == b"newer"

    def test_gc_keeps_current_and_newest_and_waits_for_the_grace_period(
        self, make_store: MakeStore
    ) -> None:
        clock = ManualClock()
        store = make_store("monotonic", clock=clock, gc_grace=60)
        for epoch in (1, 2, 3, 4):
            store.publish(token(epoch), f"export {epoch}".encode())
        store.publish(token(4), b"other name", name="other")
        assert store.gc(keep=1) == 0  # all superseded less than 60 s ago
        clock.advance(61)
        assert store.gc(keep=3) == 1  # epoch 1
        assert store.gc(keep=2) == 1  # epoch 2
        assert store.gc(keep=0) == 1  # epoch 3; never the current objects
        assert store.gc(keep=0, grace=0) == 0
        assert store.read(R) == b"export 4"
        assert store.read(R, "other") == b"other name"
        store.publish(token(5), b"export 5")
        clock.advance(1)
        assert store.gc(keep=1, grace=0) == 1  # an explicit grace overrides the store's
        assert store.read(R) == b"export 5"

    def test_bad_publication_arguments(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        monotonic.publish(token(1), b"ok")
        before = snapshot(monotonic)
        for name in ("../x", "/abs", "a\x00b", "x" * 256, ".", "a//b"):
            with pytest.raises(InvalidName):
                monotonic.publish(token(1), b"data", name=name)
            with pytest.raises(InvalidName):
                monotonic.latest(R, name)
            with pytest.raises(InvalidName):
                monotonic.read(R, name)
        for keep in (-1, True, 1.5):
            with pytest.raises(ConfigurationError, match="keep"):
                monotonic.gc(keep=keep)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="grace"):
            monotonic.gc(grace=-1)
        assert snapshot(monotonic) == before


class OpIdConformance(_Base):
    """Operation ids: a retry returns the first outcome; other content conflicts."""

    required = frozenset({Capability.OP_IDS})

    def test_a_retry_returns_the_first_outcome_and_applies_nothing(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        first = monotonic.put(token(1), "k", b"v", op_id="write-1")
        after_first = snapshot(monotonic)
        assert monotonic.put(token(1), "k", b"v", op_id="write-1") == first
        assert snapshot(monotonic) == after_first
        item = monotonic.get(R, "k")
        assert item is not None and item.version == 1

    def test_a_retry_after_the_floor_moved_still_reports_the_write_that_landed(
        self, strict: Store
    ) -> None:
        strict.fence(token(1))
        first = strict.put(token(1), "k", b"v", op_id="write-1", if_version=0)
        strict.fence(token(2))  # a successor installed meanwhile
        assert strict.put(token(1), "k", b"v", op_id="write-1", if_version=0) == first
        with pytest.raises(StaleToken):
            strict.put(token(1), "k", b"v", op_id="write-2")

    def test_the_same_op_id_with_other_content_conflicts(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        monotonic.put(token(1), "k", b"v", op_id="write-1")
        before = snapshot(monotonic)
        attempts: list[Callable[[], object]] = [
            lambda: monotonic.put(token(1), "k", b"other value", op_id="write-1"),
            lambda: monotonic.put(token(1), "other-key", b"v", op_id="write-1"),
            lambda: monotonic.put(token(1), "k", b"v", op_id="write-1", if_version=1),
            lambda: monotonic.put(token(2), "k", b"v", op_id="write-1"),
        ]
        for attempt in attempts:
            with pytest.raises(IdempotencyConflict):
                attempt()
        with pytest.raises(IdempotencyConflict):
            monotonic.publish(token(1), b"v", op_id="write-1")
        assert snapshot(monotonic) == before

    def test_a_rejected_attempt_is_not_recorded(self, strict: Store) -> None:
        with pytest.raises(NotInstalled):
            strict.put(token(1), "k", b"v", op_id="write-1")
        strict.fence(token(1))
        assert strict.put(token(1), "k", b"v", op_id="write-1").version == 1

    def test_publish_with_an_op_id(
        self, monotonic: Store, snapshot: Callable[[Store], object]
    ) -> None:
        first = monotonic.publish(token(1), b"export", op_id="publish-1")
        after_first = snapshot(monotonic)
        assert monotonic.publish(token(1), b"export", op_id="publish-1") == first
        assert snapshot(monotonic) == after_first  # the retry's staged object was dropped
        with pytest.raises(IdempotencyConflict):
            monotonic.publish(token(1), b"other export", op_id="publish-1")
        with pytest.raises(IdempotencyConflict):
            monotonic.publish(token(1), b"export", name="other", op_id="publish-1")
        assert snapshot(monotonic) == after_first
        assert monotonic.latest(R) == first

    def test_records_expire_after_the_retention(self, make_store: MakeStore) -> None:
        clock = ManualClock()
        store = make_store("monotonic", clock=clock, op_retention=60)
        store.put(token(1), "k", b"v", op_id="write-1")
        clock.advance(30)
        with pytest.raises(IdempotencyConflict):
            store.put(token(1), "k", b"w", op_id="write-1")
        clock.advance(31)
        assert store.put(token(1), "k", b"w", op_id="write-1").version == 2

    def test_bad_op_ids(self, monotonic: Store) -> None:
        for op_id in ("", "x" * 256, "a\x00b", "line\nbreak", 5):
            with pytest.raises(InvalidName):
                monotonic.put(token(1), "k", b"v", op_id=op_id)  # type: ignore[arg-type]
            with pytest.raises(InvalidName):
                monotonic.publish(token(1), b"v", op_id=op_id)  # type: ignore[arg-type]
        assert monotonic.get(R, "k") is None
        assert monotonic.latest(R) is None


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


class LocalFilesConformance(_Base):
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


def _summary(records: list[Record]) -> list[tuple[str, int, dict[str, object]]]:
    """(kind, epoch, detail without volatile keys) of each record."""
    volatile = {"object_id", "size"}
    return [
        (r.kind.value, r.epoch, {k: v for k, v in r.detail.items() if k not in volatile})
        for r in records
    ]


class RecordsConformance(_Base):
    """Store records (DESIGN §7): installs, accepted and rejected mutations, ``history``."""

    required = frozenset({Capability.RECORDS})

    def test_installs_accepted_and_rejected_mutations_are_recorded_in_order(
        self, strict: Store
    ) -> None:
        strict.fence(token(1))
        strict.put(token(1), "k", b"v")
        strict.fence(token(2))
        with pytest.raises(StaleToken):
            strict.put(token(1), "k", b"late")
        with pytest.raises(NotInstalled):
            strict.put(token(3), "k", b"early")
        strict.publish(token(2), b"export", name="daily")
        with pytest.raises(StaleToken):
            strict.publish(token(1), b"late export", name="daily")
        with pytest.raises(StaleToken):
            strict.fence(token(1))
        with pytest.raises(ForeignToken):
            strict.put(token(9, coordinator=C2), "k", b"foreign")
        history = strict.history(R)
        assert _summary(history) == [
            ("installed", 1, {"op": "fence", "previous": None}),
            ("accepted", 1, {"op": "put", "key": "k", "version": 1}),
            ("installed", 2, {"op": "fence", "previous": 1}),
            ("rejected", 1, {"op": "put", "key": "k", "reason": "stale", "presented": 1,
                             "floor": 2}),
            ("rejected", 3, {"op": "put", "key": "k", "reason": "not-installed", "presented": 3,
                             "floor": 2}),
            ("accepted", 2, {"op": "publish", "name": "daily"}),
            ("rejected", 1, {"op": "publish", "name": "daily", "reason": "stale",
                             "presented": 1, "floor": 2}),
            ("rejected", 1, {"op": "fence", "reason": "stale", "presented": 1, "floor": 2}),
            ("rejected", 9, {"op": "put", "key": "k", "reason": "foreign", "presented": 9,
                             "bound": C1, "coordinator": C2}),
        ]  # fmt: skip
        published = strict.latest(R, "daily")
        assert published is not None and history[5].detail["object_id"] == published.object_id
        seqs = [r.seq for r in history]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) and seqs[0] >= 1
        assert all(r.resource == R and r.holder is None for r in history)
        assert all(history[i].at <= history[i + 1].at for i in range(len(history) - 1))

    def test_a_monotonic_store_records_its_implicit_installs(self, monotonic: Store) -> None:
        monotonic.put(token(4), "k", b"v", op_id="first")
        monotonic.put(token(4), "k", b"w")
        monotonic.publish(token(6), b"export")
        assert _summary(monotonic.history(R)) == [
            ("installed", 4, {"op": "put", "previous": None}),
            ("accepted", 4, {"op": "put", "key": "k", "version": 1, "op_id": "first"}),
            ("accepted", 4, {"op": "put", "key": "k", "version": 2}),
            ("installed", 6, {"op": "publish", "previous": 4}),
            ("accepted", 6, {"op": "publish", "name": ""}),
        ]

    def test_a_rejection_leaves_a_record_and_changes_no_data(
        self, strict: Store, snapshot: Callable[[Store], object]
    ) -> None:
        strict.fence(token(2))
        strict.put(token(2), "k", b"v")
        before, recorded = snapshot(strict), len(strict.history(R))
        for _ in range(3):
            with pytest.raises(StaleToken):
                strict.put(token(1), "k", b"stale")
        assert snapshot(strict) == before
        assert len(strict.history(R)) == recorded + 3

    def test_replays_and_repeated_fences_leave_no_record(self, strict: Store) -> None:
        strict.fence(token(1))
        strict.put(token(1), "k", b"v", op_id="once")
        recorded = strict.history(R)
        strict.fence(token(1))  # a no-op
        strict.put(token(1), "k", b"v", op_id="once")  # a replay
        assert strict.history(R) == recorded

    def test_history_after_a_seq_and_per_resource(self, strict: Store) -> None:
        for epoch in (1, 2, 3):
            strict.fence(token(epoch, "a"))
            strict.fence(token(epoch, "b"))
        history = strict.history("a")
        assert [(r.kind, r.epoch) for r in history] == [
            (RecordKind.INSTALLED, e) for e in (1, 2, 3)
        ]
        assert strict.history("a", after=history[0].seq) == history[1:]
        assert strict.history("a", after=history[-1].seq) == []
        assert [r.epoch for r in strict.history("b")] == [1, 2, 3]
        assert strict.history("never/used") == []

    def test_many_records_keep_their_order_across_reopening(self, make_store: MakeStore) -> None:
        store = make_store("strict")
        expected: list[tuple[str, int]] = []
        for epoch in range(1, 41):  # well past any batching of the backend
            store.fence(token(epoch))
            store.put(token(epoch), "k", b"v")
            expected += [("installed", epoch), ("accepted", epoch)]
            if epoch % 3 == 0:
                with pytest.raises(StaleToken):
                    store.put(token(epoch - 1), "k", b"stale")
                expected.append(("rejected", epoch - 1))
        store.close()
        again = make_store()
        history = again.history(R)
        assert [(r.kind.value, r.epoch) for r in history] == expected
        seqs = [r.seq for r in history]
        assert seqs == sorted(set(seqs))
        assert again.history(R, after=seqs[50]) == history[51:]

    def test_threads_mixing_accepted_and_rejected_writes_lose_no_record(
        self, strict: Store
    ) -> None:
        strict.fence(token(5))

        def work(index: int) -> None:
            for step in range(10):
                if step % 2:
                    strict.put(token(5), f"k{index}", b"v")
                else:
                    with pytest.raises(StaleToken):
                        strict.put(token(4), f"k{index}", b"stale")

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        history = strict.history(R)
        kinds = [r.kind for r in history]
        assert kinds.count(RecordKind.ACCEPTED) == 20
        assert kinds.count(RecordKind.REJECTED) == 20
        assert len({r.seq for r in history}) == len(history) == 41

    def test_retention_by_count_and_by_age(self, make_store: MakeStore) -> None:
        clock = ManualClock()
        store = make_store("strict", clock=clock, record_limit=10, record_retention=100)
        store.fence(token(1))
        for _ in range(5):
            store.put(token(1), "k", b"v")
        clock.advance(60)
        for _ in range(7):
            store.put(token(1), "k", b"v")
        history = store.history(R)
        assert len(history) == 10  # the newest ten
        assert [r.detail["version"] for r in history] == list(range(3, 13))
        clock.advance(50)  # the first five puts are now 110 s old
        assert [r.detail["version"] for r in store.history(R)] == list(range(6, 13))
        for _ in range(200):  # past every pruning interval: the old records go for good
            store.put(token(1), "other", b"v")
        assert len(store.history(R)) == 10
        with pytest.raises(ConfigurationError, match="record_limit"):
            make_store(record_limit=0)
        with pytest.raises(ConfigurationError, match="record_retention"):
            make_store(record_retention=0)

    def test_floors_lists_every_resource_with_a_floor(self, strict: Store) -> None:
        assert strict.floors() == {}
        strict.fence(token(3, "a"))
        strict.fence(token(7, "b/c"))
        with pytest.raises(NotInstalled):
            strict.put(token(1, "d"), "k", b"v")  # rejected: no floor
        assert strict.floors() == {"a": 3, "b/c": 7}

    def test_history_arguments(self, strict: Store) -> None:
        with pytest.raises(InvalidName):
            strict.history("../x")
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(ConfigurationError, match="after"):
                strict.history(R, after=bad)  # type: ignore[arg-type]

    def test_rejections_are_logged_as_warnings_and_installs_as_info(
        self, strict: Store, caplog: pytest.LogCaptureFixture
    ) -> None:
        with caplog.at_level(logging.DEBUG, logger="fenced.store"):
            strict.fence(token(2))
            strict.put(token(2), "k", b"v")
            with pytest.raises(StaleToken):
                strict.put(token(1), "k", b"v")
        levels = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "fenced.store"]
        assert (logging.INFO, f"{R}: installed epoch 2 (previous floor None)") in levels
        assert (logging.DEBUG, f"{R}: accepted put with epoch 2") in levels
        assert (logging.WARNING, f"{R}: rejected put with epoch 1: stale (floor 2)") in levels


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

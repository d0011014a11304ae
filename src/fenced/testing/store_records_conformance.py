"""The conformance classes of what a store remembers about its mutations:
:class:`OpIdConformance` (:attr:`Capability.OP_IDS`: a retry with an operation id returns the
first outcome, other content under the same id conflicts, ids expire after ``op_retention``) and
:class:`RecordsConformance` (:attr:`Capability.RECORDS`: install, accept and reject records read
through ``history``, their retention, ``floors`` and the ``fenced.store`` log).

Part of the store conformance suite; import them from :mod:`fenced.testing.store_conformance`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest

from fenced.core._clock import ManualClock
from fenced.core._errors import (
    ConfigurationError,
    ForeignToken,
    IdempotencyConflict,
    InvalidName,
    NotInstalled,
    StaleToken,
)
from fenced.core._records import Record, RecordKind
from fenced.fence import Capability, Store
from fenced.testing.store_fixtures import C1, C2, CapabilityConformance, MakeStore, R, token

__all__ = ["OpIdConformance", "RecordsConformance"]


class OpIdConformance(CapabilityConformance):
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


def _summary(records: list[Record]) -> list[tuple[str, int, dict[str, object]]]:
    """(kind, epoch, detail without volatile keys) of each record."""
    volatile = {"object_id", "size"}
    return [
        (r.kind.value, r.epoch, {k: v for k, v in r.detail.items() if k not in volatile})
        for r in records
    ]


class RecordsConformance(CapabilityConformance):
    """Store records (docs/stores.md): installs, accepted and rejected mutations, ``history``."""

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
                             "floor": 2, "bound": C1, "coordinator": C2}),
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

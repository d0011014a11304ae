"""The publication conformance class: :class:`PublicationConformance` tests publish, latest,
read, open and gc on a store that declares :attr:`Capability.PUBLICATION`.

Part of the store conformance suite; import it from :mod:`fenced.testing.store_conformance`.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from pathlib import Path

import pytest

from fenced.core._clock import ManualClock
from fenced.core._errors import (
    ConfigurationError,
    ForeignToken,
    InvalidName,
    NotInstalled,
    StaleToken,
)
from fenced.fence import Capability, Publication, Store
from fenced.fence._values import Mode
from fenced.testing.store_fixtures import C2, CapabilityConformance, MakeStore, R, token

__all__ = ["PublicationConformance"]


def _payload(size: int, seed: int = 0) -> bytes:
    """``size`` bytes determined by ``seed``: its SHA-256 digest, repeated."""
    block = hashlib.sha256(str(seed).encode()).digest()
    return (block * (size // len(block) + 1))[:size]


class PublicationConformance(CapabilityConformance):
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

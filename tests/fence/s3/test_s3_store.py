"""The store conformance suite on ``s3://`` (Ceph RGW; a fresh key prefix per test), in both
modes, plus what is specific to S3: the optimistic commit under contention, multipart staging,
gc of condemned objects and stale uploads, op ids and records moved out of the state.

The store has every capability but :attr:`Capability.LOCAL_FILES`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fenced.core._errors import ConfigurationError, IdempotencyConflict, StaleToken
from fenced.fence import Store
from fenced.fence import open_store as fenced_open_store
from fenced.fence._values import Mode
from fenced.fence.s3._state import INLINE_BYTES
from fenced.fence.s3._store import S3Backend
from fenced.testing.rgw import RgwServer
from fenced.testing.store_conformance import (
    FencingConformance,
    KeysConformance,
    OpIdConformance,
    PublicationConformance,
    RecordsConformance,
)
from fenced.testing.store_fixtures import R, token
from support.cli_processes import run_python
from support.s3_stores import s3_bucket, s3_snapshot, s3_url

__all__ = ["s3_bucket", "s3_url"]  # fixtures from support.s3_stores, used here


class TestS3Store(
    FencingConformance,
    KeysConformance,
    PublicationConformance,
    OpIdConformance,
    RecordsConformance,
):
    @pytest.fixture
    def make_store(self, s3_url: str) -> Iterator[Callable[..., Store]]:
        opened: list[Store] = []

        def make(mode: Mode | None = None, **options: Any) -> Store:
            opened.append(fenced_open_store(s3_url, mode, **options))
            return opened[-1]

        yield make
        for store in opened:
            store.close()

    @pytest.fixture
    def snapshot(self) -> Callable[[Store], object]:
        return s3_snapshot


# -- what is specific to S3 ------------------------------------------------------------------


@pytest.fixture
def store(s3_url: str) -> Iterator[Store]:
    opened = fenced_open_store(s3_url, "monotonic")
    yield opened
    opened.close()


def _keys(store: Store, area: str) -> list[str]:
    backend = _backend(store)
    prefix = backend.location.key(area, "")
    return sorted(entry["Key"][len(prefix) :] for entry in backend.listing(prefix))


def _backend(store: Store) -> S3Backend:
    backend = store._backend
    assert isinstance(backend, S3Backend)
    return backend


def test_op_outcomes_moved_out_of_the_state_still_replay(store: Store) -> None:
    for number in range(80):
        store.put(token(1), f"k{number}", b"v", op_id=f"op-{number}")
    state = _backend(store).read_state(R)[0]
    assert len(state.ops) <= 64
    assert len(_keys(store, "ops")) >= 16  # the oldest went out, one object each
    again = fenced_open_store(store.url)  # another process's view: nothing remembered
    try:
        assert again.put(token(1), "k0", b"v", op_id="op-0").version == 1
        assert again.get(R, "k0") is not None and again.get(R, "k0").version == 1  # type: ignore[union-attr]
        with pytest.raises(IdempotencyConflict):
            again.put(token(1), "k0", b"other", op_id="op-0")
    finally:
        again.close()


def test_records_moved_out_in_segments_keep_their_order(store: Store) -> None:
    for number in range(1, 111):
        store.fence(token(number))
        store.put(token(number), "k", b"v")
    segments = _keys(store, "records")
    assert segments  # 220 records: the oldest are in segment objects
    history = fenced_open_store(store.url).history(R)
    assert [r.seq for r in history] == list(range(1, 221))
    assert [(r.kind.value, r.epoch) for r in history[:4]] == [
        ("installed", 1),
        ("accepted", 1),
        ("installed", 2),
        ("accepted", 2),
    ]
    assert [r.seq for r in store.history(R, after=150)] == list(range(151, 221))


def test_a_large_value_lives_in_its_own_object_and_the_replaced_one_is_deleted(
    store: Store,
) -> None:
    big = b"x" * (INLINE_BYTES + 1)
    store.put(token(1), "big", big)
    first = _keys(store, "values")
    assert len(first) == 1
    store.put(token(1), "big", big + b"y")
    second = _keys(store, "values")
    assert len(second) == 1 and second != first
    item = store.get(R, "big")
    assert item is not None and item.value == big + b"y" and item.version == 2
    store.put(token(1), "big", b"small now")
    assert _keys(store, "values") == []


def test_a_decision_on_remembered_state_is_checked_at_commit(s3_url: str) -> None:
    first = fenced_open_store(s3_url, "strict")
    second = fenced_open_store(s3_url)
    try:
        first.fence(token(1))
        first.put(token(1), "k", b"one")  # first now remembers floor 1
        second.fence(token(2))  # first does not know
        with pytest.raises(StaleToken):
            first.put(token(1), "k", b"stale")
        assert first.get(R, "k") is not None and first.get(R, "k").value == b"one"  # type: ignore[union-attr]
        assert first.fence(token(2)) == 2  # a no-op decided on fresh state
        with pytest.raises(StaleToken):
            first.fence(token(1))
    finally:
        first.close()
        second.close()


def test_gc_condemns_an_object_before_deleting_it_so_no_commit_can_name_it(store: Store) -> None:
    backend = _backend(store)
    store.publish(token(1), b"current")
    backend.stage(R, "00000000000000000001-orphan", [b"never published"], 0.0)
    with backend.transaction(R) as tx:
        assert tx.has_object("00000000000000000001-orphan")
    assert store.gc(grace=0) == 1
    with backend.transaction(R) as tx:
        assert not tx.has_object("00000000000000000001-orphan")
    state = backend.read_state(R)[0]
    assert state.condemned == {}  # forgotten once deleted
    assert store.read(R) == b"current"
    assert len(_keys(store, "objects")) == 1


def test_resources_that_nest_keep_apart(store: Store) -> None:
    store.publish(token(1, "a"), b"a")
    store.publish(token(1, "a/b"), b"a/b")
    assert store.floors() == {"a": 1, "a/b": 1}
    assert store.gc(grace=0) == 0
    assert store.read("a") == b"a" and store.read("a/b") == b"a/b"


def test_the_example_of_the_docs_runs(s3_url: str, rgw_server: RgwServer, tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "s3.md").read_text()
    blocks = re.findall(r"^```python-example\n(.*?)^```", doc, re.DOTALL | re.MULTILINE)
    assert len(blocks) == 1, "docs/s3.md should have exactly one ```python-example block"
    env = {
        **rgw_server.environment(),
        "FENCED_S3_URL": s3_url,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
    }
    result = run_python(str(blocks[0]), tmp_path, env)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "id,total\n1,42" in result.stdout
    assert "Publication(resource='exports/daily', name='daily.csv', epoch=1" in result.stdout


def test_a_reader_that_may_not_write_opens_an_existing_store_and_reads(
    s3_url: str, s3_bucket: str, rgw_server: RgwServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fenced_open_store(s3_url, "strict") as writer:
        writer.fence(token(3))
        writer.publish(token(3), b"the export")
    uid = f"reader-{uuid.uuid4().hex[:8]}"
    created = json.loads(
        rgw_server.radosgw_admin("user", "create", f"--uid={uid}", "--display-name=r")
    )
    keys = created["keys"][0]
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"AWS": [f"arn:aws:iam:::user/{uid}"]},
                "Action": ["s3:GetObject", "s3:ListBucket"],
                "Resource": [f"arn:aws:s3:::{s3_bucket}", f"arn:aws:s3:::{s3_bucket}/*"],
            }
        ],
    }
    rgw_server.client().put_bucket_policy(Bucket=s3_bucket, Policy=json.dumps(policy))
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["access_key"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["secret_key"])
        with fenced_open_store(s3_url, create=False) as reader:
            assert reader.read(R) == b"the export"
            assert reader.floor(R) == 3
            with pytest.raises(ConfigurationError, match="refused"):
                reader.fence(token(4))
            assert reader.floor(R) == 3
        with pytest.raises(ConfigurationError, match="may not write"):
            fenced_open_store(s3_url.replace("/t-", "/new-t-"))
    finally:
        rgw_server.client().delete_bucket_policy(Bucket=s3_bucket)

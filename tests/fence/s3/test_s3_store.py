"""The store conformance suite on ``s3://`` (Ceph RGW; a fresh key prefix per test), in both
modes, plus what is specific to S3: the optimistic commit under contention, multipart staging,
gc of condemned objects and stale uploads, op ids and records moved out of the state.

The store has every capability but :attr:`Capability.LOCAL_FILES`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fenced.fence import Store
from fenced.fence import open_store as fenced_open_store
from fenced.fence._values import Mode
from fenced.testing.store_conformance import (
    FencingConformance,
    KeysConformance,
    OpIdConformance,
    PublicationConformance,
    RecordsConformance,
)
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

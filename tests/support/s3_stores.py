"""``s3://`` stores on the session's RGW (:mod:`fenced.testing.rgw`): a fresh store URL per test
(a new key prefix in the session's bucket, the AWS variables set for the test) and a snapshot
of a store's objects. Import the fixtures into a test module to use them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fenced._drivers import s3
from fenced.fence import Store
from fenced.testing.rgw import RgwServer

__all__ = ["s3_bucket", "s3_snapshot", "s3_url"]

_DATA = ("items", "pointers", "published", "condemned", "ops")


@pytest.fixture(scope="session")
def s3_bucket(rgw_server: RgwServer) -> str:
    """One bucket for the session's ``s3://`` stores (each test has its own prefix)."""
    return rgw_server.create_bucket()


@pytest.fixture
def s3_url(rgw_server: RgwServer, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The URL of a store under a prefix no other test uses; the test's environment has the
    server's keys and region (the AWS chain finds them, as it would a user's)."""
    for name, value in rgw_server.environment().items():
        monkeypatch.setenv(name, value)
    yield f"s3://{s3_bucket}/t-{uuid.uuid4().hex[:12]}?endpoint={rgw_server.endpoint}"


def s3_snapshot(store: Store) -> dict[str, Any]:
    """Every object under a store's prefix but its records, read with a client of its own (only
    ``store.url`` is used, so it works on both faces). A state object is its JSON without the
    records, the nonce and the commits (a rejection adds a record); a state that holds nothing
    but records is left out."""
    location = s3.parse_url(store.url)
    client = s3.clients(location).reads
    prefix, bucket = location.prefix, location.bucket
    found: dict[str, Any] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for entry in page.get("Contents") or []:
            key = entry["Key"]
            if key.startswith(prefix + "records/"):
                continue
            body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
            if key.startswith(prefix + "state/"):
                state = json.loads(body)
                for field in ("records", "seq", "nonce", "commits"):
                    state.pop(field)
                if state["floor"] is None and not any(state[f] for f in _DATA):
                    continue  # created by a rejection's record: holds no data
                found[key] = state
            else:
                found[key] = body
    return found

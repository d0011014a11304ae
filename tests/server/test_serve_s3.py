"""``fenced serve --store exports=s3://…``: a real server process serving an ``s3://`` store (the
session's Ceph RGW, a fresh key prefix per test; the server finds the keys in the environment it
inherits, as the AWS chain does). Clients publish and read through the gateway with
``fenced.open_store("http://…/stores/exports")``, holders of the served coordinator fence it,
and a stale owner's write is rejected and changes nothing in the bucket. A bad store is one line
and its exit code before the server listens (preflight opens every store)."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import fenced
from fenced import StaleToken
from fenced.cli._exitcodes import BAD_INPUT
from fenced.core._records import RecordKind
from fenced.testing.rgw import RgwServer
from fenced.testing.server import ServeProcess
from support.s3_stores import s3_bucket, s3_snapshot, s3_url

__all__ = ["s3_bucket", "s3_url"]  # fixtures from support.s3_stores, used here

R = "exports/daily"


@pytest.fixture
def served(tmp_path: Path, s3_url: str) -> Iterator[ServeProcess]:
    coordinator = f"sqlite:///{tmp_path / 'fenced.db'}"
    with ServeProcess(coordinator, "--store", f"exports={s3_url}", "--poll", "1") as process:
        yield process


def test_publish_and_read_through_the_gateway_and_a_stale_write_is_rejected(
    served: ServeProcess, s3_url: str
) -> None:
    coordinator = fenced.connect(served.url)
    gateway = fenced.open_store(served.url + "/stores/exports")
    direct = fenced.open_store(s3_url)  # the bucket itself, read by this process
    try:
        with coordinator.hold(R, ttl=10, wait=5, fence=[gateway]) as first:
            published = gateway.publish(first.token, io.BytesIO(b"first export"))
            assert published.epoch == first.epoch
            gateway.put(first.token, "config", b"v1")
        assert gateway.read(R) == b"first export"
        assert direct.latest(R) == published
        stale = first.token
        with coordinator.hold(R, ttl=10, wait=5, fence=[gateway]) as second:
            assert second.epoch > stale.epoch
            assert direct.floor(R) == second.epoch  # installed in the bucket, through the server
            before = s3_snapshot(direct)
            with pytest.raises(StaleToken):
                gateway.publish(stale, io.BytesIO(b"late write of a paused owner"))
            with pytest.raises(StaleToken):
                gateway.put(stale, "config", b"late")
            assert s3_snapshot(direct) == before
            gateway.publish(second.token, io.BytesIO(b"second export"))
        assert gateway.read(R) == b"second export"
        item = gateway.get(R, "config")
        assert item is not None and item.value == b"v1"
        rejected = [
            r for r in direct.history(R) if r.kind is RecordKind.REJECTED and r.epoch == stale.epoch
        ]
        assert len(rejected) == 2  # the store recorded both rejections
    finally:
        gateway.close()
        direct.close()
        coordinator.close()


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "fenced", "serve", "--listen", "127.0.0.1:0", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize(
    ("spelling", "message"),
    [
        ("s3://Not_A_Bucket/{prefix}?{options}", "is not a bucket name"),
        ("s3://fenced-no-such-bucket/{prefix}?{options}", "does not exist"),  # found by opening
    ],
)
def test_preflight_opens_the_s3_store_before_listening(
    tmp_path: Path,
    s3_url: str,
    s3_bucket: str,
    rgw_server: RgwServer,
    spelling: str,
    message: str,
) -> None:
    """A bad ``s3://`` store is one line and exit 2, with no ``listening`` line: the store is
    opened before the server listens (an unreachable endpoint would be 69, refused credentials
    2: the store commands' tests show each)."""
    base, _, options = s3_url.partition("?")
    prefix = base.split("/", 3)[3]
    url = spelling.format(prefix=prefix, options=options)
    done = _serve("--url", f"sqlite:///{tmp_path / 'fenced.db'}", "--store", f"exports={url}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == BAD_INPUT, done.stderr
    assert len(lines) == 1 and lines[0].startswith("fenced: "), done.stderr
    assert message in lines[0], lines[0]
    listing = rgw_server.client().list_objects_v2(Bucket=s3_bucket, Prefix=prefix + "/")
    assert not listing.get("Contents")  # nothing was created anywhere

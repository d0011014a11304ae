"""Bad input and bad servers for ``s3://`` stores (issue 24): a clear one-line error of the right
type, and nothing written (the bucket or prefix is listed before and after).

* A missing bucket, refused credentials: :class:`ConfigurationError` (permanent) naming them.
* An endpoint that refuses or hangs: :class:`Unavailable`, within seconds (``timeout=``).
* A server that ignores ``If-None-Match``/``If-Match`` (:class:`FakeS3`): refused at
  ``open_store`` by the probe, nothing left on it. A server that honours them works end to end
  in both ``If-Match`` forms: quoted (AWS, the fake) and bare (Ceph RGW's quirk, RGW and the fake).
* URL errors before any I/O, never echoing a secret; invalid names (:class:`InvalidName`);
  ``create=False``, the other mode and a foreign ``fenced-store.json``.

The store's real suites run on RGW (``test_s3_store.py``); the fake only plays the servers RGW
cannot (see ``support/fake_s3.py``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import fenced._drivers.s3
from fenced.core._errors import (
    ConfigurationError,
    InvalidName,
    StaleToken,
    Unavailable,
)
from fenced.fence import Store, open_store
from fenced.testing.rgw import RgwServer
from fenced.testing.store_fixtures import R, token
from support.cli_processes import run_python
from support.fake_s3 import Conditions, FakeS3
from support.s3_stores import s3_bucket, s3_url

__all__ = ["s3_bucket", "s3_url"]  # fixtures from support.s3_stores, used here

HANG_CHECK = 15.0
"""Seconds a refused or hanging endpoint may take: generous slack, only to prove no hang."""
SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"


@pytest.fixture(autouse=True)
def aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy keys and no shared files, profile, endpoint or instance metadata: the AWS chain
    sees only what a test sets (``s3_url`` then sets RGW's keys)."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "FAKEACCESSKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "fake-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3(rgw_server: RgwServer) -> Any:
    """A client of RGW of the test's own (the store's are not used to check the store)."""
    return rgw_server.client()


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text, text
    return text


def listing(s3: Any, bucket: str, prefix: str = "") -> dict[str, str]:
    """Every key under ``prefix`` with its ETag."""
    found: dict[str, str] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.update({entry["Key"]: entry["ETag"] for entry in page.get("Contents") or []})
    return found


def prefix_of(url: str) -> str:
    return fenced._drivers.s3.parse_url(url).prefix


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# -- the bucket, the credentials, the endpoint ---------------------------------------------


def test_a_missing_bucket_is_a_configuration_error_naming_it(
    rgw_server: RgwServer, s3_url: str, s3: Any
) -> None:
    bucket = f"fenced-missing-{uuid.uuid4().hex[:8]}"
    before = sorted(b["Name"] for b in s3.list_buckets()["Buckets"])
    with pytest.raises(ConfigurationError) as raised:
        open_store(f"s3://{bucket}/p?endpoint={rgw_server.endpoint}")
    assert f"the bucket {bucket} does not exist" in one_line(raised.value)
    assert sorted(b["Name"] for b in s3.list_buckets()["Buckets"]) == before


@pytest.mark.parametrize("wrong", ["AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"])
def test_refused_credentials_are_a_configuration_error(
    s3_url: str, s3_bucket: str, s3: Any, monkeypatch: pytest.MonkeyPatch, wrong: str
) -> None:
    monkeypatch.setenv(wrong, "WRONGKEY1234567890AB" if "KEY_ID" in wrong else SECRET)
    with pytest.raises(ConfigurationError) as raised:
        open_store(s3_url)
    message = one_line(raised.value)
    assert "credentials" in message
    assert SECRET not in message
    assert type(raised.value) is ConfigurationError
    assert listing(s3, s3_bucket, prefix_of(s3_url)) == {}


def test_an_endpoint_that_refuses_is_unavailable_at_once() -> None:
    began = time.monotonic()
    with pytest.raises(Unavailable) as raised:
        open_store(f"s3://fenced-nowhere/p?endpoint=http://127.0.0.1:{free_port()}")
    message = one_line(raised.value)
    assert "s3://fenced-nowhere/p" in message
    assert "connect" in message
    assert time.monotonic() - began < HANG_CHECK


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An endpoint whose connections are accepted (by the kernel: a listening socket's backlog)
    and never answered."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_an_endpoint_that_hangs_is_unavailable_after_the_timeout(silent_endpoint: str) -> None:
    began = time.monotonic()
    with pytest.raises(Unavailable) as raised:
        open_store(f"s3://fenced-nowhere/p?endpoint={silent_endpoint}&timeout=0.5")
    message = one_line(raised.value)
    assert "s3://fenced-nowhere/p" in message
    assert "timeout" in message.lower()
    assert time.monotonic() - began < HANG_CHECK  # a hang check, not a speed assertion


# -- the conditional-write probe -----------------------------------------------------------


@pytest.mark.parametrize(
    ("conditions", "ignored"), [("ignore", "If-None-Match"), ("ignore-if-match", "If-Match")]
)
def test_a_server_that_ignores_conditional_writes_is_refused(
    conditions: Conditions, ignored: str
) -> None:
    with FakeS3(conditions) as fake:
        with pytest.raises(ConfigurationError) as raised:
            open_store(f"s3://{fake.bucket}/p?endpoint={fake.endpoint}")
        message = one_line(raised.value)
        assert f"ignores {ignored} on PUT" in message
        assert "cannot order two writers" in message
        assert fake.keys() == []


@pytest.fixture(params=["fake-quoted", "fake-bare", "rgw"])
def working_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool]]:
    """A store URL on a server that honours conditional writes, and whether ``If-Match`` takes
    the quoted ETag there."""
    if request.param == "rgw":
        yield request.getfixturevalue("s3_url"), False
        return
    conditions: Conditions = "quoted" if request.param == "fake-quoted" else "bare"
    with FakeS3(conditions) as fake:
        yield f"s3://{fake.bucket}/p?endpoint={fake.endpoint}", conditions == "quoted"


def test_a_server_that_honours_conditional_writes_works_in_its_if_match_form(
    working_url: tuple[str, bool],
) -> None:
    url, quoted = working_url
    with open_store(url) as store:
        backend: Any = store._backend
        assert backend._quoted is quoted
        assert store.fence(token(5)) == 5
        assert store.put(token(5), "k", b"v").version == 1
        assert store.put(token(5), "k", b"w").version == 2  # an If-Match commit
        item = store.get(R, "k")
        assert item is not None and item.value == b"w"
        assert store.publish(token(5), b"data").epoch == 5
        assert store.read(R) == b"data"
        assert store.fence(token(7)) == 7
        with pytest.raises(StaleToken):
            store.put(token(5), "k", b"stale")
        with pytest.raises(StaleToken):
            store.publish(token(5), b"stale")
        item = store.get(R, "k")
        assert item is not None and (item.value, item.version) == (b"w", 2)
        assert store.read(R) == b"data"
        assert store.floor(R) == 7
        # a commit from remembered state whose ETag is stale loses (412) and is decided again
        assert backend.knows(R, "k")
        with open_store(url) as other:
            assert other.fence(token(8)) == 8
        with pytest.raises(StaleToken):
            store.put(token(7), "k", b"late")
        item = store.get(R, "k")
        assert item is not None and (item.value, item.version) == (b"w", 2)


# -- the URL -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"s3://AKIAEXAMPLE:{SECRET}@bucket/p", "carries no credentials"),
        (f"s3://:{SECRET}@bucket/p", "carries no credentials"),
        ("s3://AKIAEXAMPLE@bucket/p", "carries no credentials"),
        ("s3://Bucket/p", "not a bucket name"),
        ("s3://ab/p", "not a bucket name"),
        ("s3://a_b_c/p", "not a bucket name"),
        ("s3://-bucket/p", "not a bucket name"),
        ("s3://bucket-/p", "not a bucket name"),
        ("s3://my..bucket/p", "not a bucket name"),
        (f"s3://{'b' * 64}/p", "not a bucket name"),
        ("s3:///p", "not a bucket name"),
        ("s3://bucket:9000/p", "not a bucket name"),
        ("s3://bucket/a//c", "empty segment"),
        ("s3://bucket/p?bogus=1", "unknown option 'bogus'"),
        ("s3://bucket/p?endpoint=http://h:1&endpoint=http://h:2", "once"),
        ("s3://bucket/p?region=", "once, with a value"),
        ("s3://bucket/p?timeout=0", "timeout= must be a positive number"),
        ("s3://bucket/p?timeout=-1", "timeout= must be a positive number"),
        ("s3://bucket/p?timeout=abc", "timeout= must be a positive number"),
        ("s3://bucket/p?timeout=nan", "timeout= must be a positive number"),
        ("s3://bucket/p?timeout=inf", "timeout= must be a positive number"),
        ("s3://bucket/p?endpoint=ftp://127.0.0.1:21", "endpoint= must be an http(s):// URL"),
        ("s3://bucket/p?endpoint=127.0.0.1:9000", "endpoint= must be an http(s):// URL"),
        ("s3://bucket/p?endpoint=http://", "endpoint= must be an http(s):// URL"),
        ("s3://bucket/p?addressing=dns", "addressing= is path, virtual or auto"),
        ("s3://bucket/p#frag", "no fragment"),
        (f"s3://bucket/p?secret={SECRET}", "carries no credentials (secret=…)"),
        (f"s3://bucket/p?secret_key={SECRET}", "carries no credentials (secret_key=…)"),
        (f"s3://bucket/p?aws_secret_access_key={SECRET}", "carries no credentials"),
        (f"s3://bucket/p?aws_session_token={SECRET}", "carries no credentials"),
        ("s3://bucket//a", "empty segment"),
        (f"s3://bucket/p?endpoint=http://k:{SECRET}@h:1&timeout=0", "timeout="),
    ],
)
def test_a_bad_url_is_refused_before_any_io_without_echoing_a_secret(
    monkeypatch: pytest.MonkeyPatch, url: str, expected: str
) -> None:
    def no_io(*args: object, **kwargs: object) -> object:
        raise AssertionError("a bad URL reached the S3 clients")

    monkeypatch.setattr(fenced._drivers.s3, "clients", no_io)
    with pytest.raises(ConfigurationError) as raised:
        open_store(url)
    message = one_line(raised.value)
    assert expected in message
    assert SECRET not in message


# -- names ---------------------------------------------------------------------------------

BAD_NAMES = [
    "",
    "a%2Fb",
    "a%b",
    "../x",
    "/abs",
    "a//b",
    "a/./b",
    "..",
    "x" * 256,
    "é",
    "a b",
    "a\x00b",
]


def refusals(store: Store, bad: str) -> list[Callable[[], object]]:
    """Every call that takes ``bad`` as a resource name, a key or a publication name."""
    calls: list[Callable[[], object]] = [
        lambda: token(1, resource=bad),
        lambda: store.floor(bad),
        lambda: store.get(bad, "k"),
        lambda: store.get(R, bad),
        lambda: store.put(token(1), bad, b"v"),
        lambda: store.latest(bad),
        lambda: store.history(bad),
    ]
    if bad:  # "" is the default publication's name
        calls += [
            lambda: store.publish(token(1), b"evil", name=bad),
            lambda: store.read(R, bad),
            lambda: store.latest(R, bad),
        ]
    return calls


def test_invalid_names_are_refused_and_nothing_is_written(
    s3_url: str, s3_bucket: str, s3: Any
) -> None:
    with open_store(s3_url, "monotonic") as store:
        store.put(token(1), "k", b"v")
        store.publish(token(1), b"data")
        before = listing(s3, s3_bucket, prefix_of(s3_url))
        for bad in BAD_NAMES:
            for call in refusals(store, bad):
                with pytest.raises(InvalidName) as raised:
                    call()
                one_line(raised.value)
        assert listing(s3, s3_bucket, prefix_of(s3_url)) == before
        assert store.floors() == {R: 1}


# -- the store's identity ------------------------------------------------------------------


def test_create_false_on_a_prefix_without_a_store_creates_nothing(
    s3_url: str, s3_bucket: str, s3: Any
) -> None:
    with pytest.raises(ConfigurationError) as raised:
        open_store(s3_url, create=False)
    assert "no fenced store at s3://" in one_line(raised.value)
    assert listing(s3, s3_bucket, prefix_of(s3_url)) == {}


def test_a_store_opens_in_its_own_mode_only(s3_url: str, s3_bucket: str, s3: Any) -> None:
    with open_store(s3_url, "strict") as store:
        store.fence(token(3))
    before = listing(s3, s3_bucket, prefix_of(s3_url))
    with pytest.raises(ConfigurationError) as raised:
        open_store(s3_url, "monotonic")
    assert "created in strict mode and cannot be opened in monotonic mode" in one_line(raised.value)
    assert listing(s3, s3_bucket, prefix_of(s3_url)) == before


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"garbage \x00\xff", "is not a fenced store's identity"),
        (b"[1, 2]", "is not a fenced store's identity"),
        (json.dumps({"kind": "something-else", "format": 1}).encode(), "not a fenced store's"),
        (json.dumps({"kind": "fenced-s3-store", "format": 99}).encode(), "has format 99"),
    ],
)
def test_a_foreign_identity_object_is_refused_and_kept(
    s3_url: str, s3_bucket: str, s3: Any, body: bytes, expected: str
) -> None:
    key = prefix_of(s3_url) + "fenced-store.json"
    s3.put_object(Bucket=s3_bucket, Key=key, Body=body)
    before = listing(s3, s3_bucket, prefix_of(s3_url))
    with pytest.raises(ConfigurationError) as raised:
        open_store(s3_url)  # create=True: the path that could write
    assert expected in one_line(raised.value)
    assert listing(s3, s3_bucket, prefix_of(s3_url)) == before
    assert s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == body


def test_without_the_s3_extra_it_says_what_to_install(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['boto3'] = sys.modules['botocore'] = None  # as if not installed\n"
        "import fenced\n"
        "try:\n"
        "    fenced.open_store('s3://bucket/p')\n"
        "except fenced.ConfigurationError as error:\n"
        "    print(error)\n"
    )
    env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = run_python(code, tmp_path, env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "this store kind needs botocore: pip install 'fenced[s3]'\n"

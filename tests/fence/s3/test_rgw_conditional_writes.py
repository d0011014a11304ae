"""What Ceph RGW (Debian 12: Ceph 16.2 "pacific") does with S3's conditional writes, pinned down
against the session's real server, through boto3 as the ``s3://`` store will call it.

The store's protocol (docs/s3.md) rests on these facts; a test that fails here after an upgrade
of Ceph or botocore means the protocol's assumptions must be checked again, not that the test
should be loosened. botocore sends ``If-None-Match``/``If-Match`` from ``put_object``'s
``IfNoneMatch``/``IfMatch`` parameters (no event hooks needed).

Measured (and asserted below):

* ``PUT`` + ``If-None-Match: *``: 200 if the key is absent, 412 ``PreconditionFailed`` if it
  exists; of 16 concurrent creates exactly one wins.
* ``PUT`` + ``If-Match``: compared with the **unquoted** ETag. The ETag exactly as S3 returns it
  (``"…"``, with quotes) never matches: 412 even when it is the current one. The unquoted form:
  200 if current, 412 if not, 412 if the key does not exist. Of 16 concurrent swaps from the same
  ETag exactly one wins. ``If-Match: *`` is 200 on an existing key, 412 on a missing one.
* ``PUT`` + ``If-None-Match: <etag>`` (not ``*``) is the same quirk inverted: the quoted current
  ETag does not stop the write (200), the unquoted one does (412). The store never sends it.
* ``GET`` + ``If-Match`` accepts both forms.
* ETags of single PUTs are the MD5 of the body: identical bytes give identical ETags, so a swap
  from an ETag read before an A → B → A sequence succeeds (ABA) unless every body is unique.
* ``CompleteMultipartUpload`` ignores ``If-None-Match: *`` (it overwrites) and ``DeleteObject``
  ignores ``If-Match`` (it deletes): only single ``PUT`` is conditional on this server.
* Multipart: parts but the last must be ≥ 5 MiB; nothing is visible before completion; the
  object's ETag is ``"<md5 of part md5s>-<parts>"``; in-progress uploads are listed (key, upload
  id, ``Initiated``) until completed or aborted; an aborted upload is gone.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from fenced.testing.rgw import RgwServer

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3(rgw_server: RgwServer) -> Any:
    return rgw_server.client(max_pool_connections=32)


@pytest.fixture(scope="module")
def bucket(rgw_server: RgwServer) -> str:
    return rgw_server.create_bucket()


@pytest.fixture
def key() -> Iterator[str]:
    yield f"t/{secrets.token_hex(6)}"


def status(call: Callable[[], Any]) -> int:
    """The HTTP status of a boto3 call: its reply's, or its error's (412 is a ClientError)."""
    try:
        reply = call()
    except ClientError as error:
        code: int = error.response["ResponseMetadata"]["HTTPStatusCode"]
        return code
    answered: int = reply["ResponseMetadata"]["HTTPStatusCode"]
    return answered


def body(s3: Any, bucket: str, key: str) -> bytes:
    data: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    return data


def etag(s3: Any, bucket: str, key: str) -> str:
    """The object's ETag as S3 returns it: quoted."""
    tag: str = s3.head_object(Bucket=bucket, Key=key)["ETag"]
    return tag


# -- the fixture ---------------------------------------------------------------------------------


def test_the_server_exposes_endpoint_keys_region_and_pids(rgw_server: RgwServer) -> None:
    assert rgw_server.endpoint.startswith("http://127.0.0.1:")
    assert len(rgw_server.access_key) == 20
    assert rgw_server.secret_key
    assert rgw_server.region == "us-east-1"
    assert set(rgw_server.pids) == {"mon", "osd", "rgw"}
    assert rgw_server.environment()["AWS_ENDPOINT_URL_S3"] == rgw_server.endpoint
    assert rgw_server.started_in is not None


def test_wrong_keys_are_refused(rgw_server: RgwServer, bucket: str) -> None:
    import boto3

    stranger = boto3.client(
        "s3",
        endpoint_url=rgw_server.endpoint,
        aws_access_key_id="NOBODY",
        aws_secret_access_key="nothing",
        region_name=rgw_server.region,
    )
    assert status(lambda: stranger.put_object(Bucket=bucket, Key="x", Body=b"x")) == 403


def test_a_start_that_times_out_says_why_and_leaves_nothing_running(tmp_path: Path) -> None:
    server = RgwServer(tmp_path / "rgw")
    try:
        with pytest.raises(RuntimeError, match="timed out waiting until the OSD is up") as failed:
            server.start(timeout=0)
        assert "--- mon.a.log ---" in str(failed.value)  # the logs' tails
        assert set(server.pids) == {"mon", "osd"}
    finally:
        server.stop()
    assert server.pids == {}


def test_missing_ceph_programs_are_named_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"radosgw.*apt-get install"), RgwServer():
        pass


# -- If-None-Match: * (create only) ------------------------------------------------------------


def test_if_none_match_star_creates_once_then_412(s3: Any, bucket: str, key: str) -> None:
    assert status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"1", IfNoneMatch="*")) == 200
    assert status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")) == 412
    assert body(s3, bucket, key) == b"1"


def test_the_412_is_precondition_failed(s3: Any, bucket: str, key: str) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=b"1")
    with pytest.raises(ClientError) as refused:
        s3.put_object(Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")
    assert refused.value.response["Error"]["Code"] == "PreconditionFailed"


def test_a_retried_create_whose_first_attempt_landed_gets_412(
    s3: Any, bucket: str, key: str
) -> None:
    """A lost reply: the retry cannot tell "I won" from "someone else won" by the status; the
    store re-reads and recognizes its own body (its nonce)."""
    mine = b'{"epoch": 3, "nonce": "a1"}'
    s3.put_object(Bucket=bucket, Key=key, Body=mine, IfNoneMatch="*")
    assert status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=mine, IfNoneMatch="*")) == 412
    assert body(s3, bucket, key) == mine


def test_concurrent_creates_have_exactly_one_winner(s3: Any, bucket: str) -> None:
    for round_ in range(3):
        key = f"race-create/{round_}-{secrets.token_hex(4)}"

        def create(i: int, key: str = key) -> int:
            return status(
                lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"w%d" % i, IfNoneMatch="*")
            )

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(create, range(16)))
        assert sorted(results) == [200] + [412] * 15
        assert body(s3, bucket, key) == b"w%d" % results.index(200)


# -- If-Match: <etag> (swap) -----------------------------------------------------------------


def test_if_match_with_the_unquoted_current_etag_swaps(s3: Any, bucket: str, key: str) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=b"old")
    current = etag(s3, bucket, key).strip('"')
    assert (
        status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"new", IfMatch=current)) == 200
    )
    assert body(s3, bucket, key) == b"new"


def test_if_match_with_a_stale_etag_is_412_in_either_form(s3: Any, bucket: str, key: str) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=b"v1")
    stale = etag(s3, bucket, key)
    s3.put_object(Bucket=bucket, Key=key, Body=b"v2")
    for form in (stale, stale.strip('"')):
        swap = functools.partial(s3.put_object, Bucket=bucket, Key=key, Body=b"x", IfMatch=form)
        assert status(swap) == 412
    assert body(s3, bucket, key) == b"v2"


def test_quirk_if_match_with_the_quoted_current_etag_is_412(s3: Any, bucket: str, key: str) -> None:
    """RGW 16's quirk: the ETag exactly as returned (quoted, RFC 7232's entity-tag) never matches
    a PUT's If-Match; AWS S3 accepts it. The store sends the unquoted form (which AWS accepts
    too). If this starts failing, RGW fixed it: both forms would then work."""
    s3.put_object(Bucket=bucket, Key=key, Body=b"old")
    quoted = etag(s3, bucket, key)
    assert quoted.startswith('"') and quoted.endswith('"')
    assert status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"new", IfMatch=quoted)) == 412
    assert body(s3, bucket, key) == b"old"  # nothing written
    unquoted = quoted.strip('"')
    assert (
        status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"new", IfMatch=unquoted)) == 200
    )


def test_quirk_if_none_match_with_an_etag_is_inverted_too(s3: Any, bucket: str, key: str) -> None:
    """``If-None-Match: <etag>`` on PUT: the quoted current ETag does not stop the write, the
    unquoted one does. The store sends ``If-None-Match`` only as ``*``."""
    s3.put_object(Bucket=bucket, Key=key, Body=b"a")
    quoted = etag(s3, bucket, key)
    assert (
        status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"b", IfNoneMatch=quoted)) == 200
    )
    unquoted = etag(s3, bucket, key).strip('"')
    assert (
        status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"c", IfNoneMatch=unquoted))
        == 412
    )
    assert body(s3, bucket, key) == b"b"


def test_get_if_match_accepts_both_forms(s3: Any, bucket: str, key: str) -> None:
    s3.put_object(Bucket=bucket, Key=key, Body=b"a")
    quoted = etag(s3, bucket, key)
    assert status(lambda: s3.get_object(Bucket=bucket, Key=key, IfMatch=quoted)) == 200
    assert status(lambda: s3.get_object(Bucket=bucket, Key=key, IfMatch=quoted.strip('"'))) == 200
    assert status(lambda: s3.get_object(Bucket=bucket, Key=key, IfMatch='"0"')) == 412


def test_if_match_on_a_missing_key_is_412_not_404(s3: Any, bucket: str, key: str) -> None:
    some = hashlib.md5(b"x").hexdigest()
    assert status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"x", IfMatch=some)) == 412
    assert status(lambda: s3.head_object(Bucket=bucket, Key=key)) == 404


def test_if_match_star_needs_an_existing_key(s3: Any, bucket: str, key: str) -> None:
    assert status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"x", IfMatch="*")) == 412
    s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    assert status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"y", IfMatch="*")) == 200


def test_concurrent_swaps_from_one_etag_have_exactly_one_winner(s3: Any, bucket: str) -> None:
    for round_ in range(3):
        key = f"race-swap/{round_}-{secrets.token_hex(4)}"
        s3.put_object(Bucket=bucket, Key=key, Body=b"base")
        current = etag(s3, bucket, key).strip('"')

        def swap(i: int, key: str = key, current: str = current) -> int:
            return status(
                lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"w%d" % i, IfMatch=current)
            )

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(swap, range(16)))
        assert sorted(results) == [200] + [412] * 15
        assert body(s3, bucket, key) == b"w%d" % results.index(200)


# -- ETags and ABA ---------------------------------------------------------------------------


def test_a_single_put_etag_is_the_md5_of_the_body(s3: Any, bucket: str, key: str) -> None:
    data = secrets.token_bytes(1000)
    reply = s3.put_object(Bucket=bucket, Key=key, Body=data)
    assert reply["ETag"] == f'"{hashlib.md5(data).hexdigest()}"'


def test_identical_bytes_give_identical_etags_so_a_swap_can_suffer_aba(
    s3: Any, bucket: str, key: str
) -> None:
    """A reads the pointer (body P), B swaps it to Q, C swaps it back to P: A's swap from the ETag
    it read still succeeds, though the pointer changed twice. Hence the epoch and a fresh nonce
    in every pointer and floor body: no two writes of them have the same bytes."""
    pointer = b'{"epoch": 5, "object": "objects/r/5-ab"}'
    first = s3.put_object(Bucket=bucket, Key=key, Body=pointer)["ETag"]
    s3.put_object(Bucket=bucket, Key=key, Body=b'{"epoch": 6, "object": "objects/r/6-cd"}')
    again = s3.put_object(Bucket=bucket, Key=key, Body=pointer)["ETag"]
    assert again == first
    late = b'{"epoch": 4}'
    assert (
        status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=late, IfMatch=first.strip('"')))
        == 200
    )
    # with a nonce the same logical content has a new ETag, and the stale swap is refused
    s3.put_object(Bucket=bucket, Key=key, Body=b'{"epoch": 5, "nonce": "n1"}')
    read = etag(s3, bucket, key)
    s3.put_object(Bucket=bucket, Key=key, Body=b'{"epoch": 6, "nonce": "n2"}')
    s3.put_object(Bucket=bucket, Key=key, Body=b'{"epoch": 5, "nonce": "n3"}')
    assert etag(s3, bucket, key) != read
    assert (
        status(lambda: s3.put_object(Bucket=bucket, Key=key, Body=late, IfMatch=read.strip('"')))
        == 412
    )


# -- what is not conditional on this server ------------------------------------------------------


def _two_part_upload(s3: Any, bucket: str, key: str) -> tuple[str, list[dict[str, Any]]]:
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number, data in ((1, b"a" * (5 * MiB)), (2, b"tail")):
        reply = s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=data
        )
        parts.append({"PartNumber": number, "ETag": reply["ETag"]})
    return upload, parts


def test_complete_multipart_ignores_if_none_match(s3: Any, bucket: str, key: str) -> None:
    """So a multipart object is never the target of a conditional write: objects go under keys
    no one else writes (``<epoch>-<sha256>``), and only the small pointer is swapped."""
    s3.put_object(Bucket=bucket, Key=key, Body=b"existing")
    upload, parts = _two_part_upload(s3, bucket, key)
    done = s3.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, IfNoneMatch="*",
        MultipartUpload={"Parts": parts},
    )  # fmt: skip
    assert done["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == 5 * MiB + 4


def test_delete_ignores_if_match(s3: Any, bucket: str, key: str) -> None:
    """So ``gc`` cannot delete "only if unchanged": it deletes objects only (never a pointer or
    floor), and only ones no pointer names and older than the grace period."""
    s3.put_object(Bucket=bucket, Key=key, Body=b"x")
    wrong = hashlib.md5(b"other").hexdigest()
    assert status(lambda: s3.delete_object(Bucket=bucket, Key=key, IfMatch=wrong)) == 204
    assert status(lambda: s3.head_object(Bucket=bucket, Key=key)) == 404


# -- multipart uploads -------------------------------------------------------------------------


def test_a_multipart_object_is_invisible_until_complete(s3: Any, bucket: str, key: str) -> None:
    upload, parts = _two_part_upload(s3, bucket, key)
    assert status(lambda: s3.head_object(Bucket=bucket, Key=key)) == 404
    done = s3.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
    )
    assert done["ResponseMetadata"]["HTTPStatusCode"] == 200
    head = s3.head_object(Bucket=bucket, Key=key)
    assert head["ContentLength"] == 5 * MiB + 4
    digests = b"".join(hashlib.md5(data).digest() for data in (b"a" * (5 * MiB), b"tail"))
    assert head["ETag"] == f'"{hashlib.md5(digests).hexdigest()}-2"'
    assert body(s3, bucket, key)[-4:] == b"tail"


def test_parts_but_the_last_must_be_at_least_5_mib(s3: Any, bucket: str, key: str) -> None:
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number in (1, 2):
        reply = s3.upload_part(
            Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=b"small"
        )
        parts.append({"PartNumber": number, "ETag": reply["ETag"]})
    with pytest.raises(ClientError) as refused:
        s3.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
        )
    assert refused.value.response["Error"]["Code"] == "EntityTooSmall"
    s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload)


def test_in_progress_uploads_are_listed_until_aborted(s3: Any, bucket: str) -> None:
    prefix = f"mp-{secrets.token_hex(4)}/"
    started = datetime.now(UTC)
    uploads = {}
    for name in ("a", "b"):
        key = prefix + name
        upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"p")
        uploads[key] = upload
    listed = s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix)["Uploads"]
    assert {(u["Key"], u["UploadId"]) for u in listed} == set(uploads.items())
    for entry in listed:  # what gc's "older than the grace period" reads
        assert abs(entry["Initiated"] - started) < timedelta(minutes=1)

    aborted_key = prefix + "a"
    aborted = uploads[aborted_key]
    assert (
        status(lambda: s3.abort_multipart_upload(Bucket=bucket, Key=aborted_key, UploadId=aborted))
        == 204
    )
    listed = s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
    assert [u["Key"] for u in listed] == [prefix + "b"]
    assert status(lambda: s3.head_object(Bucket=bucket, Key=aborted_key)) == 404
    assert status(lambda: s3.list_parts(Bucket=bucket, Key=aborted_key, UploadId=aborted)) == 404
    with pytest.raises(ClientError) as again:
        s3.abort_multipart_upload(Bucket=bucket, Key=aborted_key, UploadId=aborted)
    assert again.value.response["Error"]["Code"] == "NoSuchUpload"
    s3.abort_multipart_upload(Bucket=bucket, Key=prefix + "b", UploadId=uploads[prefix + "b"])
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []

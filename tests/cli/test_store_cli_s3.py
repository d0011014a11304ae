"""The store commands on an ``s3://`` store (the session's Ceph RGW, a fresh key prefix per test):
``fenced fence|put|get|publish|latest|read|gc`` round trips in both modes, ``fenced run --fence``
with a child that publishes, the operations commands that read a store's records and floors
(``timeline``, ``restore --floor-from``, ``rebind``), and every S3 failure as one line with its
documented exit code: a bad ``s3://`` URL, a missing bucket and refused or missing credentials
are bad input (2), an unreachable endpoint is 69; none of them writes anything.

Credentials come from the AWS chain only: the ``s3_url`` fixture puts the server's keys in the
environment, which the child processes inherit.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from fenced._drivers import s3
from fenced.cli._exitcodes import BAD_INPUT, CONFLICT, NOT_FOUND, REJECTED, UNAVAILABLE
from fenced.cli._main import cli
from fenced.fence import open_store
from fenced.fence.s3._objects import PART_BYTES
from fenced.testing.etcd import free_ports
from fenced.testing.rgw import RgwServer
from fenced.testing.store_conformance import C2, R, token
from support.s3_stores import s3_bucket, s3_url

__all__ = ["s3_bucket", "s3_url"]  # fixtures from support.s3_stores, used here


def fenced_cli(
    *args: str,
    token_text: str | None = None,
    stdin: bytes = b"",
    env: dict[str, str | None] | None = None,
) -> Result:
    """``fenced ARGS`` in this process; ``env`` is laid over this process's environment (None
    removes a variable)."""
    overlay: dict[str, str | None] = dict(env or {})
    if token_text is not None:
        overlay["FENCED_TOKEN"] = token_text
    return CliRunner().invoke(cli, list(args), env=overlay, input=stdin)


def one_line_error(result: Result) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fenced: ")
    assert "Traceback" not in result.output + result.stderr
    return lines[0]


def keys_under(rgw: RgwServer, url: str) -> list[str]:
    """Every key under the store prefix of ``url``, read with a client of the test's own."""
    location = s3.parse_url(url)
    reply = rgw.client().list_objects_v2(Bucket=location.bucket, Prefix=location.prefix)
    return sorted(entry["Key"] for entry in reply.get("Contents") or [])


def with_options(url: str, **options: str) -> str:
    """``url`` with its ``endpoint=`` (and any other option) replaced by ``options``."""
    base = url.partition("?")[0]
    return base + "?" + "&".join(f"{name}={value}" for name, value in options.items())


def test_round_trip(s3_url: str, tmp_path: Path, rgw_server: RgwServer) -> None:
    text = str(token(7))
    assert fenced_cli("fence", s3_url, token_text=text).stdout == "7\n"  # creates it: strict
    large = random.Random(7).randbytes(6000)  # beyond what the state keeps inline
    put = fenced_cli("put", s3_url, "k", "--json", token_text=text, stdin=large)
    assert put.exit_code == 0, put.stderr
    assert json.loads(put.stdout) == {"resource": R, "key": "k", "epoch": 7, "version": 1}
    assert fenced_cli("get", s3_url, R, "k").stdout_bytes == large

    export = tmp_path / "export.bin"
    export.write_bytes(b"first export\n")
    published = fenced_cli("publish", s3_url, str(export), "--json", token_text=text)
    assert published.exit_code == 0, published.stderr
    latest = fenced_cli("latest", s3_url, R, "--json")
    assert json.loads(latest.stdout) == json.loads(published.stdout)
    assert fenced_cli("read", s3_url, R).stdout_bytes == b"first export\n"
    streamed = fenced_cli("publish", s3_url, "--name", "daily", token_text=text, stdin=b"piped")
    assert streamed.exit_code == 0, streamed.stderr
    assert streamed.stdout.startswith(f"resource={R} name=daily epoch=7 object_id=")
    assert fenced_cli("read", s3_url, R, "--name", "daily").stdout_bytes == b"piped"

    export.write_bytes(b"second export\n")
    assert fenced_cli("publish", s3_url, str(export), token_text=text).exit_code == 0
    before = keys_under(rgw_server, s3_url)
    assert fenced_cli("gc", s3_url, "--keep", "1", "--grace", "0").stdout == "1\n"
    assert len(keys_under(rgw_server, s3_url)) == len(before) - 1  # the superseded object
    assert fenced_cli("read", s3_url, R).stdout_bytes == b"second export\n"


def test_monotonic_mode(s3_url: str) -> None:
    created = fenced_cli("put", s3_url, "k", "--mode", "monotonic", token_text=str(token(3)))
    assert created.exit_code == 0, created.stderr  # monotonic: no fence needed
    published = fenced_cli("publish", s3_url, token_text=str(token(4)), stdin=b"four")
    assert published.exit_code == 0, published.stderr  # a larger epoch: accepted
    stale = fenced_cli("publish", s3_url, token_text=str(token(3)), stdin=b"three")
    assert stale.exit_code == REJECTED
    assert one_line_error(stale) == f"fenced: stale token for {R}: epoch 3 is below the floor 4"
    assert fenced_cli("read", s3_url, R).stdout_bytes == b"four"
    other = fenced_cli("get", s3_url, R, "k", "--mode", "strict")
    assert other.exit_code == BAD_INPUT
    assert "monotonic mode" in one_line_error(other)


def test_rejections_exit_3_and_conflicts_exit_4(s3_url: str) -> None:
    text = str(token(5))
    assert fenced_cli("fence", s3_url, token_text=text).exit_code == 0
    for args, presented in [
        (("publish", s3_url), str(token(4))),  # stale
        (("put", s3_url, "k"), str(token(6))),  # strict: not installed
        (("put", s3_url, "k"), str(token(9, coordinator=C2))),  # foreign
    ]:
        result = fenced_cli(*args, token_text=presented, stdin=b"v")
        assert result.exit_code == REJECTED, (args, result.stderr)
        one_line_error(result)
    assert fenced_cli("get", s3_url, R, "k").exit_code == NOT_FOUND  # nothing was written

    first = fenced_cli("put", s3_url, "k", "--op-id", "w1", "--if-version", "0", token_text=text)
    again = fenced_cli("put", s3_url, "k", "--op-id", "w1", "--if-version", "0", token_text=text)
    assert (first.exit_code, again.exit_code, again.stdout) == (0, 0, first.stdout)
    conflict = fenced_cli("put", s3_url, "k", "--if-version", "0", token_text=text, stdin=b"v")
    assert conflict.exit_code == CONFLICT
    assert "version conflict" in one_line_error(conflict)
    reused = fenced_cli("put", s3_url, "k", "--op-id", "w1", token_text=text, stdin=b"other")
    assert reused.exit_code == CONFLICT
    assert "op_id" in one_line_error(reused)


def test_readers_never_create_a_store_and_find_nothing_in_an_empty_one(
    s3_url: str, rgw_server: RgwServer
) -> None:
    for args in (("get", s3_url, R, "k"), ("read", s3_url, R), ("gc", s3_url)):
        missing = fenced_cli(*args)
        assert missing.exit_code == BAD_INPUT
        assert "no fenced store at s3://" in one_line_error(missing)
    assert keys_under(rgw_server, s3_url) == []

    open_store(s3_url).close()
    assert fenced_cli("get", s3_url, R, "k").exit_code == NOT_FOUND
    latest = fenced_cli("latest", s3_url, R, "--json")
    assert (latest.exit_code, latest.stdout) == (NOT_FOUND, "null\n")
    nothing = fenced_cli("read", s3_url, R)
    assert nothing.exit_code == NOT_FOUND
    one_line_error(nothing)


def test_reading_a_damaged_publication_exits_2(s3_url: str, rgw_server: RgwServer) -> None:
    with open_store(s3_url, "monotonic") as store:
        publication = store.publish(token(1), b"x" * 100_000)
    (key,) = [k for k in keys_under(rgw_server, s3_url) if k.endswith(publication.object_id)]
    rgw_server.client().put_object(Bucket=s3.parse_url(s3_url).bucket, Key=key, Body=b"x" * 999)
    result = fenced_cli("read", s3_url, R)
    assert result.exit_code == BAD_INPUT
    assert one_line_error(result).startswith(
        f"fenced: object {publication.object_id} of {R!r} is damaged: "
    )


BAD_URLS = [
    ("s3://Bad_Bucket/p", "is not a bucket name"),
    ("s3:///p", "is not a bucket name"),
    ("s3://user:secret@{bucket}/p", "carries no credentials"),
    ("s3://{bucket}/a//b", "empty segment"),
    ("s3://{bucket}/p?bogus=1", "unknown option 'bogus'"),
    ("s3://{bucket}/p?timeout=soon", "timeout= must be a positive number"),
    ("s3://{bucket}/p?timeout=0", "timeout= must be a positive number"),
    ("s3://{bucket}/p?endpoint=ftp://host", "endpoint= must be an http(s):// URL"),
    ("s3://{bucket}/p?endpoint=", "give endpoint= once"),
    ("s3://{bucket}/p?addressing=sideways", "addressing= is path, virtual or auto"),
    ("s3://{bucket}/p#fragment", "has no fragment"),
]


@pytest.mark.parametrize(("spelling", "message"), BAD_URLS)
def test_a_bad_s3_url_exits_2_with_one_line_and_writes_nothing(
    s3_bucket: str, rgw_server: RgwServer, spelling: str, message: str
) -> None:
    url = spelling.format(bucket=s3_bucket)
    for args, text in [
        (("fence", url), str(token(1))),
        (("publish", url, "-"), str(token(1))),
        (("latest", url, R), None),
    ]:
        result = fenced_cli(*args, token_text=text, stdin=b"v")
        assert result.exit_code == BAD_INPUT, (args, result.output)
        line = one_line_error(result)
        assert message in line, line
        assert "secret" not in line  # a password in the URL is never echoed
    listing = rgw_server.client().list_objects_v2(Bucket=s3_bucket, Prefix="p/")
    assert not listing.get("Contents")


Command = tuple[tuple[str, ...], str | None]
"""A store command's arguments (``{url}`` for its store) and the token it presents."""


def _failures(
    url: str, s3_bucket: str, tmp_path: Path
) -> list[tuple[str, dict[str, str | None], int, str]]:
    """(URL, environment overlay, exit code, message) of each S3 failure."""
    port = free_ports(1)[0]  # nothing listens there
    nowhere = str(tmp_path / "no-such-file")
    return [
        (url.replace(s3_bucket, "fenced-no-such-bucket"), {}, BAD_INPUT,
         "the bucket fenced-no-such-bucket does not exist"),
        (url, {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, BAD_INPUT,
         "was refused (403): check the credentials"),
        (url, {"AWS_ACCESS_KEY_ID": "AKIDUNKNOWN000000000"}, BAD_INPUT,
         "was refused (403): check the credentials"),
        (url,
         {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None, "AWS_PROFILE": None,
          "AWS_SHARED_CREDENTIALS_FILE": nowhere, "AWS_CONFIG_FILE": nowhere,
          "AWS_EC2_METADATA_DISABLED": "true"}, BAD_INPUT,
         "no AWS credentials found"),
        (with_options(url, endpoint=f"http://127.0.0.1:{port}", timeout="1"), {}, UNAVAILABLE,
         "Could not connect to the endpoint URL"),
    ]  # fmt: skip


def test_s3_failures_are_one_line_with_their_exit_code_and_write_nothing(
    s3_url: str, s3_bucket: str, rgw_server: RgwServer, tmp_path: Path
) -> None:
    """Missing bucket, wrong secret, unknown key, no credentials at all: 2; an endpoint that
    cannot be reached: 69. Every command opens its store the same way (the failures are found
    there), so each failure meets a writer and a reader, in turn."""
    export = tmp_path / "export.bin"
    export.write_bytes(b"data")
    writer = str(token(1))
    publish: Command = (("publish", "{url}", str(export)), writer)
    fence: Command = (("fence", "{url}"), writer)
    put: Command = (("put", "{url}", "k"), writer)
    latest: Command = (("latest", "{url}", R), None)
    read: Command = (("read", "{url}", R), None)
    gc: Command = (("gc", "{url}", "--grace", "0"), None)
    get: Command = (("get", "{url}", R, "k"), None)
    pairs = [(publish, latest), (fence, read), (put, gc), (publish, get), (publish, latest)]
    failures = _failures(s3_url, s3_bucket, tmp_path)
    for (url, env, code, message), pair in zip(failures, pairs, strict=True):
        for args, text in pair:
            filled = [arg.format(url=url) for arg in args]
            result = fenced_cli(*filled, token_text=text, stdin=b"v", env=env)
            assert result.exit_code == code, (filled, env, result.output)
            line = one_line_error(result)
            assert message in line, (env, line)
    assert keys_under(rgw_server, s3_url) == []


def _fenced(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """``python -m fenced ARGS`` as a process of its own (it inherits the AWS variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    return subprocess.run(
        [sys.executable, "-m", "fenced", *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_fenced_run_fences_an_s3_store_for_a_child_that_streams_a_multipart_publication(
    s3_url: str, tmp_path: Path
) -> None:
    """``fenced run --fence s3://…`` installs the new epoch; its child publishes from standard
    input (streamed: more than one part) with the token fenced run gives it; then the
    operations commands read the store's records (timeline) and floors (restore, rebind)."""
    coordinator = f"sqlite:///{tmp_path / 'fenced.db'}"
    data = random.Random(1).randbytes(PART_BYTES + 4096)
    child = [sys.executable, "-m", "fenced", "publish", s3_url, "-", "--json"]
    run = _fenced("run", R, "--url", coordinator, "--fence", s3_url, "--", *child, stdin=data)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["epoch"] == 1
    assert fenced_cli("read", s3_url, R).stdout_bytes == data

    timeline = fenced_cli("timeline", R, "--url", coordinator, "--store", s3_url, "--json")
    assert timeline.exit_code == 0, timeline.stderr
    view = json.loads(timeline.stdout)
    assert [(i["epoch"], i["accepted_writes"]) for i in view["intervals"]] == [(1, 1)]
    assert [(e["kind"], e["epoch"]) for e in view["events"]] == [("installed", 1)]

    other = f"sqlite:///{tmp_path / 'other.db'}"
    refused = fenced_cli("rebind", s3_url, "--url", other, "--yes")
    assert refused.exit_code == BAD_INPUT
    assert "is not past the floors of s3://" in one_line_error(refused)
    advanced = fenced_cli("restore", "--advance", "--floor-from", s3_url, "--url", other, "--yes")
    assert advanced.exit_code == 0, advanced.stderr
    rebound = fenced_cli("rebind", s3_url, "--url", other, "--yes", "--json")
    assert rebound.exit_code == 0, rebound.stderr
    assert json.loads(rebound.stdout)["rebound"] == {R: 1}

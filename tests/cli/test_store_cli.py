"""``fenced fence|put|publish|get|latest|read|gc``: round trips, exit codes, one-line errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import fenced.fence
from fenced.cli._exitcodes import BAD_INPUT
from fenced.cli._main import cli
from fenced.testing.store_conformance import C2, R, token
from support.store_damage import DAMAGES, damage_file_object, damage_sqlite_object, original

SRC = str(Path(fenced.fence.__file__).resolve().parents[2])


def fenced_cli(*args: str, token_text: str | None = None, stdin: bytes = b"") -> Result:
    env = {"FENCED_TOKEN": token_text} if token_text is not None else {}
    return CliRunner().invoke(cli, list(args), env=env, input=stdin)


def one_line_error(result: Result) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fenced: ")
    assert "Traceback" not in result.output + result.stderr
    return lines[0]


@pytest.fixture(params=["sqlite", "file"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return (
        f"sqlite:///{tmp_path}/fenced.db" if request.param == "sqlite" else f"file://{tmp_path}/s"
    )


def test_round_trip_through_a_real_process_with_fenced_token(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
        "FENCED_TOKEN": str(token(42)),
    }

    def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "fenced", *args],
            input=stdin,
            capture_output=True,
            env=env,
            timeout=60,
            check=False,
        )

    assert run("fence", url).stdout == b"42\n"
    put = run("put", url, "config", "-", "--json", stdin=b"\x00binary\xff")
    assert put.returncode == 0, put.stderr
    assert json.loads(put.stdout) == {"resource": R, "key": "config", "epoch": 42, "version": 1}
    assert run("get", url, R, "config").stdout == b"\x00binary\xff"
    export = tmp_path / "export.bin"
    export.write_bytes(b"x" * 3_000_000)
    published = run("publish", url, str(export), "--json")
    assert published.returncode == 0, published.stderr
    latest = run("latest", url, R, "--json")
    assert json.loads(latest.stdout) == json.loads(published.stdout)
    assert json.loads(latest.stdout)["sha256"] == hashlib.sha256(export.read_bytes()).hexdigest()
    assert run("read", url, R).stdout == export.read_bytes()
    env["FENCED_TOKEN"] = str(token(41))
    stale = run("publish", url, str(export))
    assert stale.returncode == 3
    assert stale.stderr.decode().splitlines() == [
        f"fenced: stale token for {R}: epoch 41 is below the floor 42"
    ]
    env["FENCED_TOKEN"] = "not a token"
    malformed = run("put", url, "config", stdin=b"v")
    assert malformed.returncode == 2
    assert len(malformed.stderr.splitlines()) == 1 and b"Traceback" not in malformed.stderr


def test_round_trip_in_process(url: str, tmp_path: Path) -> None:
    text = str(token(7))
    assert fenced_cli("fence", url, token_text=text).stdout == "7\n"
    put = fenced_cli("put", url, "k", token_text=text, stdin=b"value")
    assert (put.exit_code, put.stdout) == (0, f"resource={R} key=k epoch=7 version=1\n")
    assert fenced_cli("get", url, R, "k").stdout_bytes == b"value"
    published = fenced_cli("publish", url, "--name", "daily", "--json", token_text=text, stdin=b"e")
    assert published.exit_code == 0, published.stderr
    document = json.loads(published.stdout)
    assert (document["name"], document["size"], document["epoch"]) == ("daily", 1, 7)
    assert fenced_cli("read", url, R, "--name", "daily").stdout_bytes == b"e"
    latest = fenced_cli("latest", url, R, "--name", "daily")
    assert latest.stdout.startswith(f"resource={R} name=daily epoch=7 object_id=")
    assert fenced_cli("gc", url, "--keep", "1", "--grace", "0").stdout == "0\n"


def test_op_id_and_if_version(url: str) -> None:
    text = str(token(1))
    fenced_cli("fence", url, token_text=text)
    first = fenced_cli("put", url, "k", "--op-id", "w1", "--if-version", "0", token_text=text)
    again = fenced_cli("put", url, "k", "--op-id", "w1", "--if-version", "0", token_text=text)
    assert (first.exit_code, again.exit_code, again.stdout) == (0, 0, first.stdout)
    conflict = fenced_cli("put", url, "k", "--if-version", "0", token_text=text, stdin=b"v")
    assert conflict.exit_code == 4
    assert "version conflict" in one_line_error(conflict)
    reused = fenced_cli("put", url, "k", "--op-id", "w1", token_text=text, stdin=b"other")
    assert reused.exit_code == 4
    assert "op_id" in one_line_error(reused)


def test_rejections_exit_3(url: str) -> None:
    fenced_cli("fence", url, token_text=str(token(5)))
    for args, text in [
        (("put", url, "k"), str(token(4))),  # stale
        (("put", url, "k"), str(token(6))),  # strict: not installed
        (("publish", url), str(token(4))),
        (("fence", url), str(token(4))),
        (("put", url, "k"), str(token(9, coordinator=C2))),  # foreign
    ]:
        result = fenced_cli(*args, token_text=text, stdin=b"v")
        assert result.exit_code == 3, (args, result.stderr)
        one_line_error(result)
    assert fenced_cli("get", url, R, "k").exit_code == 1  # nothing was written


@pytest.mark.parametrize(
    ("args", "text", "message"),
    [
        (("put", "{url}", "k"), None, "no fencing token"),
        (("put", "{url}", "k"), "fenced1:xyz", "malformed fencing token"),
        (("put", "{url}", "../escape"), "{token}", "'..' segment"),
        (("put", "{url}", "/etc/passwd"), "{token}", "empty segment"),
        (("put", "{url}", "a\x01b"), "{token}", "contains"),
        (("put", "{url}", "k" * 256), "{token}", "limit is 255"),
        (("put", "{url}", "k", "{tmp}/missing"), "{token}", "no such file"),
        (("publish", "{url}", "{tmp}/missing"), "{token}", "no such file"),
        (("publish", "{url}", "--name", "../x"), "{token}", "'..' segment"),
        (("put", "{url}", "k", "--resource", "other/resource"), "{token}", "not 'other/"),
        (("get", "{url}", "bad//name", "k"), None, "empty segment"),
        (("latest", "{url}", "../up"), None, "'..' segment"),
        (("get", "ftp://host/x", R, "k"), None, "no store for ftp"),
        (("put", "{url}", "k", "--if-version", "x"), "{token}", "is not a valid integer"),
        (("gc", "{url}", "--grace", "soon"), None, "--grace must be a number"),
        (("gc", "{url}", "--keep", "-1"), None, "--keep"),
        (("put", "{url}"), "{token}", "Missing argument 'KEY'"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(
    url: str, tmp_path: Path, args: tuple[str, ...], text: str | None, message: str
) -> None:
    fenced_cli("fence", url, token_text=str(token(1)))
    listing = sorted(str(p) for p in tmp_path.rglob("*"))
    filled = [a.format(url=url, tmp=tmp_path) for a in args]
    token_text = None if text is None else text.format(token=token(1))
    result = fenced_cli(*filled, token_text=token_text, stdin=b"v")
    assert result.exit_code == 2, result.output
    assert message in one_line_error(result)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == listing


def test_nothing_found_exits_1(url: str) -> None:
    fenced.fence.open_store(url).close()  # an empty store: readers create none (exit 2)
    missing = fenced_cli("get", url, R, "k")
    assert missing.exit_code == 1
    assert "no key 'k'" in one_line_error(missing)
    latest = fenced_cli("latest", url, R, "--json")
    assert (latest.exit_code, latest.stdout) == (1, "null\n")
    assert fenced_cli("read", url, R).exit_code == 1


def test_mode_option(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/m.db"
    created = fenced_cli("put", url, "k", "--mode", "monotonic", token_text=str(token(3)))
    assert created.exit_code == 0, created.stderr  # monotonic: no fence needed
    other = fenced_cli("get", url, R, "k", "--mode", "strict")
    assert other.exit_code == 2
    assert "monotonic mode" in one_line_error(other)


@pytest.mark.parametrize("damage", DAMAGES)
def test_reading_a_damaged_publication_exits_2_with_one_line(url: str, damage: str) -> None:
    """``fenced read`` of an object cut to 1 MiB of its 5 MiB, with a flipped byte or with a byte
    too many exits 2 (a corrupt store is bad input, as a corrupt state file is) with one line."""
    with fenced.fence.open_store(url, "monotonic") as store:
        publication = store.publish(token(1), original())
    location = Path(url.split("://", 1)[1])
    if url.startswith("sqlite:"):
        damage_sqlite_object(location, publication, damage)
    else:
        damage_file_object(location, publication, damage)
    result = fenced_cli("read", url, R)
    assert result.exit_code == BAD_INPUT
    line = one_line_error(result)
    assert line.startswith(f"fenced: object {publication.object_id} of {R!r} is damaged: ")
    assert len(result.stdout_bytes) <= publication.size  # never a damaged byte past the size

"""``fenced keys add|list|revoke --keys FILE`` (issue 23, item 4).

* ``add`` prints the new key on standard output, once, and nowhere else: not on stderr, not in
  the file, not in ``list`` (plain or ``--json``), which shows id, name, roles, prefixes, created
  and revoked, never a hash.
* ``revoke`` by id or name takes effect for an authority reading the file, idempotently; an
  unknown id or name exits 1.
* Bad input is one line on stderr with exit 2, standard output empty, the file unchanged.

In process with click's runner (fast), and one run of the real ``python -m fenced``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from fenced.cli._main import cli
from fenced.core._errors import NotAuthenticated
from fenced.server._keys import open_keys
from support.cli_processes import fenced_cmd

KEY = re.compile(r"fk_[0-9a-f]{12}_[A-Za-z0-9_-]{43}")


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "keys.json"


def fenced(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), prog_name="fenced", catch_exceptions=False)


def add(path: Path, name: str, *options: str) -> str:
    result = fenced("keys", "add", name, "--keys", str(path), *options)
    assert result.exit_code == 0, result.stderr
    assert KEY.fullmatch(result.stdout.strip()) and result.stdout.count("\n") == 1
    return result.stdout.strip()


def one_line(result: Result, code: int) -> str:
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fenced: "), result.stderr
    return lines[0]


def test_add_prints_the_key_once_on_stdout_and_list_never_shows_it(path: Path) -> None:
    result = fenced(
        "keys", "add", "ci", "--keys", str(path), "--role", "hold", "--role", "read",
        "--prefix", "jobs/", "--prefix", "ci/",
    )  # fmt: skip
    assert result.exit_code == 0
    key = result.stdout.strip()
    assert KEY.fullmatch(key) and result.stdout == key + "\n"
    key_id = key[3:15]
    assert key_id in result.stderr and "roles hold, read; prefixes ci/,jobs/" in result.stderr
    assert key[16:] not in result.stderr
    everywhere = add(path, "all", "--role", "admin", "--prefix", "")

    listed = fenced("keys", "list", "--keys", str(path))
    assert listed.exit_code == 0
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["ID", "NAME", "ROLES", "PREFIXES", "CREATED", "REVOKED"]
    assert lines[1].split()[:4] == [key_id, "ci", "hold,read", "ci/,jobs/"]
    assert lines[2].split()[:4] == [everywhere[3:15], "all", "admin", '""']
    assert lines[1].split()[5] == "-"

    as_json = fenced("keys", "list", "--keys", str(path), "--json")
    document = json.loads(as_json.stdout)
    assert document["format"] == 1 and document["file"] == str(path)
    assert [set(entry) for entry in document["keys"]] == [
        {"id", "name", "roles", "prefixes", "created", "revoked"}
    ] * 2
    assert document["keys"][0] | {"created": None} == {
        "id": key_id,
        "name": "ci",
        "roles": ["hold", "read"],
        "prefixes": ["ci/", "jobs/"],
        "created": None,
        "revoked": None,
    }
    salt = json.loads(path.read_text())["keys"][0]["salt"]
    for text in (listed.stdout, as_json.stdout, path.read_text()):
        for secret in (key, everywhere):
            assert secret not in text and secret[16:] not in text
    for text in (listed.stdout, as_json.stdout):
        assert salt not in text and "sha256" not in text

    open_keys(path).check(f"Bearer {key}", "hold", "jobs/nightly")


def test_list_of_an_empty_file(path: Path) -> None:
    path.write_text('{"format": "fenced-keys", "version": 1, "keys": []}')
    result = fenced("keys", "list", "--keys", str(path))
    assert result.exit_code == 0 and result.stdout == f"no API keys in {path}\n"
    result = fenced("keys", "list", "--keys", str(path), "--json")
    assert json.loads(result.stdout)["keys"] == []


def test_revoke_by_name_or_id_takes_effect_and_is_idempotent(path: Path) -> None:
    first = add(path, "first", "--role", "read", "--prefix", "")
    second = add(path, "second", "--role", "read", "--prefix", "")
    authority = open_keys(path)
    authority.check(f"Bearer {first}", "read", "x")

    result = fenced("keys", "revoke", "first", "--keys", str(path))
    assert result.exit_code == 0
    assert result.stdout == f"revoked API key {first[3:15]} (first)\n"
    with pytest.raises(NotAuthenticated):
        authority.check(f"Bearer {first}", "read", "x")
    authority.check(f"Bearer {second}", "read", "x")

    again = fenced("keys", "revoke", first[3:15], "--keys", str(path))
    assert again.exit_code == 0 and "was already revoked at" in again.stdout
    result = fenced("keys", "revoke", second[3:15], "--keys", str(path))
    assert result.exit_code == 0
    with pytest.raises(NotAuthenticated):
        authority.check(f"Bearer {second}", "read", "x")

    listed = fenced("keys", "list", "--keys", str(path)).stdout.splitlines()
    assert all(re.search(r"Z\s+\d{4}-\d\d-\d\dT\S+Z$", line) for line in listed[1:])

    line = one_line(fenced("keys", "revoke", "nobody", "--keys", str(path)), 1)
    assert "no key with id or name 'nobody'" in line and str(path) in line


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["add", "ci", "--prefix", ""], "give the key a role: --role hold|write|read|admin"),
        (["add", "ci", "--role", "root", "--prefix", ""], "'root' is not one of"),
        (["add", "ci", "--role", "read"], "give the key a name prefix"),
        (["add", "ci", "--role", "read", "--prefix", "a b"], "cannot start a name"),
        (["add", "c i", "--role", "read", "--prefix", ""], "key name 'c i' is not allowed"),
        (["add", "taken", "--role", "read", "--prefix", ""], "already has a valid key named"),
        (["add", "--role", "read"], "Missing argument 'NAME' (see 'fenced keys add --help')"),
        (["list", "--keys", "MISSING"], "no keys file at"),
        (["list", "--keys", "BROKEN"], "is not valid JSON"),
        (["revoke", "taken", "--keys", "BROKEN"], "is not valid JSON"),
        (["add", "x", "--keys", "BROKEN", "--role", "read", "--prefix", ""], "not valid JSON"),
        (["add", "x", "--keys", "NODIR", "--role", "read", "--prefix", ""], "directory"),
        (["revoke", "taken", "--keys", "MISSING"], "no keys file at"),
        (["frobnicate"], "No such command 'frobnicate' (see 'fenced keys --help')"),
        (["list"], "Missing option '--keys' (see 'fenced keys list --help')"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_bad_input_is_one_line_exit_2_and_changes_nothing(
    tmp_path: Path, path: Path, args: list[str], says: str
) -> None:
    key = add(path, "taken", "--role", "read", "--prefix", "")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    places = {
        "MISSING": tmp_path / "missing.json",
        "BROKEN": broken,
        "NODIR": tmp_path / "no" / "keys.json",
    }
    args = [str(places.get(arg, arg)) for arg in args]
    if args[0] == "add" and "--keys" not in args:
        args += ["--keys", str(path)]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*")}
    line = one_line(fenced("keys", *args), 2)
    assert says in line
    assert key not in line and key[16:] not in line
    assert {p: p.read_bytes() for p in tmp_path.rglob("*")} == before


def test_the_real_command(path: Path) -> None:
    added = fenced_cmd(
        "keys", "add", "ci", "--keys", str(path), "--role", "write", "--prefix", "jobs/"
    )
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert KEY.fullmatch(key) and added.stdout == key + "\n" and key not in added.stderr
    refused = fenced_cmd("keys", "add", "ci", "--keys", str(path), "--role", "x", "--prefix", "")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("fenced: ") and refused.stderr.count("\n") == 1
    open_keys(path).check(f"Bearer {key}", "write", "jobs/a")


def test_without_the_server_extra_it_says_what_to_install(path: Path) -> None:
    code = (
        "import sys; sys.modules['fastapi'] = None; sys.argv[0] = 'fenced'\n"
        "from fenced.cli._main import main; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "keys", "list", "--keys", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        "fenced: fenced keys needs the server extra: pip install 'fenced[server]'\n"
    )

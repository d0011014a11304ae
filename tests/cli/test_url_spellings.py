"""One URL parser for every command: each spelling of a ``sqlite:`` or ``file:`` URL names the
same file for ``fenced.connect``, ``fenced.open_store`` and every ``fenced`` command, run from a
temporary current directory.

Spellings: ``sqlite:///rel`` (three slashes: relative, SQLAlchemy's rule), ``sqlite:////abs``
(four: absolute), ``sqlite:rel``, ``sqlite:/abs``, ``file:///abs`` (RFC 8089), ``file:rel``.
Each test checks that the command used the database or store at the path the spelling means
(the one the test created), and that nothing appeared anywhere else. Also the transition check:
``sqlite:///x/y.db`` when ``x/y.db`` does not exist but ``/x/y.db`` is a fenced database is a
one-line refusal naming both spellings (CLI: exit 2, no traceback), and creates nothing.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

import fenced
from fenced.cli._main import cli
from fenced.core._errors import ConfigurationError

R = "jobs/urls"


@dataclass(frozen=True)
class Place:
    """A test's two directories: the current directory and another (absolute) one."""

    cwd: Path
    other: Path

    def files(self) -> set[str]:
        """Every file under both, relative to their common parent."""
        root = self.cwd.parent
        return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Place:
    cwd, other = tmp_path / "cwd", tmp_path / "abs"
    (cwd / "rel").mkdir(parents=True)  # stores do not create their parent directory
    other.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("FENCED_URL", raising=False)
    return Place(cwd, other)


# spelling name -> (URL for a given place, where it must land)
Spelling = Callable[[Place, str], tuple[str, Path]]

COORDINATORS: dict[str, Spelling] = {
    "sqlite:///rel": lambda p, n: (f"sqlite:///rel/{n}", p.cwd / "rel" / n),
    "sqlite:////abs": lambda p, n: (f"sqlite:///{p.other}/{n}", p.other / n),
    "sqlite:rel": lambda p, n: (f"sqlite:rel/{n}", p.cwd / "rel" / n),
    "sqlite:/abs": lambda p, n: (f"sqlite:{p.other}/{n}", p.other / n),
}
STORES: dict[str, Spelling] = {
    **COORDINATORS,
    "file:///abs": lambda p, n: (f"file://{p.other}/{n}", p.other / n),
    "file:rel": lambda p, n: (f"file:rel/{n}", p.cwd / "rel" / n),
}


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output + result.stderr
    return result


def lease_at(url: str) -> fenced.FencingToken:
    """Create the coordinator at ``url`` with one released lease; its token."""
    with fenced.connect(url) as coord:
        lease = coord.acquire(R, ttl=30, wait=0)
        coord.release(lease)
        return lease.token


def assert_only(place: Place, expected: set[Path]) -> None:
    """The files of the test are the expected ones and their SQLite/marker companions."""
    root = place.cwd.parent
    wanted = {str(p.relative_to(root)) for p in expected}
    found = place.files()
    stray = {f for f in found if not any(f == w or f.startswith(w + "-") or
                                         f.startswith(w + ".") or f.startswith(w + "/")
                                         for w in wanted)}  # fmt: skip
    assert stray == set(), f"files outside {sorted(wanted)}: {sorted(stray)}"
    for path in expected:
        assert path.exists(), f"{path} was not used"


# -- the coordinator, command by command ------------------------------------------------------


@pytest.mark.parametrize("spelling", COORDINATORS)
def test_connect(place: Place, spelling: str) -> None:
    url, path = COORDINATORS[spelling](place, "c.db")
    with fenced.connect(url) as coord:
        coord.release(coord.acquire(R, ttl=30, wait=0))
        assert coord.url == f"sqlite:///{path}"  # canonical: four slashes, absolute
    assert_only(place, {path})


@pytest.mark.parametrize("spelling", COORDINATORS)
def test_status(place: Place, spelling: str) -> None:
    url, path = COORDINATORS[spelling](place, "c.db")
    lease_at(url)
    assert R in invoke("status", "--url", url).output
    assert_only(place, {path})


@pytest.mark.parametrize("spelling", COORDINATORS)
def test_timeline_and_metrics(place: Place, spelling: str) -> None:
    url, path = COORDINATORS[spelling](place, "c.db")
    lease_at(url)
    timeline = invoke("timeline", R, "--url", url).output
    assert f"at sqlite:///{path}," in timeline and "released" in timeline
    assert (
        f'fenced_ownership_changes_total{{resource="{R}"}} 1'
        in invoke("metrics", "--url", url).output
    )
    assert_only(place, {path})


@pytest.mark.parametrize("spelling", COORDINATORS)
def test_backup_and_restore(place: Place, spelling: str) -> None:
    url, path = COORDINATORS[spelling](place, "c.db")
    first = lease_at(url)
    backup = place.other / "backup.db"
    invoke("backup", str(backup), "--url", url)
    assert backup.is_file()
    invoke("restore", str(backup), "--url", url, "--yes")
    with fenced.connect(url) as coord:
        lease = coord.acquire(R, ttl=30, wait=0)
        assert lease.epoch > first.epoch and lease.token.coordinator_id == first.coordinator_id
        coord.release(lease)
    assert_only(place, {path, backup})


@pytest.mark.parametrize("spelling", COORDINATORS)
def test_run(place: Place, spelling: str) -> None:
    url, path = COORDINATORS[spelling](place, "c.db")
    lease_at(url)
    invoke("run", R, "--ttl", "10", "--url", url, "--", sys.executable, "-c", "pass")
    with fenced.connect(url) as coord:
        assert [r.epoch for r in coord.history(R) if r.kind.value == "granted"] == [1, 2]
    assert_only(place, {path})


# -- stores, command by command ---------------------------------------------------------------


@pytest.mark.parametrize("spelling", STORES)
def test_open_store_and_store_commands(place: Place, spelling: str) -> None:
    coordinator = place.other / "c.db"
    token = str(lease_at(f"sqlite:///{coordinator}"))
    url, path = STORES[spelling](place, "s.db" if spelling.startswith("sqlite") else "store")
    with fenced.open_store(url) as store:
        scheme = "sqlite:///" if spelling.startswith("sqlite") else "file://"
        assert store.url == f"{scheme}{path}"  # canonical: absolute
    data = place.other / "data.txt"
    data.write_bytes(b"payload")
    invoke("fence", url, "--token", token)
    invoke("put", url, "k", str(data), "--token", token)
    assert invoke("get", url, R, "k").stdout_bytes == b"payload"
    invoke("publish", url, str(data), "--token", token)
    assert invoke("read", url, R).stdout_bytes == b"payload"
    assert "1" in invoke("latest", url, R).output
    assert_only(place, {coordinator, path, data})


@pytest.mark.parametrize("spelling", STORES)
def test_run_fence_timeline_metrics_and_restore_floor_from(place: Place, spelling: str) -> None:
    coordinator = f"sqlite:///{place.other}/c.db"
    url, path = STORES[spelling](place, "s.db" if spelling.startswith("sqlite") else "store")
    fenced.open_store(url).close()
    invoke("run", R, "--ttl", "10", "--url", coordinator, "--fence", url, "--", "true")
    with fenced.open_store(url) as store:
        assert store.floor(R) == 1
    invoke("timeline", R, "--url", coordinator, "--store", url)
    invoke("metrics", "--url", coordinator, "--store", url)
    invoke("status", "--url", coordinator, "--store", url)
    invoke("restore", "--advance", "--url", coordinator, "--floor-from", url, "--yes")
    assert_only(place, {place.other / "c.db", path})


# -- the transition check ---------------------------------------------------------------------


def _old_spelling(path: Path) -> str:
    """What fenced read as ``path`` before it followed SQLAlchemy: three slashes + absolute."""
    return "sqlite://" + str(path)


@pytest.mark.parametrize("kind", ["coordinator", "store"])
def test_three_slashes_for_an_existing_absolute_database_are_refused(
    place: Place, kind: str
) -> None:
    existing = place.other / "fenced.db"
    if kind == "coordinator":
        lease_at(f"sqlite:///{existing}")
    else:
        fenced.open_store(f"sqlite:///{existing}").close()
    before = place.files()
    old = _old_spelling(existing)
    assert old.startswith("sqlite:///") and not old.startswith("sqlite:////")
    for opening in (fenced.connect, fenced.open_store):
        with pytest.raises(ConfigurationError) as caught:
            opening(old)
        message = str(caught.value)
        assert "\n" not in message
        assert old in message and f"sqlite:///{existing}" in message  # both spellings
    assert place.files() == before  # nothing created under the current directory


def test_the_cli_refuses_it_with_exit_2_and_one_line(place: Place) -> None:
    existing = place.other / "fenced.db"
    token = str(lease_at(f"sqlite:///{existing}"))
    before = place.files()
    old = _old_spelling(existing)
    env = {k: v for k, v in os.environ.items() if k != "FENCED_URL"}
    for args in (
        ["status", "--url", old],
        ["run", R, "--url", old, "--", "true"],
        ["backup", str(place.other / "b.db"), "--url", old],
        ["put", old, "k", "-", "--token", token],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "fenced", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=place.cwd,
            input="",
            timeout=60,
            check=False,
        )
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
        assert old in lines[0] and f"sqlite:///{existing}" in lines[0]
    assert place.files() == before


def test_no_refusal_when_the_relative_database_exists_or_the_absolute_one_is_not_fenced(
    place: Place,
) -> None:
    existing = place.other / "fenced.db"
    lease_at(f"sqlite:///{existing}")
    relative = place.cwd / str(existing).lstrip("/")
    relative.parent.mkdir(parents=True)
    lease_at(f"sqlite:{relative}")  # both exist: the three-slash URL is the relative one
    with fenced.connect(_old_spelling(existing)) as coord:
        assert coord.url == f"sqlite:///{relative}"
    not_fenced = place.other / "notes.txt"
    not_fenced.write_text("not a database")
    with fenced.connect(_old_spelling(not_fenced) + ".db") as coord:  # not even there
        assert coord.url.startswith(f"sqlite:///{place.cwd}/")
    plain = place.other / "plain.db"
    sqlite3.connect(plain).execute("CREATE TABLE t (x)").connection.close()
    with fenced.open_store(_old_spelling(plain)) as store:  # a SQLite file, not fenced's
        assert store.url == f"sqlite:///{place.cwd}{plain}"

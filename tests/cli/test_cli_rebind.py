"""``fenced rebind``: the lost-coordinator procedure from the command line, its refusals and
exit codes (docs/cli.md), and the ``rebound`` event in ``fenced timeline``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from fenced.cli._exitcodes import BAD_INPUT
from fenced.cli._main import cli
from fenced.coordinator._connect import connect
from fenced.core._urls import url_of_path
from fenced.fence._store import open_store

R = "exports/daily"


def fenced_cli(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def one_line_error(result: Result, code: int = BAD_INPUT) -> str:
    assert result.exit_code == code, result.output + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fenced: "), result.stderr
    return lines[0]


@pytest.fixture
def lost(tmp_path: Path) -> tuple[str, str, str]:
    """A store fenced at epoch 2 by a coordinator whose database is then deleted; the URLs of
    the store and of a new coordinator, and the old coordinator's id."""
    store_url = url_of_path("sqlite", f"{tmp_path}/store.db")
    old = tmp_path / "old" / "fenced.db"
    with connect(url_of_path("sqlite", str(old))) as coord, open_store(store_url) as store:
        coord.release(coord.acquire(R, ttl=30, wait=0))
        store.fence(coord.acquire(R, ttl=30, wait=0).token)
        old_id = coord.coordinator_id
    for suffix in ("", "-wal", "-shm", ".coordinator-id"):
        Path(f"{old}{suffix}").unlink(missing_ok=True)
    return store_url, url_of_path("sqlite", str(tmp_path / "new" / "fenced.db")), old_id


def test_the_procedure_from_the_command_line(lost: tuple[str, str, str]) -> None:
    store_url, new_url, old_id = lost
    assert "pass --yes" in one_line_error(fenced_cli("rebind", store_url, "--url", new_url))
    refused = one_line_error(fenced_cli("rebind", store_url, "--url", new_url, "--yes"))
    assert f"fenced restore --advance --floor-from {store_url}" in refused
    advanced = fenced_cli(
        "restore", "--advance", "--floor-from", store_url, "--url", new_url, "--yes"
    )
    assert advanced.exit_code == 0, advanced.stderr
    done = fenced_cli("rebind", store_url, "--coordinator", new_url, "--yes", "--json")
    assert done.exit_code == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["rebound"] == {R: 2} and report["previous"] == [old_id]
    again = fenced_cli("rebind", store_url, "--url", new_url, "--yes")
    assert again.exit_code == 0 and again.stdout.startswith("nothing to rebind")
    timeline = fenced_cli("timeline", R, "--store", store_url, "--url", new_url, "--json")
    assert timeline.exit_code == 0, timeline.stderr
    events = [e for e in json.loads(timeline.stdout)["events"] if e["kind"] == "rebound"]
    assert [(e["epoch"], e["detail"]["previous"]) for e in events] == [(2, old_id)]


def test_the_plain_report_is_one_line(lost: tuple[str, str, str]) -> None:
    store_url, new_url, old_id = lost
    fenced_cli("restore", "--advance", "--floor-from", store_url, "--url", new_url, "--yes")
    done = fenced_cli("rebind", store_url, "--url", new_url, "--yes")
    assert done.exit_code == 0, done.stderr
    assert done.stdout.count("\n") == 1
    assert f"rebound 1 resource(s) of {store_url} from coordinator {old_id}" in done.stdout
    assert f"floors kept: {R} 2" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resource", "../x"], "resource name"),
        (["--from", "not-an-id"], "coordinator id"),
        (["--from", "a" * 32, "--resource", R], "not " + "a" * 32),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    lost: tuple[str, str, str], args: list[str], message: str
) -> None:
    store_url, new_url, _ = lost
    fenced_cli("restore", "--advance", "--floor-from", store_url, "--url", new_url, "--yes")
    error = one_line_error(fenced_cli("rebind", store_url, "--url", new_url, "--yes", *args))
    assert message in error


def test_a_store_that_does_not_exist_is_refused_not_created(tmp_path: Path) -> None:
    missing = url_of_path("sqlite", f"{tmp_path}/nope.db")
    new_url = url_of_path("sqlite", f"{tmp_path}/new.db")
    assert "no fenced store" in one_line_error(
        fenced_cli("rebind", missing, "--url", new_url, "--yes")
    )
    assert not (tmp_path / "nope.db").exists()

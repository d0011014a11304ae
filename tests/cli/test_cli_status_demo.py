"""``fenced status`` and ``fenced demo`` as a user runs them: real processes, real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import fenced

pytestmark = pytest.mark.slow

DEADLINE = 20.0
FENCED = [sys.executable, "-m", "fenced"]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'fenced.db'}"


def fenced_cmd(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "FENCED_URL"}
    return subprocess.run(
        [*FENCED, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


def status_json(url: str, *resources: str) -> dict[str, Any]:
    result = fenced_cmd("status", "--json", "--url", url, *resources)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert isinstance(document, dict)
    return document


ROW_KEYS = {"resource", "held", "holder", "epoch", "expires_in", "ttl", "last_epoch", "figures"}


# -- status --------------------------------------------------------------------------------


def test_status_json_of_an_empty_coordinator(url: str) -> None:
    with fenced.connect(url) as coord:  # status creates none (tests/cli/test_cli_inputs.py)
        coordinator_id = coord.coordinator_id
    document = status_json(url)
    assert document == {
        "format": 1,
        "url": url,
        "coordinator_id": coordinator_id,
        "window": 3600.0,
        "stores": [],
        "resources": [],
    }


def test_status_json_shape_with_a_holder(url: str, tmp_path: Path) -> None:
    with fenced.connect(url) as coord:
        coord.release(coord.acquire("jobs/done", ttl=5, wait=0))
    started = tmp_path / "started"
    holder = subprocess.Popen(
        [
            *FENCED, "run", "jobs/busy", "--url", url, "--ttl", "30", "--holder", "tester",
            "--", "sh", "-c", f"touch {started}; exec sleep 60",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + DEADLINE
        while not started.exists():
            assert time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.02)
        everything = status_json(url)
        chosen = status_json(url, "jobs/busy", "never/granted")
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(DEADLINE)

    rows = everything["resources"]
    assert [row["resource"] for row in rows] == ["jobs/busy", "jobs/done"]  # sorted
    busy, done = rows
    assert set(busy) == ROW_KEYS == set(done)
    assert busy["held"] is True
    assert busy["holder"] == "tester"
    assert busy["epoch"] == 1 == busy["last_epoch"]
    assert busy["ttl"] == 30.0
    assert 0 < busy["expires_in"] <= 30
    figures = done.pop("figures")
    assert (figures["ownership_changes"], figures["rejected_writes"]) == (1, 0)
    assert done == {
        "resource": "jobs/done",
        "held": False,
        "holder": None,
        "epoch": None,
        "expires_in": None,
        "ttl": None,
        "last_epoch": 1,
    }
    picked = chosen["resources"]
    assert [row["resource"] for row in picked] == ["jobs/busy", "never/granted"]
    assert picked[1]["last_epoch"] == 0
    assert picked[1]["held"] is False


def test_status_plain_text_when_not_on_a_terminal(url: str) -> None:
    with fenced.connect(url) as coord:
        lease = coord.acquire("a/held", ttl=30, wait=0, holder="worker-1")
        coord.release(coord.acquire("b/free", ttl=30, wait=0))
        coord.release(coord.acquire("b/free", ttl=30, wait=0))
        result = fenced_cmd("status", "--url", url)
        coord.release(lease)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "RESOURCE", "HOLDER", "EPOCH", "REMAINING", "LAST", "EPOCH", "CHANGES/1h", "UNOWNED/1h",
        "REJECTED/1h",
    ]  # fmt: skip
    assert re.fullmatch(r"a/held\s+worker-1\s+1\s+\d+\.\ds\s+1\s+1\s+\S+\s+-", lines[1])
    assert re.fullmatch(r"b/free\s+-\s+-\s+-\s+2\s+2\s+\S+\s+-", lines[2])
    assert len(lines) == 3


def test_status_of_nothing_says_so(url: str) -> None:
    fenced.connect(url).close()
    result = fenced_cmd("status", "--url", url)
    assert result.returncode == 0
    assert "no resources" in result.stdout


@pytest.mark.parametrize(
    "args",
    [["status", "bad name"], ["status", "../x"], ["status", "--url", "nope://x"], ["status", "-z"]],
)
def test_status_bad_input_is_one_line_and_exit_2(args: list[str]) -> None:
    result = fenced_cmd(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("fenced: ")


# -- demo ----------------------------------------------------------------------------------

STORY = [
    r"A\s+acquired exports/daily at epoch 1",
    r"A\s+generated its export .*checked its lease: HELD",
    r"A\s+is paused with SIGSTOP",
    r"B\s+acquired epoch 2 once A's lease had expired",
    r"B\s+published its export: epoch 2",
    r"A\s+is continued with SIGCONT",
    r"A\s+its publication is rejected by the store: StaleToken: .*epoch 1 is below the floor 2",
    r"A\s+check\(\) raised LeaseLost",
    r"the visible export: epoch 2, .*worker B at epoch 2",
    r"The story came out as expected",
]


def test_demo_tells_the_whole_story_and_leaves_nothing_behind() -> None:
    result = fenced_cmd("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    position = 0
    for pattern in STORY:  # in this order
        match = re.compile(pattern).search(result.stdout, position)
        assert match, f"{pattern!r} missing after position {position}:\n{result.stdout}"
        position = match.end()
    assert "FAILED" not in result.stdout
    workdir = re.search(r"store\s+file://(/\S+)/store", result.stdout)
    assert workdir
    assert not Path(workdir.group(1)).exists()  # the temporary directory is removed


def test_demo_on_a_given_coordinator_uses_a_fresh_resource(url: str) -> None:
    with fenced.connect(url) as coord:
        coord.release(coord.acquire("exports/daily", ttl=5, wait=0))
    result = fenced_cmd("demo", "--url", url, "--ttl", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    resources = [row["resource"] for row in status_json(url)["resources"]]
    assert "exports/daily" in resources
    demo = [name for name in resources if name.startswith("demo/export-")]
    assert len(demo) == 1
    with fenced.connect(url) as coord:
        assert coord.last_epoch("exports/daily") == 1  # untouched
        assert coord.last_epoch(demo[0]) == 2


@pytest.mark.parametrize(
    "args", [["--ttl", "0"], ["--ttl", "x"], ["--url", "memory://x"], ["--url", "nope://x"]]
)
def test_demo_bad_input_is_one_line_and_exit_2(args: list[str]) -> None:
    result = fenced_cmd("demo", *args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

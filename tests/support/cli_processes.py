"""Helpers of the tests that run ``fenced`` as a user does, each command in its own process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

__all__ = [
    "DEADLINE",
    "FENCED",
    "Start",
    "fenced_cmd",
    "one_line_error",
    "run_python",
    "start_fenced",
    "wait_for",
]

DEADLINE = 20.0
"""Seconds any awaited condition may take on a loaded 2-core machine."""
FENCED = [sys.executable, "-m", "fenced"]


def fenced_cmd(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``fenced ARGS…`` to its end; ``env`` defaults to this one without ``FENCED_*``
    variables (a test says which settings it means)."""
    if env is None:
        env = {key: value for key, value in os.environ.items() if not key.startswith("FENCED_")}
    return subprocess.run(
        [*FENCED, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def run_python(
    code: str, home: Path, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE`` run to its end in ``home`` as a user would run it: ``PATH=/usr/bin:/bin``,
    ``HOME=home`` and ``env``, nothing else of this environment; its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=home,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one line ``fenced: …`` that ``result`` wrote on stderr (asserting there is one)."""
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("fenced: ")
    return lines[0]


Start = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def start_fenced() -> Iterator[Start]:
    """Start ``fenced ARGS…`` in the background (stdout and stderr piped, text); whatever is
    left is killed at teardown (registered by ``tests/conftest.py``)."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [*FENCED, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.send_signal(signal.SIGCONT)
        proc.communicate()


def wait_for(condition: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    """Poll ``condition`` until it holds; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)
